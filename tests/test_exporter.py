"""Prometheus exposition: rendered from a constructed snapshot, checked by promtool, scraped over real HTTP."""
from __future__ import annotations

import gzip
import math
import shutil
import subprocess
import urllib.error
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuwatch.core import fields
from gpuwatch.core.errors import UserError
from gpuwatch.core.metrics_catalogue import EXPORTED_METRICS, METRICS
from gpuwatch.core.metrics_families import build_registry
from gpuwatch.core.metrics_http import start_metrics_server
from gpuwatch.core.metrics_snapshot import LatencyHistogram
from gpuwatch.core.vocabulary import BREAKDOWN_CATEGORIES

PROMTOOL = shutil.which("promtool")
TOKEN = "scrape-token"


def _gpu(node: str, index: int, missing: tuple[str, ...] = (), **extra) -> dict:
    values = {f.name: math.nan if f.name in missing else float(index + 1) for f in fields.GPU_FIELDS}
    return {"node": node, "gpu": index, "gpu_uuid": f"GPU-{node}-{index}", "model": "NVIDIA H100 80GB HBM3",
            "values": values, **extra}


def _snapshot(n_jobs: int = 2) -> dict:
    latency = LatencyHistogram()
    for seconds in (0.002, 0.004, 0.3):
        latency.observe(seconds)
    jobs = [
        {"job_id": f"job-{j}", "breakdown": {"compute": 0.55, "comm_wait": 0.25, "host_stall": 0.2, "bogus": 1.0},
         "lost_gpu_seconds_total": 100.0 * j, "rank_lost_ratio": {0: 0.4, 1: 0.5},
         "stragglers": {1: 0.012} if j else {},
         "slow_ranks": [{"rank": 1, "cause": "thermal", "lost_gpu_seconds": 30.0, "speedup_without": 0.25}]
         if j else []}
        for j in range(n_jobs)
    ]
    return {
        "gpus": [_gpu("n1", 0, xid_counts={79: 1, 13: 2}, failure_risk=0.91, health="fail", job_id="job-1", rank=1),
                 _gpu("n1", 1, ("gpu_power_watts",), failure_risk=0.05, health="ok"), _gpu("n2", 0, health="melting")],
        "hosts": [{"node": "n1", "values": {f.name: 1.0 for f in fields.HOST_FIELDS}}],
        "jobs": jobs,
        "ingest": {"batches_total": 10, "samples_total": 800, "duplicates_total": 1, "rejected_total": 2,
                   "write_queue_depth": 3, "commit_seconds": latency.snapshot(), "not_a_metric": 5},
        "agents": [{"node": "n1", "spool_bytes": 4096, "spool_dropped_total": 0, "last_seen_timestamp_seconds": 1.7e9}],
    }


def _render(snapshot: dict, **kw) -> str:
    return generate_latest(build_registry(lambda: snapshot, **kw)).decode()


def _samples(text: str) -> list:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def _value(text: str, name: str, **labels) -> float:
    matches = [s.value for s in _samples(text) if s.name == name and labels.items() <= s.labels.items()]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


def test_render_values_and_types():
    text = _render(_snapshot())
    assert _value(text, "gpu_utilization_ratio", node="n1", gpu="1") == 2.0
    assert _value(text, "gpu_energy_joules_total", node="n2", gpu="0") == 1.0
    assert "# TYPE gpu_energy_joules_total counter" in text and "# TYPE gpu_temperature_celsius gauge" in text
    assert {s.labels["gpu"] for s in _samples(text)
            if s.name == "gpu_power_watts" and s.labels["node"] == "n1"} == {"0"}
    assert _value(text, "gpu_xid_errors_total", gpu="0", node="n1", xid="13") == 2.0
    assert _value(text, "gpuwatch_gpu_failure_risk_ratio", node="n1", gpu="0") == 0.91
    assert _value(text, "gpuwatch_gpu_health_state", node="n1", gpu="0", state="fail") == 1.0
    assert _value(text, "gpuwatch_gpu_health_state", node="n1", gpu="0", state="ok") == 0.0
    assert not [s for s in _samples(text) if s.name == "gpuwatch_gpu_health_state" and s.labels["node"] == "n2"]
    assert _value(text, "gpuwatch_gpu_job_info", node="n1", gpu="0") == 1.0
    assert _value(text, "gpuwatch_job_breakdown_ratio", job_id="job-1", category="comm_wait") == 0.25
    assert _value(text, "gpuwatch_job_lost_gpu_seconds_total", job_id="job-1") == 100.0
    assert _value(text, "gpuwatch_job_stragglers", job_id="job-0") == 0.0
    assert _value(text, "gpuwatch_job_straggler_lateness_seconds", job_id="job-1", rank="1") == 0.012
    assert _value(text, "gpuwatch_job_slow_rank_lost_gpu_seconds", job_id="job-1", rank="1", cause="thermal") == 30.0
    assert _value(text, "gpuwatch_job_slow_rank_speedup_ratio", job_id="job-1", rank="1", cause="thermal") == 0.25
    assert not [s for s in _samples(text) if s.name.startswith("gpu_") and "cause" in s.labels]  # per job only
    assert _value(text, "gpuwatch_ingest_write_queue_depth") == 3.0
    assert _value(text, "gpuwatch_ingest_commit_seconds_bucket", le="0.005") == 2.0
    assert _value(text, "gpuwatch_ingest_commit_seconds_count") == 3.0
    assert _value(text, "gpuwatch_agent_spool_bytes", node="n1") == 4096.0
    assert _value(text, "gpuwatch_build_info") == 1.0


def test_every_exported_name_is_in_the_catalogue_with_its_type():
    families = list(text_string_to_metric_families(_render(_snapshot())))
    for family in families:
        full = family.name + "_total" if family.type == "counter" else family.name
        assert EXPORTED_METRICS.get(full) == family.type, full
    assert len(families) == len(EXPORTED_METRICS)  # a full snapshot fills every family
    assert all(name.endswith("_total") for name, kind in EXPORTED_METRICS.items() if kind == "counter")


def test_label_cardinality_is_bounded():
    text = _render(_snapshot())
    allowed = {spec.name: set(spec.labels) for spec in METRICS}
    for sample in _samples(text):
        base = sample.name.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
        labels = set(sample.labels) - {"le"}
        assert labels == allowed.get(base, allowed.get(sample.name)), sample
    categories = {s.labels["category"] for s in _samples(text) if "category" in s.labels}
    assert categories <= set(BREAKDOWN_CATEGORIES) and "bogus" not in categories
    forbidden = {"step", "seq", "pid", "sequence"}
    assert not forbidden & {label for spec in METRICS for label in spec.labels}


def test_job_limit_keeps_the_costliest_jobs():
    text = _render(_snapshot(n_jobs=5), max_jobs=2)
    kept = {s.labels["job_id"] for s in _samples(text) if s.name == "gpuwatch_job_stragglers"}
    assert kept == {"job-4", "job-3"}
    assert _value(text, "gpuwatch_exporter_jobs_omitted") == 3.0


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package 'prometheus')")
def test_promtool_accepts_the_exposition():
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=_render(_snapshot()), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def _get(url: str, token: str | None = None, accept: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    if accept:
        request.add_header("Accept", accept)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_scrape_over_http_with_token():
    scrapes = []

    def provider():
        scrapes.append(1)
        return _snapshot()

    with start_metrics_server("127.0.0.1:0", provider, token=TOKEN) as server:
        assert _get(server.url)[0] == 401
        assert _get(server.url, token="wrong")[0] == 401
        assert not scrapes  # refused requests never reach the provider
        status, body = _get(server.url, token=TOKEN)
        assert status == 200 and _value(body, "gpuwatch_ingest_batches_total") == 10.0
        status, body = _get(server.url, token=TOKEN, accept="application/openmetrics-text; version=1.0.0")
        assert status == 200 and body.rstrip().endswith("# EOF")
        assert _get(server.url.replace("/metrics", "/other"), token=TOKEN)[0] == 404
    assert len(scrapes) == 2


def test_rendered_endpoint_serves_each_render_to_every_scraper_and_format():
    state = {"batches_total": 1}
    calls = []

    def provider():
        calls.append(1)
        return {"ingest": dict(state)}

    with start_metrics_server("127.0.0.1:0", provider, render_interval_s=3600) as server:
        text = _get(server.url)[1]
        assert _value(text, "gpuwatch_ingest_batches_total") == 1.0
        state["batches_total"] = 7
        openmetrics = _get(server.url, accept="application/openmetrics-text; version=1.0.0")[1]
        request = urllib.request.Request(server.url, headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.headers["Content-Encoding"] == "gzip"
            assert gzip.decompress(response.read()).decode() == text
        assert _get(server.url)[1] == text and openmetrics.rstrip().endswith("# EOF")
        assert _value(openmetrics, "gpuwatch_ingest_batches_total") == 1.0
        assert len(calls) == server.rendered.renders == 1  # four scrapes, one snapshot
        server.rendered.render()
        assert _value(_get(server.url)[1], "gpuwatch_ingest_batches_total") == 7.0
        assert len(calls) == 2


def test_scrape_without_token_on_loopback_reflects_each_snapshot():
    state = {"batches_total": 1}
    with start_metrics_server("127.0.0.1:0", lambda: {"ingest": dict(state)}) as server:
        assert _value(_get(server.url)[1], "gpuwatch_ingest_batches_total") == 1.0
        state["batches_total"] = 7
        assert _value(_get(server.url)[1], "gpuwatch_ingest_batches_total") == 7.0


def test_refuses_public_bind_without_token():
    with pytest.raises(UserError, match="refusing to serve metrics on 0.0.0.0:0 without a bearer token"):
        start_metrics_server("0.0.0.0:0", dict)
    with start_metrics_server("0.0.0.0:0", dict, insecure=True) as server:
        assert _get(f"http://127.0.0.1:{server.port}/metrics")[0] == 200


def test_bad_listen_address_and_port_in_use():
    with pytest.raises(UserError, match="metrics listen address 'nowhere' is not HOST:PORT"):
        start_metrics_server("nowhere", dict)
    with start_metrics_server("127.0.0.1:0", dict) as server:
        with pytest.raises(UserError, match=f"cannot serve metrics on 127.0.0.1:{server.port}"):
            start_metrics_server(f"127.0.0.1:{server.port}", dict)


def test_latency_histogram_is_cumulative():
    hist = LatencyHistogram(buckets=(0.1, 1.0))
    for seconds in (0.05, 0.1, 0.5, 3.0):
        hist.observe(seconds)
    snap = hist.snapshot()
    assert snap["buckets"] == [(0.1, 2), (1.0, 3), (math.inf, 4)]
    assert snap["sum"] == pytest.approx(3.65)


def test_xid_counters_carry_nvidias_name_of_the_code_from_a_bounded_set():
    from gpuwatch.core import xids

    text = _render(_snapshot() | {"gpus": [_gpu("n1", 0, xid_counts={79: 1, 13: 2, 9999: 1})]})
    names = {s.labels["xid"]: s.labels["xid_description"] for s in _samples(text) if s.name == "gpu_xid_errors_total"}
    assert names == {"79": "GPU has fallen off the bus", "13": "Graphics engine exception", "9999": "Unknown XID"}
    assert set(names.values()) <= xids.DESCRIPTIONS


def test_a_collector_whose_agents_are_scraped_exports_scores_not_per_gpu_telemetry():
    """Agent-only per-GPU truth: with gpu_telemetry off the collector keeps what needs the fleet's history."""
    full, scores_only = _render(_snapshot()), _render(_snapshot(), gpu_telemetry=False)
    names = {s.name for s in _samples(scores_only)}
    assert not {n for n in names if n.startswith(("gpu_", "host_"))} and "gpuwatch_gpu_job_info" not in names
    assert _value(scores_only, "gpuwatch_gpu_failure_risk_ratio", node="n1", gpu="0") == 0.91
    assert {"gpuwatch_job_breakdown_ratio", "gpuwatch_ingest_batches_total"} <= names
    assert "gpu_power_watts" in {s.name for s in _samples(full)}


def test_dcgm_legacy_naming_serves_dcgm_exporter_4_8_names_units_and_labels():
    gpu = _gpu("n1", 0, xid_counts={48: 1}, last_xid=48, pci_bus_id="00000000:18:00.0", driver_version="570.1",
               job_id="job-1", rank=0)
    gpu["values"].update(gpu_utilization_ratio=0.5, gpu_memory_used_bytes=2 * 2**30, gpu_memory_total_bytes=80 * 2**30,
                         gpu_sm_clock_hertz=1.98e9, gpu_energy_joules_total=10.0)
    text = _render({"gpus": [gpu]}, names="dcgm-legacy")
    labels = {"gpu": "0", "UUID": "GPU-n1-0", "pci_bus_id": "00000000:18:00.0", "device": "nvidia0",
              "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "n1", "DCGM_FI_DRIVER_VERSION": "570.1",
              "hpc_job": "job-1"}
    assert _value(text, "DCGM_FI_DEV_GPU_UTIL", **labels) == 50.0
    assert _value(text, "DCGM_FI_DEV_FB_USED", **labels) == 2048.0 and _value(text, "DCGM_FI_DEV_FB_FREE") == 78 * 1024
    assert _value(text, "DCGM_FI_DEV_SM_CLOCK") == pytest.approx(1980.0)
    assert _value(text, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION") == 10_000.0  # mJ
    assert _value(text, "DCGM_FI_DEV_XID_ERRORS", err_code="48") == 48.0
    assert not any(s.name.startswith("gpu_") for s in _samples(text))  # parsed: valid exposition text
    # (promtool's lint objects to dcgm-exporter's own camelCase labels: UUID, modelName, Hostname)
    with pytest.raises(UserError, match="metrics names 'nvidia'"):
        build_registry(lambda: {}, names="nvidia")


def test_dcgm_naming_follows_dcgm_exporter_4_9_names_base_units_and_labels():
    """4.9 (DCGM 4.7): deprecated fields under their DCGM names, clocks in Hz, energy in J, utilisation as a
    ratio, memory in bytes; labels hostname and DCGM_FI_SYSTEM_DRIVER_VERSION. None of 4.8's names remain."""
    from gpuwatch.core.dcgm_names import DCGM_4_9, LEGACY, RENAMED_4_9

    gpu = _gpu("n1", 0, last_xid=48, pci_bus_id="00000000:18:00.0", driver_version="570.1")
    gpu["values"].update(gpu_utilization_ratio=0.5, gpu_memory_used_bytes=2 * 2**30, gpu_memory_total_bytes=80 * 2**30,
                         gpu_sm_clock_hertz=1.98e9, gpu_energy_joules_total=10.0, gpu_memory_utilization_ratio=0.25)
    text = _render({"gpus": [gpu]}, names="dcgm")
    labels = {"gpu": "0", "UUID": "GPU-n1-0", "pci_bus_id": "00000000:18:00.0", "device": "nvidia0",
              "modelName": "NVIDIA H100 80GB HBM3", "hostname": "n1", "DCGM_FI_SYSTEM_DRIVER_VERSION": "570.1"}
    assert _value(text, "DCGM_FI_DEV_GPU_UTIL_RATIO", **labels) == 0.5
    assert _value(text, "DCGM_FI_DEV_MEMORY_UTIL_RATIO") == 0.25
    assert _value(text, "DCGM_FI_DEV_FB_USED_BYTES") == 2 * 2**30
    assert _value(text, "DCGM_FI_DEV_FB_FREE_BYTES") == 78 * 2**30
    assert _value(text, "DCGM_FI_DEV_FB_CAPACITY_BYTES") == 80 * 2**30
    assert _value(text, "DCGM_FI_DEV_SM_CLOCK_HERTZ") == pytest.approx(1.98e9)
    assert _value(text, "DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL") == 10.0
    assert _value(text, "DCGM_FI_DEV_XID_ERROR", err_code="48") == 48.0
    served = {s.name for s in _samples(text)}
    assert not served & set(LEGACY.metrics()) - set(DCGM_4_9.metrics())  # no 4.8 name left beside its new one
    # 4.9's eleven unit changes less the four fields gpuwatch does not serve (ENC/DEC_UTIL, FB_RESERVED, NVLink
    # throughput), plus FB_TOTAL whose bytes twin 4.9 collects by default
    unit_changes = {old.removeprefix("DCGM_FI_DEV_") for old, (_, scale, _) in RENAMED_4_9.items() if scale is not None}
    assert unit_changes == {"SM_CLOCK", "MEM_CLOCK", "TOTAL_ENERGY_CONSUMPTION", "GPU_UTIL", "MEM_COPY_UTIL",
                            "FB_USED", "FB_FREE", "FB_TOTAL"}


def test_one_owner_info_series_per_held_gpu_for_group_left_joins():
    pod = {"pod": "train-0", "namespace": "ml", "container": "trainer"}
    text = _render({"gpus": [_gpu("n1", 0, job_id="job-1", rank=3, **pod), _gpu("n1", 1, job_id="slurm-9", rank=0),
                             _gpu("n1", 2)]})
    owners = [s for s in _samples(text) if s.name == "gpuwatch_gpu_owner_info"]
    assert sorted((s.labels["gpu"], s.labels["pod"], s.labels["job"], s.labels["rank"]) for s in owners) == [
        ("0", "train-0", "job-1", "3"), ("1", "", "slurm-9", "0")]  # GPU 2 is held by no one: no series
    assert _value(text, "gpuwatch_gpu_owner_info", gpu="0", uuid="GPU-n1-0", namespace="ml", container="trainer") == 1
    # the per-GPU series carry no owner labels: one series per GPU whoever holds it
    assert all("pod" not in s.labels for s in _samples(text) if s.name == "gpu_power_watts")


@pytest.mark.parametrize("names, util_name", [("dcgm", "DCGM_FI_DEV_GPU_UTIL_RATIO"),
                                               ("dcgm-legacy", "DCGM_FI_DEV_GPU_UTIL")])
def test_dcgm_naming_puts_the_pod_labels_on_a_held_gpus_series_as_dcgm_exporter_does(names, util_name):
    text = _render({"gpus": [_gpu("n1", 0, pod="train-0", namespace="ml", container="trainer"), _gpu("n1", 1)]},
                   names=names)
    util = {s.labels["gpu"]: s.labels for s in _samples(text) if s.name == util_name}
    assert (util["0"]["pod"], util["0"]["namespace"], util["0"]["container"]) == ("train-0", "ml", "trainer")
    assert not {"pod", "namespace", "container"} & set(util["1"])  # not held by a pod: no empty labels
