"""End to end over real gRPC on loopback: `gpuwatch agent` processes (simulated GPUs beneath pynvml) stream to
a real `gpuwatch collector` process with its store (DuckDB, and ClickHouse in-process through chdb); restarts and
kills on either side lose nothing and store nothing twice."""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpuwatch.core import events as ev
from gpuwatch.agent.daemon import AgentConfig
from gpuwatch.apps.agent_cli import simulated_agent
from gpuwatch.simulator.node import SimulatedNode
from gpuwatch.agent.spool import decode_record
from gpuwatch.collector.client import connect
from gpuwatch.apps.commandline import parse_time_ms
from gpuwatch.v1 import query_pb2 as q
from gpuwatch.v1 import telemetry_pb2 as pb
from helpers import STORE_KINDS, CollectorProcess, free_port, poll, store_url

GPUS = 2


def agent_cmd(address: str, node: str, spool: Path, *extra: str, interval: float = 0.05) -> list[str]:
    return [sys.executable, "-m", "gpuwatch", "agent", "--collector", address, "--simulate", str(GPUS), "--node", node,
            "--interval", str(interval), "--batch-interval", str(2 * interval), "--spool", str(spool),
            "--log-level", "error", *extra]


def samples_by_node(address: str) -> dict[str, int]:
    try:
        reply = connect(address, timeout=1.0).ListNodes(q.ListNodesRequest(), timeout=5)
    except Exception:  # not up yet, or just killed
        return {}
    return {n.node: n.samples for n in reply.nodes}


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_collector_killed_mid_stream_and_restarted_stores_every_sample_once(kind, tmp_path):
    collector = CollectorProcess(store_url(kind, tmp_path)).start()
    ticks, nodes = 60, ("kill-a", "kill-b")
    agents = [subprocess.Popen(agent_cmd(collector.address, node, tmp_path / node, "--ticks", str(ticks)))
              for node in nodes]
    try:
        poll(lambda: all(samples_by_node(collector.address).get(n) for n in nodes), 60, "first samples stored")
        collector.kill()
        assert all(a.poll() is None for a in agents), "the agents should still be sampling"
        collector.start()  # on the same port and store
        assert [a.wait(120) for a in agents] == [0, 0]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
        collector.stop()
    counts = collector.rows("SELECT node, gpu_index, count(*), count(DISTINCT ts) FROM gpu_samples "
                            "GROUP BY ALL ORDER BY ALL")
    assert counts == [(n, g, ticks, ticks) for n in nodes for g in range(GPUS)]
    assert collector.rows("SELECT count(*) FROM host_samples") == [(ticks * len(nodes),)]


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_agent_restarted_with_a_full_spool_drains_it_in_order_once(kind, tmp_path):
    port, spool = free_port(), tmp_path / "spool"
    address = f"127.0.0.1:{port}"
    first = subprocess.Popen(agent_cmd(address, "spool-node", spool, interval=0.02))  # no collector yet
    try:
        poll(lambda: len(list((spool / "batches").glob("*.pb"))) >= 30, 60, "30 spooled batches")
    finally:
        first.kill()
        first.wait(30)
    spooled = [pb.TelemetryBatch.FromString(decode_record(p.read_bytes()))
               for p in sorted((spool / "batches").glob("*.pb"))]
    spooled_rows = sum(len(s.ts_ms) for b in spooled for s in b.samples if s.gpu_index == 0)
    collector = CollectorProcess(store_url(kind, tmp_path), port).start()
    try:
        second = subprocess.run(agent_cmd(address, "spool-node", spool, "--ticks", "3", interval=0.02), timeout=120)
        assert second.returncode == 0
    finally:
        collector.stop()
    assert not list((spool / "batches").glob("*.pb"))
    ts = [t for (t,) in collector.rows("SELECT ts FROM gpu_samples WHERE gpu_index = 0")]  # in insertion order
    assert len(ts) == spooled_rows + 3 and ts == sorted(set(ts))
    sequences = [s for (s,) in collector.rows("SELECT sequence FROM ingested ORDER BY ingested_at, sequence")]
    assert sequences == sorted(set(sequences)) and {b.sequence for b in spooled} <= set(sequences)


@pytest.fixture(scope="module", params=STORE_KINDS)
def shared_collector(request, tmp_path_factory):
    collector = CollectorProcess(store_url(request.param, tmp_path_factory.mktemp("collector"))).start()
    yield collector
    collector.stop()


def test_unsupported_fields_and_a_lost_gpu_arrive_as_events_while_the_rest_keeps_sampling(tmp_path, shared_collector):
    address = shared_collector.address
    sim = SimulatedNode(4, node="faulty")
    fleet = sim.fleet
    fleet.gpus[1].unsupported.add("nvmlDeviceGetPowerUsage")
    cfg = AgentConfig(collector=address, node="faulty", interval=0.05, batch_interval=0.05, spool=tmp_path)
    agent = simulated_agent(cfg, sim)
    runner = threading.Thread(target=agent.run)
    stub = connect(address)
    with sim:
        runner.start()
        try:
            poll(lambda: samples_by_node(address).get("faulty"), 30, "first samples")
            fleet.lose_gpu(2)
            lost = poll(lambda: stub.Events(q.EventsRequest(node="faulty", kind=ev.GPU_LOST)).events, 30,
                        "gpu_lost")
            lost_ms = lost[0].event.ts_ms

            def last_seen():
                return {g.info.index: g.last_seen_ms for g in stub.ListGpus(q.ListGpusRequest(node="faulty")).gpus}

            poll(lambda: all(last_seen()[g] > lost_ms + 200 for g in (0, 1, 3)), 30, "samples after the loss")
        finally:
            agent.stop()
            runner.join(60)
    assert [e.event.gpu_index for e in lost] == [2]
    assert last_seen()[2] <= lost_ms
    unsupported = stub.Events(q.EventsRequest(node="faulty", kind=ev.FIELD_UNSUPPORTED)).events
    refused = {(e.event.gpu_index, e.event.attrs["field"]) for e in unsupported}
    assert (1, "nvmlDeviceGetPowerUsage") in refused and (0, "nvmlDeviceGetPowerUsage") not in refused
    assert {(g, "gpu_retired_pages_sbe") for g in range(4)} <= refused  # H100: Ampere and newer remap rows
    assert len(unsupported) == len(refused)  # each reported once
    xids = stub.Events(q.EventsRequest(node="faulty", kind=ev.XID)).events
    assert [(e.event.gpu_index, e.event.code) for e in xids] == [(2, 79)]


def test_nodes_json_after_an_agent_run(tmp_path, shared_collector):
    ticks, gpus = 5, 3
    started_ms = int(time.time() * 1000)
    run = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "agent", "--collector", shared_collector.address, "--simulate", str(gpus),
         "--node", "listed", "--interval", "0.2", "--spool", str(tmp_path), "--ticks", str(ticks)],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    ended_ms = int(time.time() * 1000)
    out = subprocess.run([sys.executable, "-m", "gpuwatch", "nodes", "--json", "--collector", shared_collector.address],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "GPUWATCH_COLLECTOR": ""})
    assert out.returncode == 0, out.stderr
    (node,) = [n for n in json.loads(out.stdout) if n["node"] == "listed"]
    assert (node["gpus"], node["samples"]) == (gpus, gpus * ticks)
    assert started_ms <= parse_time_ms(node["last_seen"]) <= ended_ms
