"""Writes the Grafana dashboards in dashboards/grafana/ from the compact definitions below.

Dashboard JSON is long and repetitive; writing it by hand invites ids that clash, panels that forget the
datasource variable or a unit. Edit this file, run ``python dashboards/generate.py``, commit both; the tests
fail when the JSON and this file disagree. Every metric used must be one the collector exports, or one the agents'
node-local /metrics export with the panel saying so (tests/test_dashboards.py checks).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT_DIR = Path(__file__).resolve().parent / "grafana"
SCHEMA_VERSION = 39
DS = {"type": "prometheus", "uid": "${datasource}"}
GPU_SEL = 'node=~"$node", gpu=~"$gpu"'
NODE_SEL = 'node=~"$node"'
JOB_SEL = 'job_id=~"$job"'
GPU_LEGEND = "{{node}} GPU {{gpu}}"
# Series of the collector's own scrape target: gpuwatch_ingest_batches_total is exported by the collector only,
# while the agents' node-local /metrics also export gpuwatch_agent_* (about themselves, on their own clock).
COLLECTOR_ONLY = "and on (instance, job) gpuwatch_ingest_batches_total"
# Said by every panel that reads a series only the agents' node-local /metrics export (the backlog of a spool
# never reaches the collector); tests/test_dashboards.py checks.
AGENT_METRICS_NOTE = "From the agents' own /metrics (agent --metrics-listen): empty when only the collector is scraped."


# ---- building blocks ----------------------------------------------------------------------------------

def datasource_var() -> dict[str, Any]:
    return {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0}


def query_var(name: str, label: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": f"{name}-var"}, "definition": query, "refresh": 2,
            "multi": True, "includeAll": True, "allValue": ".*", "current": {}, "sort": 3, "hide": 0}


NODE_VAR = query_var("node", "Node", "label_values(gpu_utilization_ratio, node)")
GPU_VAR = query_var("gpu", "GPU", 'label_values(gpu_utilization_ratio{node=~"$node"}, gpu)')
JOB_VAR = query_var("job", "Job", "label_values(gpuwatch_job_breakdown_ratio, job_id)")


def panel(kind: str, title: str, unit: str, *queries: tuple[str, str], width: int = 12, height: int = 8,
          description: str = "", stack: bool = False, instant: bool = False) -> dict[str, Any]:
    """One panel; ``queries`` are (PromQL, legend) pairs. Position and id are set by :func:`dashboard`."""
    defaults: dict[str, Any] = {"unit": unit}
    if stack:
        defaults["custom"] = {"stacking": {"mode": "normal", "group": "A"}, "fillOpacity": 60, "lineWidth": 1}
    targets = [
        {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend,
         **({"instant": True, "range": False, "format": "table" if kind == "table" else "time_series"}
            if instant else {"range": True})}
        for i, (expr, legend) in enumerate(queries)
    ]
    return {"type": kind, "title": title, "description": description, "datasource": DS,
            "fieldConfig": {"defaults": defaults, "overrides": []}, "options": {}, "targets": targets,
            "gridPos": {"w": width, "h": height}}


def stat(title: str, unit: str, expr: str, description: str = "") -> dict[str, Any]:
    return panel("stat", title, unit, (expr, ""), width=6, height=4, description=description, instant=True)


def dashboard(uid: str, title: str, description: str, variables: list[dict], panels: list[dict]) -> dict[str, Any]:
    """Lays panels out left to right, wrapping at Grafana's 24 columns, and numbers them."""
    x = y = row_height = 0
    for number, p in enumerate(panels, start=1):
        w, h = p["gridPos"]["w"], p["gridPos"]["h"]
        if x + w > 24:
            x, y, row_height = 0, y + row_height, 0
        p["id"] = number
        p["gridPos"] = {"x": x, "y": y, "w": w, "h": h}
        x, row_height = x + w, max(row_height, h)
    return {
        "uid": uid, "title": title, "description": description, "tags": ["gpuwatch"], "editable": True,
        "schemaVersion": SCHEMA_VERSION, "version": 1, "timezone": "", "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"}, "graphTooltip": 1,
        "templating": {"list": [datasource_var(), *variables]},
        "annotations": {"list": []}, "links": [], "panels": panels,
    }


def rate(metric: str, selector: str) -> str:
    return f"rate({metric}{{{selector}}}[$__rate_interval])"


def one(expr: str, by: str = "node, gpu") -> str:
    """``expr`` once per GPU (``by``): the same series may come from an agent's and the collector's /metrics
    (docs/operations.md), and a sum over both would count every GPU twice."""
    return f"max by ({by}) ({expr})"


def gpu(metric: str, selector: str = GPU_SEL) -> str:
    return one(f"{metric}{{{selector}}}")


# ---- the dashboards -----------------------------------------------------------------------------------

def fleet() -> dict[str, Any]:
    by_node = "{{node}}"
    return dashboard(
        "gpuwatch-fleet", "gpuwatch / Fleet overview", "Every GPU at a glance: use, power, errors, ingest health.",
        [NODE_VAR],
        [
            stat("GPUs reporting", "none", f"count({gpu('gpu_utilization_ratio', NODE_SEL)})"),
            stat("Mean GPU utilization", "percentunit", f"avg({gpu('gpu_utilization_ratio', NODE_SEL)})"),
            stat("GPUs failing health", "none",
                 f'count(gpuwatch_gpu_health_state{{{NODE_SEL}, state="fail"}} == 1) or vector(0)'),
            stat("GPU-hours lost in range", "h", "sum(increase(gpuwatch_job_lost_gpu_seconds_total[$__range])) / 3600",
                 "GPU time of known jobs spent on anything but compute (efficiency spec)."),
            panel("timeseries", "GPU utilization by node", "percentunit",
                  (f"avg by (node) ({gpu('gpu_utilization_ratio', NODE_SEL)})", by_node)),
            panel("timeseries", "Tensor pipes active by node", "percentunit",
                  (f"avg by (node) ({gpu('gpu_tensor_active_ratio', NODE_SEL)})", by_node),
                  description="Hopper and newer (NVML GPM); empty on older GPUs."),
            panel("timeseries", "Power draw by node", "watt",
                  (f"sum by (node) ({gpu('gpu_power_watts', NODE_SEL)})", by_node)),
            panel("timeseries", "GPU memory used by node", "bytes",
                  (f"sum by (node) ({gpu('gpu_memory_used_bytes', NODE_SEL)})", by_node)),
            panel("timeseries", "XID errors", "cps",
                  (f"sum by (node, xid) ({one(rate('gpu_xid_errors_total', NODE_SEL), 'node, gpu, xid')})",
                   "{{node}} XID {{xid}}")),
            panel("timeseries", "Time since each agent's last stored batch", "s",
                  (f"time() - max by (node) (gpuwatch_agent_last_seen_timestamp_seconds{{{NODE_SEL}}}"
                   f" {COLLECTOR_ONLY})", by_node),
                  description="From the collector: grows while an agent cannot reach it or is down."),
            panel("timeseries", "Agent spool backlog", "bytes",
                  (f"max by (node) (gpuwatch_agent_spool_bytes{{{NODE_SEL}}})", by_node),
                  description=f"Bytes waiting for an acknowledgement; grows when agents cannot reach the collector. "
                              f"{AGENT_METRICS_NOTE}"),
            panel("timeseries", "Collector ingest", "cps",
                  ("sum(rate(gpuwatch_ingest_batches_total[$__rate_interval]))", "batches/s"),
                  ("sum(rate(gpuwatch_ingest_rejected_total[$__rate_interval]))", "rejected/s"),
                  ("sum(rate(gpuwatch_ingest_duplicates_total[$__rate_interval]))", "duplicates/s")),
            panel("timeseries", "Collector commit latency", "s",
                  *[(f"histogram_quantile({q}, sum by (le) (rate(gpuwatch_ingest_commit_seconds_bucket"
                     f"[$__rate_interval])))", f"p{int(q * 100)}") for q in (0.5, 0.99)]),
        ],
    )


def jobs() -> dict[str, Any]:
    rank_legend = "{{job_id}} rank {{rank}}"
    return dashboard(
        "gpuwatch-jobs", "gpuwatch / Job efficiency",
        "Where each job's GPU time goes (compute, communication wait, bubbles, host stalls...), per rank.",
        [JOB_VAR],
        [
            panel("timeseries", "Where the GPU time went", "percentunit",
                  (f"avg by (category) (gpuwatch_job_breakdown_ratio{{{JOB_SEL}}})", "{{category}}"),
                  width=16, stack=True, description="Categories partition the window: they sum to 100 %."),
            panel("bargauge", "Breakdown now", "percentunit",
                  (f"avg by (category) (gpuwatch_job_breakdown_ratio{{{JOB_SEL}}})", "{{category}}"),
                  width=8, instant=True),
            panel("timeseries", "GPUs' worth of time lost", "none",
                  (f"sum by (job_id) ({rate('gpuwatch_job_lost_gpu_seconds_total', JOB_SEL)})", "{{job_id}}"),
                  description="Lost GPU-seconds per second: 3 means three GPUs' time is lost right now."),
            panel("bargauge", "Lost share per rank", "percentunit",
                  (f"gpuwatch_job_rank_lost_ratio{{{JOB_SEL}}}", rank_legend), instant=True),
            panel("timeseries", "GPU utilization per rank", "percentunit",
                  (f"{one('gpu_utilization_ratio')} * on (node, gpu) group_left (job_id, rank) "
                   f"{one(f'gpuwatch_gpu_job_info{{{JOB_SEL}}}', 'node, gpu, job_id, rank')}", rank_legend)),
            panel("stat", "Stragglers", "none", (f"sum(gpuwatch_job_stragglers{{{JOB_SEL}}})", ""),
                  width=4, instant=True),
            panel("timeseries", "Straggler lateness at collectives", "s",
                  (f"gpuwatch_job_straggler_lateness_seconds{{{JOB_SEL}}}", rank_legend), width=8,
                  description="Mean arrival after the median rank; only ranks classified as stragglers."),
        ],
    )


def gpu_health() -> dict[str, Any]:
    return dashboard(
        "gpuwatch-gpu-health", "gpuwatch / GPU health and failure risk",
        "Which GPU is about to fail, and the reliability counters behind it.",
        [NODE_VAR, GPU_VAR],
        [
            panel("table", "Highest failure risk", "percentunit",
                  (f"topk(20, gpuwatch_gpu_failure_risk_ratio{{{NODE_SEL}}})", ""), instant=True),
            panel("table", "GPUs not healthy", "none",
                  (f'gpuwatch_gpu_health_state{{{GPU_SEL}, state!="ok"}} == 1', ""), instant=True),
            panel("timeseries", "Failure risk", "percentunit",
                  (f"gpuwatch_gpu_failure_risk_ratio{{{GPU_SEL}}}", GPU_LEGEND)),
            panel("timeseries", "XID errors by code", "none",
                  (one(f"increase(gpu_xid_errors_total{{{GPU_SEL}}}[$__rate_interval])",
                       "node, gpu, xid, xid_description"),
                   GPU_LEGEND + " XID {{xid}} {{xid_description}}")),
            panel("timeseries", "ECC errors", "cps",
                  (one(rate("gpu_ecc_sbe_volatile_total", GPU_SEL)), GPU_LEGEND + " correctable"),
                  (one(rate("gpu_ecc_dbe_volatile_total", GPU_SEL)), GPU_LEGEND + " uncorrectable")),
            panel("timeseries", "Row remapping", "none",
                  *[(gpu(name), f"{GPU_LEGEND} {name.removeprefix('gpu_remapped_rows_')}")
                    for name in ("gpu_remapped_rows_correctable", "gpu_remapped_rows_uncorrectable",
                                 "gpu_remapped_rows_pending", "gpu_remapped_rows_failure")]),
            panel("timeseries", "PCIe replays", "cps", (one(rate("gpu_pcie_replay_total", GPU_SEL)), GPU_LEGEND)),
            panel("timeseries", "PCIe link width (current / max)", "none",
                  (f"{gpu('gpu_pcie_link_width')} / {gpu('gpu_pcie_link_width_max')}", GPU_LEGEND),
                  description="Below 1: the link trained down, a common precursor of falling off the bus."),
            panel("timeseries", "NVLink errors", "cps",
                  (one(rate("gpu_nvlink_crc_flit_errors_total", GPU_SEL)), GPU_LEGEND + " CRC flit"),
                  (one(rate("gpu_nvlink_replay_errors_total", GPU_SEL)), GPU_LEGEND + " replay"),
                  (one(rate("gpu_nvlink_recovery_errors_total", GPU_SEL)), GPU_LEGEND + " recovery")),
            panel("timeseries", "Temperature", "celsius",
                  (gpu("gpu_temperature_celsius"), GPU_LEGEND + " core"),
                  (gpu("gpu_memory_temperature_celsius"), GPU_LEGEND + " HBM")),
            panel("timeseries", "Time throttled", "percentunit",
                  (one(rate("gpu_throttle_thermal_seconds_total", GPU_SEL)), GPU_LEGEND + " thermal"),
                  (one(rate("gpu_throttle_power_seconds_total", GPU_SEL)), GPU_LEGEND + " power")),
        ],
    )


DASHBOARDS = {"fleet-overview": fleet, "job-efficiency": jobs, "gpu-health": gpu_health}


def render(name: str) -> str:
    return json.dumps(DASHBOARDS[name](), indent=2) + "\n"


def main() -> None:
    OUT_DIR.mkdir(exist_ok=True)
    for name in DASHBOARDS:
        (OUT_DIR / f"{name}.json").write_text(render(name))
        print(f"wrote {OUT_DIR / f'{name}.json'}")


if __name__ == "__main__":
    main()
