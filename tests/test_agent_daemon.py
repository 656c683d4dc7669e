"""The agent end to end on one node: simulated GPUs -> spool -> gRPC -> an in-memory Ingest sink."""
import signal
import subprocess
import sys
import time
import threading

import pandas as pd
import pytest

from gpuwatch.core import events as ev
from gpuwatch.agent.daemon import AgentConfig, span_chunks
from gpuwatch.apps.agent_cli import simulated_agent
from gpuwatch.simulator.node import SimulatedNode
from gpuwatch.core.errors import UserError
from gpuwatch.v1 import telemetry_pb2 as pb
from helpers import poll, running_simulated_agent


def _events(store):
    return [e for b in store.batches.values() for e in b.events]


def test_agent_in_process_sends_every_tick_with_jobs_and_events(tmp_path, sink):
    server, address = sink
    cfg = AgentConfig(collector=address, node="n1", interval=0.02, batch_interval=0.1, spool=tmp_path)
    with SimulatedNode(8, node="n1") as sim:
        summary = simulated_agent(cfg, sim).run(ticks=12)
    assert summary.ticks == 12 and summary.pending == 0 and summary.batches >= 3
    batches = [server.store.batches[k] for k in sorted(server.store.batches)]
    assert [b.sequence for b in batches] == list(range(1, len(batches) + 1))
    gpu3 = [s for b in batches for s in b.samples if s.gpu_index == 3]
    assert sum(len(s.ts_ms) for s in gpu3) == 12
    assert set(j for s in gpu3 for j in s.job_id) == {"sim-n1"} and set(r for s in gpu3 for r in s.rank) == {3}
    assert sum(len(b.host.ts_ms) for b in batches) == 12
    kinds = [e.kind for e in _events(server.store)]
    assert kinds.count(ev.AGENT_START) == 1 and kinds[-1] == ev.AGENT_STOP
    assert batches[0].node.labels["simulated"] == "true" and len(batches[0].gpus) == 8


def test_fault_injected_while_running_arrives_as_events(tmp_path, sink):
    server, address = sink
    sim = SimulatedNode(4, node="n2")
    fleet = sim.fleet
    cfg = AgentConfig(collector=address, node="n2", interval=0.05, batch_interval=0.05, spool=tmp_path)
    agent = simulated_agent(cfg, sim)

    def inject_when_first_batch_arrives(store):
        if store.batches and not fleet.gpus[1].lost:
            fleet.lose_gpu(1)
        return any(e.kind == ev.GPU_LOST for b in store.batches.values() for e in b.events)

    t = threading.Thread(target=lambda: (server.store.wait_for(inject_when_first_batch_arrives, 20), agent.stop()))
    t.start()
    with sim:
        agent.run()
    t.join()
    events = _events(server.store)
    assert [(e.gpu_index, e.code) for e in events if e.kind == ev.XID] == [(1, 79)]
    assert [e.gpu_index for e in events if e.kind == ev.GPU_LOST] == [1]


def test_unreachable_collector_keeps_data_and_says_so(tmp_path):
    cfg = AgentConfig(collector="127.0.0.1:1", interval=0.01, spool=tmp_path, drain_timeout=0.5)
    with SimulatedNode(2) as sim, pytest.raises(UserError, match=r"did not acknowledge 1 batches.*kept in the spool"):
        simulated_agent(cfg, sim).run(ticks=2)
    assert len(list((tmp_path / "batches").iterdir())) == 1


def _agent_cmd(address, spool, *extra):
    return [sys.executable, "-m", "gpuwatch", "agent", "--collector", address, "--simulate", "4", "--node", "sub",
            "--interval", "0.05", "--spool", str(spool), "--log-level", "WARNING", *extra]


def test_command_with_ticks_exits_zero_after_everything_is_acknowledged(tmp_path, sink):
    server, address = sink
    proc = subprocess.run(_agent_cmd(address, tmp_path, "--ticks", "4"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = sum(len(s.ts_ms) for b in server.store.batches.values() for s in b.samples)
    assert rows == 4 * 4 and not list((tmp_path / "batches").iterdir())


def test_command_stops_cleanly_on_sigterm(tmp_path, sink):
    server, address = sink
    proc = subprocess.Popen(_agent_cmd(address, tmp_path, "--batch-interval", "0.05"), stderr=subprocess.PIPE,
                            text=True)
    try:
        assert server.store.wait_for(lambda s: len(s.batches) >= 2, 60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _events(server.store)[-1].kind == ev.AGENT_STOP


def test_bad_flag_is_one_line(tmp_path):
    proc = subprocess.run(_agent_cmd("nowhere", tmp_path, "--ticks", "1"), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "gpuwatch agent: error: collector (from flag --collector): 'nowhere' is not HOST:PORT "
        "(use 0.0.0.0:PORT for all interfaces)")


def test_large_span_tables_are_cut_below_the_batch_limit():
    n = 50_000
    spans = pb.SpanTable(job_id=["job-with-a-long-name"] * n, rank=[r % 8 for r in range(n)], step=list(range(n)),
                         kind=["collective"] * n, name=["all_reduce"] * n, start_us=[float(i) for i in range(n)],
                         dur_us=[1.5] * n)
    chunks = span_chunks(spans, 200_000)
    assert len(chunks) > 1 and all(c.ByteSize() <= 220_000 for c in chunks)
    merged = pb.SpanTable()
    for c in chunks:
        merged.MergeFrom(c)
    assert merged == spans and not merged.peer  # columns the probe left empty stay empty
    assert span_chunks(pb.SpanTable(), 10) == [] and span_chunks(spans, 10**9) == [spans]


def test_simulated_time_runs_at_sim_speed_for_samples_and_events(tmp_path, sink):
    server, address = sink
    start = 1_767_225_600.0  # 2026-01-01T00:00:00Z
    cfg = AgentConfig(collector=address, node="n1", interval=0.05, batch_interval=0.1, spool=tmp_path)
    with SimulatedNode(2, node="n1", speed=1200.0, start=start) as sim:
        began = time.monotonic()
        simulated_agent(cfg, sim).run(ticks=10)
        wall_s = time.monotonic() - began
    batches = [server.store.batches[k] for k in sorted(server.store.batches)]
    ts = sorted({t for b in batches for s in b.samples for t in s.ts_ms})
    steps = [b - a for a, b in zip(ts, ts[1:])]
    # at least 60 simulated s per 0.05 s tick; in all, no more simulated time than 1200x the wall time taken
    # (a loaded machine makes ticks longer, never the ratio of the clocks larger)
    assert len(ts) == 10 and 40_000 < min(steps) and ts[-1] - ts[0] <= 1200 * wall_s * 1000
    assert start * 1000 <= ts[0] < start * 1000 + 120_000
    start_event = next(e for b in batches for e in b.events if e.kind == ev.AGENT_START)
    assert abs(start_event.ts_ms - ts[0]) < 120_000  # events are on the simulated clock too, not the wall clock


def test_sim_flags_are_checked_with_one_line_errors(tmp_path):
    base = [sys.executable, "-m", "gpuwatch", "agent", "--spool", str(tmp_path), "--ticks", "1"]
    for extra, problem in [
        (["--sim-speed", "10"], "need --simulate"),
        (["--simulate", "2", "--sim-speed", "0"], "--sim-speed 0.0: must be > 0"),
        (["--simulate", "2", "--sim-fault", "gpu=1,kind=ecc"], "missing fail"),
        (["--simulate", "2", "--sim-fault", "gpu=4,kind=ecc,fail=1h"], "gpu=4: the node simulates GPUs 0-1"),
        (["--simulate", "2", "--sim-start", "tomorrow"], "not epoch seconds or an ISO 8601 time"),
    ]:
        out = subprocess.run(base + extra, capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and problem in out.stderr and "Traceback" not in out.stderr, (extra, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1


def test_sigterm_during_the_final_drain_exits_promptly_keeping_the_batches(tmp_path):
    """--drain-timeout 600 against a closed port: SIGTERM must end the wait, not the 600 s."""
    proc = subprocess.Popen(_agent_cmd("127.0.0.1:1", tmp_path, "--ticks", "2", "--drain-timeout", "600",
                                          "--log-level", "ERROR"),
                            stderr=subprocess.PIPE, text=True)
    try:
        poll(lambda: list((tmp_path / "batches").glob("*")) if (tmp_path / "batches").exists() else [], 60,
             "the last batch spooled (the drain starts right after)")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2 and "Traceback" not in err
    [line] = err.strip().splitlines()
    assert line.startswith("gpuwatch agent: error: stopped; collector 127.0.0.1:1 did not acknowledge 1 batches")
    assert "kept in the spool" in line


def test_simulate_zero_is_refused(tmp_path):
    out = subprocess.run([sys.executable, "-m", "gpuwatch", "agent", "--spool", str(tmp_path), "--ticks", "1",
                          "--simulate", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.strip() == (
        "gpuwatch agent: error: --simulate 0: must be a number of GPUs (>= 1)")


def test_forwarded_probe_spans_carry_the_agents_node_name(tmp_path, sink):
    import gpuwatch.probe

    server, address = sink
    cfg = AgentConfig(collector=address, node="agent-node", interval=0.05, batch_interval=0.05,
                      spool=tmp_path / "spool", probe_socket=str(tmp_path / "p.sock"))
    with running_simulated_agent(cfg, 2) as (agent, _):
        poll(lambda: agent.probe is not None, 30, "the probe listener")
        probe = gpuwatch.probe.start(job="forwarded", endpoint=cfg.probe_socket)  # node: this host's name
        with probe.step_scope():
            pass
        probe.close()
        assert server.store.wait_for(lambda s: any(b.spans.start_us for b in s.batches.values()), 30)
    spans = [b.spans for b in server.store.batches.values() if b.spans.start_us]
    assert {j for s in spans for j in s.job_id} == {"forwarded"}
    assert {n for s in spans for n in s.node} == {"agent-node"}


def test_sim_job_sends_probe_style_spans_with_a_slow_rank(tmp_path, sink):
    from gpuwatch.efficiency.engine import analyze
    from gpuwatch.collector.live import probe_timelines

    server, address = sink
    cfg = AgentConfig(collector=address, node="n1", interval=0.05, batch_interval=0.1, spool=tmp_path)
    with SimulatedNode(8, node="n1", speed=100.0, job="job-n1", job_step_s=1.0) as sim:
        simulated_agent(cfg, sim).run(ticks=10)
    batches = list(server.store.batches.values())
    columns = [f.name for f in pb.SpanTable.DESCRIPTOR.fields]
    rows = pd.DataFrame([dict(zip(columns, r)) for b in batches
                         for r in zip(*(getattr(b.spans, c) for c in columns))])
    assert set(rows["job_id"]) == {"job-n1"} and set(rows["node"]) == {"n1"} and set(rows["rank"]) == set(range(8))
    assert set(rows["kind"]) == {"step", "compute", "collective"}
    coll = rows[rows["kind"] == "collective"]
    assert set(coll["name"]) == {"all_reduce"} and set(coll["process_group"]) == {"0"} and (coll["bytes"] > 0).all()
    assert (coll.groupby("seq")["rank"].nunique() == 8).all()  # every rank joins every collective
    assert rows["step"].max() >= 10  # ~50 simulated seconds of 1.29 s steps, minus the last unfinished one
    gpu_jobs = {j for b in batches for s in b.samples for j in s.job_id}
    assert gpu_jobs == {"job-n1"}  # the GPU rows name the same job, so spans and telemetry join
    doc = analyze(probe_timelines(rows, "sim job")).to_json()
    assert doc["job"]["breakdown_fraction"]["comm_wait"] > 0.05
    assert [s["rank"] for s in doc["stragglers"]] == [7]
