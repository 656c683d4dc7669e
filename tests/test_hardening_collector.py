"""Hardening round 2, the collector's side (issue 29): poison columns, unbounded labels and GPUs, damaged
store files, private files, and what the stores keep. Each test was written to fail before its fix."""
import logging

import grpc
import pytest

from gpuwatch.collector import client
from gpuwatch.collector.server import serve
from gpuwatch.v1 import ingest_view_pb2 as view
from helpers import make_batch


@pytest.fixture
def collector(tmp_path):
    server = serve("127.0.0.1:0", str(tmp_path / "c.duckdb"))
    yield server
    server.stop()


@pytest.fixture
def channel(collector):
    ch = client.channel(collector.address)
    yield ch
    ch.close()


def _with_column(seq: int, column: bytes, agent: str = "poison-col") -> bytes:
    """A valid batch whose first GPU block's first column is replaced by ``column`` (its raw bytes)."""
    batch = view.TelemetryBatchView.FromString(make_batch(seq, agent=agent).SerializeToString())
    batch.samples[0].columns[0] = column
    return batch.SerializeToString()


POISON_COLUMNS = {
    "name_not_utf8": b"\x0a\x04\xff\xfe\xfd\xfc",            # field = four bytes that are not UTF-8
    "name_not_utf8_long": b"\x0a\x81\x01" + b"\xff" * 129,     # the same, name length not in canonical form
    "inner_truncated": b"\x0a\x10gpu_",                        # name's length runs past the column's end
    "inner_bad_wire_type": b"\x0f\x01\x02",                    # wire type 7 does not exist
    "values_cut": b"\x0a\x0fgpu_power_watts\x12\x18" + b"\x00" * 3,  # packed values shorter than declared
}


@pytest.mark.parametrize("kind", sorted(POISON_COLUMNS))
def test_a_malformed_column_is_refused_as_invalid_argument_on_push_and_stream(collector, channel, kind, caplog):
    poison = _with_column(2, POISON_COLUMNS[kind])
    caplog.set_level(logging.WARNING, "gpuwatch.collector.server")
    with pytest.raises(grpc.RpcError) as pushed:
        client.push(channel, poison)
    assert pushed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, pushed.value.details()
    # on a stream after an acked batch: the acks of earlier batches, then INVALID_ARGUMENT, never an OK end
    acks = []
    with pytest.raises(grpc.RpcError) as streamed:
        for ack in client.stream_batches(channel, [make_batch(1, agent="poison-col"), poison,
                                                   make_batch(3, agent="poison-col")]):
            acks.append(ack.sequence)
    assert acks == [1]
    assert streamed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, streamed.value.details()
    refusals = [r for r in caplog.records if "rejected a batch from agent" in r.getMessage()]
    assert len(refusals) == 2 and all("poison-col" in r.getMessage() for r in refusals)
