"""The DuckDB store on its own: grouped writes, dedup, NULL for NaN, reads, retention, reopening."""
import pytest

from gpuwatch.core import fields
from gpuwatch.collector.store.duckdb import DDL, ms_to_datetime
from gpuwatch.collector.store import open_store
from gpuwatch.collector.store.base import TABLES
from gpuwatch.core.errors import AgentIdConflict, UserError
from helpers import ROWS_PER_BATCH, T0_MS, TICKS, make_batch, store_url, STORE_KINDS


RETENTION_DAYS = 3650  # the test data lies in 2023; ClickHouse's TTL would drop it at insert under a short one


@pytest.fixture(params=STORE_KINDS)
def store(request, tmp_path):
    s = open_store(store_url(request.param, tmp_path), retention_days=RETENTION_DAYS)
    yield s
    s.close()


def test_wide_tables_have_one_column_per_catalogue_field(store):
    gpu_columns = store.columns("gpu_samples")
    host_columns = store.columns("host_samples")
    assert gpu_columns == ["node", "gpu_index", "ts", "job_id", "rank", "local_rank", *fields.GPU_FIELD_NAMES]
    assert host_columns == ["node", "ts", *fields.HOST_FIELD_NAMES]
    assert len(DDL) == len(TABLES) == 17  # every table, features' included, is created when the store opens
    assert all(store.count(table) == 0 for table in TABLES)


def test_group_with_duplicates_stores_each_batch_once(store):
    store.write(make_batch(1))
    futures = [store.submit(make_batch(seq)) for seq in (1, 2, 3, 2, 3)]
    results = [f.result(30) for f in futures]
    assert [r.duplicate for r in results] == [True, False, False, True, True]
    assert store.count("gpu_samples") == 3 * ROWS_PER_BATCH
    assert store.count("ingested") == 3 and store.count("events") == 3
    assert store.nodes()[0]["last_sequence"] == 3


def test_nan_is_null_and_job_columns_are_null_without_a_job(store):
    store.write(make_batch(1))
    df = store.query_df("SELECT * FROM gpu_samples WHERE gpu_index = 0 ORDER BY ts")
    assert df["gpu_memory_temperature_celsius"].isna().tolist() == [False] + [True] * (TICKS - 1)
    assert df["gpu_sm_active_ratio"].isna().all()
    assert df["job_id"].isna().all() and df["rank"].isna().all()
    owned = store.query_df("SELECT job_id, rank FROM gpu_samples WHERE gpu_index = 1")
    assert set(owned["job_id"]) == {"job-7"} and set(owned["rank"]) == {1}


def test_reads_return_what_was_written(store):
    for seq in (1, 2):
        store.write(make_batch(seq))
    store.write(make_batch(1, agent="agent-2", node="node-2"))
    assert [(n["node"], n["gpus"], n["samples"]) for n in store.nodes()] == [
        ("node-1", 2, 2 * ROWS_PER_BATCH), ("node-2", 2, ROWS_PER_BATCH)]
    gpu1 = store.gpus("node-1")[1]
    assert (gpu1["uuid"], gpu1["job_id"], gpu1["rank"], gpu1["samples"]) == ("GPU-node-1-1", "job-7", 1, 2 * TICKS)
    latest = store.latest("node-1", 0)
    assert len(latest) == 1
    # the memory temperature was only sampled on the first tick; latest keeps its last non-NULL value
    assert latest[0]["gpu_memory_temperature_celsius"] == 62.0
    assert latest[0]["gpu_power_watts"] == pytest.approx(2.2)
    assert latest[0]["ts_ms"] == T0_MS + 1000 * (2 * TICKS + TICKS - 1)
    assert latest[0]["gpu_sm_active_ratio"] is None  # never sampled
    series = store.series("node-1", 0, "gpu_power_watts", limit=4)
    assert series["ts_ms"].is_monotonic_increasing and len(series) == 4
    assert series["value"].iloc[-1] == pytest.approx(2.2)
    events = store.events(kind="xid", limit=2)
    assert len(events) == 2 and events[0]["attrs"]["seq"] in {"2", "1"} and events[0]["code"] == 79
    wide = store.gpu_samples(nodes=["node-2"], columns=["gpu_power_watts"])
    assert len(wide) == ROWS_PER_BATCH and wide.columns[-1] == "gpu_power_watts"
    jobs = store.jobs_seen()
    assert [(j["job_id"], j["nodes"], j["ranks"]) for j in jobs] == [("job-7", 2, 1)]
    with pytest.raises(UserError, match="unknown GPU field"):
        store.series("node-1", 0, "gpu_nonsense")


def test_latest_values_follow_what_arrives_reading_only_the_new_samples_and_drop_deleted_gpus(store, monkeypatch):
    """The latest values were a scan of every raw sample at each read (/metrics reads them every few seconds);
    now a read merges the samples stored since the last one, and equals a whole read."""
    store.write(make_batch(1))
    store.write(make_batch(1, agent="agent-2", node="node-2"))
    assert store.latest() == store.latest_since(None, None) and len(store.latest()) == 4
    reads = []
    latest_since = store.latest_since
    monkeypatch.setattr(store, "latest_since", lambda after, nodes: reads.append((after, nodes)) or
                        latest_since(after, nodes))
    store.write(make_batch(2))
    assert store.latest() == latest_since(None, None)  # the memory temperature of batch 1's first tick kept
    first_newest_ms = T0_MS + 1000 * (TICKS + TICKS - 1)
    assert reads == [(first_newest_ms, ["node-1", "node-2"])]  # the new samples of the nodes that sent
    owners = {(g["node"], g["index"]): (g["job_id"], g["rank"]) for g in store.gpus()}
    assert {(r["node"], r["gpu_index"]): (r["job_id"], r["rank"]) for r in store.latest()} == owners
    from gpuwatch.collector.snapshot import build_snapshot  # /metrics: identities and owners without gpus()

    monkeypatch.setattr(store, "gpus", lambda *a, **k: pytest.fail("/metrics read every stored sample"))
    snapshot = build_snapshot(store)["gpus"]
    shown = {(g["node"], g["gpu"]): (g["job_id"] or None, None if g["rank"] < 0 else g["rank"]) for g in snapshot}
    assert shown == owners
    assert {g["gpu_uuid"] for g in snapshot} == {f"GPU-{n}-{i}" for n, i in owners}
    last_old_ms = T0_MS + 1000 * (1 * TICKS + TICKS - 1)
    store.write(make_batch(1000))
    store.apply_retention(now_ms=last_old_ms + RETENTION_DAYS * 86_400_000 + 1)  # node-2's samples all expire
    assert store.latest() == latest_since(None, None) and {r["node"] for r in store.latest()} == {"node-1"}


def test_retention_deletes_only_rows_older_than_the_window(store):
    store.write(make_batch(1))
    store.write(make_batch(1000))
    last_old_ms = T0_MS + 1000 * (1 * TICKS + TICKS - 1)
    deleted = store.apply_retention(now_ms=last_old_ms + RETENTION_DAYS * 86_400_000 + 1)
    assert deleted["gpu_samples"] == ROWS_PER_BATCH and deleted["events"] == 1 and deleted["host_samples"] == 1
    assert store.count("gpu_samples") == ROWS_PER_BATCH
    assert store.gpu_samples()["ts"].min() > ms_to_datetime(last_old_ms)


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_reopened_store_keeps_rows_and_dedup_state(kind, tmp_path):
    path = store_url(kind, tmp_path, "reopen")
    first = open_store(path)
    first.write(make_batch(1))
    first.write(make_batch(2))
    first.close()
    second = open_store(path)
    try:
        assert second.write(make_batch(1)).duplicate  # below last_sequence: found in `ingested`
        assert not second.write(make_batch(3)).duplicate
        assert second.count("gpu_samples") == 3 * ROWS_PER_BATCH
    finally:
        second.close()


def test_a_cloned_agent_ids_batch_is_a_conflict_not_a_duplicate(store):
    store.write(make_batch(1, agent="cloned"))
    assert store.write(make_batch(1, agent="cloned")).duplicate  # a resend: the same content
    with pytest.raises(AgentIdConflict):
        store.write(make_batch(1, agent="cloned", node="node-2"))  # another agent's batch under that id
    assert store.count("gpu_samples") == ROWS_PER_BATCH and store.count("ingested") == 1


def test_an_ingested_table_from_before_fingerprints_is_migrated(tmp_path):
    import duckdb

    path = str(tmp_path / "old.duckdb")
    store = open_store(path)
    store.write(make_batch(1, agent="old-agent"))
    store.close()
    con = duckdb.connect(path)
    con.execute("ALTER TABLE ingested DROP COLUMN fingerprint")  # as stores written before fingerprints are
    con.close()
    store = open_store(path)
    try:
        assert "fingerprint" in store.columns("ingested")
        # a batch stored before there were fingerprints: its resend is still a duplicate, never a conflict
        assert store.write(make_batch(1, agent="old-agent")).duplicate
    finally:
        store.close()


def test_clickhouse_tables_from_before_get_the_merge_settings_and_rows_stored_twice_read_once(tmp_path):
    """Every MergeTree table, also one created before the settings existed, merges with the store's
    merge_selector_base. Inserts no longer fold rows of one key within their block (optimize_on_insert=0):
    the same rows sent by two agents, likely in one group, still read once (final reads fold them)."""
    from gpuwatch.collector.store.clickhouse import MERGE_SETTINGS

    url = store_url("chdb", tmp_path, "merge")
    store = open_store(url)
    store._command("ALTER TABLE gpu_samples RESET SETTING merge_selector_base")  # as a table from before
    store.close()
    store = open_store(url)
    try:
        engines = store.query_df("SELECT name, engine_full FROM system.tables WHERE database = 'gpuwatch' "
                                 "AND engine LIKE '%MergeTree'")
        assert len(engines) == len(store.query_df("SELECT name FROM system.tables WHERE database = 'gpuwatch'"))
        for name, value in MERGE_SETTINGS.items():
            assert all(f"{name} = {value}" in e for e in engines["engine_full"]), engines
        first, same_rows = make_batch(1, agent="a"), make_batch(1, agent="b")  # two agents, one node's rows
        for future in [store.submit(first), store.submit(same_rows)]:
            assert not future.result().duplicate
        assert store.count("gpu_samples") == ROWS_PER_BATCH
    finally:
        store.close()


def test_a_chdb_store_alone_looks_up_only_possible_resends_and_one_shared_in_the_process_every_batch(
        tmp_path, monkeypatch):
    """A chdb directory is locked against other processes: alone, a store is its only writer and, as DuckDB,
    looks up in ``ingested`` only batches at or below an agent's last sequence. Two stores of one process on
    one directory (how the tests run several collectors) look up every batch, until both are closed."""
    from gpuwatch.collector.store.clickhouse import ClickHouseStore

    asked: list[tuple[str, int]] = []
    real = ClickHouseStore._stored_keys
    monkeypatch.setattr(ClickHouseStore, "_stored_keys", lambda self, keys: asked.extend(keys) or real(self, keys))
    url = store_url("chdb", tmp_path, "alone")
    first = open_store(url)
    try:
        assert not first.write(make_batch(1)).duplicate and not first.write(make_batch(2)).duplicate
        assert asked == []
        assert first.write(make_batch(2)).duplicate and asked == [("agent-1", 2)]  # a resend: looked up
        second = open_store(url)
        try:
            assert second.write(make_batch(3)).sequence == 3 and asked[-1] == ("agent-1", 3)
        finally:
            second.close()
        assert first.write(make_batch(3)).duplicate  # stored by the other store: still looked up
    finally:
        first.close()
    reopened = open_store(url)
    try:
        asked.clear()
        assert not reopened.write(make_batch(4)).duplicate and asked == []
    finally:
        reopened.close()


def test_spans_are_stored_columnar(store):
    from gpuwatch.v1 import telemetry_pb2 as pb
    batch = make_batch(1)
    batch.spans.CopyFrom(pb.SpanTable(job_id=["j", "j"], rank=[0, 1], start_us=[1.0, 2.0], dur_us=[5.0, 6.0],
                                      kind=["collective"] * 2, name=["all_reduce"] * 2))
    store.write(batch)
    spans = store.spans(job_id="j")
    assert spans["rank"].tolist() == [0, 1] and spans["dur_us"].tolist() == [5.0, 6.0]
    assert spans["seq"].tolist() == [-1, -1]  # columns the batch left empty get their "unknown" value


def test_a_batch_that_cannot_be_stored_fails_alone_not_its_group(store):
    from gpuwatch.core.columnar import ColumnarBatch, from_message

    message = make_batch(1, agent="agent-bad", node="node-bad")
    checked = from_message(message)
    message.samples[0].gpu_index = 2**31  # overflows INTEGER; the server's checks refuse it, the store must
    del message.gpus[:]                   # cope all the same: past the checks, as if they missed a case
    bad = ColumnarBatch(message, checked.gpu_values, checked.host_values, checked.sample_ts)
    futures = [store.submit(make_batch(1)), store.submit(bad), store.submit(make_batch(2))]
    assert not futures[0].result(30).duplicate and not futures[2].result(30).duplicate
    with pytest.raises(OverflowError):
        futures[1].result(30)
    assert store.count("gpu_samples") == 2 * ROWS_PER_BATCH
    assert store.write(make_batch(3)).sequence == 3  # the writer keeps going


def test_raw_spans_are_trimmed_per_job_while_step_marks_stay(store):
    from gpuwatch.v1 import telemetry_pb2 as pb
    batch = make_batch(1)
    steps = range(0, 3000, 10)  # a step every 10 s of the job's clock, 3000 s in all
    starts = [s * 1e6 for s in steps for _ in (0, 1)]
    batch.spans.CopyFrom(pb.SpanTable(
        job_id=["j"] * len(starts), rank=[0] * len(starts), step=[s // 10 for s in steps for _ in (0, 1)],
        kind=["step", "compute"] * len(steps), name=["step", "fwd"] * len(steps), start_us=starts,
        dur_us=[9e6] * len(starts)))
    store.write(batch)
    store.span_retention_s = 1000.0
    deleted = store.trim_spans()
    kept = store.spans("j")
    assert deleted == len(starts) - len(kept) > 0
    assert kept["start_us"].min() >= (2990 - 1000) * 1e6  # the last 1000 s before the job's newest span
    progress = store.job_progress().set_index("job_id").loc["j"]
    assert progress["steps"] == len(steps) and not progress["finished"]  # step marks outlive the raw spans
    assert len(store.recent_spans(100.0, "j")) < len(kept)


def test_cluster_schema_parses(tmp_path):
    """The --clickhouse-cluster DDL (ReplicatedMergeTree + Distributed) is valid ClickHouse SQL; running it
    needs a cluster with ZooKeeper/Keeper, which these tests do not have."""
    import clickhouse_connect

    from gpuwatch.collector.store.clickhouse import MERGE_SETTINGS, create_statements

    client = clickhouse_connect.get_client(dsn=f"chdb://{tmp_path / 'ddl'}")
    try:
        statements = create_statements("gpuwatch", 30, cluster="prod", merge_settings=MERGE_SETTINGS)
        assert sum("_local ON CLUSTER prod MODIFY SETTING" in s for s in statements) == len(TABLES)
        assert sum("Distributed(prod" in s for s in statements) == len(TABLES)
        for statement in statements:
            client.query(f"EXPLAIN AST {statement}")
    finally:
        client.close()


@pytest.mark.parametrize("url, options, message", [
    ("mysql://h/db", {}, "unknown scheme"),
    ("chdb://", {}, "give a directory"),
    ("clickhouse://127.0.0.1:1/gpuwatch", {}, "cannot open store clickhouse://127.0.0.1:1/gpuwatch"),
    ("clickhouse://u:secret@127.0.0.1:1/gpu-watch", {}, r"database name 'gpu-watch'.*letters"),
    ("DUCKDB", {"memory_limit": "lots"}, "cannot open store"),
    ("chdb://DIR", {"memory_limit": "lots"}, "memory limit 'lots'"),
])
def test_a_store_that_cannot_be_opened_is_one_clear_error(tmp_path, url, options, message):
    url = url.replace("DUCKDB", str(tmp_path / "s.duckdb")).replace("DIR", str(tmp_path / "ch"))
    with pytest.raises(UserError, match=message) as info:
        open_store(url, **options).close()
    assert "secret" not in str(info.value) and "\n" not in str(info.value)


def test_failure_evidence_reads(store):
    """What collector/failed.py and the jobs monitor read: fatal events, agent starts and stops, counter resets."""
    from gpuwatch.core.batches import BatchBuilder
    from gpuwatch.v1 import telemetry_pb2 as pb
    builder = BatchBuilder(pb.NodeIdentity(node="n"), "agent-f", [pb.GpuInfo(index=0, uuid="GPU-f")])
    for i, joules in enumerate([10.0, 20.0, 5.0, 6.0]):  # the driver reloaded before the third sample
        builder.add_gpu_row(0, T0_MS + 1000 * i, {"gpu_energy_joules_total": joules})
    builder.add_event("agent_start", T0_MS, gpu_index=-1)
    builder.add_event("xid", T0_MS + 500, gpu_index=0, code=48, message="DBE")
    builder.add_event("xid", T0_MS + 600, gpu_index=0, code=13, message="not fatal")
    builder.add_event("agent_stop", T0_MS + 4000, gpu_index=-1)
    store.write(builder.build(1))
    fatal = store.fatal_events([48, 79])
    assert fatal[["node", "gpu_index", "ts_ms", "kind", "code"]].values.tolist() == [["n", 0, T0_MS + 500, "xid", 48]]
    assert store.fatal_events([48], until_ms=T0_MS + 100).empty
    assert store.event_times("agent_start")["ts_ms"].tolist() == [T0_MS]
    drops = store.counter_drops("gpu_energy_joules_total", [("n", 0)], T0_MS - 1000)
    assert drops[["node", "gpu_index", "ts_ms"]].values.tolist() == [["n", 0, T0_MS + 2000]]
    assert store.stopped_agents()[["node", "stopped_us"]].values.tolist() == [["n", (T0_MS + 4000) * 1000]]


def test_empty_answers_keep_their_columns(store):
    assert list(store.recent_spans(60.0).columns[:3]) == ["job_id", "rank", "step"]
    assert list(store.stopped_agents().columns) == ["node", "stopped_us"]
    assert list(store.event_rows(["xid"]).columns) == ["node", "gpu_index", "ts", "kind", "code"]


def test_queries_written_once_answer_on_both_engines(store):
    """The queries of store/queries.py, spelled by each engine's dialect: events, samples, jobs, breakdowns,
    alerts read back what was written, with absent time bounds and with given ones."""
    import json

    import pandas as pd

    for seq in (1, 2):
        store.write(make_batch(seq))
    store.write(make_batch(1, agent="agent-2", node="node-2"))
    first_xid_ms, newest_ms = T0_MS + 1000 * TICKS, T0_MS + 1000 * (2 * TICKS + TICKS - 1)
    assert store.xid_counts() == [{"node": "node-1", "gpu_index": 1, "code": 79, "n": 2},
                                  {"node": "node-2", "gpu_index": 1, "code": 79, "n": 1}]
    assert store.event_counts_by_node() == {"node-1": 2, "node-2": 1}
    assert len(store.event_rows(["xid"])) == 3 and len(store.event_rows(["agent_stop"])) == 0
    assert len(store.event_rows(["xid"], since_ms=first_xid_ms)) == 1  # strictly after
    assert len(store.event_rows(["xid"], until_ms=first_xid_ms)) == 2
    failed = store.first_failures([79])
    assert failed[["node", "gpu_index", "failed_ms"]].values.tolist() == [["node-1", 1, first_xid_ms],
                                                                       ["node-2", 1, first_xid_ms]]
    assert store.first_failures([48]).empty
    assert store.fatal_events([79], until_ms=first_xid_ms)["ts_ms"].tolist() == [first_xid_ms] * 2
    assert store.event_times("xid", until_ms=first_xid_ms)["node"].tolist() in (["node-1", "node-2"],
                                                                              ["node-2", "node-1"])
    assert store.stopped_agents().empty
    assert store.newest_sample_ms() == newest_ms
    # each GPU's newest sample, reading only some nodes' samples after a time: what a scoring round reads
    assert store.newest_samples() == {(n, i): newest_ms if n == "node-1" else newest_ms - 1000 * TICKS
                                      for n in ("node-1", "node-2") for i in (0, 1)}
    assert store.newest_samples(newest_ms - 1000, ["node-1", "node-2"]) == {("node-1", 0): newest_ms,
                                                                            ("node-1", 1): newest_ms}
    assert store.newest_samples(newest_ms) == {} and store.newest_samples(None, []) == {}
    assert store.gpu_identities() == {(n, i): {"uuid": f"GPU-{n}-{i}", "name": "H100"}
                                      for n in ("node-1", "node-2") for i in (0, 1)}
    stored_at = {n["node"]: n["last_seen_ms"] for n in store.nodes()}  # the agents' last batches, wall clock
    for since in sorted(stored_at.values()) + [max(stored_at.values()) + 1]:
        assert store.nodes_heard_since(since) == sorted(n for n, at in stored_at.items() if at >= since)
    (job,) = store.sample_jobs()
    assert (job["job_id"], list(job["nodes"]), job["gpus"], job["ranks"]) == ("job-7", ["node-1", "node-2"], 2, 1)
    assert store.span_job_ids() == [] and store.traced_jobs() == []

    # spool drops: the running total an agent reports wins over the sum of the per-report counts
    from gpuwatch.core.batches import BatchBuilder
    from gpuwatch.v1 import telemetry_pb2 as pb

    for seq, (batches, total) in enumerate([(2, "2"), (3, "7")], start=3):
        builder = BatchBuilder(pb.NodeIdentity(node="node-2"), "agent-2", [])
        builder.add_event("spool_dropped", T0_MS + seq, code=batches, attrs={"dropped_total": total})
        store.write(builder.build(seq))
    health = {h["node"]: h for h in store.agent_health()}
    assert (health["node-1"]["spool_dropped"], health["node-2"]["spool_dropped"]) == (0, 7)
    assert [(n["node"], n["gpus"], n["last_sequence"]) for n in store.nodes()] == [("node-1", 2, 2), ("node-2", 2, 4)]
    gpu = store.gpus("node-2")[1]
    assert (gpu["index"], gpu["uuid"], gpu["name"], gpu["samples"], gpu["job_id"], gpu["rank"]) == (
        1, "GPU-node-2-1", "H100", TICKS, "job-7", 1)

    store.add_step_breakdowns(pd.DataFrame({"job_id": ["j"] * 3, "rank": [0, 1, 0], "step": [1, 1, 2],
                                            "category": ["compute"] * 3, "us": [10.0, 20.0, 30.0]}))
    store.flush(30)
    totals = store.step_breakdown_totals("j")
    assert totals[["category", "us", "steps", "ranks"]].values.tolist() == [["compute", 60.0, 2, 2]]
    rows = pd.DataFrame({"rank": [0], "step": [None], "category": ["compute"], "us": [5.0]})
    store.save_breakdown("j", "live", rows, '{"a": 1}')
    store.flush(30)
    assert json.loads(store.breakdown_doc("j", "live")) == {"a": 1} and store.breakdown_doc("j", "traces") is None
    assert store.breakdown_rows("j")["source"].tolist() == ["live"] and store.breakdown_rows("j", "traces").empty

    doc = {"status": "firing", "node": "node-1", "gpu_index": 1, "peak_risk": 0.75}
    store.upsert_alerts(pd.DataFrame([{"id": "a:1", "alertname": "GpuFailureRisk", "subject": "node-1/1",
                                       "status": "firing", "starts_at": ms_to_datetime(T0_MS), "ends_at": None,
                                       "updated_at": ms_to_datetime(T0_MS + 5), "doc": json.dumps(doc)}]))
    store.flush(30)
    (firing,) = store.firing_alerts().to_dict("records")
    assert (firing["alertname"], firing["updated_ms"], json.loads(firing["doc"])) == ("GpuFailureRisk", T0_MS + 5, doc)
    assert [json.loads(d) for d in store.alert_docs(include_resolved=False)] == [doc]
    starts = store.alert_starts("GpuFailureRisk")
    assert starts[["node", "gpu_index", "starts_ms", "peak_risk"]].values.tolist() == [["node-1", 1, T0_MS, 0.75]]
