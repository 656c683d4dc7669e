"""`gpuwatch collector --metrics-listen`: a real collector, batches in, /metrics scraped over HTTP, promtool."""
from __future__ import annotations

import re
import shutil
import subprocess
import time
import urllib.request

import pytest

from gpuwatch.collector.assembly import start_collector
from gpuwatch.collector.scoring import Scorer
from gpuwatch.collector.snapshot import MetricsService
from gpuwatch.core.settings import COLLECTOR_OPTIONS, CollectorSettings, load_config
from gpuwatch.simulator.failing_fleet import HOUR_MS
from helpers import data_parallel_job, degrading_node, make_batch, poll, sim_batches, write_spans

PROMTOOL = shutil.which("promtool")


@pytest.fixture
def collector(tmp_path):
    cfg = load_config(COLLECTOR_OPTIONS, {"listen": "127.0.0.1:0", "db": str(tmp_path / "m.duckdb"),
                                "metrics_listen": "127.0.0.1:0", "score_interval": 0.2, "jobs_interval": 0.2},
                      env={})
    server = start_collector(cfg.build(CollectorSettings))
    yield server
    server.stop()


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def _value(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample of ``name`` whose labels include ``labels``."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return None


def _after_two(counter, what: str) -> None:
    """Waits until ``counter`` (rounds of a background loop) has moved on by two from now: the first may have
    begun before this call, the second began after it."""
    start = counter()
    poll(lambda: counter() >= start + 2, 60, what, every=0.05)


def test_scrape_shows_gpus_xids_risk_jobs_ingest_and_agents_and_passes_promtool(collector):
    now = int(time.time() * 1000)
    for seq in (1, 2):
        collector.store.write(make_batch(seq, t0_ms=now - 60_000))
    collector.store.write(make_batch(2, t0_ms=now - 60_000))  # a duplicate (a resend: the same content)
    gpu, events = degrading_node(now - 28 * HOUR_MS, hours=28, fault_after_h=29)
    for batch in sim_batches(gpu, events):
        collector.store.write(batch)
    write_spans(collector.store, data_parallel_job("slow-job", now * 1000.0, slow_rank=2), 1)
    (metrics,) = [s for s in collector.services if isinstance(s, MetricsService)]
    (scorer,) = [s for s in collector.services if isinstance(s, Scorer)]
    # Every write above is committed. A scoring round running meanwhile scored part of the history (online
    # scoring scores what is stored so far); the second round from here began after the last commit, and the
    # second render from then on shows it.
    _after_two(lambda: scorer.rounds, "two scoring rounds after the history was stored")
    _after_two(lambda: metrics.server.rendered.renders, "two renders after those rounds")

    def ready():
        text = _scrape(metrics.server.url)
        wanted = (_value(text, "gpuwatch_gpu_failure_risk_ratio", node="node-0000", gpu="1"),
                  _value(text, "gpuwatch_job_stragglers", job_id="slow-job"))
        return text if None not in wanted else None

    text = poll(ready, 60, "risk and job metrics in the scrape", every=0.5)
    assert _value(text, "gpu_power_watts", node="node-1", gpu="1", gpu_uuid="GPU-node-1-1") is not None
    assert _value(text, "gpu_xid_errors_total", node="node-1", gpu="1", xid="79") == 2
    assert _value(text, "gpuwatch_gpu_failure_risk_ratio", node="node-0000", gpu="1") > 0.5
    assert _value(text, "gpuwatch_gpu_failure_risk_ratio", node="node-0000", gpu="0") < 0.1
    assert _value(text, "gpuwatch_gpu_health_state", node="node-0000", gpu="1", state="warn") == 1
    assert _value(text, "gpuwatch_job_stragglers", job_id="slow-job") == 1
    assert _value(text, "gpuwatch_job_straggler_lateness_seconds", job_id="slow-job", rank="2") > 0.02
    assert 0 < _value(text, "gpuwatch_job_breakdown_ratio", job_id="slow-job", category="comm_wait") < 1
    assert _value(text, "gpuwatch_job_lost_gpu_seconds_total", job_id="slow-job") > 0
    batches = 3 + len(sim_batches(gpu, events))
    assert _value(text, "gpuwatch_ingest_batches_total") == batches
    assert _value(text, "gpuwatch_ingest_duplicates_total") == 1
    assert _value(text, "gpuwatch_ingest_commit_seconds_count") == batches + 1
    assert _value(text, "gpuwatch_agent_last_seen_timestamp_seconds", node="node-1") > now / 1000 - 60
    if PROMTOOL:
        result = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_scrapes_get_the_last_render_until_the_next_one(collector):
    (metrics,) = [s for s in collector.services if isinstance(s, MetricsService)]
    rendered = metrics.server.rendered
    poll(lambda: rendered.renders >= 1, 60, "the first render")
    rendered.close()  # no background renders from here on: this test renders by hand
    rendered.render()
    before = _scrape(metrics.server.url)
    collector.store.write(make_batch(1))
    assert _scrape(metrics.server.url) == before  # served from the render, not rebuilt per scrape
    assert _value(before, "gpuwatch_ingest_batches_total") == 0
    rendered.render()
    assert _value(_scrape(metrics.server.url), "gpuwatch_ingest_batches_total") == 1

def test_a_failed_gpu_shows_risk_one_not_the_score_of_its_idle_hours(collector):
    """After its fatal XID a GPU idles and the model scores it ~0: exported as such it would be the fleet's
    healthiest in Grafana's "highest risk" panel. A failed GPU's risk is 1 while it is failed."""
    now = int(time.time() * 1000)
    gpu, events = degrading_node(now - 28 * HOUR_MS, hours=28, fault_after_h=26)  # down from 2 h ago to now
    for batch in sim_batches(gpu, events):
        collector.store.write(batch)
    (metrics,) = [s for s in collector.services if isinstance(s, MetricsService)]
    (scorer,) = [s for s in collector.services if isinstance(s, Scorer)]
    _after_two(lambda: scorer.rounds, "two scoring rounds after the history was stored")
    assert scorer.latest()[("node-0000", 1)]["failed"]
    _after_two(lambda: metrics.server.rendered.renders, "two renders after those rounds")
    text = _scrape(metrics.server.url)
    assert _value(text, "gpuwatch_gpu_failure_risk_ratio", node="node-0000", gpu="1") == 1.0
    assert _value(text, "gpuwatch_gpu_health_state", node="node-0000", gpu="1", state="fail") == 1
    assert _value(text, "gpuwatch_gpu_failure_risk_ratio", node="node-0000", gpu="0") < 0.1
