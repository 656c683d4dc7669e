import math

import numpy as np
import pytest

from gpuwatch.core.batches import BatchBuilder, BatchError, encoded_columns, validate
from gpuwatch.v1 import telemetry_pb2 as pb


def _builder():
    return BatchBuilder(pb.NodeIdentity(node="n1"), "agent-1", [pb.GpuInfo(index=0), pb.GpuInfo(index=1)])


def test_builder_pads_missing_values_with_nan_and_resets():
    b = _builder()
    b.add_gpu_row(0, 1000, {"gpu_power_watts": 100.0}, job_id="j", rank=3)
    b.add_gpu_row(0, 2000, {"gpu_power_watts": 110.0, "gpu_ecc_sbe_volatile_total": 5.0})
    b.add_host_row(1000, {"host_load1": 0.5})
    batch = b.build(sequence=7)
    validate(batch)
    cols = {c.field: list(c.values) for c in batch.samples[0].columns}
    assert cols["gpu_power_watts"] == [100.0, 110.0]
    assert math.isnan(cols["gpu_ecc_sbe_volatile_total"][0]) and cols["gpu_ecc_sbe_volatile_total"][1] == 5.0
    assert list(batch.samples[0].job_id) == ["j", ""] and list(batch.samples[0].rank) == [3, -1]
    assert batch.sequence == 7 and len(b) == 0


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: setattr(b, "schema_version", 9), "schema_version 9"),
        (lambda b: setattr(b, "agent_id", ""), "agent_id"),
        (lambda b: b.samples[0].columns[0].values.append(1.0), "has 2 values for 1 timestamps"),
        (lambda b: setattr(b.samples[0].columns[0], "field", "nope"), "unknown field 'nope'"),
        (lambda b: setattr(b.samples[0], "gpu_index", 5), "GPU index not in"),
    ],
)
def test_validate_names_the_problem(mutate, message):
    b = _builder()
    b.add_gpu_row(0, 1000, {"gpu_power_watts": 100.0})
    batch = b.build(sequence=1)
    mutate(batch)
    with pytest.raises(BatchError, match=message):
        validate(batch)


@pytest.mark.parametrize("count", [0, 1, 15, 16, 17, 3000])  # packed lengths of one and two varint bytes
def test_encoded_columns_are_the_bytes_protobuf_writes(count):
    values = np.linspace(-1.0, 1.0, count)
    if count:
        values[0] = np.nan
    columns = {"gpu_power_watts": values, "gpu_temperature_celsius": values[::-1].tolist(), "é_name": values}
    expected = pb.GpuSamples(columns=[pb.Column(field=k, values=v) for k, v in columns.items()])
    assert encoded_columns(3, columns) == expected.SerializeToString()
    host = pb.HostSamples(columns=[pb.Column(field="host_load1", values=values)])
    assert encoded_columns(2, {"host_load1": values}) == host.SerializeToString()


def test_gpu_and_host_blocks_build_the_batch_rows_build():
    rows, blocks = _builder(), _builder()
    for t in range(3):
        rows.add_gpu_row(1, 1000 * t, {"gpu_power_watts": 100.0 + t, "gpu_temperature_celsius": math.nan},
                         job_id="j", rank=0, local_rank=0)
        rows.add_host_row(1000 * t, {"host_load1": 0.5 * t})
    blocks.add_gpu_block(1, [0, 1000, 2000], {"gpu_power_watts": np.array([100.0, 101.0, 102.0]),
                                              "gpu_temperature_celsius": np.full(3, np.nan)},
                         ["j"] * 3, [0] * 3, [0] * 3)
    blocks.add_host_block([0, 1000, 2000], {"host_load1": np.array([0.0, 0.5, 1.0])})
    by_rows, by_blocks = rows.build(1, created_ms=5), blocks.build(1, created_ms=5)
    validate(by_blocks)
    assert by_blocks.SerializeToString() == by_rows.SerializeToString()
