"""The collector's jobs monitor over span rows written through both real stores (DuckDB, chdb): slow ranks,
hangs, alerts."""
from __future__ import annotations

import json
import time

import pytest

from gpuwatch.core import events as ev
from gpuwatch.core.batches import BatchBuilder
from gpuwatch.collector.alert_hub import JOB_HANG, SLOW_RANK, AlertHub, list_alerts
from gpuwatch.collector.alerts import AlertmanagerSender
from gpuwatch.apps import cli
from gpuwatch.collector import client
from gpuwatch.collector.breakdowns import BreakdownService
from gpuwatch.apps.commandline import json_text
from gpuwatch.collector.jobs import JobsMonitor, list_jobs_rpc
from gpuwatch.collector.query_documents import alert_documents, job_documents, jobs_response
from gpuwatch.collector.server import serve
from gpuwatch.core.settings import local_collector
from gpuwatch.v1 import query_pb2 as q
from gpuwatch.v1 import telemetry_pb2 as pb
from gpuwatch.collector.store import open_store
from gpuwatch.simulator.job import SimJob
from helpers import (KINETO_SAMPLED, SPAN_FIELDS, STEP_US, STORE_KINDS, WORLD, alertmanager_alerts, data_parallel_job,
                     make_batch, poll, span_row, store_url, write_spans)

@pytest.fixture(params=STORE_KINDS)
def store(tmp_path, request):
    store = open_store(store_url(request.param, tmp_path, "jobs"))
    yield store
    store.close()


def _monitor(store, hub=None, **options) -> JobsMonitor:
    hub = hub or AlertHub()
    hub.start(store)
    monitor = JobsMonitor(hub, **options)
    monitor.bind(store)
    return monitor


def _alerts(store, include_resolved=False):
    """The Alerts RPC's typed alerts as documents, checked to be the stored documents, keys and numbers alike."""
    typed = alert_documents(list_alerts(q.AlertsRequest(include_resolved=include_resolved), store))
    assert json.dumps(typed) == json.dumps([json.loads(doc) for doc in store.alert_docs(include_resolved)])
    return typed


def _jobs(monitor, now):
    """The monitor's job documents, checked to come back the same, keys and numbers alike, through the
    typed Jobs message (what `gpuwatch jobs --json` prints)."""
    docs = monitor.jobs(now)
    assert json_text(job_documents(jobs_response(docs))) == json_text(docs)
    return docs


def test_slow_rank_is_flagged_with_evidence_and_alerted_balanced_job_is_not(store, alertmanager):
    now = time.time() * 1e6
    write_spans(store, data_parallel_job("slow-job", now, slow_rank=2), 1)
    write_spans(store, data_parallel_job("even-job", now, seed=1), 2)
    hub = AlertHub(senders=[AlertmanagerSender(alertmanager, backoff_s=0.1)])
    monitor = _monitor(store, hub, hang_threshold_s=60)
    first = monitor.check_once(now)
    assert first["even-job"]["stragglers"] == [] and first["even-job"]["hang"] is None
    (slow,) = first["slow-job"]["stragglers"]
    assert slow["rank"] == 2 and slow["last_share"] == 1.0 and slow["chance_share"] == 0.25
    assert slow["mean_lateness_us"] > 20_000 and slow["busy_ratio"] > 1.3 and slow["node"] == "node-1"
    breakdown = first["slow-job"]["breakdown"]
    assert breakdown["comm_wait"] > 0.1 and abs(sum(breakdown.values()) - 1) < 1e-6

    later = monitor.check_once(now + 10e6)  # "since" stays the first time it was flagged
    assert later["slow-job"]["stragglers"][0]["since"] == slow["since"]
    lost = first["slow-job"]["lost_gpu_seconds_total"]  # counted once per ingested span, not per round
    assert 0 < lost < WORLD * 20 * STEP_US / 1e6 and later["slow-job"]["lost_gpu_seconds_total"] == lost
    jobs = {j["job_id"]: j for j in _jobs(monitor, now)}
    assert jobs["slow-job"]["ranks"] == WORLD and jobs["slow-job"]["nodes"] == ["node-0", "node-1"]
    assert jobs["slow-job"]["stragglers"][0]["rank"] == 2 and jobs["even-job"]["stragglers"] == []
    assert 9 < jobs["slow-job"]["step_rate"] < 11 and 0 < jobs["slow-job"]["lost_fraction"] < 1

    (alert,) = _alerts(store)
    assert alert["alertname"] == SLOW_RANK and alert["job_id"] == "slow-job" and alert["rank"] == "2"
    assert alert["details"]["busy_ratio"] == slow["busy_ratio"] and "rank 2 of job slow-job" in alert["summary"]

    (received,) = poll(lambda: alertmanager_alerts(alertmanager, SLOW_RANK), 20, "the SlowRank alert in Alertmanager",
                       every=0.1)
    assert received["labels"]["job_id"] == "slow-job" and received["labels"]["rank"] == "2"
    hub.stop()


def test_slow_rank_alert_resolves_when_the_job_ends(store):
    now = time.time() * 1e6
    write_spans(store, data_parallel_job("slow-job", now, slow_rank=1), 1)
    monitor = _monitor(store)
    monitor.check_once(now)
    assert [a["alertname"] for a in _alerts(store)] == [SLOW_RANK]
    write_spans(store, [span_row("slow-job", r, 20, "end", "end", now + 1, 0) for r in range(WORLD)], 2)
    flags = monitor.check_once(now + 5e6)["slow-job"]
    assert flags["finished"] and flags["stragglers"][0]["rank"] == 1  # still shown for the finished job
    assert _alerts(store) == [] and _alerts(store, include_resolved=True)[0]["status"] == "resolved"


def test_slow_rank_alert_resolves_when_the_jobs_agents_stopped(store):
    """The job's nodes' agents stopped after its last span: the job is gone, its alert resolves (within the
    analysis window, where its spans still say "straggler")."""
    now = time.time() * 1e6
    rows = data_parallel_job("slow-job", now, slow_rank=1)
    write_spans(store, rows, 1)
    monitor = _monitor(store)
    monitor.check_once(now)
    assert [a["alertname"] for a in _alerts(store)] == [SLOW_RANK]
    for seq, node in enumerate(sorted({r[SPAN_FIELDS.index("node")] for r in rows}), start=1):
        builder = BatchBuilder(pb.NodeIdentity(node=node), f"agent-{node}")
        builder.add_event(ev.AGENT_STOP, int(now / 1000) + 1000, message="stopped")
        store.write(builder.build(seq))
    flags = monitor.check_once(now + 5e6)["slow-job"]
    assert flags["gone"] and not flags["finished"] and flags["stragglers"]  # still shown, no longer alerted
    assert _alerts(store) == [] and _alerts(store, include_resolved=True)[0]["status"] == "resolved"


def test_a_restarted_hub_keeps_the_slow_rank_alert_without_a_duplicate(store):
    now = time.time() * 1e6
    write_spans(store, data_parallel_job("slow-job", now, slow_rank=1), 1)
    _monitor(store).check_once(now)
    (before,) = _alerts(store)
    restarted = _monitor(store)  # a new hub on the same store, as after a collector restart
    assert [(a.alertname, a.subject) for a in restarted.hub.active_job_alerts()] == [(SLOW_RANK, "slow-job/1")]
    restarted.check_once(now + 1e6)
    (after,) = _alerts(store, include_resolved=True)
    same = ("alertname", "job_id", "rank", "status", "starts_at")
    assert [after[k] for k in same] == [before[k] for k in same] == [SLOW_RANK, "slow-job", "1", "firing",
                                                                       before["starts_at"]]


def test_hang_names_the_stuck_rank_and_collective_then_clears(store):
    now = time.time() * 1e6
    stop = now - 600e6  # the job stopped 10 minutes ago
    rows = data_parallel_job("hung-job", stop, steps=10)
    for rank in (0, 1, 3):  # ranks 0, 1, 3 entered all_reduce 10 and wait there; rank 2 never arrived
        rows.append(span_row("hung-job", rank, 10, "collective", "all_reduce", stop + 50_000, -1, seq=10))
    write_spans(store, rows, 1)
    monitor = _monitor(store, hang_threshold_s=120)
    hang = monitor.check_once(now)["hung-job"]["hang"]
    assert hang["culprits"] == [2] and hang["stalled_s"] > 500
    stuck = {e["rank"]: e for e in hang["stuck"]}
    assert _jobs(monitor, now)[0]["hang"] == hang
    assert stuck[2]["op"] == "all_reduce" and stuck[2]["seq"] == 10 and stuck[2]["state"] == "absent"
    (alert,) = _alerts(store)
    assert alert["alertname"] == JOB_HANG and alert["job_id"] == "hung-job" and "rank(s) 2" in alert["summary"]

    # the job moves again: rank 2 arrives, everyone completes the collective and more steps
    write_spans(store, data_parallel_job("hung-job", now, steps=5), 2)
    assert monitor.check_once(now)["hung-job"]["hang"] is None
    assert _alerts(store) == []


def test_jobs_lists_every_job_the_collector_knows_and_from_where(tmp_path, capsys):
    server = serve(local_collector(str(tmp_path / "c.duckdb")),
                   query_handlers={"Jobs": list_jobs_rpc, **BreakdownService().handlers()})
    try:
        address = ["--collector", server.address]
        assert cli.main(["jobs", *address, "--json"]) == 0  # a fresh store: no breakdown tables yet
        assert json.loads(capsys.readouterr().out) == []
        write_spans(server.store, data_parallel_job("job-7", time.time() * 1e6, steps=3), 1)  # node-0
        ch = client.channel(server.address)
        client.push(ch, make_batch(1))  # node-1: GPU 1 runs job-7
        ch.close()
        assert cli.main(["submit-trace", "--job", "J1", KINETO_SAMPLED, *address]) == 0
        capsys.readouterr()
        server.store.flush()
        assert cli.main(["jobs", *address, "--json"]) == 0
        jobs = {j["job_id"]: j for j in json.loads(capsys.readouterr().out)}
        assert set(jobs) == {"J1", "job-7"}
        assert jobs["J1"]["sources"] == ["traces"] and jobs["J1"]["ranks"] == 2 and jobs["J1"]["submitted_at"]
        assert jobs["job-7"]["sources"] == ["spans", "gpu_samples"] and jobs["job-7"]["ranks"] == WORLD
        assert jobs["job-7"]["nodes"] == ["node-0", "node-1"] and jobs["job-7"]["gpus"] == 1
        assert cli.main(["jobs", *address]) == 0
        table = capsys.readouterr().out.splitlines()
        assert table[0].split()[:2] == ["job_id", "sources"] and table[1].split()[:2] == ["J1", "traces"]
        column = table[0].split().index("stragglers")  # a count of straggler ranks, not a rank
        assert [row.split()[column] for row in table[1:]] == ["0", "0"]
    finally:
        server.stop()


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_steps_and_per_step_breakdowns_outlive_the_raw_span_window(kind, tmp_path):
    store = open_store(store_url(kind, tmp_path))
    try:
        now = time.time() * 1e6
        write_spans(store, data_parallel_job("long-job", now, steps=20, slow_rank=1), 1)
        monitor = _monitor(store)
        monitor.check_once(now)  # analyses the new spans and keeps their per-step breakdown
        store.span_retention_s = 5 * STEP_US / 1e6  # keep the last 5 steps' raw spans
        assert store.trim_spans() > 0 and len(store.spans("long-job")) < 20 * WORLD * 2
        (job,) = _jobs(monitor, now)
        assert job["steps"] == 20 and job["ranks"] == WORLD  # from the step marks, not the trimmed spans
        doc = json.loads(BreakdownService().breakdown(q.BreakdownRequest(job_id="long-job"), store).json)
        assert doc["history"]["steps"] == 20 and doc["history"]["ranks"] == WORLD
        assert doc["history"]["breakdown_us"]["comm_wait"] > 0  # rank 1's peers wait for it in every step
        assert max(r["window_us"] for r in doc["ranks"]) <= 6 * STEP_US  # the live part: the raw window only
    finally:
        store.close()


class _SteadyStraggler(SimJob):
    """A simulated job whose last rank computes a steady 12 % longer than its peers: a straggler by the spec's
    10 % busy-time rule, but only just."""

    def slow_factor(self, t_s: float) -> float:
        return 1.12


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_a_window_that_begins_inside_a_step_judges_every_rank_over_the_same_whole_steps(kind, tmp_path):
    """The window's start falls between the peers' and the slow rank's last all_reduce of a step: cut span by
    span, the slow rank counted one step more (its collective alone), its busy time per step fell below the
    10 % rule and it was no straggler."""
    store = open_store(store_url(kind, tmp_path))
    try:
        clock = [time.time() - 30.0]
        job = _SteadyStraggler("edge-job", "node-0", lambda: clock[0], ranks=4, step_s=1.0)
        clock[0] += 25.0
        table = job.spans()
        builder = BatchBuilder(pb.NodeIdentity(node="node-0"), "agent-spans")
        builder.add_spans(table)
        store.write(builder.build(1))
        rows = [dict(zip(SPAN_FIELDS, values)) for values in zip(*(getattr(table, f) for f in SPAN_FIELDS))]
        last_of_step = [r for r in rows if r["kind"] == "collective" and r["step"] == 10 and r["seq"] % 3 == 2]
        peers, slow = (max(r["start_us"] for r in last_of_step if (r["rank"] == 3) == late) for late in (False, True))
        window_s = 10.0
        now = (peers + slow) / 2 + window_s * 1e6  # the window opens between the two arrivals
        flags = _monitor(store, window_s=window_s, hang_threshold_s=600).check_once(now)
        (straggler,) = flags["edge-job"]["stragglers"]
        assert straggler["rank"] == 3 and straggler["busy_ratio"] == pytest.approx(1.12, abs=1e-3)
    finally:
        store.close()
