"""Why is it slow: every injected fail-slow kind named on its rank with evidence, a healthy job never
blamed, a rank that only waits never blamed, and the jobs monitor's slow_ranks over both store engines."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from gpuwatch.collector.alert_hub import SLOW_RANK, AlertHub, list_alerts
from gpuwatch.apps.commandline import json_text
from gpuwatch.collector.query_documents import alert_documents, job_documents, jobs_response
from gpuwatch.collector.breakdowns import BreakdownService
from gpuwatch.collector.change_point import upward_shift
from gpuwatch.collector.jobs import JobsMonitor
from gpuwatch.collector.store import open_store
from gpuwatch.collector.slow_evidence import THERMAL_REASONS, rank_intervals
from gpuwatch.collector.why_slow import find_slow_ranks
from gpuwatch.core.recording import open_recording
from gpuwatch.simulator.fail_slow import KINDS, parse_fail_slow_spec
from gpuwatch.v1 import query_pb2 as q
from helpers import STORE_KINDS, store_url
from slow_jobs import START_S, run_job

SLOW_KEYS = {"rank", "node", "gpu_index", "cause", "evidence", "since", "lost_gpu_seconds", "speedup_without"}


@pytest.mark.parametrize("kind", KINDS)
def test_each_injected_kind_is_named_on_its_rank_soon_after_onset(kind):
    onset = 150
    named = []
    for check in run_job(f"job-{kind}", 8, [parse_fail_slow_spec(f"gpu=5,kind={kind},after={onset}")],
                         seconds=270):
        found = find_slow_ranks(*check.evidence(f"job-{kind}"))
        if check.t < onset:
            assert found == [], f"before the onset at {check.t} s: {found}"
        elif found:
            named.append((check.t, found))
    assert named, "never named"
    first_t, first = named[0]
    assert first_t <= onset + 60  # the first check a minute after the onset at the latest (checks every 30 s)
    for _, found in named:  # one rank blamed, the right one, for the right cause, with numbers
        (slow,) = found
        assert (slow.rank, slow.gpu_index, slow.cause) == (5, 5, kind), slow
        assert any(ch.isdigit() for ch in slow.evidence) and slow.speedup_without > 0.1
        assert abs(slow.since_us / 1e6 - START_S - onset) < 15


def test_a_healthy_job_is_never_blamed_over_a_long_run():
    checks = 0
    for check in run_job("healthy", 4, [], seconds=2 * 3600, check_every_s=60):
        assert find_slow_ranks(*check.evidence("healthy")) == [], f"a cause raised at {check.t} s"
        checks += 1
    assert checks == 120


def test_a_slowdown_that_ends_is_no_longer_named():
    spec = parse_fail_slow_spec("gpu=1,kind=thermal,after=60,until=120")
    last = [find_slow_ranks(*c.evidence("ends")) for c in run_job("ends", 4, [spec], seconds=480)][-1]
    assert last == []


def _intervals(work: dict[int, list[float]], coll: dict[int, list[float]]) -> pd.DataFrame:
    rows = []
    for rank in work:
        t = START_S * 1e6
        for i, (w, c) in enumerate(zip(work[rank], coll[rank])):
            rows.append({"rank": rank, "seq": i, "arrive_us": t + w, "work_us": w, "coll_us": c,
                         "compute_us": np.nan, "copy_us": np.nan, "stall_us": np.nan})
            t += w + c
    return pd.DataFrame(rows)


def test_a_rank_that_only_waits_is_never_blamed_it_waits_for_its_peer():
    rng = np.random.default_rng(0)
    work = {r: list(100_000 * (1 + 0.02 * rng.standard_normal(60))) for r in range(4)}
    work[2][30:] = [w * 1.5 for w in work[2][30:]]  # rank 2 slows; the others wait for it
    coll = {r: [10_000.0 + (max(work[p][i] for p in work) - work[r][i]) for i in range(60)] for r in work}
    found = find_slow_ranks(_intervals(work, coll), lambda since: {}, delayed=[0])
    by_rank = {s.rank: s for s in found}
    assert set(by_rank) == {0, 2}
    assert by_rank[2].cause == "unknown" and "no GPU samples" in by_rank[2].evidence
    assert by_rank[0].cause == "peer" and by_rank[0].culprit == 2 and "waits for rank 2" in by_rank[0].evidence


def test_collectives_slower_for_everyone_with_normal_compute_is_the_network():
    rng = np.random.default_rng(1)
    work = {r: list(100_000 * (1 + 0.02 * rng.standard_normal(60))) for r in range(4)}
    coll = {r: [10_000.0 * (1 + 0.02 * rng.standard_normal()) * (4 if i >= 30 else 1) for i in range(60)]
            for r in work}
    (slow,) = find_slow_ranks(_intervals(work, coll), lambda since: {})
    assert slow.cause == "network" and slow.rank is None and "own work stayed normal" in slow.evidence
    assert slow.speedup_without > 0.2


def test_change_point_finds_the_onset_and_ignores_noise():
    rng = np.random.default_rng(2)
    noise = 1 + 0.03 * rng.standard_normal(200)
    assert upward_shift(noise) is None
    shifted = noise.copy()
    shifted[140:] *= 1.3
    shift = upward_shift(shifted)
    assert shift is not None and abs(shift.index - 140) <= 2 and 1.25 < shift.ratio < 1.35


def test_change_point_onset_is_not_pulled_early_by_hiccups_just_before_the_change():
    """A loaded host lengthens a few intervals at the old level (12 ms to 100-400 ms) just before a data
    loader turns a second slower: each interval sides with the level it is nearer to, so the onset stays."""
    work = np.full(30, 0.012)
    work[17:20] = [0.1, 0.4, 0.25]
    work[20:] = 1.012
    shift = upward_shift(work)
    assert shift is not None and shift.index == 20 and shift.before == 0.012 and shift.after == 1.012


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_jobs_monitor_names_the_cause_live_on_both_engines(kind, tmp_path):
    store = open_store(store_url(kind, tmp_path))
    hub = AlertHub()
    try:
        hub.start(store)
        monitor = JobsMonitor(hub, window_s=300, hang_threshold_s=600)
        monitor.bind(store)
        flags = {}
        for check in run_job("live-job", 4, [parse_fail_slow_spec("gpu=2,kind=power,after=90")], seconds=210,
                             store=store, node_name="node-live"):
            store.flush()
            flags = monitor.check_once(check.now_s * 1e6)
            if check.t < 90:
                assert flags["live-job"]["slow_ranks"] == []
        (slow,) = flags["live-job"]["slow_ranks"]
        assert set(slow) == SLOW_KEYS
        assert (slow["rank"], slow["node"], slow["gpu_index"], slow["cause"]) == (2, "node-live", 2, "power")
        assert "power cap/brake active" in slow["evidence"] and slow["lost_gpu_seconds"] > 0
        assert 0.1 < slow["speedup_without"] < 1
        jobs = monitor.jobs(check.now_s * 1e6)
        assert json_text(job_documents(jobs_response(jobs))) == json_text(jobs)  # the typed Jobs message keeps all
        (job,) = [j for j in jobs if j["job_id"] == "live-job"]
        assert job["slow_ranks"] == [slow]
        doc = json.loads(BreakdownService().breakdown(q.BreakdownRequest(job_id="live-job"), store).json)
        assert [(r["rank"], r["cause"]) for r in doc["slow_ranks"]] == [(2, "power")]
        alerts = alert_documents(list_alerts(q.AlertsRequest(), store))
        (alert,) = [a for a in alerts if a["alertname"] == SLOW_RANK]
        assert alert["rank"] == "2" and "power" in alert["summary"] and "power cap/brake" in alert["summary"]
    finally:
        hub.stop()
        store.close()


@pytest.mark.parametrize("spec, message", [
    ("gpu=1,kind=warm", "kind=warm: must be one of thermal, power"),
    ("gpu=x,kind=thermal", "gpu=x: must be a GPU index"),
    ("gpu=1,kind=thermal,after=10m,until=5m", "until=5m must come after after=10m"),
    ("gpu=1,kind=thermal,factor=0.5", "factor=0.5: must be a number > 1"),
    ("kind=thermal", "missing gpu"),
])
def test_a_bad_fail_slow_spec_is_refused_with_one_line(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_fail_slow_spec(spec)


def _agent(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuwatch", "agent", *argv], capture_output=True, text=True,
                          timeout=120)


def test_agent_flag_refuses_without_a_job_and_a_gpu_the_node_lacks():
    run = _agent("--simulate", "2", "--sim-fail-slow", "gpu=1,kind=thermal", "--ticks", "1", "--record", "/nonexistent")
    assert run.returncode != 0 and "--sim-fail-slow needs --simulate N and --sim-job JOB" in run.stderr
    assert "Traceback" not in run.stderr
    run = _agent("--simulate", "2", "--sim-job", "j", "--sim-fail-slow", "gpu=2,kind=thermal", "--ticks", "1")
    assert run.returncode != 0 and "gpu=2: the node simulates GPUs 0-1" in run.stderr


def test_agent_with_a_fail_slow_sends_the_cause_in_its_counters_and_the_rank_slower(tmp_path):
    rec = tmp_path / "R"
    run = _agent("--simulate", "2", "--sim-job", "fs-job", "--sim-fail-slow", "gpu=1,kind=host_cpu,after=0",
                 "--sim-fail-slow", "gpu=0,kind=thermal,after=0", "--sim-speed", "20", "--ticks", "4",
                 "--interval", "0.2", "--record", str(rec), "--node", "fs-node")
    assert run.returncode == 0, run.stderr
    recording = open_recording(rec)
    gpu = recording.table("gpu_samples")
    hot = gpu[gpu["gpu_index"] == 0]
    assert (hot["gpu_clock_event_reasons"].astype(int) & THERMAL_REASONS).all()
    assert (hot["gpu_sm_clock_hertz"] < gpu[gpu["gpu_index"] == 1]["gpu_sm_clock_hertz"].min()).all()
    assert (recording.table("host_samples")["host_cpu_utilization_ratio"] > 0.95).all()
    spans = recording.table("spans")
    intervals = rank_intervals(spans[spans["job_id"] == "fs-job"])
    stall = intervals.groupby("rank")["stall_us"].median()
    compute = intervals.groupby("rank")["compute_us"].median()
    assert stall[1] > 0.3 * compute[1] and stall[0] < 0.01 * compute[0]  # the starved rank stalls on its host
    assert compute[0] > 1.3 * compute[1]  # the throttled GPU computes slower
