"""Agents against a real collector when things go wrong: an unstorable batch is
set aside and counted while the rest flow; a cloned spool is refused with a clear error, `--check` says
what to do, and `--new-agent-id` sends the clone's data under its own id without losing any of it."""
import json
import shutil
import subprocess
import sys

import pytest

from gpuwatch.agent.spool import Spool
from gpuwatch.agent.uplink import Uplink
from gpuwatch.collector.server import serve
from gpuwatch.core.settings import local_collector
from helpers import CollectorProcess, make_batch


def test_an_unstorable_batch_is_quarantined_counted_and_the_rest_are_stored(tmp_path):
    server = serve(local_collector(str(tmp_path / "c.duckdb")))
    spool = Spool(tmp_path / "spool")
    for _ in range(6):
        seq = spool.next_sequence()
        batch = make_batch(seq, agent=spool.agent_id)
        if seq == 3:
            batch.gpus[0].index = batch.samples[0].gpu_index = 2**31  # passes the wire format, not the store
        spool.append(seq, batch.SerializeToString())
    uplink = Uplink(spool, server.address, window=4, backoff_initial_s=0.05)
    uplink.start()
    try:
        assert uplink.wait_drained(60)
    finally:
        uplink.stop()
        server.stop()
    assert spool.rejected() == [3] and uplink.stats.rejected == 1
    reason = (tmp_path / "spool" / "rejected" / f"{3:020d}.reason.txt").read_text()
    assert "INVALID_ARGUMENT" in reason and "out of range" in reason
    rows = CollectorProcess(tmp_path / "c.duckdb").rows("SELECT sequence FROM ingested ORDER BY sequence")
    assert [r[0] for r in rows] == [1, 2, 4, 5, 6]


def _agent(collector: str, spool, node: str, ticks: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpuwatch", "agent", "--collector", collector, "--simulate", "2", "--node", node,
         "--interval", "0.05", "--batch-interval", "0.1", "--spool", str(spool), "--ticks", str(ticks),
         "--drain-timeout", "60", "--log-level", "warning", *extra],
        capture_output=True, text=True, timeout=300)


def _samples(collector: str) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-m", "gpuwatch", "nodes", "--collector", collector, "--json"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return {n["node"]: n["samples"] for n in json.loads(out)}


@pytest.mark.slow
def test_a_cloned_spool_is_refused_checked_and_renewed_without_losing_samples(tmp_path):
    collector = CollectorProcess(tmp_path / "c.duckdb").start()
    try:
        original, clone = tmp_path / "spool-a", tmp_path / "spool-b"
        assert _agent(collector.address, original, "node-a", 2).returncode == 0
        shutil.copytree(original, clone)  # a VM image taken after the first run
        assert _agent(collector.address, original, "node-a", 10).returncode == 0

        refused = _agent(collector.address, clone, "node-b", 10)
        assert refused.returncode != 0
        assert "used by two agents" in refused.stderr and "--new-agent-id" in refused.stderr
        assert "Traceback" not in refused.stderr

        check = subprocess.run([sys.executable, "-m", "gpuwatch", "agent", "--check", "--collector",
                                collector.address, "--simulate", "2", "--node", "node-b", "--spool", str(clone)],
                               capture_output=True, text=True, timeout=120)
        assert check.returncode == 1 and "FAIL  agent identity" in check.stdout
        assert f"gpuwatch agent --new-agent-id --spool {clone}" in check.stdout

        renew = subprocess.run([sys.executable, "-m", "gpuwatch", "agent", "--new-agent-id", "--spool", str(clone)],
                               capture_output=True, text=True, timeout=60)
        assert renew.returncode == 0 and "renumbered" in renew.stdout
        again = _agent(collector.address, clone, "node-b", 4)
        assert again.returncode == 0, again.stderr
        # every tick of both agents is stored once: 12 of node-a, 10 + 4 of node-b, 2 GPUs each
        assert _samples(collector.address) == {"node-a": 2 * 12, "node-b": 2 * 14}
    finally:
        collector.stop()
