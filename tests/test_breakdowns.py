"""Breakdowns in the collector: real gRPC server on loopback, both real stores (DuckDB, ClickHouse through chdb),
real Kineto traces."""
from __future__ import annotations

import gzip
import io
import json
import os
import shutil

import grpc
import msgspec
import numpy as np
import orjson
import pandas as pd
import pytest

from gpuwatch.apps import cli
from gpuwatch.core.batches import BatchBuilder
from gpuwatch.apps.breakdown_cli import fetch_breakdown, submit_traces
from gpuwatch.collector.breakdowns import BreakdownService
from gpuwatch.collector.client import connect
from gpuwatch.efficiency import analyze, load_paths
from gpuwatch.collector.server import serve
from gpuwatch.core.settings import local_collector
from gpuwatch.efficiency.timeline import RankTimeline
from gpuwatch.efficiency.traces.spans import timelines_from_spans
from gpuwatch.v1 import query_pb2 as q
from gpuwatch.v1 import telemetry_pb2 as pb
from helpers import KINETO_SAMPLED, STORE_KINDS, store_url

RANKS = [os.path.join(KINETO_SAMPLED, f"rank{r}.json.gz") for r in (0, 1)]


@pytest.fixture(params=STORE_KINDS)
def collector(tmp_path, request):
    server = serve(local_collector(store_url(request.param, tmp_path), max_workers=8),
                   query_handlers=BreakdownService().handlers())
    try:
        yield server, connect(server.address)
    finally:
        server.stop()


def _analyzed(paths, per_step=False):
    """`gpuwatch analyze --json` of the files, as the JSON text round-trips it."""
    return orjson.loads(orjson.dumps(analyze(load_paths(paths), per_step=per_step).to_json()))


def test_ranks_submitted_one_by_one_give_the_analyze_document(collector):
    server, stub = collector
    first = submit_traces(stub, "J", [RANKS[0]])
    assert [r["rank"] for r in first["ranks"]] == [0]
    both = submit_traces(stub, "J", [RANKS[1]])
    assert [r["rank"] for r in both["ranks"]] == [0, 1]
    assert both["matched_collectives"] == 10  # matched across the two submissions

    doc = fetch_breakdown(stub, "J")
    assert doc.pop("source") == "traces"
    assert doc == _analyzed(RANKS)
    stepped = fetch_breakdown(stub, "J", per_step=True)
    stepped.pop("source")
    assert stepped == _analyzed(RANKS, per_step=True)

    rows = server.store.query_df("SELECT * FROM breakdowns WHERE job_id = 'J' AND source = 'traces'")
    for rank in stepped["ranks"]:
        mine = rows[rows["rank"] == rank["rank"]]
        whole = mine[mine["step"].isna()].set_index("category")["us"]
        assert whole.to_dict() == rank["breakdown_us"]
        steps = mine[mine["step"].notna()]
        assert sorted(steps["step"].unique()) == [s["step"] for s in rank["per_step"]]
        assert steps["us"].sum() == pytest.approx(rank["window_us"])


def test_resubmitting_a_rank_replaces_it(collector):
    _, stub = collector
    submit_traces(stub, "J", RANKS)
    again = submit_traces(stub, "J", [RANKS[1]])
    assert [r["rank"] for r in again["ranks"]] == [0, 1]


def _probe_batch(rows: pd.DataFrame) -> pb.TelemetryBatch:
    builder = BatchBuilder(pb.NodeIdentity(node="n1"), agent_id="agent-1")
    builder.add_spans(pb.SpanTable(**{c: rows[c].tolist() for c in rows.columns}))
    return builder.build(sequence=1)


def _probe_rows() -> pd.DataFrame:
    """Two ranks, three 10 ms steps each, one all-reduce per step; rank 1 arrives 2 ms late."""
    rows = []
    for rank in (0, 1):
        for step in range(3):
            t0 = 1e15 + step * 10_000
            rows.append(("L", rank, step, "step", "", t0, 10_000.0, "", -1))
            late = 2_000.0 * rank
            rows.append(("L", rank, step, "collective", "all_reduce", t0 + 6_000 + late, 3_000.0 - late, "pg0", step))
    return pd.DataFrame(rows, columns=["job_id", "rank", "step", "kind", "name", "start_us", "dur_us",
                                       "process_group", "seq"])


def test_live_breakdown_from_probe_spans(collector):
    server, stub = collector
    rows = _probe_rows()
    server.store.write(_probe_batch(rows))
    doc = fetch_breakdown(stub, "L", per_step=True)
    assert doc.pop("source") == "live"
    assert doc.pop("history") == {"steps": 0, "ranks": 0, "breakdown_us": {}}  # no jobs-monitor round yet
    assert doc.pop("slow_ranks") == []  # no rank's work stands out (docs/why-slow.md)
    expected = orjson.loads(orjson.dumps(analyze(timelines_from_spans(rows, source="job L probe spans"),
                                                 per_step=True).to_json()))
    assert doc == expected
    assert doc["ranks"][0]["breakdown_us"]["comm_wait"] == pytest.approx(3 * 2_000)
    stored = server.store.query_df("SELECT DISTINCT source, rank FROM breakdowns WHERE job_id = 'L' ORDER BY rank")
    assert stored.values.tolist() == [["live", 0], ["live", 1]]


def test_bad_trace_is_refused_naming_the_file_and_nothing_is_kept(collector, tmp_path):
    _, stub = collector
    with gzip.open(RANKS[0]) as f:
        content = f.read()[:50_000]
    with pytest.raises(grpc.RpcError) as err:
        stub.SubmitTrace(q.SubmitTraceRequest(job_id="B", filename="traces/rank0.json", content=content))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "traces/rank0.json: truncated or invalid JSON" in err.value.details()
    assert "gpuwatch-trace-" not in err.value.details()  # no temporary path leaks into the message
    with pytest.raises(grpc.RpcError) as err:
        stub.SubmitTrace(q.SubmitTraceRequest(job_id="B", filename="notes.txt", content=b"hello"))
    assert "notes.txt: unknown format" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        fetch_breakdown(stub, "B")
    assert "job 'B': unknown to this collector" in err.value.details()


def test_unknown_job_and_missing_job_id(collector):
    _, stub = collector
    with pytest.raises(grpc.RpcError) as err:
        fetch_breakdown(stub, "no-such-job")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-job" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        fetch_breakdown(stub, " ")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "a job id is required" in err.value.details()


def test_cli_submit_and_breakdown(collector, tmp_path, capsys):
    server, _ = collector
    folder = tmp_path / "traces"
    folder.mkdir()
    for path in RANKS:  # one plain JSON (gzipped on the way) and one .json.gz
        shutil.copy(path, folder)
    with gzip.open(RANKS[0]) as f:
        (folder / "rank0.json").write_bytes(f.read())
    os.remove(folder / "rank0.json.gz")

    assert cli.main(["submit-trace", "--job", "C", str(folder), "--collector", server.address]) == 0
    assert "2 rank(s) analysed" in capsys.readouterr().err
    assert cli.main(["breakdown", "C", "--json", "--collector", server.address]) == 0
    doc = orjson.loads(capsys.readouterr().out)
    assert doc.pop("source") == "traces"
    assert doc == _analyzed([str(folder)])
    assert cli.main(["breakdown", "C", "--collector", server.address]) == 0
    table = capsys.readouterr().out
    assert table.startswith("job C (from traces)") and "rank 1" in table

    assert cli.main(["breakdown", "nope", "--collector", server.address]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "job 'nope': unknown" in err and "NOT_FOUND" in err


def test_cli_with_a_token_collector(tmp_path, capsys, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("breakdown-token\n")
    token_file.chmod(0o600)
    server = serve(local_collector(str(tmp_path / "t.duckdb"), token_file=str(token_file)))
    try:
        flags = ["--collector", server.address, "--json"]
        assert cli.main(["submit-trace", "--job", "T", RANKS[0], *flags]) == 2
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert cli.main(["submit-trace", "--job", "T", RANKS[0], *flags, "--token-file", str(token_file)]) == 0
        capsys.readouterr()
        assert cli.main(["breakdown", "T", *flags, "--token-file", str(token_file)]) == 0
        assert orjson.loads(capsys.readouterr().out)["source"] == "traces"
    finally:
        server.stop()


def test_a_stored_timeline_reads_back_whole_also_with_a_header_written_by_the_json_module():
    (timeline,) = load_paths(RANKS[:1])
    timeline.job_id = "jöb-7"  # not ASCII: the json module escaped it, msgspec writes UTF-8
    again = RankTimeline.from_bytes(timeline.to_bytes())
    assert again.job_id == "jöb-7" and again.trace_meta == timeline.trace_meta and again.rank == timeline.rank
    assert np.array_equal(again.start_us, timeline.start_us) and again.group_ranks == timeline.group_ranks
    with np.load(io.BytesIO(timeline.to_bytes())) as arrays:  # rewritten as an earlier gpuwatch stored it
        columns = {name: arrays[name] for name in arrays.files}
    header = json.dumps(msgspec.json.decode(columns.pop("header").tobytes())).encode()
    assert b"\\u00f6" in header
    old = io.BytesIO()
    np.savez_compressed(old, header=np.frombuffer(header, np.uint8), **columns)
    earlier = RankTimeline.from_bytes(old.getvalue())
    assert earlier.job_id == "jöb-7" and np.array_equal(earlier.end_us, timeline.end_us)
