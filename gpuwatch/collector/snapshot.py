"""What the collector's /metrics shows: the exporter's snapshot, built from the store, scorer and jobs monitor.

A snapshot reads the latest value of every GPU field, XID counts, agents' spool health and the ingest
counters from the store, and the last round of the scorer (risk, health) and of the jobs monitor
(breakdowns, lost time, stragglers). It is built and rendered once per interval on one background thread,
however many Prometheus servers and dashboards scrape.
"""
from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Protocol

from gpuwatch.core import fields
from gpuwatch.core.metrics_http import MetricsServer, start_metrics_server
from gpuwatch.core.metrics_snapshot import GpuSnapshot, JobSnapshot, Snapshot
from gpuwatch.collector.jobs import JobsMonitor
from gpuwatch.collector.owners import current_owners, owner_columns
from gpuwatch.collector.scoring import Scorer
from gpuwatch.collector.store.base import EventQueries, IngestStats, Inventory, SampleQueries

DEFAULT_RENDER_INTERVAL_S = 5.0



class MetricsReads(IngestStats, Inventory, SampleQueries, EventQueries, Protocol):
    """What /metrics reads: the inventory's latest values, owners, the writer's counters."""


def build_snapshot(store: MetricsReads, scorer: Scorer | None = None, jobs: JobsMonitor | None = None) -> Snapshot:
    """One consistent-enough view for one scrape (each part is read once)."""
    identities = store.gpu_identities()
    xids: dict[tuple[str, int], dict[int, int]] = defaultdict(dict)
    for row in store.xid_counts():
        xids[(row["node"], row["gpu_index"])][int(row["code"])] = int(row["n"])
    scores = scorer.latest() if scorer is not None else {}
    owners = current_owners(store)
    gpus: list[GpuSnapshot] = []
    for row in store.latest():
        key = (row["node"], row["gpu_index"])
        identity, score = identities.get(key, {}), scores.get(key, {})
        gpu: GpuSnapshot = {"node": key[0], "gpu": key[1], "gpu_uuid": identity.get("uuid") or "",
               "model": identity.get("name") or "",
               "values": {name: row[name] for name in fields.GPU_FIELD_NAMES if row.get(name) is not None},
               "xid_counts": xids.get(key, {}), "job_id": row.get("job_id") or "",
               "rank": -1 if row.get("rank") is None else int(row["rank"])}
        owner = owner_columns(owners.get(key))
        gpu["namespace"], gpu["pod"], gpu["container"] = owner["namespace"], owner["pod"], owner["container"]
        if score.get("failed"):  # it has failed: the model's score of its last hours (idle, ~0) is not its risk
            gpu["failure_risk"] = 1.0
        elif score.get("risk") is not None:
            gpu["failure_risk"] = score["risk"]
        if score.get("health"):
            gpu["health"] = score["health"]
        gpus.append(gpu)
    return {
        "gpus": gpus,
        "jobs": [_job(j) for j in jobs.snapshot()] if jobs is not None else [],
        "ingest": {**store.counters.snapshot(), "write_queue_depth": store.queue_depth()},
        "agents": [{"node": a["node"], "spool_dropped_total": a["spool_dropped"],
                    "last_seen_timestamp_seconds": a["last_seen_ms"] / 1000} for a in store.agent_health()],
    }


def _job(flags: Mapping[str, Any]) -> JobSnapshot:
    return {"job_id": flags["job_id"], "breakdown": flags["breakdown"],
            "lost_gpu_seconds_total": flags["lost_gpu_seconds_total"], "rank_lost_ratio": flags["rank_lost_ratio"],
            "stragglers": {s["rank"]: s["mean_lateness_us"] / 1e6 for s in flags["stragglers"]},
            "slow_ranks": flags.get("slow_ranks", [])}


class MetricsService:
    """Collector service: the Prometheus endpoint, rendered from a fresh snapshot every ``interval_s``
    (exporter.RenderedMetrics); a scrape gets the last render."""

    def __init__(self, listen: str, *, scorer: Scorer | None = None, jobs: JobsMonitor | None = None,
                 token: str | None = None, insecure: bool = False, gpu_telemetry: bool = True,
                 interval_s: float = DEFAULT_RENDER_INTERVAL_S) -> None:
        self.listen = listen
        self.gpu_telemetry = gpu_telemetry
        self._parts = (scorer, jobs)
        self._token, self._insecure, self._interval_s = token, insecure, interval_s
        self.server: MetricsServer | None = None

    def start(self, store: MetricsReads) -> Mapping[str, Any]:
        provider = functools.partial(build_snapshot, store, *self._parts)
        self.server = start_metrics_server(self.listen, provider, self._token, insecure=self._insecure,
                                           gpu_telemetry=self.gpu_telemetry, render_interval_s=self._interval_s)
        return {}

    def stop(self) -> None:
        if self.server is not None:
            self.server.close()
