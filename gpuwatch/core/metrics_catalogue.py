"""The exported metrics: every name, type, help text and label set, and the namings an endpoint may use.

Names follow Prometheus conventions (base units, ``_total`` counters, ``_ratio`` 0-1) and labels stay
bounded: node, GPU index/UUID/model, job id, rank, breakdown category, health state, XID code. Never step
numbers, sequence ids or PIDs. The per-GPU names are those of :mod:`gpuwatch.core.fields`, so the agent's
node-local endpoint and the collector export identical series. :data:`EXPORTED_METRICS` is the catalogue
dashboards and rules are checked against.
"""
from __future__ import annotations

from dataclasses import dataclass

from gpuwatch.core import fields
from gpuwatch.core.dcgm_names import NAMINGS as DCGM_NAMINGS


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # "gauge" | "counter" | "histogram"
    help: str
    labels: tuple[str, ...]


GPU_LABELS = ("node", "gpu", "gpu_uuid", "model")
_JOB, _RANK = ("job_id",), ("job_id", "rank")

_OWN_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("gpu_xid_errors_total", "counter",
               "XID events reported by the driver, per code; xid_description is NVIDIA's name for the code.",
               GPU_LABELS + ("xid", "xid_description")),
    MetricSpec("gpuwatch_gpu_failure_risk_ratio", "gauge", "Online failure risk score (0-1); 1 once the GPU failed.",
               GPU_LABELS),
    MetricSpec("gpuwatch_gpu_health_state", "gauge", "1 for the GPU's current rule-based health state.",
               GPU_LABELS + ("state",)),
    MetricSpec("gpuwatch_gpu_job_info", "gauge", "1 for the job and rank owning a GPU; join on node, gpu.",
               ("node", "gpu", "gpu_uuid", "job_id", "rank")),
    MetricSpec("gpuwatch_gpu_owner_info", "gauge", "1 for the pod and job holding a GPU now (empty: none); join "
               "on node, gpu with group_left instead of labelling every series.",
               ("node", "gpu", "uuid", "pod", "namespace", "container", "job", "rank")),
    MetricSpec("gpuwatch_job_breakdown_ratio", "gauge", "Share of the job's GPU time per efficiency category.",
               _JOB + ("category",)),
    MetricSpec("gpuwatch_job_lost_gpu_seconds_total", "counter", "GPU-seconds lost to anything but compute.", _JOB),
    MetricSpec("gpuwatch_job_rank_lost_ratio", "gauge", "Share of a rank's window lost to anything but compute.",
               _RANK),
    MetricSpec("gpuwatch_job_stragglers", "gauge", "Ranks currently classified as stragglers.", _JOB),
    MetricSpec("gpuwatch_job_straggler_lateness_seconds", "gauge", "A straggler rank's mean lateness at collectives.",
               _RANK),
    MetricSpec("gpuwatch_job_slow_rank_lost_gpu_seconds", "gauge",
               "GPU-seconds the job lost to a slow rank since its onset, by cause (rank empty: the network).",
               _RANK + ("cause",)),
    MetricSpec("gpuwatch_job_slow_rank_speedup_ratio", "gauge",
               "How much faster the job would run without a slow rank's slowdown (0.25: 25 %), by cause.",
               _RANK + ("cause",)),
    MetricSpec("gpuwatch_ingest_batches_total", "counter", "Telemetry batches committed.", ()),
    MetricSpec("gpuwatch_ingest_samples_total", "counter", "Per-GPU sample rows committed.", ()),
    MetricSpec("gpuwatch_ingest_duplicates_total", "counter", "Batches acknowledged as already stored.", ()),
    MetricSpec("gpuwatch_ingest_rejected_total", "counter", "Batches refused (malformed, oversized, version).", ()),
    MetricSpec("gpuwatch_ingest_write_queue_depth", "gauge", "Batches waiting for the store writer.", ()),
    MetricSpec("gpuwatch_ingest_commit_seconds", "histogram", "Time to commit one group of batches.", ()),
    MetricSpec("gpuwatch_agent_spool_bytes", "gauge", "Bytes waiting in an agent's spool.", ("node",)),
    MetricSpec("gpuwatch_agent_spool_dropped_total", "counter", "Batches an agent dropped: spool full.", ("node",)),
    MetricSpec("gpuwatch_agent_last_seen_timestamp_seconds", "gauge", "Unix time of an agent's last batch.",
               ("node",)),
    MetricSpec("gpuwatch_exporter_jobs_omitted", "gauge", "Jobs left out of this scrape by the job limit.", ()),
    MetricSpec("gpuwatch_build_info", "gauge", "Always 1; the gpuwatch version as a label.", ("version",)),
)

METRICS: tuple[MetricSpec, ...] = (
    tuple(MetricSpec(f.name, f.kind.value, f.help, GPU_LABELS) for f in fields.GPU_FIELDS)
    + tuple(MetricSpec(f.name, f.kind.value, f.help, ("node",)) for f in fields.HOST_FIELDS)
    + _OWN_METRICS
)
EXPORTED_METRICS: dict[str, str] = {m.name: m.kind for m in METRICS}
#: --metrics-names values: the project's own names, or dcgm-exporter's for the per-GPU values.
NAMINGS: tuple[str, ...] = ("gpuwatch", *DCGM_NAMINGS)
