"""The collector's store interface: what ingest, queries and every feature ask of a store, as roles.

Every piece of SQL lives behind this interface in gpuwatch.collector.store (``queries.py`` for the reads
both engines answer alike, one module per engine for the rest: ``duckdb.py`` embedded, ``clickhouse.py`` for
a ClickHouse server or the in-process chdb engine), so the scorer, the jobs monitor, the alert hub,
breakdowns, demo and replay work on either. Features depend on the roles below, not the whole ``Store``. Times cross the
interface as epoch milliseconds (span times as the probe's microseconds); frames are pandas DataFrames.
"""
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only: the collector binds its port before it loads pandas and numpy
    import pandas as pd

    from gpuwatch.collector.store.writer import IngestCounters
    from gpuwatch.core.columnar import ColumnarBatch
    from gpuwatch.v1 import telemetry_pb2 as pb

#: How often raw probe spans older than the span retention are deleted (docs/operations.md, "Memory"; the
#: retention and the engine's memory limit are settings: gpuwatch.core.settings).
DEFAULT_SPAN_TRIM_INTERVAL_S = 30.0

#: The span kinds that are step marks: kept (in job_steps) as long as samples, while raw spans are trimmed.
STEP_MARK_KINDS = ("step", "end")

#: Every table of a store, created when it opens (docs/store-schema.md).
TABLES = ("gpu_samples", "host_samples", "events", "gpus", "agents", "ingested", "spans", "alerts", "job_steps",
          "step_breakdowns", "job_timelines", "breakdowns", "breakdown_docs", "leases", "gpu_rollups", "tier_state",
          "owner_intervals")


@dataclass(frozen=True)
class WriteResult:
    """What the writer did with one batch: stored it, or recognised it as already stored."""

    agent_id: str
    sequence: int
    duplicate: bool


class StoreClosed(RuntimeError):
    """The store no longer accepts writes."""


class StoreDamaged(RuntimeError):
    """The store's files were found unreadable (truncated, corrupted): it takes no more batches (agents keep
    them and resend once an operator restored the store) and queries answer UNAVAILABLE with the cause."""


# ---- roles: each feature depends on the few it uses; the engines implement them all (Store) ----------

class IngestStats(Protocol):
    """What the writer counts: for /metrics and for the scorer's incremental minutes."""

    counters: IngestCounters

    def queue_depth(self) -> int: ...


class IngestSink(IngestStats, Protocol):
    """Where batches go. Writes are committed in order by one writer per store object; a batch's future
    resolves once it is durable, which is when the server acknowledges it."""

    path: str
    unstorable_errors: tuple[type[BaseException], ...]  # what makes a batch unstorable, not the engine failing

    def submit(self, batch: ColumnarBatch | pb.TelemetryBatch) -> Future: ...
    def write(self, batch: ColumnarBatch | pb.TelemetryBatch, timeout: float | None = None) -> WriteResult: ...
    def flush(self, timeout: float | None = None) -> None: ...
    def close(self) -> None: ...


class Maintenance(Protocol):
    """Deleting what outlived its retention (the store schedules it; tests and tools call it directly)."""

    def apply_retention(self, now_ms: int | None = None, timeout: float | None = None) -> dict[str, int]: ...
    def trim_spans(self, timeout: float | None = None) -> int: ...


class Inventory(Protocol):
    """What the fleet is: nodes, GPUs, their latest values and counters, agents; table sizes and columns."""

    def nodes(self) -> list[dict[str, Any]]: ...
    def gpus(self, node: str | None = None) -> list[dict[str, Any]]: ...
    def gpu_identities(self) -> dict[tuple[str, int], dict[str, str]]: ...
    def nodes_heard_since(self, since_ms: int) -> list[str]: ...
    def latest(self, node: str | None = None, gpu_index: int | None = None) -> list[dict[str, Any]]: ...
    def xid_counts(self) -> list[dict[str, Any]]: ...
    def agent_health(self) -> list[dict[str, Any]]: ...
    def event_counts_by_node(self) -> dict[str, int]: ...
    def count(self, table: str) -> int: ...
    def columns(self, table: str) -> list[str]: ...


class SampleQueries(Protocol):
    """Telemetry over time: raw samples, one field's series, per-minute aggregates."""

    def series(self, node: str, gpu_index: int, field: str, since_ms: int | None = None,
               until_ms: int | None = None, limit: int | None = None) -> pd.DataFrame: ...
    def gpu_samples(self, since_ms: int | None = None, until_ms: int | None = None,
                    nodes: Sequence[str] | None = None, columns: Sequence[str] | None = None) -> pd.DataFrame: ...
    def tiered_gpu_samples(self, since_ms: int | None = None, until_ms: int | None = None,
                           nodes: Sequence[str] | None = None) -> pd.DataFrame: ...
    def host_samples(self, since_ms: int | None = None, nodes: Sequence[str] | None = None) -> pd.DataFrame: ...
    def gpu_minutes(self, since_ms: int, until_ms: int, *, last: Sequence[str], means: Sequence[str],
                    mins: Sequence[str], maxs: Sequence[str]) -> pd.DataFrame: ...
    def newest_sample_ms(self) -> int | None: ...
    def newest_samples(self, after_ms: int | None = None, nodes: Sequence[str] | None = None
                       ) -> dict[tuple[str, int], int]: ...


class EventQueries(Protocol):
    """Events (XIDs, agent starts and stops, owners) and the failure evidence read from them."""

    def events(self, node: str | None = None, kind: str | None = None, since_ms: int | None = None,
               limit: int | None = None) -> list[dict[str, Any]]: ...
    def event_rows(self, kinds: Sequence[str], since_ms: int | None = None,
                   until_ms: int | None = None) -> pd.DataFrame: ...
    def event_attrs(self, kind: str, keys: Sequence[str], since_ms: int | None = None,
                    until_ms: int | None = None) -> pd.DataFrame: ...
    def owner_intervals(self, since_ms: int | None = None) -> pd.DataFrame: ...
    def first_failures(self, fatal_xids: Sequence[int]) -> pd.DataFrame: ...
    def fatal_events(self, fatal_xids: Sequence[int], until_ms: int | None = None) -> pd.DataFrame: ...
    def event_times(self, kind: str, until_ms: int | None = None) -> pd.DataFrame: ...
    def counter_drops(self, field: str, gpus: Sequence[tuple[str, int]], since_ms: int,
                      until_ms: int | None = None) -> pd.DataFrame: ...
    def stopped_agents(self) -> pd.DataFrame: ...


class SpanQueries(Protocol):
    """Jobs as the probe sees them: spans and their per-step aggregates."""

    def spans(self, job_id: str | None = None, since_us: float | None = None) -> pd.DataFrame: ...
    def recent_spans(self, window_s: float, job_id: str | None = None,
                     kinds: Sequence[str] | None = None) -> pd.DataFrame: ...
    def span_job_ids(self) -> list[str]: ...
    def job_progress(self) -> pd.DataFrame: ...
    def add_step_breakdowns(self, rows: pd.DataFrame) -> None: ...
    def step_breakdown_totals(self, job_id: str) -> pd.DataFrame: ...
    def sample_jobs(self) -> list[dict[str, Any]]: ...
    def jobs_seen(self) -> list[dict[str, Any]]: ...


class BreakdownRecords(Protocol):
    """Breakdowns of submitted traces and of live windows: timelines, rows and documents."""

    def job_timelines(self, job_id: str) -> list[bytes]: ...
    def traced_jobs(self) -> list[dict[str, Any]]: ...
    def save_submission(self, job_id: str, timelines: pd.DataFrame, rows: pd.DataFrame, doc_json: str,
                        source: str) -> None: ...
    def save_breakdown(self, job_id: str, source: str, rows: pd.DataFrame, doc_json: str) -> None: ...
    def breakdown_doc(self, job_id: str, source: str) -> str | None: ...
    def breakdown_rows(self, job_id: str, source: str | None = None) -> pd.DataFrame: ...


class AlertRecords(Protocol):
    """Every alert raised, firing or resolved, so a restarted or second collector takes them back."""

    def upsert_alerts(self, rows: pd.DataFrame) -> None: ...
    def firing_alerts(self) -> pd.DataFrame: ...
    def alert_docs(self, include_resolved: bool) -> list[str]: ...
    def alert_starts(self, alertname: str) -> pd.DataFrame: ...


class Leases(Protocol):
    """Named leases that decide which of the collectors sharing a store does once-per-cluster work."""

    def take_lease(self, name: str, holder: str, ttl_s: float) -> bool: ...
    def release_lease(self, name: str, holder: str) -> None: ...


class Store(IngestSink, Maintenance, Inventory, SampleQueries, EventQueries, SpanQueries, BreakdownRecords,
            AlertRecords, Leases, Protocol):
    """A collector store: every role. The engines implement it; the server and assembly hold one. Reads never
    wait for the writer."""
