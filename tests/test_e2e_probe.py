"""Probe spans end to end: gpuwatch.probe in a training process -> the agent's probe socket -> the agent's
batches and spool -> real gRPC -> the collector's `spans` table."""
import gpuwatch.probe
from gpuwatch.agent.daemon import AgentConfig
from helpers import CollectorProcess, poll, running_simulated_agent


def test_probe_steps_reach_the_collector_store_through_the_agent(tmp_path):
    collector = CollectorProcess(tmp_path / "store.duckdb").start()
    socket_path = str(tmp_path / "probe.sock")
    cfg = AgentConfig(collector=collector.address, node="probe-node", interval=0.05, batch_interval=0.05,
                      spool=tmp_path / "spool", probe_socket=socket_path)
    try:
        with running_simulated_agent(cfg, 1) as (agent, _):
            poll(lambda: agent.probe is not None, 30, "the agent's probe socket")
            probe = gpuwatch.probe.start(job="e2e-job", endpoint=socket_path)
            for _ in range(5):
                probe.step()
            probe.close()
            poll(lambda: agent.probe.stats()["datagrams"] and not agent.probe.pending(), 30,
                 "spans taken into a batch")
    finally:
        collector.stop()
    assert not agent.spool.pending()
    steps = collector.rows("SELECT DISTINCT step FROM spans WHERE job_id = 'e2e-job' AND kind = 'step' ORDER BY step")
    assert len(steps) >= 5
    assert collector.rows("SELECT count(*) FROM spans WHERE job_id <> 'e2e-job'") == [(0,)]
