"""Every GPU's latest values (the last non-NULL value of each field), kept up to date from what arrives.

Read whole, the latest values are a scan of every raw sample: seconds per 256 GPUs of a two-day raw tier, and
the collector's /metrics reads them every few seconds. Kept here, a read merges only the samples that arrived
since the last one (:mod:`~gpuwatch.collector.store.arrivals`). They are read whole again after the store
deleted samples (retention) and every ``REBUILD_S``, so GPUs whose samples a TTL expired elsewhere (a shared
ClickHouse) leave them too.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from gpuwatch.collector.store.arrivals import HeardNodes, SampleArrivals

#: The longest the kept values go without a whole read.
REBUILD_S = 3600.0


class LatestReads(HeardNodes, Protocol):
    def latest_since(self, after_ms: int | None, nodes: Sequence[str] | None) -> list[dict[str, Any]]: ...


class LatestValues:
    """The latest-values rows (node, gpu_index, ts_ms and every field) of one store, thread-safe."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, int], dict[str, Any]] = {}
        self._arrivals = SampleArrivals()
        self._read_whole_at: float | None = None
        self._lock = threading.Lock()

    def forget(self) -> None:
        """Read whole next time (samples were deleted)."""
        with self._lock:
            self._read_whole_at = None

    def rows(self, store: LatestReads) -> list[dict[str, Any]]:
        """Every GPU's row, ordered by node and GPU index."""
        with self._lock:
            if self._read_whole_at is None or time.monotonic() - self._read_whole_at > REBUILD_S:
                self._rows, self._arrivals, self._read_whole_at = {}, SampleArrivals(), time.monotonic()
            after, nodes = self._arrivals.where(store)
            fresh = store.latest_since(after, nodes)
            for row in fresh:
                key = (row["node"], row["gpu_index"])
                kept = self._rows.get(key)
                self._rows[key] = row if kept is None else {  # the owner of its newest samples, whoever it is
                    **kept, **{name: value for name, value in row.items() if value is not None},
                    "ts_ms": max(row["ts_ms"], kept["ts_ms"]), "job_id": row["job_id"], "rank": row["rank"]}
            self._arrivals.saw({(r["node"], r["gpu_index"]): r["ts_ms"] for r in fresh}, nodes)
            return [dict(self._rows[key]) for key in sorted(self._rows)]
