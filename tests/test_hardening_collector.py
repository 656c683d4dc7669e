"""Hardening round 2, the collector's side: poison columns, unbounded labels and GPUs, damaged
store files, private files, and what the stores keep. Each test was written to fail before its fix."""
import logging
import os

import grpc
import pytest

from gpuwatch.collector import client
from gpuwatch.collector.server import serve
from gpuwatch.core.settings import local_collector
from gpuwatch.collector.store import open_store
from gpuwatch.collector.store import duckdb as duckdb_store
from gpuwatch.collector.store.duckdb import DuckDBStore
from gpuwatch.core.errors import UserError
from gpuwatch.v1 import ingest_view_pb2 as view
from gpuwatch.v1 import query_pb2 as q
from helpers import ROWS_PER_BATCH, make_batch, serving


@pytest.fixture
def collector(tmp_path):
    yield from serving(str(tmp_path / "c.duckdb"))


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
    caplog.set_level(logging.WARNING, "gpuwatch.collector.ingest_service")
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


def _refused(channel, batch) -> str:
    with pytest.raises(grpc.RpcError) as refused:
        client.push(channel, batch)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    return refused.value.details()


def _label_bomb(kind: str):
    batch = make_batch(1, agent=f"bomb-{kind}")
    if kind == "node":
        batch.node.node = "n" * 2**20
    elif kind == "job_id":
        batch.samples[0].job_id[:] = ["j" * 2**21] * len(batch.samples[0].ts_ms)
    elif kind == "event_kind":
        batch.events[0].kind = "k" * 2**22
    elif kind == "agent_id":
        batch.agent_id = "a" * 300
    elif kind == "span_job_id":
        batch.spans.start_us.append(batch.samples[0].ts_ms[0] * 1000.0)
        batch.spans.dur_us.append(1.0)
        batch.spans.job_id.append("j" * 1000)
    elif kind == "labels":
        batch.node.labels.update({f"k{i}": "v" for i in range(1000)})
    elif kind == "gpus":  # one batch declared 100,000 GPUs
        batch.gpus.extend([type(batch.gpus[0])(index=i, uuid=f"GPU-{i}") for i in range(2, 100_000)])
    return batch


@pytest.mark.parametrize("kind", ["node", "job_id", "event_kind", "agent_id", "span_job_id", "labels", "gpus"])
def test_unbounded_names_and_gpus_are_refused(collector, channel, kind):
    """Before the fix: a 1 MiB node name, a 2 MiB job id, a 4 MiB event kind, 100,000 GPUs were acked."""
    details = _refused(channel, _label_bomb(kind))
    assert "at most" in details
    assert len(details) < 1000, "the refusal does not echo the huge name"
    assert collector.store.nodes() == []


def test_a_huge_event_message_is_cut_and_the_rest_of_the_batch_kept(collector, channel):
    batch = make_batch(1, agent="chatty")
    batch.events[0].message = "m" * 2**20
    batch.events[0].attrs["detail"] = "d" * 2**20
    client.push(channel, batch)
    (event,) = collector.store.events(None, None, None, None)
    assert 0 < len(event["message"]) <= 4096 and event["message"].startswith("mmm")
    assert 0 < len(event["attrs"]["detail"]) <= 4096
    assert collector.store.nodes()[0]["samples"] > 0


def test_distinct_label_values_per_agent_are_bounded_and_other_agents_are_served(collector, channel):
    """Before the fix: 50,000 distinct event kinds from one agent were acked (each a key of the events table)."""
    from gpuwatch.collector.label_budget import BUDGET

    seq = 0
    for seq in range(1, BUDGET["event kind"] + 1):
        batch = make_batch(seq, agent="inventive")
        batch.events[0].kind = f"kind-{seq}"
        client.push(channel, batch)
    batch = make_batch(seq + 1, agent="inventive")
    batch.events[0].kind = "one-too-many"
    assert "distinct event kind values" in _refused(channel, batch)
    batch.events[0].kind = "kind-1"  # a kind it made before is fine
    client.push(channel, batch)
    for index in range(2, BUDGET["gpu"] + 2, 256):  # GPUs too, counted over batches (each batch is in bounds)
        many = make_batch(seq + 2 + index, agent="inventive-gpus")
        many.gpus.extend([type(many.gpus[0])(index=i) for i in range(index, index + 256)])
        if index + 256 > BUDGET["gpu"]:
            assert "distinct gpu values" in _refused(channel, many)
        else:
            client.push(channel, many)
    for code in range(BUDGET["xid code"] + 1):  # each XID code is a series of gpu_xid_errors_total per GPU
        batch = make_batch(1000 + code, agent="inventive-xids")
        batch.events[0].code = 10_000 + code
        if code == BUDGET["xid code"]:
            assert "distinct xid code values" in _refused(channel, batch)
        else:
            client.push(channel, batch)
    client.push(channel, make_batch(1, agent="someone-else"))


def _truncated_store(path) -> None:
    store = DuckDBStore(str(path))
    for seq in range(1, 300):
        store.write(make_batch(seq))
    store.close()
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_a_truncated_duckdb_file_is_refused_at_open_with_one_line(tmp_path):
    """Before the fix: a file cut to half was served: batches acked into it, every query an IO error."""
    path = tmp_path / "cut.duckdb"
    _truncated_store(path)
    with pytest.raises(UserError) as refused:
        DuckDBStore(str(path))
    assert "truncated" in str(refused.value) and str(path) in str(refused.value)
    assert "\n" not in str(refused.value)
    fresh = DuckDBStore(str(tmp_path / "fresh.duckdb"))  # an empty new file is not taken for a cut one
    fresh.close()
    DuckDBStore(str(tmp_path / "fresh.duckdb")).close()


def test_a_store_found_unreadable_while_serving_answers_unavailable_not_ack(tmp_path, monkeypatch):
    path = tmp_path / "c.duckdb"
    store = DuckDBStore(str(path))
    for seq in range(1, 300):
        store.write(make_batch(seq))
    store.close()
    monkeypatch.setattr(duckdb_store, "_check_size", lambda con, path: None)  # cut after the open's check
    server = serve(local_collector(str(path)))
    ch = client.channel(server.address)
    try:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        stub = client.connect(server.address)
        with pytest.raises(grpc.RpcError) as query:
            stub.Latest(q.LatestRequest(gpu_index=-1), timeout=30)
        assert query.value.code() == grpc.StatusCode.UNAVAILABLE and "damaged" in query.value.details()
        with pytest.raises(grpc.RpcError) as pushed:
            client.push(ch, make_batch(400))
        assert pushed.value.code() == grpc.StatusCode.UNAVAILABLE and "damaged" in pushed.value.details()
    finally:
        ch.close()
        server.stop()


def test_the_duckdb_wal_stays_private_when_the_engine_recreates_it_after_a_checkpoint(tmp_path):
    """Before the fix: under umask 022 the WAL DuckDB recreates after a checkpoint was 0644 (telemetry, node names
    and job ids readable by every local user)."""
    old = os.umask(0o022)
    try:
        path = tmp_path / "c.duckdb"
        store = DuckDBStore(str(path))
        try:
            store.write(make_batch(1))
            store.run_write(lambda con: con.execute("CHECKPOINT"))  # the WAL is removed ...
            store.write(make_batch(2))  # ... and recreated by this commit
            wal = tmp_path / "c.duckdb.wal"
            assert wal.exists()
            assert oct(wal.stat().st_mode & 0o777) == oct(0o600)
            assert oct(path.stat().st_mode & 0o777) == oct(0o600)
        finally:
            store.close()
    finally:
        os.umask(old)


def _one_batch_chdb(folder):
    url = f"chdb://{folder}"
    store = open_store(url)
    store.write(make_batch(1))
    store.close()
    return url


def test_a_broken_clickhouse_part_is_logged_with_the_rows_lost(tmp_path, caplog):
    """Before the fix: a truncated part was moved to detached/broken-on-start_* and its rows vanished silently."""
    url = _one_batch_chdb(tmp_path / "st")
    (part,) = [p for p in (tmp_path / "st" / "data" / "gpuwatch" / "gpu_samples").iterdir() if p.is_dir()
               and p.name != "detached"]
    with open(part / "data.bin", "r+b") as f:
        f.truncate(16)
    with caplog.at_level(logging.ERROR, "gpuwatch.collector.store.clickhouse"):
        store = open_store(url)
    try:
        assert store.nodes() == [] or store.nodes()[0]["samples"] == 0
    finally:
        store.close()
    (line,) = [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]
    assert "gpu_samples" in line and "broken" in line and f"{ROWS_PER_BATCH} rows no longer served" in line


def test_a_damaged_clickhouse_table_definition_names_the_cause(tmp_path):
    """Before the fix: the open failed with "Error initializing EmbeddedServer: . (BAD_ARGUMENTS)" and no cause."""
    url = _one_batch_chdb(tmp_path / "st")
    (tmp_path / "st" / "metadata" / "gpuwatch" / "gpus.sql").write_text("CREATE TABLE garbage ((")
    with pytest.raises(UserError) as refused:
        open_store(url)
    assert "gpus.sql" in str(refused.value) and "SYNTAX_ERROR" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_memory_limit_help_names_what_it_bounds(capsys):
    """Before the fix: 2,000 agents peaked at 1,776 MiB with --memory-limit 1GB, which bounds the engine only."""
    from gpuwatch.apps import cli

    with pytest.raises(SystemExit):
        cli.main(["collector", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    described = text.split("--memory-limit MEMORY_LIMIT")[-1][:400]  # the option's entry, not the usage
    assert "DuckDB" in described and "on top" in described


def test_an_agent_quarantines_a_batch_with_a_malformed_column_and_sends_the_rest(collector, tmp_path):
    """End to end: before the fix, the agent resent such a batch for ever and every later batch waited behind it."""
    from gpuwatch.agent.spool import Spool
    from gpuwatch.agent.uplink import Uplink

    spool = Spool(tmp_path / "spool")
    for seq in range(1, 7):
        assert spool.next_sequence() == seq
        data = make_batch(seq, agent=spool.agent_id).SerializeToString()
        spool.append(seq, _with_column(seq, POISON_COLUMNS["name_not_utf8"], spool.agent_id) if seq == 3 else data)
    uplink = Uplink(spool, collector.address, window=4, backoff_initial_s=0.05)
    uplink.start()
    try:
        assert uplink.wait_drained(60)
    finally:
        uplink.stop()
    assert spool.rejected() == [3] and uplink.stats.rejected == 1
    (node,) = collector.store.nodes()
    assert node["last_sequence"] == 6 and node["samples"] == 5 * ROWS_PER_BATCH
