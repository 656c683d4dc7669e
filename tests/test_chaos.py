"""Chaos: three agents stream while the collector is SIGKILLed again and again, one agent is
SIGKILLed and restarted on its spool, and another's spool disk fills up and is freed. Afterwards every
sample is stored once, the agents that were not killed lost nothing, and every dropped batch is counted
by the agent and reported to the collector."""
import json
import signal
import subprocess
import sys

import pytest

from gpuwatch.collector import client
from gpuwatch.collector.store.duckdb import DuckDBStore
from gpuwatch.v1 import query_pb2 as q
from helpers import CollectorProcess, fill_disk, poll, small_filesystem

TICKS = 600
GPUS = 2
COLLECTOR_KILLS = 4


def _agent(address: str, node: str, spool, log, ticks: int | None = None) -> subprocess.Popen:
    """An agent process; without ``ticks`` it samples until SIGTERM, then sends what it spooled and exits."""
    return subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "agent", "--collector", address, "--simulate", str(GPUS), "--node", node,
         "--interval", "0.05", "--batch-interval", "0.1", "--spool", str(spool),
         *(["--ticks", str(ticks)] if ticks else []), "--drain-timeout", "300", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=log)


def _samples(address: str) -> dict[str, int]:
    try:
        nodes = client.connect(address, timeout=5).ListNodes(q.ListNodesRequest(), timeout=5).nodes
    except Exception:  # the collector is down or starting: no progress seen yet
        return {}
    return {n.node: n.samples for n in nodes}


def _sequences(db, agent_id: str) -> list[int]:
    rows = CollectorProcess(db).rows(f"SELECT sequence FROM ingested WHERE agent_id = '{agent_id}' ORDER BY 1")
    return [int(r[0]) for r in rows]


@pytest.mark.slow
def test_nothing_is_lost_or_stored_twice_through_kills_and_a_full_disk(tmp_path):
    db = tmp_path / "chaos.duckdb"
    collector = CollectorProcess(db).start()
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("steady", "full", "killed", "restarted")}
    with small_filesystem(tmp_path / "disk", "2m") as disk:
        steady = _agent(collector.address, "steady", tmp_path / "spool-steady", logs["steady"])
        full = _agent(collector.address, "full", disk / "spool", logs["full"])
        killed = _agent(collector.address, "killed", tmp_path / "spool-killed", logs["killed"])
        restarted = None
        try:
            # every agent running and stored before the first kill: the disk must fill under a running agent
            # (one still starting on a loaded machine would find it full at start, with no batch to drop)
            poll(lambda: all(_samples(collector.address).get(n, 0) > 0 for n in ("steady", "full", "killed")), 120,
                 "every agent to store samples")
            # "steady" and "full" sample until they are stopped after the last kill, so every kill falls while
            # they run, however slowly this machine starts collectors
            for kills in range(1, COLLECTOR_KILLS + 1):
                before = _samples(collector.address)
                poll(lambda before=before: any(_samples(collector.address).get(n, 0) > before.get(n, 0)
                                               for n in ("steady", "full")),
                     120, f"progress before collector kill {kills}")
                for name, agent in (("steady", steady), ("full", full)):
                    assert agent.poll() is None, (tmp_path / f"{name}.log").read_text()[-3000:]
                collector.kill()
                if kills == 1:  # while the collector is away the "full" agent's spool disk fills up
                    filler = fill_disk(disk)
                    poll(lambda: "disk is full" in (tmp_path / "full.log").read_text(), 120, "the agent to see it")
                    filler.unlink()
                if kills == 2:  # an agent dies too, and comes back on its spool
                    killed.send_signal(signal.SIGKILL)
                    killed.wait(30)
                    restarted = _agent(collector.address, "killed", tmp_path / "spool-killed", logs["restarted"],
                                       ticks=TICKS // 4)
                collector.start()
            for agent in (steady, full):
                agent.send_signal(signal.SIGTERM)
            for name, agent in (("steady", steady), ("full", full), ("restarted", restarted)):
                assert agent.wait(600) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        finally:
            for agent in (steady, full, killed, restarted):
                if agent is not None and agent.poll() is None:
                    agent.kill()
            for log in logs.values():
                log.close()
            collector.stop()
        full_state = json.loads((disk / "spool" / "state.json").read_text())
    steady_state = json.loads((tmp_path / "spool-steady" / "state.json").read_text())

    (duplicates,) = CollectorProcess(db).rows(
        "SELECT count(*) FROM (SELECT node, gpu_index, ts FROM gpu_samples GROUP BY ALL HAVING count(*) > 1)")
    assert duplicates == (0,)
    stored = dict(CollectorProcess(db).rows("SELECT node, count(*) FROM gpu_samples GROUP BY node"))
    # through the collector kills: every batch the steady agent numbered, once, each with every GPU of each tick
    assert _sequences(db, steady_state["agent_id"]) == list(range(1, steady_state["next_sequence"]))
    (ticks,) = CollectorProcess(db).rows("SELECT count(DISTINCT ts) FROM gpu_samples WHERE node = 'steady'")
    assert stored["steady"] == ticks[0] * GPUS and ticks[0] > 0

    # the full disk: every sequence the agent numbered is stored or counted as dropped, and reported
    dropped = full_state["dropped_batches_total"]
    assert dropped > 0
    assert len(_sequences(db, full_state["agent_id"])) + dropped == full_state["next_sequence"] - 1
    store = DuckDBStore(str(db))
    try:
        reported = {a["node"]: a["spool_dropped"] for a in store.agent_health()}
    finally:
        store.close()
    assert reported["full"] == dropped and reported["steady"] == 0

    # the killed agent: its restart sent everything; what it had spooled before the kill too (a batch being
    # numbered at the kill may leave one gap), and nothing twice
    killed_state = json.loads((tmp_path / "spool-killed" / "state.json").read_text())
    sequences = _sequences(db, killed_state["agent_id"])
    missing = set(range(1, killed_state["next_sequence"])) - set(sequences)
    assert len(missing) <= 1, sorted(missing)
    assert stored["killed"] >= TICKS // 4 * GPUS
