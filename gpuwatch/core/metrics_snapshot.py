"""The snapshot a metrics provider returns: plain dicts the exporter turns into series.

A *snapshot provider* is any callable returning a :class:`Snapshot`; the collector fills every part
(gpuwatch.collector.snapshot), the agent only ``gpus``, ``hosts`` and ``agents``. The exporter knows nothing
about where the values come from. :class:`LatencyHistogram` keeps a duration in the shape ``commit_seconds``
expects.
"""
from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

class GpuSnapshot(TypedDict, total=False):
    node: str
    gpu: int                        # index on the node
    gpu_uuid: str
    model: str                      # product name, e.g. "NVIDIA H100 80GB HBM3"
    values: Mapping[str, float]     # gpuwatch.core.fields name -> latest value; NaN / missing = not exported
    pci_bus_id: str                 # NVML's bus id, e.g. "00000000:3B:00.0"
    driver_version: str
    xid_counts: Mapping[int, int]   # XID code -> events counted (a counter, never reset by the provider)
    last_xid: int                   # the most recent XID (dcgm naming's DCGM_FI_DEV_XID_ERRORS); 0: none
    failure_risk: float             # 0-1, the online failure score
    health: str                     # one of HEALTH_STATES
    job_id: str                     # job owning the GPU now ("" or absent: none)
    rank: int
    namespace: str                  # the Kubernetes pod holding the GPU now ("" or absent: none)
    pod: str
    container: str


class HostSnapshot(TypedDict):
    node: str
    values: Mapping[str, float]     # HOST_FIELDS name -> latest value


class JobSnapshot(TypedDict, total=False):
    job_id: str
    breakdown: Mapping[str, float]        # BREAKDOWN_CATEGORIES -> fraction of the window (sums to 1)
    lost_gpu_seconds_total: float         # GPU-seconds lost (everything but compute) since the job was seen
    rank_lost_ratio: Mapping[int, float]  # rank -> lost fraction of its window
    stragglers: Mapping[int, float]       # straggler rank -> mean lateness in seconds (empty: none)
    slow_ranks: Sequence[Mapping[str, Any]]  # the jobs view's slow_ranks (rank None: the path between ranks)


class IngestSnapshot(TypedDict, total=False):
    batches_total: int
    samples_total: int
    duplicates_total: int
    rejected_total: int
    write_queue_depth: int
    commit_seconds: Mapping[str, Any]     # LatencyHistogram.snapshot(): {"buckets": [(le, cumulative)], "sum"}


class AgentSnapshot(TypedDict, total=False):
    node: str
    spool_bytes: float                    # bytes waiting in the agent's spool
    spool_dropped_total: int              # batches the agent dropped because its spool was full
    last_seen_timestamp_seconds: float | None  # unix time of the agent's last batch (None: none yet)


class Snapshot(TypedDict, total=False):
    gpus: Sequence[GpuSnapshot]
    hosts: Sequence[HostSnapshot]
    jobs: Sequence[JobSnapshot]
    ingest: IngestSnapshot
    agents: Sequence[AgentSnapshot]


SnapshotProvider = Callable[[], Snapshot]

DEFAULT_LATENCY_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class LatencyHistogram:
    """Thread-safe cumulative histogram of durations in seconds, in the shape ``commit_seconds`` expects."""

    def __init__(self, buckets: Sequence[float] = DEFAULT_LATENCY_BUCKETS) -> None:
        self._bounds = sorted(buckets)
        self._counts = [0] * (len(self._bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self._bounds, seconds)] += 1
            self._sum += seconds

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, count in zip([*self._bounds, math.inf], counts):
            running += count
            cumulative.append((bound, running))
        return {"buckets": cumulative, "sum": total}
