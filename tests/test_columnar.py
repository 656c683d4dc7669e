"""gpuwatch.core.columnar: a batch's bytes decoded through the view equal the message's values, for any encoding."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from gpuwatch.core import fields
from gpuwatch.core.batches import BatchBuilder, BatchError
from gpuwatch.core.columnar import decode, from_message
from gpuwatch.v1 import ingest_view_pb2 as view
from gpuwatch.v1 import telemetry_pb2 as pb
from helpers import GPUS, T0_MS, TICKS, make_batch


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


def test_a_batch_of_a_shape_read_before_is_read_by_its_plan_with_its_own_values_and_names():
    first, second = make_batch(1), make_batch(2)
    for s in second.samples:
        for c in s.columns:
            c.values[:] = [v * 3 + 1 for v in c.values]
    _same(decode(first.SerializeToString()), from_message(first))
    _same(decode(second.SerializeToString()), from_message(second))  # same shape (the plan), other values
    # two fields whose names have the same length: swapping them keeps the shape, the plan must notice
    by_length: dict[int, list[str]] = {}
    for name in fields.GPU_FIELD_NAMES:
        by_length.setdefault(len(name), []).append(name)
    x, y = next(names for names in by_length.values() if len(names) >= 2)[:2]
    builder = BatchBuilder(pb.NodeIdentity(node="n"), "agent-swap", [pb.GpuInfo(index=0)])
    builder.add_gpu_row(0, T0_MS, {x: 1.0, y: 2.0})
    plain = builder.build(1)
    swapped = pb.TelemetryBatch()
    swapped.CopyFrom(plain)
    a, b = swapped.samples[0].columns
    a.field, b.field = b.field, a.field
    before = decode(plain.SerializeToString())
    _same(before, from_message(plain))
    after = decode(swapped.SerializeToString())
    _same(after, from_message(swapped))
    ix, iy = fields.GPU_FIELD_NAMES.index(x), fields.GPU_FIELD_NAMES.index(y)
    assert (before.gpu_values[0, ix], before.gpu_values[0, iy]) == (1.0, 2.0)
    assert (after.gpu_values[0, ix], after.gpu_values[0, iy]) == (2.0, 1.0)
    no_gpus = pb.TelemetryBatch()
    no_gpus.CopyFrom(first)
    del no_gpus.samples[:]
    for _ in range(2):  # learnt, then read by its plan: a batch of host samples only
        decoded = decode(no_gpus.SerializeToString())
        assert decoded.gpu_values.shape == (0, len(fields.GPU_FIELD_NAMES))
        _same(decoded, from_message(no_gpus))
