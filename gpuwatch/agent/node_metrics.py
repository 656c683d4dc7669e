"""The agent's optional node-local Prometheus endpoint (``metrics_listen``), for sites that run only Prometheus.

It serves the collector's exporter (same names, labels, /metrics path and token rule) from what this agent
sampled last instead of from the store, so a node scraped directly and the collector expose identical
per-GPU series: each GPU's latest value of every field (slow-tier counters kept between their ticks), XID
counts since the agent started, the job and rank on each GPU, the host's metrics and the spool's health.
Failure risk and job breakdowns need the fleet's history and stay with the collector.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence

from gpuwatch.agent.owners import GpuOwner
from gpuwatch.agent.spool import Spool
from gpuwatch.core.metrics_snapshot import AgentSnapshot, GpuSnapshot, HostSnapshot, Snapshot
from gpuwatch.v1 import telemetry_pb2 as pb


class NodeMetrics:
    """The latest per-GPU and host values of one node, fed by the agent's ticks, read by scrapes."""

    def __init__(self, node: str, gpus: Sequence[pb.GpuInfo], spool: Spool | None = None, *,
                 driver_version: str = "") -> None:
        self._node = node
        self._driver_version = driver_version
        self._gpus = {g.index: g for g in gpus}
        self._spool = spool
        self._lock = threading.Lock()
        self._values: dict[int, dict[str, float]] = {i: {} for i in self._gpus}
        self._jobs: dict[int, tuple[str, int]] = {}
        self._owners: dict[int, GpuOwner] = {}
        self._xids: dict[int, Counter[int]] = {i: Counter() for i in self._gpus}
        self._last_xid: dict[int, int] = {}
        self._host: dict[str, float] = {}
        self._dropped = 0
        self._last_sample_s: float | None = None

    def observe_gpu(self, index: int, values: Mapping[str, float], job_id: str, rank: int) -> None:
        with self._lock:
            self._values.setdefault(index, {}).update(values)
            self._jobs[index] = (job_id, rank)

    def observe_owner(self, index: int, owner: GpuOwner) -> None:
        with self._lock:
            self._owners[index] = owner

    def observe_host(self, values: Mapping[str, float]) -> None:
        with self._lock:
            self._host.update(values)
            self._last_sample_s = time.time()

    def observe_xid(self, gpu_index: int, code: int) -> None:
        with self._lock:
            self._xids.setdefault(gpu_index, Counter())[code] += 1
            self._last_xid[gpu_index] = code

    def observe_dropped(self, batches: int) -> None:
        with self._lock:
            self._dropped += batches

    def snapshot(self) -> Snapshot:
        """The exporter's snapshot: ``gpus``, ``hosts`` and this agent's spool under ``agents``."""
        with self._lock:
            gpus = [self._gpu(i) for i in sorted(self._values)]
            host: HostSnapshot = {"node": self._node, "values": dict(self._host)}
            agent: AgentSnapshot = {"node": self._node, "spool_dropped_total": self._dropped,
                     "last_seen_timestamp_seconds": self._last_sample_s}
        if self._spool is not None:
            agent["spool_bytes"] = self._spool.pending_bytes()
        return {"gpus": gpus, "hosts": [host] if host["values"] else [], "agents": [agent]}

    def _gpu(self, index: int) -> GpuSnapshot:
        info = self._gpus.get(index)
        job_id, rank = self._jobs.get(index, ("", -1))
        owner = self._owners.get(index)
        return {"node": self._node, "gpu": index, "gpu_uuid": info.uuid if info else "",
                "model": info.name if info else "", "pci_bus_id": info.pci_bus_id if info else "",
                "driver_version": self._driver_version, "values": dict(self._values[index]),
                "xid_counts": dict(self._xids.get(index, {})), "last_xid": self._last_xid.get(index, 0),
                "job_id": job_id, "rank": rank, "namespace": owner.namespace if owner else "",
                "pod": owner.pod if owner else "", "container": owner.container if owner else ""}
