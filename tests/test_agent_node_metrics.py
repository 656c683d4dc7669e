"""The agent's node-local /metrics (`metrics_listen`): the same per-GPU series as the collector's, served from
what the agent sampled, scraped over HTTP while it streams to a real collector."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from gpuwatch.agent.daemon import AgentConfig
from gpuwatch.collector.assembly import start_collector
from gpuwatch.core.metrics_catalogue import EXPORTED_METRICS
from gpuwatch.collector.snapshot import MetricsService
from gpuwatch.core.settings import COLLECTOR_OPTIONS, CollectorSettings, load_config
from helpers import poll, running_simulated_agent

PROMTOOL = shutil.which("promtool")
SAMPLE = re.compile(r"^(\w+)(\{[^}]*\})? (\S+)$")


def _scrape(url: str, token: str | None = None) -> str:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read().decode()


def _scrape_once_it_shows(url: str, needle: str, token: str | None = None) -> str:
    return poll(lambda: (lambda text: needle in text and text)(_scrape(url, token)), 30, f"{needle} at {url}")


def _series(name: str, **labels: object) -> tuple[str, frozenset]:
    return name, frozenset((k, str(v)) for k, v in labels.items())


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    """(metric name, label set) -> value, for every sample line of an exposition."""
    found = (SAMPLE.match(line) for line in text.splitlines() if not line.startswith("#"))
    return {_series(m[1], **dict(re.findall(r'(\w+)="([^"]*)"', m[2] or ""))): float(m[3]) for m in found if m}


def _gpu_series(text: str) -> dict[tuple[str, frozenset], float]:
    return {k: v for k, v in _samples(text).items() if k[0].startswith("gpu_") and k[0] != "gpu_xid_errors_total"}


@pytest.fixture
def running_agent(tmp_path):
    """A collector with /metrics, and an agent on 4 simulated GPUs streaming to it with its own /metrics."""
    cfg = load_config(COLLECTOR_OPTIONS, {"listen": "127.0.0.1:0", "db": str(tmp_path / "c.duckdb"),
                                          "metrics_listen": "127.0.0.1:0"}, env={})
    collector = start_collector(cfg.build(CollectorSettings))
    cfg = AgentConfig(collector=collector.address, node="n7", interval=0.05, slow_interval=3600, batch_interval=0.1,
                      spool=tmp_path / "spool", metrics_listen="127.0.0.1:0")
    try:
        with running_simulated_agent(cfg, 4) as (agent, fleet):
            poll(lambda: agent.metrics_server is not None, 30, "the agent's metrics endpoint")
            (service,) = [s for s in collector.services if isinstance(s, MetricsService)]
            yield agent, fleet, collector, service.server.url
    finally:
        collector.stop()


def test_agent_serves_the_collectors_per_gpu_series_and_counts_xids(running_agent):
    agent, fleet, collector, collector_url = running_agent
    fleet.inject_xid(2, 63, "row remap pending")
    text = _scrape_once_it_shows(agent.metrics_server.url, 'xid="63"')
    samples = _samples(text)
    gpu2 = {"node": "n7", "gpu": 2, "gpu_uuid": fleet.gpus[2].uuid, "model": fleet.gpus[2].model.name}
    assert samples[_series("gpu_xid_errors_total", **gpu2, xid=63,
                           xid_description="ECC page retirement or row remapping recorded")] == 1
    assert samples[_series("gpu_memory_total_bytes", **gpu2)] == fleet.gpus[2].model.memory_bytes
    assert samples[_series("gpuwatch_gpu_job_info", node="n7", gpu=2, gpu_uuid=fleet.gpus[2].uuid, job_id="sim-n7",
                           rank=2)] == 1
    assert samples[_series("host_memory_total_bytes", node="n7")] > 0
    assert _series("gpuwatch_agent_spool_bytes", node="n7") in samples
    assert {name for name, _ in samples} <= set(EXPORTED_METRICS)

    # The collector, fed by the same agent, exposes the very same per-GPU series (names and labels).
    def same_series():
        ours, theirs = _gpu_series(_scrape(agent.metrics_server.url)), _gpu_series(_scrape(collector_url))
        return ours.keys() == theirs.keys() and (ours, theirs)

    ours, theirs = poll(same_series, 30, "the collector to expose the agent's per-GPU series", every=0.5)
    assert len({name for name, _ in ours}) > 20 and len({labels for _, labels in ours}) == 4
    gauge = _series("gpu_memory_total_bytes", **gpu2)
    assert ours[gauge] == theirs[gauge]
    if PROMTOOL:
        result = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def test_the_endpoint_asks_for_its_token(tmp_path):
    (tmp_path / "token").write_text("s3cret\n")
    (tmp_path / "token").chmod(0o600)
    cfg = AgentConfig(collector=None, record=tmp_path / "rec", node="n8", interval=0.05,
                      metrics_listen="127.0.0.1:0", metrics_token_file=str(tmp_path / "token"))
    with running_simulated_agent(cfg, 1) as (agent, _):
        poll(lambda: agent.metrics_server is not None, 30, "the agent's metrics endpoint")
        with pytest.raises(urllib.error.HTTPError) as refused:
            _scrape(agent.metrics_server.url, token="wrong")
        assert refused.value.code == 401
        text = _scrape_once_it_shows(agent.metrics_server.url, "gpu_power_watts", token="s3cret")
        assert 'node="n8"' in text


def test_beyond_loopback_without_a_token_is_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "agent", "--simulate", "1", "--record", str(tmp_path / "rec"),
         "--ticks", "1", "--metrics-listen", "0.0.0.0:0"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "metrics" in result.stderr and "token" in result.stderr
    assert "Traceback" not in result.stderr
