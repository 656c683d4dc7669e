import math

import pytest

from gpuwatch.core.batches import BatchBuilder, BatchError, validate
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
