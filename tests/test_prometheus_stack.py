"""gpuwatch in the monitoring stack people run: Debian's Prometheus, started here on loopback, scrapes a real
agent (its node-local /metrics), the collector that agent streams to, and a second agent started from the
command line with ``--metrics-names dcgm``; it evaluates dashboards/prometheus/rules.yml and sends to a real
Alertmanager. A simulated fatal XID must fire GpuXidFatal at once, the rule test must pass on the series
Prometheus recorded from the exporter, every Grafana panel must answer with correctly scaled numbers (each GPU
counted once although agent and collector both export it), and NVIDIA's published dcgm-exporter dashboard
queries must work on the dcgm-named agent."""
from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest
import yaml

from gpuwatch.agent.daemon import AgentConfig
from gpuwatch.collector.assembly import start_collector
from gpuwatch.collector.snapshot import MetricsService
from gpuwatch.core.settings import COLLECTOR_OPTIONS, CollectorSettings, load_config
from helpers import (PROMETHEUS, alertmanager_alerts, free_port, get_json, poll, running_simulated_agent,
                     start_alertmanager)

ROOT = Path(__file__).resolve().parent.parent / "dashboards"
RULES = ROOT / "prometheus" / "rules.yml"
PROMTOOL = shutil.which("promtool")
NODE, DCGM_NODE, GPUS, FAILING, XID = "n7", "dcgm-node", 4, 2, 48
SCRAPE_S = 1
# Grafana's variables as a dashboard opened on "All" substitutes them (rate windows cover >= 4 scrapes).
GRAFANA_VARS = {"$__rate_interval": "30s", "$__interval": "5s", "$__range": "5m", "$node": ".*", "$gpu": ".*",
                "$job": ".*", "$instance": ".*"}
# Panels that may be empty on a healthy few-minute stack, and why.
MAY_BE_EMPTY = {
    "Straggler lateness at collectives": "only ranks classified as stragglers have a lateness",
}
# NVIDIA's published dashboard (NVIDIA/dcgm-exporter grafana/dcgm-exporter-dashboard.json): each panel's query and
# the range its unit implies for a simulated H100.
DCGM_DASHBOARD = {
    'DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"}': (10, 110),            # celsius
    'avg(DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"})': (10, 110),
    'DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"}': (10, 700),         # watt
    'sum(DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"})': (20, 1400),
    'DCGM_FI_DEV_SM_CLOCK{instance=~"$instance", gpu=~"$gpu"} * 1000000': (1e8, 3e9),  # hertz
    'DCGM_FI_DEV_GPU_UTIL{instance=~"$instance", gpu=~"$gpu"}': (0, 100),              # percent
    'DCGM_FI_DEV_FB_USED{instance=~"$instance", gpu=~"$gpu"}': (100, 81920),           # MiB
    'DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{instance=~"$instance", gpu=~"$gpu"}': (0, 1),     # percentunit
}
# The same panels after dcgm-exporter 4.9's renames and base units (its release notes; the names from DCGM's
# deprecated-field table): no MHz-to-Hz factor any more, utilisation a ratio, memory in bytes.
DCGM_4_9_DASHBOARD = {
    'DCGM_FI_DEV_GPU_TEMP_CELSIUS{instance=~"$instance", gpu=~"$gpu"}': (10, 110),    # celsius
    'avg(DCGM_FI_DEV_GPU_TEMP_CELSIUS{instance=~"$instance", gpu=~"$gpu"})': (10, 110),
    'DCGM_FI_DEV_BOARD_POWER_WATTS{instance=~"$instance", gpu=~"$gpu"}': (10, 700),   # watt
    'sum(DCGM_FI_DEV_BOARD_POWER_WATTS{instance=~"$instance", gpu=~"$gpu"})': (20, 1400),
    'DCGM_FI_DEV_SM_CLOCK_HERTZ{instance=~"$instance", gpu=~"$gpu"}': (1e8, 3e9),     # hertz
    'DCGM_FI_DEV_GPU_UTIL_RATIO{instance=~"$instance", gpu=~"$gpu"}': (0, 1),         # percentunit
    'DCGM_FI_DEV_FB_USED_BYTES{instance=~"$instance", gpu=~"$gpu"}': (1e8, 81920 * 2**20),  # bytes
    'DCGM_FI_PROF_TENSOR_UTIL_RATIO{instance=~"$instance", gpu=~"$gpu"}': (0, 1),     # percentunit
    'rate(DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL{instance=~"$instance", gpu=~"$gpu"}[30s])': (10, 700),  # J/s = W
}

pytestmark = pytest.mark.skipif(not shutil.which(PROMETHEUS), reason=f"{PROMETHEUS} is not installed")


class Prometheus:
    """Debian's Prometheus server on a free loopback port, its data under ``workdir``."""

    def __init__(self, workdir: Path, targets: dict[str, str], alertmanager: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
            "rule_files": [str(RULES)],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [alertmanager.removeprefix("http://")]}]}]},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target]}]}
                               for job, target in targets.items()],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=(workdir / "prometheus.log").open("wb"))
        self.log = workdir / "prometheus.log"
        poll(self._ready, 60, "prometheus to start")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {self.log.read_text()[-2000:]}")
        try:
            return get_json(f"{self.url}/api/v1/status/buildinfo")["status"] == "success"
        except OSError:
            return False

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr, **({"time": f"{at:.3f}"} if at else {})}
        answer = get_json(f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}")
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
        answer = get_json(f"{self.url}/api/v1/query_range?{urllib.parse.urlencode(params)}")
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def targets_up(self) -> bool:
        active = get_json(f"{self.url}/api/v1/targets")["data"]["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)

    def alerts(self, name: str, state: str = "firing") -> list[dict]:
        return [a for a in get_json(f"{self.url}/api/v1/alerts")["data"]["alerts"]
                if a["labels"]["alertname"] == name and a["state"] == state]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Collector (scoring, jobs monitor, /metrics), an in-process agent on 4 simulated GPUs running a training
    job with its own /metrics, a dcgm-named agent process, Alertmanager and Prometheus scraping all three."""
    tmp = tmp_path_factory.mktemp("stack")
    am_proc, am_url = start_alertmanager(tmp)
    cfg = load_config(COLLECTOR_OPTIONS, {"listen": "127.0.0.1:0", "db": str(tmp / "c.duckdb"),
                                          "metrics_listen": "127.0.0.1:0", "score_interval": 1.0,
                                          "jobs_interval": 1.0}, env={})
    collector = start_collector(cfg.build(CollectorSettings))
    agent_cfg = AgentConfig(collector=collector.address, node=NODE, interval=0.2, slow_interval=1.0,
                            batch_interval=0.5, spool=tmp / "spool", metrics_listen="127.0.0.1:0")
    in_process = contextlib.ExitStack()  # closed in the finally below, after Prometheus and the dcgm agent
    agent, fleet = in_process.enter_context(running_simulated_agent(agent_cfg, GPUS, job="train-7", job_step_s=0.5))
    dcgm_port = free_port()
    dcgm_agent = subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "agent", "--simulate", "2", "--node", DCGM_NODE, "--record",
         str(tmp / "dcgm-rec"), "--interval", "0.2", "--slow-interval", "1", "--no-probe-socket",
         "--sim-fault", "gpu=1,kind=ecc,after=1s,fail=20s",
         "--metrics-listen", f"127.0.0.1:{dcgm_port}", "--metrics-names", "dcgm"],
        stdout=subprocess.DEVNULL, stderr=(tmp / "dcgm-agent.log").open("wb"))
    legacy_port = free_port()
    legacy_agent = subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "agent", "--simulate", "1", "--node", DCGM_NODE, "--record",
         str(tmp / "legacy-rec"), "--interval", "0.2", "--slow-interval", "1", "--no-probe-socket",
         "--metrics-listen", f"127.0.0.1:{legacy_port}", "--metrics-names", "dcgm-legacy"],
        stdout=subprocess.DEVNULL, stderr=(tmp / "dcgm-legacy-agent.log").open("wb"))
    prometheus = None
    try:
        poll(lambda: agent.metrics_server is not None, 30, "the agent's metrics endpoint")
        (service,) = [s for s in collector.services if isinstance(s, MetricsService)]
        targets = {"gpuwatch-agent": agent.metrics_server.url.split("/")[2],
                   "gpuwatch-collector": service.server.url.split("/")[2], "dcgm-agent": f"127.0.0.1:{dcgm_port}",
                   "dcgm-legacy-agent": f"127.0.0.1:{legacy_port}"}
        started = time.time()
        prometheus = Prometheus(tmp, targets, am_url)
        poll(prometheus.targets_up, 60, "prometheus to scrape every target", every=0.5)
        yield {"prometheus": prometheus, "alertmanager": am_url, "agent": agent, "fleet": fleet,
               "collector": collector, "started": started, "tmp": tmp}
    finally:
        if prometheus is not None:
            prometheus.stop()
        for process in (dcgm_agent, legacy_agent):
            process.terminate()
            process.wait(30)
        in_process.close()
        collector.stop()
        am_proc.terminate()
        am_proc.wait(10)


@pytest.fixture(scope="module")
def fatal_xid(stack):
    """XID 48 on GPU 2 once Prometheus has the agent's series (so the XID series is new to it); the time."""
    prometheus = stack["prometheus"]
    poll(lambda: prometheus.query(f'gpu_utilization_ratio{{job="gpuwatch-agent", node="{NODE}"}}'), 30,
         "the agent's GPU series in prometheus", every=0.5)
    at = time.time()
    stack["fleet"].inject_xid(FAILING, XID)
    return at


def test_gpu_xid_fatal_fires_on_the_first_fatal_xid_in_prometheus_and_alertmanager(stack, fatal_xid):
    prometheus = stack["prometheus"]
    (alert,) = poll(lambda: [a for a in prometheus.alerts("GpuXidFatal") if a["labels"]["node"] == NODE], 60,
                    "GpuXidFatal firing in prometheus", every=0.5)
    assert alert["labels"]["gpu"] == str(FAILING) and alert["labels"]["xid"] == str(XID)
    assert alert["labels"]["xid_description"] == "Double bit ECC error (uncorrectable memory error)"
    assert alert["annotations"]["summary"] == (f"GPU {FAILING} on {NODE} failed: XID 48 "
                                               "(Double bit ECC error (uncorrectable memory error))")
    # the counter appeared at its first value: increase() alone would still say 0
    query = f'increase(gpu_xid_errors_total{{job="gpuwatch-agent", xid="{XID}"}}[10m])'
    increase = poll(lambda: prometheus.query(query), 30, "two samples of the XID counter", every=0.5)
    assert all(float(s["value"][1]) == 0 for s in increase)
    (received,) = poll(lambda: [a for a in alertmanager_alerts(stack["alertmanager"], "GpuXidFatal")
                                if a["labels"]["node"] == NODE], 60, "GpuXidFatal in alertmanager", every=0.5)
    assert received["labels"]["gpu_uuid"] == stack["fleet"].gpus[FAILING].uuid
    assert "stays failed until it is reset" in received["annotations"]["description"]


@pytest.mark.skipif(not PROMTOOL, reason="promtool is not installed")
def test_the_rule_test_passes_on_series_prometheus_recorded_from_the_exporter(stack, fatal_xid, tmp_path):
    """The XID counters as Prometheus stored them (absent, then appearing at their first value) become
    promtool's input: GpuXidFatal must be quiet before the XID and fire after it."""
    prometheus = stack["prometheus"]
    poll(lambda: prometheus.query(f'gpu_xid_errors_total{{job="gpuwatch-agent", xid="{XID}"}}'), 30,
         "the XID counter in prometheus", every=0.5)
    start, end = stack["started"], time.time()
    steps = int((end - start) // SCRAPE_S)
    recorded = prometheus.query_range('gpu_xid_errors_total{job="gpuwatch-agent"}', start, start + steps * SCRAPE_S,
                                      SCRAPE_S)
    assert recorded
    series = []
    for s in recorded:
        values = {round((float(t) - start) / SCRAPE_S): v for t, v in s["values"]}
        labels = ", ".join(f'{k}="{v}"' for k, v in s["metric"].items() if k != "__name__")
        series.append({"series": f"gpu_xid_errors_total{{{labels}}}",
                       "values": " ".join(values.get(i, "_") for i in range(steps + 1))})
    first_seen = min(round((float(s["values"][0][0]) - start) / SCRAPE_S) for s in recorded)
    assert first_seen > 0, "the XID came after Prometheus's first scrape"
    labels = {"node": NODE, "gpu": str(FAILING), "gpu_uuid": stack["fleet"].gpus[FAILING].uuid,
              "xid": str(XID), "xid_description": "Double bit ECC error (uncorrectable memory error)"}
    test = {"rule_files": [str(RULES)], "evaluation_interval": f"{SCRAPE_S}s", "tests": [{
        "interval": f"{SCRAPE_S}s", "input_series": series,
        "alert_rule_test": [
            {"eval_time": f"{max(0, first_seen - 1) * SCRAPE_S}s", "alertname": "GpuXidFatal", "exp_alerts": []},
            {"eval_time": f"{steps * SCRAPE_S}s", "alertname": "GpuXidFatal", "exp_alerts": [{
                "exp_labels": {"severity": "critical", **labels},
                "exp_annotations": _annotations("GpuXidFatal", labels)}]},
        ]}]}
    path = tmp_path / "recorded_test.yml"
    path.write_text(yaml.safe_dump(test))
    result = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def _annotations(alertname: str, labels: dict[str, str]) -> dict[str, str]:
    """The rule's annotations with ``labels`` filled in (its templates use only ``$labels``)."""
    (rule,) = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
               if r.get("alert") == alertname]
    return {k: re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m[1]], v) for k, v in rule["annotations"].items()}


def _dashboard_targets():
    for path in sorted((ROOT / "grafana").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                yield pytest.param(panel["title"], panel["fieldConfig"]["defaults"]["unit"], target["expr"],
                                   id=f"{path.stem}: {panel['title']} {target['refId']}")


def _substitute(expr: str) -> str:
    for name, value in sorted(GRAFANA_VARS.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(name, value)
    assert "$" not in expr, expr
    return expr


def _values(result: list[dict]) -> list[float]:
    return [float(s["value"][1]) for s in result]


# What a value in each of the dashboards' units must look like on a simulated 4-GPU H100 node.
UNIT_RANGES = {"percentunit": (0.0, 1.0 + 1e-9), "watt": (0.0, 700.0 * GPUS), "celsius": (10.0, 110.0),
               "bytes": (0.0, 80 * 2**30 * GPUS), "cps": (0.0, 1e6), "s": (0.0, 3600.0), "h": (0.0, 1.0),
               "none": (0.0, 1e6)}


@pytest.mark.parametrize("title, unit, expr", list(_dashboard_targets()))
def test_every_dashboard_panel_answers_with_correctly_scaled_values(stack, fatal_xid, title, unit, expr):
    prometheus = stack["prometheus"]
    query = _substitute(expr)
    if title in MAY_BE_EMPTY:
        result = prometheus.query(query)
    else:
        result = poll(lambda: prometheus.query(query), 90, f"{title!r} to answer: {query}", every=1.0)
    low, high = UNIT_RANGES[unit]
    values = _values(result)
    assert all(low <= v <= high for v in values if not math.isnan(v)), (title, query, values)


def test_sums_count_each_gpu_once_though_agent_and_collector_both_export_it(stack, fatal_xid):
    """Every query at one instant, against the per-GPU samples of both sources at that instant: the collector's
    copy of a GPU's power may lag the agent's by a few seconds (a job ending, a GPU failing), so the two sources
    need not agree, but the panel must take each GPU once. The instant is two scrapes back, so that no sample
    for it is still being stored while the queries run."""
    prometheus = stack["prometheus"]

    def both_sources_two_scrapes_back() -> tuple[float, dict[str, dict[str, float]]] | None:
        at, found = time.time() - 2 * SCRAPE_S, {}
        for sample in prometheus.query(f'gpu_power_watts{{node="{NODE}"}}', at):
            found.setdefault(sample["metric"]["gpu"], {})[sample["metric"]["job"]] = float(sample["value"][1])
        complete = set(found) == {str(i) for i in range(GPUS)} and all(
            set(sources) == {"gpuwatch-agent", "gpuwatch-collector"} for sources in found.values())
        return (at, found) if complete else None

    at, per_gpu = poll(both_sources_two_scrapes_back, 60, "both sources of every GPU in prometheus", every=0.5)
    panel = next(t for t in _dashboard_targets() if t.values[0] == "Power draw by node")
    (by_node,) = [s for s in prometheus.query(_substitute(panel.values[2]), at) if s["metric"]["node"] == NODE]
    (naive,) = prometheus.query(f'sum(gpu_power_watts{{node="{NODE}"}})', at)
    once = sum(max(sources.values()) for sources in per_gpu.values())
    twice = sum(sum(sources.values()) for sources in per_gpu.values())
    assert float(by_node["value"][1]) == pytest.approx(once)
    assert float(naive["value"][1]) == pytest.approx(twice) and twice > once  # the naive sum counts each GPU twice
    join = next(t for t in _dashboard_targets() if t.values[0] == "GPU utilization per rank")
    ranks = prometheus.query(_substitute(join.values[2]))  # no "many-to-many matching" error
    assert {s["metric"]["rank"] for s in ranks if s["metric"]["node"] == NODE} == {str(i) for i in range(GPUS)}


@pytest.mark.parametrize("expr, bounds", list(DCGM_DASHBOARD.items()))
def test_nvidias_dcgm_exporter_dashboard_queries_work_on_a_dcgm_legacy_named_agent(stack, expr, bounds):
    _dashboard_query_works(stack["prometheus"], expr, bounds, "dcgm-legacy-agent",
                           ("Hostname", "DCGM_FI_DRIVER_VERSION"))


@pytest.mark.parametrize("expr, bounds", list(DCGM_4_9_DASHBOARD.items()))
def test_dcgm_exporter_4_9_dashboard_queries_work_on_a_dcgm_named_agent(stack, expr, bounds):
    _dashboard_query_works(stack["prometheus"], expr, bounds, "dcgm-agent",
                           ("hostname", "DCGM_FI_SYSTEM_DRIVER_VERSION"))


def _dashboard_query_works(prometheus, expr, bounds, job, host_and_driver_labels):
    query = _substitute(expr).replace('instance=~".*"', f'instance=~".*", job="{job}"')
    result = poll(lambda: prometheus.query(query), 60, f"{query} to answer", every=0.5)
    low, high = bounds
    assert all(low <= v <= high for v in _values(result)), (query, _values(result))
    if "avg(" not in expr and "sum(" not in expr:
        labels = result[0]["metric"]
        host = host_and_driver_labels[0]
        assert {"gpu", "UUID", "modelName", "device", "pci_bus_id", *host_and_driver_labels} <= set(labels)
        assert labels[host] == DCGM_NODE and labels["device"] == f"nvidia{labels['gpu']}"
        assert re.fullmatch(r"GPU-[0-9a-f-]{36}", labels["UUID"]) and labels["modelName"].startswith("NVIDIA")


def test_dcgm_xid_errors_holds_the_last_xid_with_its_name(stack):
    prometheus = stack["prometheus"]
    # the scripted ECC fault sends precursor XIDs (92: high SBE rate) before the fatal 48
    failed = poll(lambda: prometheus.query('DCGM_FI_DEV_XID_ERROR{job="dcgm-agent", gpu="1"} == 48'), 90,
                  "the scripted XID 48 in DCGM_FI_DEV_XID_ERROR", every=0.5)
    assert len(failed) == 1
    assert failed[0]["metric"]["err_code"] == "48" and "ECC" in failed[0]["metric"]["err_msg"]
    healthy = prometheus.query('DCGM_FI_DEV_XID_ERROR{job="dcgm-agent", gpu="0"}')
    assert _values(healthy) == [0.0] and healthy[0]["metric"]["err_msg"] == "No Error"
    # the GPU that failed stops working, as a real one does after XID 48
    util = poll(lambda: prometheus.query('DCGM_FI_DEV_GPU_UTIL_RATIO{job="dcgm-agent", gpu="1"} == 0'), 30,
                "the failed GPU to idle", every=0.5)
    assert util
