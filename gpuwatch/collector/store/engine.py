"""What the two store engines share beneath their SQL: the options a store takes and the state that follows.

``open_store(url, **options)`` passes the same keyword options to either engine; :class:`StoreOptions` is
their one list with the defaults, and :class:`EngineStore` the base that keeps the tiering and inventory
state, starts the writer with them, and carries the queries written once (store/queries.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from gpuwatch.collector.store import owner_tables, rollups
from gpuwatch.collector.store.base import DEFAULT_SPAN_TRIM_INTERVAL_S
from gpuwatch.collector.store.inventory import InventoryCache
from gpuwatch.collector.store.latest_values import LatestValues
from gpuwatch.collector.store.queries import SqlQueries
from gpuwatch.collector.store.writer import GroupWriter
from gpuwatch.core.settings import DEFAULT_MEMORY_LIMIT, DEFAULT_SPAN_RETENTION_S


@dataclass(frozen=True)
class StoreOptions:
    """The keyword options of every store (an unknown one is a TypeError, as for any keyword argument)."""

    retention_days: float | None = None
    retention_interval_s: float = 3600.0
    max_group_batches: int = 2048
    max_queued_batches: int = 8192
    memory_limit: str = DEFAULT_MEMORY_LIMIT
    span_retention_s: float | None = DEFAULT_SPAN_RETENTION_S
    span_trim_interval_s: float = DEFAULT_SPAN_TRIM_INTERVAL_S
    #: GPU samples tiered: raw rows for raw_retention_s, then per-minute rollups for rollup_retention_s
    #: (None: raw rows follow retention_days and no rollups are built)
    raw_retention_s: float | None = None
    rollup_retention_s: float | None = None


class EngineStore(SqlQueries, GroupWriter):
    """An engine's base: call ``__init__`` last, once the engine is open and knows each agent's last sequence."""

    def __init__(self, last_sequence: dict[str, int], options: StoreOptions) -> None:
        self.raw_retention_s = options.raw_retention_s
        self.rollup_retention_s = options.rollup_retention_s
        self._dirty = rollups.DirtyMinutes()
        self._owners_pending = owner_tables.PendingOwners()
        self._inventory = InventoryCache()
        self.latest_values = LatestValues()
        super().__init__(
            last_sequence, retention_days=options.retention_days, span_retention_s=options.span_retention_s,
            retention_interval_s=options.retention_interval_s, span_trim_interval_s=options.span_trim_interval_s,
            max_group_batches=options.max_group_batches, max_queued_batches=options.max_queued_batches)

    def apply_retention(self, now_ms: int | None = None, timeout: float | None = None) -> dict[str, int]:
        """Delete rows older than ``retention_days`` before ``now_ms``, and raw GPU samples past
        ``raw_retention_s`` once rolled up; return rows deleted per table."""
        try:
            return self._delete_expired(now_ms, timeout)
        finally:
            self.latest_values.forget()  # a GPU whose samples are all gone leaves the latest values

    def _delete_expired(self, now_ms: int | None, timeout: float | None) -> dict[str, int]:
        raise NotImplementedError

    def _housekeeping(self, retention: bool, trim: bool) -> None:
        try:
            self._clean_up(retention, trim)
        finally:
            if retention:
                self.latest_values.forget()

    def _clean_up(self, retention: bool, trim: bool) -> None:
        """The engine's housekeeping: rollups, owner intervals, retention (when ``retention``), span trimming."""
        raise NotImplementedError
