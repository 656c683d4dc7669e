"""The demo's result: what the store holds after the run, when each failed GPU was flagged, and the closing
summary that says so."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gpuwatch.apps.demo_view import hhmm, shown
from gpuwatch.v1 import query_pb2, query_pb2_grpc


@dataclass
class DemoResult:
    """A finished demo: what the store holds and the failure report computed from it."""

    nodes: list[dict[str, Any]]
    events: dict[str, int]
    report: dict[str, Any]
    workdir: str
    recordings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def failure_report(store: Any) -> dict[str, Any]:
    """From the store's alerts and events: per failed GPU when it was first flagged and when it failed
    (lead time; None when no alert came before the failure), and the alerts on GPUs that did not fail."""
    from gpuwatch.collector.alerts import ALERT_NAME
    from gpuwatch.models.faults import FATAL_XIDS

    faults = store.first_failures(sorted(FATAL_XIDS))
    alerts = store.alert_starts(ALERT_NAME)
    failed = []
    for f in faults.itertuples():
        mine = alerts[(alerts["node"] == f.node) & (alerts["gpu_index"] == f.gpu_index)
                       & (alerts["starts_ms"] <= f.failed_ms)]
        flagged = int(mine["starts_ms"].iloc[0]) if len(mine) else None
        failed.append({"node": f.node, "gpu_index": int(f.gpu_index), "failed_ms": int(f.failed_ms),
                       "flagged_ms": flagged, "lead_time_s": (f.failed_ms - flagged) / 1000 if flagged else None,
                       "peak_risk": float(mine["peak_risk"].max()) if len(mine) else None})
    failed_keys = {(f["node"], f["gpu_index"]) for f in failed}
    false_alarms = [{"node": a.node, "gpu_index": int(a.gpu_index), "starts_ms": int(a.starts_ms),
                     "peak_risk": float(a.peak_risk)}
                    for a in alerts.itertuples() if (a.node, a.gpu_index) not in failed_keys]
    return {"failed": failed, "false_alarms": false_alarms}


def event_counts(query: query_pb2_grpc.QueryStub) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for row in query.Events(query_pb2.EventsRequest(limit=1_000_000), timeout=10).events:
        kinds[row.event.kind] = kinds.get(row.event.kind, 0) + 1
    return dict(sorted(kinds.items()))


def node_row(n: query_pb2.NodeSummary) -> dict[str, Any]:
    return {"node": n.node, "gpus": n.gpus, "samples": n.samples, "last_seen_ms": n.last_seen_ms}


def summary_text(result: DemoResult) -> str:
    """The closing summary: what was stored, and for each failed GPU whether and how early it was flagged;
    every number with one short line saying what it is."""
    from gpuwatch.core.events import MEANINGS

    samples = sum(n["samples"] for n in result.nodes)
    lines = ["", "summary",
             f"  nodes {len(result.nodes)}, GPUs {sum(n['gpus'] for n in result.nodes)}: simulated, one agent process "
             "per node",
             f"  GPU samples stored {samples:,}: one row of every NVML reading per GPU per agent tick",
             "  events:" + ("" if result.events else " none")]
    lines += [f"    {kind} {count}: {MEANINGS.get(kind, 'events of this kind')}"
              for kind, count in result.events.items()]
    for f in result.report["failed"]:
        if f["flagged_ms"] is None:
            lines.append(f"  GPU {f['gpu_index']} on node {f['node']} failed at {hhmm(f['failed_ms'])} UTC "
                         "(simulated) without an alert before it")
        else:
            lines.append(f"  GPU {f['gpu_index']} on node {f['node']} flagged at {hhmm(f['flagged_ms'])} UTC, "
                         f"failed at "
                         f"{hhmm(f['failed_ms'])} UTC: lead time {f['lead_time_s'] / 60:.0f} minutes (simulated), "
                         f"the time there was to checkpoint and drain (peak risk {shown(f.get('peak_risk'), '.2f')})")
    if not result.report["failed"]:
        lines.append("  no GPU failed")
    lines.append(f"  alerts on GPUs that did not fail: {len(result.report['false_alarms'])} (false alarms)")
    if result.recordings:
        lines.append(f"  recordings (gpuwatch replay): {', '.join(result.recordings)}")
    return "\n".join(lines)
