"""A provider's snapshot as Prometheus metric families: the collector a registry asks at each render.

Naming is chosen per endpoint: ``gpuwatch`` (the catalogue's names) or ``dcgm`` (dcgm-exporter's names, units
and labels for the per-GPU values, see :mod:`gpuwatch.core.dcgm_names`). Per-GPU truth has one source per
deployment (docs/operations.md): the collector exports per-GPU telemetry unless told that Prometheus
scrapes the agents (``gpu_telemetry=False``), and then exports only what needs the fleet's history.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuwatch import __version__
from gpuwatch.core import fields, xids
from gpuwatch.core.dcgm_names import NAMINGS as DCGM_NAMINGS
from gpuwatch.core.dcgm_names import dcgm_families
from gpuwatch.core.errors import UserError
from gpuwatch.core.metrics_catalogue import METRICS, NAMINGS, MetricSpec
from gpuwatch.core.metrics_snapshot import GpuSnapshot, HostSnapshot, JobSnapshot, SnapshotProvider
from gpuwatch.core.vocabulary import BREAKDOWN_CATEGORIES, HEALTH_STATES

log = logging.getLogger(__name__)

DEFAULT_MAX_JOBS = 500  # jobs exported per scrape (most lost time first), to bound job_id cardinality
_SPECS: dict[str, MetricSpec] = {m.name: m for m in METRICS}
_FAMILY_TYPES = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily, "histogram": HistogramMetricFamily}


class _Families:
    """One family per catalogue entry, filled sample by sample; only non-empty families are exposed."""

    def __init__(self) -> None:
        self._families: dict[str, GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily] = {
            m.name: _FAMILY_TYPES[m.kind](m.name, m.help, labels=m.labels) for m in METRICS
        }

    def add(self, name: str, labels: Sequence[Any], value: Any) -> None:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return
        family = self._families[name]
        if isinstance(family, HistogramMetricFamily):
            raise TypeError(f"{name} is a histogram: fill it with histogram()")
        family.add_metric([str(v) for v in labels], float(value))

    def histogram(self, name: str, snapshot: Mapping[str, Any]) -> None:
        buckets = [(_le_text(le), float(count)) for le, count in snapshot["buckets"]]
        family = self._families[name]
        if not isinstance(family, HistogramMetricFamily):
            raise TypeError(f"{name} is not a histogram")
        family.add_metric([], buckets, float(snapshot["sum"]))

    def __iter__(self) -> Iterator[Metric]:
        return (family for family in self._families.values() if family.samples)


def _le_text(le: float) -> str:
    return "+Inf" if math.isinf(le) else repr(float(le))


def _add_gpu(out: _Families, gpu: GpuSnapshot, telemetry: bool = True) -> None:
    """A GPU's series; without ``telemetry`` only the scores (risk, health), not the sampled values."""
    labels = (gpu["node"], gpu["gpu"], gpu.get("gpu_uuid", ""), gpu.get("model", ""))
    if telemetry:
        values = gpu.get("values", {})
        for field in fields.GPU_FIELDS:
            out.add(field.name, labels, values.get(field.name))
        for code, count in sorted(gpu.get("xid_counts", {}).items()):
            out.add("gpu_xid_errors_total", labels + (int(code), xids.describe(code).description), count)
        if gpu.get("job_id"):
            out.add("gpuwatch_gpu_job_info", labels[:3] + (gpu["job_id"], gpu.get("rank", -1)), 1)
        if gpu.get("job_id") or gpu.get("pod"):
            out.add("gpuwatch_gpu_owner_info", labels[:3] + (gpu.get("pod", ""), gpu.get("namespace", ""),
                                                             gpu.get("container", ""), gpu.get("job_id", ""),
                                                             gpu.get("rank", -1)), 1)
    out.add("gpuwatch_gpu_failure_risk_ratio", labels, gpu.get("failure_risk"))
    health = gpu.get("health")
    if health is not None:
        if health in HEALTH_STATES:
            for state in HEALTH_STATES:
                out.add("gpuwatch_gpu_health_state", labels + (state,), state == health)
        else:
            log.warning("GPU %s/%s: unknown health state %r not exported", gpu["node"], gpu["gpu"], health)


def _add_host(out: _Families, host: HostSnapshot) -> None:
    for field in fields.HOST_FIELDS:
        out.add(field.name, (host["node"],), host["values"].get(field.name))


def _add_job(out: _Families, job: JobSnapshot) -> None:
    job_id = job["job_id"]
    breakdown = job.get("breakdown", {})
    for category in BREAKDOWN_CATEGORIES:
        out.add("gpuwatch_job_breakdown_ratio", (job_id, category), breakdown.get(category))
    out.add("gpuwatch_job_lost_gpu_seconds_total", (job_id,), job.get("lost_gpu_seconds_total"))
    for rank, ratio in sorted(job.get("rank_lost_ratio", {}).items()):
        out.add("gpuwatch_job_rank_lost_ratio", (job_id, int(rank)), ratio)
    stragglers = job.get("stragglers", {})
    out.add("gpuwatch_job_stragglers", (job_id,), len(stragglers))
    for rank, lateness in sorted(stragglers.items()):
        out.add("gpuwatch_job_straggler_lateness_seconds", (job_id, int(rank)), lateness)
    for slow in job.get("slow_ranks", ()):
        labels = (job_id, "" if slow["rank"] is None else int(slow["rank"]), slow["cause"])
        out.add("gpuwatch_job_slow_rank_lost_gpu_seconds", labels, slow["lost_gpu_seconds"])
        out.add("gpuwatch_job_slow_rank_speedup_ratio", labels, slow["speedup_without"])


def _add_prefixed(out: _Families, prefix: str, values: Mapping[str, Any], labels: tuple[str, ...] = ()) -> None:
    """Snapshot keys are the metric names without ``prefix``: ``batches_total`` -> gpuwatch_ingest_batches_total.

    Keys that name no scalar metric (the histogram, ``node``) are skipped here.
    """
    for key, value in values.items():
        spec = _SPECS.get(prefix + key)
        if spec is not None and spec.kind != "histogram":
            out.add(spec.name, labels, value)


def _top_jobs(jobs: Sequence[JobSnapshot], limit: int) -> tuple[list[JobSnapshot], int]:
    ranked = sorted(jobs, key=lambda j: j.get("lost_gpu_seconds_total") or 0.0, reverse=True)
    return ranked[:limit], max(0, len(ranked) - limit)


class SnapshotCollector(Collector):
    """A prometheus_client collector that turns one provider snapshot into families at each scrape.

    ``names``: one of :data:`NAMINGS`. ``gpu_telemetry``: export the sampled per-GPU and host values (off
    on a collector whose agents Prometheus scrapes directly, so every series has one source).
    """

    def __init__(self, provider: SnapshotProvider, max_jobs: int = DEFAULT_MAX_JOBS, *, names: str = "gpuwatch",
                 gpu_telemetry: bool = True) -> None:
        if names not in NAMINGS:
            raise UserError(f"metrics names {names!r}: expected one of {', '.join(NAMINGS)}")
        self._provider = provider
        self._max_jobs = max_jobs
        self._dcgm = DCGM_NAMINGS.get(names)
        self._telemetry = gpu_telemetry

    def collect(self) -> Iterable[Metric]:
        snap = self._provider()
        out = _Families()
        for gpu in snap.get("gpus", ()):
            _add_gpu(out, gpu, self._telemetry and self._dcgm is None)
        if self._telemetry:
            for host in snap.get("hosts", ()):
                _add_host(out, host)
        jobs, omitted = _top_jobs(snap.get("jobs", ()), self._max_jobs)
        for job in jobs:
            _add_job(out, job)
        ingest = snap.get("ingest")
        if ingest:
            _add_prefixed(out, "gpuwatch_ingest_", ingest)
            if "commit_seconds" in ingest:
                out.histogram("gpuwatch_ingest_commit_seconds", ingest["commit_seconds"])
            out.add("gpuwatch_exporter_jobs_omitted", (), omitted)
        for agent in snap.get("agents", ()):
            _add_prefixed(out, "gpuwatch_agent_", agent, (agent["node"],))
        out.add("gpuwatch_build_info", (__version__,), 1)
        if self._dcgm is not None and self._telemetry:
            return [*dcgm_families(snap.get("gpus", ()), self._dcgm), *out]
        return out

    def describe(self) -> Iterable[Metric]:
        return ()  # families depend on the snapshot; do not call the provider at registration


def build_registry(provider: SnapshotProvider, max_jobs: int = DEFAULT_MAX_JOBS, *, names: str = "gpuwatch",
                   gpu_telemetry: bool = True) -> CollectorRegistry:
    """A registry of its own (never the process-global one) holding the snapshot collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(provider, max_jobs, names=names, gpu_telemetry=gpu_telemetry))
    return registry

