"""gpuwatch.core.columnar: a batch's bytes decoded through the view equal the message's values, for any encoding."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from gpuwatch.core import fields
from gpuwatch.core.batches import BatchError
from gpuwatch.core.columnar import decode, from_message
from gpuwatch.v1 import ingest_view_pb2 as view
from gpuwatch.v1 import telemetry_pb2 as pb
from helpers import GPUS, TICKS, make_batch


def _same(a, b) -> None:
    assert np.array_equal(a.gpu_values, b.gpu_values, equal_nan=True)
    assert np.array_equal(a.host_values, b.host_values, equal_nan=True)


def test_decoded_bytes_hold_the_values_of_the_message():
    batch = make_batch(4)
    decoded = decode(batch.SerializeToString())
    _same(decoded, from_message(batch))
    power = fields.GPU_FIELD_NAMES.index("gpu_power_watts")
    assert decoded.gpu_values.shape == (GPUS * TICKS, len(fields.GPU_FIELD_NAMES))
    assert decoded.gpu_values[TICKS, power] == pytest.approx(104.0)  # GPU 1, first tick
    assert (decoded.agent_id, decoded.sequence) == ("agent-1", 4)


def _unpacked(column: pb.Column) -> bytes:
    """A Column with its doubles written one by one (legal protobuf, not what upb writes)."""
    name = column.field.encode()
    return (b"\x0a" + bytes([len(name)]) + name
            + b"".join(b"\x11" + struct.pack("<d", v) for v in column.values))


def test_columns_in_another_valid_encoding_are_read_the_same():
    batch = make_batch(2)
    raw = view.TelemetryBatchView.FromString(batch.SerializeToString())
    first = raw.samples[0]
    first.columns[0] = _unpacked(batch.samples[0].columns[0])
    _same(decode(raw.SerializeToString()), from_message(batch))


@pytest.mark.parametrize("change, message", [
    (lambda b: setattr(b.samples[1].columns[0], "field", "gpu_flux_capacitance"),
     "samples for GPU 1: unknown field 'gpu_flux_capacitance'"),
    (lambda b: b.samples[0].columns.append(pb.Column(field=b.samples[0].columns[0].field,
                                                     values=[1.0] * TICKS)), "appears twice"),
    (lambda b: b.samples[0].columns[0].values.pop(), f"has {TICKS - 1} values for {TICKS} timestamps"),
    (lambda b: setattr(b.host.columns[0], "field", "host_warp_core"), "host samples: unknown field 'host_warp_core'"),
], ids=["unknown-field", "repeated-field", "short-column", "unknown-host-field"])
def test_broken_columns_are_named_like_validate_names_them(change, message):
    batch = make_batch(1)
    change(batch)
    with pytest.raises(BatchError, match=message):
        decode(batch.SerializeToString())
    with pytest.raises(BatchError, match=message):
        from_message(batch)
