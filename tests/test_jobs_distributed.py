"""Real torch.distributed (gloo, 4 CPU ranks) jobs with the probe on -> probe socket -> real gRPC -> collector:
`gpuwatch breakdown` shows the peers' wait as comm_wait, `gpuwatch jobs` flags the slow rank (and none in a
balanced run), and a two-stage pipeline shows bubble."""
from __future__ import annotations

import json
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import gpuwatch.probe  # noqa: E402
from gpuwatch.apps import cli  # noqa: E402
from gpuwatch.collector.assembly import start_collector  # noqa: E402
from gpuwatch.core.settings import COLLECTOR_OPTIONS, CollectorSettings, load_config  # noqa: E402
from gloo_jobs import finish_rank, init_rank, pipeline_worker, run_job  # noqa: E402
from helpers import SPAN_FIELDS, poll  # noqa: E402

STEPS = 12
SLOW_RANK = 3


def _data_parallel(rank: int, world: int, port: int, sock: str, out_dir: str, job: str, slow_rank: int) -> None:
    init_rank(rank, world, port)
    probe = gpuwatch.probe.start(job=job, endpoint=sock)
    for _ in range(STEPS):
        time.sleep(0.06 if rank == slow_rank else 0.01)  # compute; one rank is slow on purpose
        dist.all_reduce(torch.ones(256))
        probe.step()
    finish_rank(probe, out_dir, rank)


def slow_worker(rank: int, world: int, port: int, sock: str, out_dir: str) -> None:
    _data_parallel(rank, world, port, sock, out_dir, "dp-slow", SLOW_RANK)


def balanced_worker(rank: int, world: int, port: int, sock: str, out_dir: str) -> None:
    _data_parallel(rank, world, port, sock, out_dir, "dp-even", -1)


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    cfg = load_config(COLLECTOR_OPTIONS, {"listen": "127.0.0.1:0", "db": str(tmp_path_factory.mktemp("c") / "c.duckdb"),
                                "jobs_interval": 0.2}, env={})
    server = start_collector(cfg.build(CollectorSettings))
    yield server
    server.stop()


def _send(collector, rows: list[dict]) -> None:
    """The probe rows as one TelemetryBatch's SpanTable over the collector's gRPC Ingest (as the agent sends them)."""
    from gpuwatch.core.batches import BatchBuilder
    from gpuwatch.collector import client
    from gpuwatch.v1 import telemetry_pb2 as pb

    builder = BatchBuilder(pb.NodeIdentity(node="gloo-node"), f"agent-{rows[0]['job_id']}")
    builder.add_spans(pb.SpanTable(**{name: [r[name] for r in rows] for name in SPAN_FIELDS}))
    ch = client.channel(collector.address)
    try:
        client.push(ch, builder.build(1))
    finally:
        ch.close()


def _cli_json(capsys, *argv: str):
    assert cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _job(collector, capsys, job_id: str, until=lambda job: True) -> dict:
    def listed():
        jobs = {j["job_id"]: j for j in _cli_json(capsys, "jobs", "--collector", collector.address)}
        return jobs.get(job_id) if job_id in jobs and "breakdown" in jobs[job_id] and until(jobs[job_id]) else None

    return poll(listed, 30, f"{job_id} analysed by the jobs monitor", every=0.2)


@pytest.mark.slow
def test_slow_rank_shows_as_comm_wait_and_is_flagged(tmp_path, collector, capsys):
    _, rows = run_job(slow_worker, 4, tmp_path)
    _send(collector, rows)
    doc = _cli_json(capsys, "breakdown", "dp-slow", "--collector", collector.address)
    wait = {r["rank"]: r["breakdown_us"]["comm_wait"] for r in doc["ranks"]}
    assert all(wait[r] > STEPS * 0.03e6 for r in range(4) if r != SLOW_RANK)  # ~50 ms per step waiting
    assert wait[SLOW_RANK] < min(wait[r] for r in range(4) if r != SLOW_RANK) / 3
    job = _job(collector, capsys, "dp-slow", until=lambda j: j["stragglers"])
    assert job["ranks"] == 4 and job["steps"] == STEPS and 0 < job["lost_fraction"] < 1
    (straggler,) = job["stragglers"]
    assert straggler["rank"] == SLOW_RANK and straggler["last_share"] > 0.9 and straggler["busy_ratio"] > 2
    assert straggler["since"]


@pytest.mark.slow
def test_balanced_run_flags_no_rank(tmp_path, collector, capsys):
    _, rows = run_job(balanced_worker, 4, tmp_path)
    _send(collector, rows)
    job = _job(collector, capsys, "dp-even")
    assert job["ranks"] == 4 and job["stragglers"] == []


@pytest.mark.slow
def test_two_stage_pipeline_shows_bubble(tmp_path, collector, capsys):
    _, rows = run_job(pipeline_worker, 2, tmp_path)
    _send(collector, rows)
    doc = _cli_json(capsys, "breakdown", "job-pipe", "--collector", collector.address)
    assert doc["job"]["breakdown_us"]["bubble"] > 0
