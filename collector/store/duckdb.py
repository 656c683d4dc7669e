"""The embedded DuckDB store of the collector: grouped columnar writes, deduplication, retention, reads.

DuckDB is built for bulk operations, so every write goes through one writer thread that takes all batches
queued at that moment, turns them into one Arrow table per target table (numpy over the packed protobuf
columns, never a Python loop per value), inserts them in a single transaction and only then resolves the
batches' futures, which is when the server acknowledges them. Reads use their own cursors and never wait
for the writer. The schema is documented in docs/store-schema.md; adding a table for a feature is one more
statement in :data:`DDL` (plus a writer for it where ingest feeds it).
"""
from __future__ import annotations

import datetime as dt
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from gpuwatch import events as event_kinds
from gpuwatch import fields
from gpuwatch.columnar import ColumnarBatch, from_message
from gpuwatch.collector.exporter import LatencyHistogram
from gpuwatch.errors import NotFound, UserError
from gpuwatch.v1 import telemetry_pb2 as pb

log = logging.getLogger(__name__)

# the kinds gpuwatch/events.py defines (its upper-case string constants): the wire contract of Event.kind
KNOWN_EVENT_KINDS = frozenset(v for k, v in vars(event_kinds).items() if k.isupper() and isinstance(v, str))

_chain = itertools.chain.from_iterable


def _value_columns(names: Iterable[str]) -> str:
    return ",\n    ".join(f"{name} DOUBLE" for name in names)


# Every table of the store, created in order when a database is opened. New features append here.
DDL: list[str] = [
    f"""CREATE TABLE IF NOT EXISTS gpu_samples (
    node VARCHAR NOT NULL, gpu_index INTEGER NOT NULL, ts TIMESTAMP NOT NULL,
    job_id VARCHAR, rank INTEGER, local_rank INTEGER,
    {_value_columns(fields.GPU_FIELD_NAMES)})""",
    f"""CREATE TABLE IF NOT EXISTS host_samples (
    node VARCHAR NOT NULL, ts TIMESTAMP NOT NULL,
    {_value_columns(fields.HOST_FIELD_NAMES)})""",
    """CREATE TABLE IF NOT EXISTS events (
    node VARCHAR NOT NULL, gpu_index INTEGER NOT NULL, ts TIMESTAMP NOT NULL, kind VARCHAR NOT NULL,
    code BIGINT, message VARCHAR, attrs JSON)""",
    """CREATE TABLE IF NOT EXISTS gpus (
    node VARCHAR NOT NULL, "index" INTEGER NOT NULL, uuid VARCHAR, name VARCHAR, pci_bus_id VARCHAR,
    serial VARCHAR, memory_total_bytes UBIGINT, architecture VARCHAR, gpm_supported BOOLEAN,
    first_seen TIMESTAMP NOT NULL, last_seen TIMESTAMP NOT NULL, PRIMARY KEY (node, "index"))""",
    """CREATE TABLE IF NOT EXISTS agents (
    agent_id VARCHAR PRIMARY KEY, node VARCHAR NOT NULL, last_sequence UBIGINT NOT NULL,
    last_seen TIMESTAMP NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS ingested (
    agent_id VARCHAR NOT NULL, sequence UBIGINT NOT NULL, ingested_at TIMESTAMP NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS spans (
    job_id VARCHAR, rank INTEGER, step BIGINT, kind VARCHAR, name VARCHAR, start_us DOUBLE, dur_us DOUBLE,
    process_group VARCHAR, seq BIGINT, bytes BIGINT, world_size INTEGER, node VARCHAR, peer INTEGER,
    ts TIMESTAMP NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS alerts (
    id VARCHAR PRIMARY KEY, alertname VARCHAR NOT NULL, subject VARCHAR NOT NULL, status VARCHAR NOT NULL,
    starts_at TIMESTAMP NOT NULL, ends_at TIMESTAMP, updated_at TIMESTAMP NOT NULL, doc JSON NOT NULL)""",
]

# Seconds after which an unchanged inventory entry is written again (its gpus.last_seen refreshed).
INVENTORY_REFRESH_S = 60.0

# Tables that retention trims, with the timestamp column it compares.
RETENTION: dict[str, str] = {
    "gpu_samples": "ts", "host_samples": "ts", "events": "ts", "spans": "ts", "ingested": "ingested_at",
}

# SpanTable column -> (Arrow type, value used when a batch leaves the column empty).
_SPAN_COLUMNS: dict[str, tuple[pa.DataType, Any]] = {
    "job_id": (pa.string(), ""), "rank": (pa.int32(), -1), "step": (pa.int64(), -1), "kind": (pa.string(), ""),
    "name": (pa.string(), ""), "start_us": (pa.float64(), np.nan), "dur_us": (pa.float64(), np.nan),
    "process_group": (pa.string(), ""), "seq": (pa.int64(), -1), "bytes": (pa.int64(), -1),
    "world_size": (pa.int32(), -1), "node": (pa.string(), ""), "peer": (pa.int32(), -1),
}

_GPU_FIELD_INDEX = {name: i for i, name in enumerate(fields.GPU_FIELD_NAMES)}
_GPU_INFO_COLUMNS = ("uuid", "name", "pci_bus_id", "serial", "memory_total_bytes", "architecture", "gpm_supported")


@dataclass(frozen=True)
class WriteResult:
    """What the writer did with one batch: stored it, or recognised it as already stored."""

    agent_id: str
    sequence: int
    duplicate: bool


@dataclass
class _Pending:
    batch: ColumnarBatch
    future: Future = field(default_factory=Future)


@dataclass
class _Task:
    """Work other than a batch that must run on the writer thread (retention, flush barriers)."""

    fn: Callable[[duckdb.DuckDBPyConnection], Any]
    future: Future = field(default_factory=Future)


_STOP = object()


class StoreClosed(RuntimeError):
    """The store no longer accepts writes."""


class IngestCounters:
    """What the writer committed since the store was opened (exported as gpuwatch_ingest_* metrics)."""

    def __init__(self) -> None:
        self.batches = self.samples = self.duplicates = self.rejected = 0
        self.commit_seconds = LatencyHistogram()
        self._oldest_sample_ms: int | None = None
        self._lock = threading.Lock()

    def committed(self, batches: Sequence[pb.TelemetryBatch], duplicates: int, seconds: float) -> None:
        blocks = [s.ts_ms for b in batches for s in b.samples if len(s.ts_ms)]
        rows = sum(len(ts) for ts in blocks)
        oldest = min(min(ts) for ts in blocks) if blocks else None
        with self._lock:
            self.batches += len(batches)
            self.samples += rows
            self.duplicates += duplicates
            if oldest is not None and (self._oldest_sample_ms is None or oldest < self._oldest_sample_ms):
                self._oldest_sample_ms = oldest
        self.commit_seconds.observe(seconds)

    def take_oldest_sample_ms(self) -> int | None:
        """The oldest GPU sample time committed since the last call (None: no samples since), so a reader
        that keeps aggregates of recent data (the scorer) knows when late data (a spool replay) needs a re-read."""
        with self._lock:
            oldest, self._oldest_sample_ms = self._oldest_sample_ms, None
        return oldest

    def reject(self) -> None:
        """The server refused a batch before it reached the store (malformed, oversized, wrong version)."""
        with self._lock:
            self.rejected += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            counts = {"batches_total": self.batches, "samples_total": self.samples,
                      "duplicates_total": self.duplicates, "rejected_total": self.rejected}
        return {**counts, "commit_seconds": self.commit_seconds.snapshot()}


class DuckDBStore:
    """One DuckDB database file (or ":memory:"), written by one writer thread, read through cursors."""

    def __init__(
        self,
        path: str,
        *,
        retention_days: float | None = None,
        retention_interval_s: float = 3600.0,
        max_group_batches: int = 2048,
        max_queued_batches: int = 8192,
    ) -> None:
        try:
            self._con = duckdb.connect(path)
        except duckdb.IOException as exc:
            raise UserError(f"cannot open store {path}: {_first_line(exc)}") from None
        for statement in DDL:
            self._con.execute(statement)
        self.path = path
        self.retention_days = retention_days
        self._retention_interval_s = retention_interval_s
        self._max_group = max_group_batches
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued_batches)
        self._cursor_lock = threading.Lock()
        self._closed = False
        self.counters = IngestCounters()
        # (node, GPU index) -> (the inventory entry as last written, monotonic time written): unchanged entries
        # are rewritten only every INVENTORY_REFRESH_S, not in every transaction
        self._inventory: dict[tuple[str, int], tuple[bytes, float]] = {}
        self._last_sequence: dict[str, int] = dict(
            self._con.execute("SELECT agent_id, last_sequence FROM agents").fetchall()
        )
        self._writer = threading.Thread(target=self._write_loop, name="store-writer", daemon=True)
        self._writer.start()

    # ----------------------------------------------------------------------------------------- writes
    def submit(self, batch: ColumnarBatch | pb.TelemetryBatch) -> Future:
        """Queue a batch (a message is checked first: BatchError); the future resolves to a
        :class:`WriteResult` once it is committed.

        Blocks while the queue is full, which pushes back on the senders instead of growing memory.
        """
        if self._closed:
            raise StoreClosed("the store is closed")
        pending = _Pending(batch if isinstance(batch, ColumnarBatch) else from_message(batch))
        self._queue.put(pending)
        return pending.future

    def write(self, batch: ColumnarBatch | pb.TelemetryBatch, timeout: float | None = None) -> WriteResult:
        """Store one batch and wait for its commit (tests, simple tools)."""
        return self.submit(batch).result(timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Return once every batch queued before this call is committed."""
        self.run_write(lambda con: None, timeout)

    def apply_retention(self, now_ms: int | None = None, timeout: float | None = None) -> dict[str, int]:
        """Delete rows older than ``retention_days`` before ``now_ms``; return rows deleted per table."""
        if not self.retention_days:
            return {}
        cutoff = self._retention_cutoff(now_ms)
        return self.run_write(lambda con: _delete_before(con, cutoff), timeout)

    def close(self) -> None:
        """Commit everything queued, stop the writer and close the database."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._writer.join()
        self._con.close()

    def run_write(self, fn: Callable[[duckdb.DuckDBPyConnection], Any], timeout: float | None = None) -> Any:
        """Run ``fn(connection)`` on the writer thread, between batch groups, and return its result.

        Features that keep their own tables (breakdowns, alerts) write through this, so DuckDB only ever
        sees one writer and their writes are ordered with ingest.
        """
        if self._closed:
            raise StoreClosed("the store is closed")
        task = _Task(fn)
        self._queue.put(task)
        return task.future.result(timeout)

    def _write_loop(self) -> None:
        next_retention = time.monotonic() + self._retention_interval_s
        stopping = False
        while not stopping:
            try:
                first = [self._queue.get(timeout=max(0.01, next_retention - time.monotonic()))]
            except queue.Empty:
                first = []
            group: list = []
            for item in itertools.chain(first, self._drain()):
                if item is _STOP:
                    stopping = True
                elif isinstance(item, _Task):
                    self._write_group(group)
                    group = []
                    _resolve(item.future, item.fn, self._con)
                else:
                    group.append(item)
            self._write_group(group)
            if time.monotonic() >= next_retention:
                next_retention = time.monotonic() + self._retention_interval_s
                self._periodic_retention()

    def _periodic_retention(self) -> None:
        if not self.retention_days:
            return
        try:
            _delete_before(self._con, self._retention_cutoff())
        except Exception:  # a failed clean-up must not stop ingest; it is retried next interval
            log.exception("retention failed")

    def _retention_cutoff(self, now_ms: int | None = None) -> dt.datetime:
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        return ms_to_datetime(now_ms - int(self.retention_days * 86_400_000))

    def _drain(self) -> Iterable:
        for _ in range(self._max_group - 1):
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return

    def _write_group(self, group: list[_Pending]) -> None:
        if not group:
            return
        results, fresh = self._deduplicate(group)
        started = time.perf_counter()
        try:
            self._commit([p.batch for p in fresh])
        except Exception as exc:
            if len(group) > 1:  # find the batch that cannot be stored so it does not fail the others
                log.warning("storing a group of %d batches failed (%s); storing them one by one", len(group), exc)
                for p in group:
                    self._write_group([p])
                return
            log.error("batch %d of agent %s cannot be stored: %s", group[0].batch.sequence, group[0].batch.agent_id,
                      exc)
            _settle(group[0].future, exception=exc)
            return
        self.counters.committed([p.batch.message for p in fresh], len(group) - len(fresh),
                                time.perf_counter() - started)
        for p in fresh:
            self._last_sequence[p.batch.agent_id] = max(self._last_sequence.get(p.batch.agent_id, 0), p.batch.sequence)
        for p, result in zip(group, results):
            _settle(p.future, result)

    def _commit(self, batches: list[ColumnarBatch]) -> None:
        """Insert ``batches`` in one transaction; nothing of them is stored if any part fails."""
        if not batches:
            return
        inventory = self._inventory_to_write(batches)
        self._con.begin()
        try:
            _insert_group(self._con, batches, inventory)
            self._con.commit()
        except BaseException:
            self._con.rollback()
            raise
        written = time.monotonic()
        self._inventory.update({key: (entry, written) for key, (entry, _) in inventory.items()})

    def _inventory_to_write(self, batches: list[ColumnarBatch]) -> dict[tuple[str, int], tuple[bytes, pb.GpuInfo]]:
        """The newest inventory entry per (node, GPU) of the group that is new, changed or due for refresh."""
        latest = {(b.message.node.node, g.index): g for b in batches for g in b.message.gpus}
        stale = time.monotonic() - INVENTORY_REFRESH_S
        out = {}
        for key, gpu in latest.items():
            entry = gpu.SerializeToString()
            known = self._inventory.get(key)
            if known is None or known[0] != entry or known[1] < stale:
                out[key] = (entry, gpu)
        return out

    def _deduplicate(self, group: list[_Pending]) -> tuple[list[WriteResult], list[_Pending]]:
        """Mark batches stored before, or earlier in the same group, as duplicates; return the rest to write."""
        maybe_stored = [p for p in group if p.batch.sequence <= self._last_sequence.get(p.batch.agent_id, 0)]
        stored = _stored_keys(self._con, [(p.batch.agent_id, p.batch.sequence) for p in maybe_stored])
        results, fresh = [], []
        for p in group:
            key = (p.batch.agent_id, p.batch.sequence)
            duplicate = key in stored
            stored.add(key)
            results.append(WriteResult(key[0], key[1], duplicate))
            if not duplicate:
                fresh.append(p)
        return results, fresh

    # ------------------------------------------------------------------------------------------ reads
    def query_df(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> pd.DataFrame:
        """Run a read query on its own cursor and return a DataFrame (the generic entry for analyses)."""
        with self._cursor_lock:
            cur = self._con.cursor()
        try:
            return cur.execute(sql, params or []).df()
        finally:
            cur.close()

    def _records(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Rows as plain dicts with None (not NaN) for SQL NULL, ready for JSON and protobuf."""
        df = self.query_df(sql, params)
        return df.astype(object).where(df.notna(), None).to_dict("records")

    def nodes(self) -> list[dict[str, Any]]:
        """Per node: GPUs in the inventory, gpu_samples rows, last batch time (ms), agent and its last sequence."""
        return self._records("""
            WITH s AS (SELECT node, count(*) AS samples FROM gpu_samples GROUP BY node),
                 g AS (SELECT node, count(*) AS gpus FROM gpus GROUP BY node)
            SELECT a.node, coalesce(g.gpus, 0)::BIGINT AS gpus, coalesce(s.samples, 0)::BIGINT AS samples,
                   epoch_ms(max(a.last_seen)) AS last_seen_ms, arg_max(a.agent_id, a.last_seen) AS agent_id,
                   arg_max(a.last_sequence, a.last_seen)::BIGINT AS last_sequence
            FROM agents a LEFT JOIN g USING (node) LEFT JOIN s USING (node)
            GROUP BY a.node, g.gpus, s.samples ORDER BY a.node""")

    def gpus(self, node: str | None = None) -> list[dict[str, Any]]:
        """Inventory rows with their sample count, last sample time (ms) and the job owning the last sample."""
        return self._records("""
            WITH s AS (SELECT node, gpu_index, count(*) AS samples, epoch_ms(max(ts)) AS last_sample_ms,
                              arg_max(job_id, ts) AS job_id, arg_max(rank, ts) AS rank
                       FROM gpu_samples WHERE $node IS NULL OR node = $node GROUP BY node, gpu_index)
            SELECT g.node, g."index", g.uuid, g.name, g.pci_bus_id, g.serial, g.memory_total_bytes::BIGINT
                   AS memory_total_bytes, g.architecture, g.gpm_supported, epoch_ms(g.first_seen) AS first_seen_ms,
                   epoch_ms(g.last_seen) AS last_seen_ms, coalesce(s.samples, 0)::BIGINT AS samples,
                   s.last_sample_ms, s.job_id, s.rank
            FROM gpus g LEFT JOIN s ON s.node = g.node AND s.gpu_index = g."index"
            WHERE $node IS NULL OR g.node = $node ORDER BY g.node, g."index" """, {"node": node})

    def latest(self, node: str | None = None, gpu_index: int | None = None) -> list[dict[str, Any]]:
        """Per GPU: the time of its last sample and the last non-NULL value of every field (None if never)."""
        values = ", ".join(f"arg_max({name}, ts) AS {name}" for name in fields.GPU_FIELD_NAMES)
        return self._records(f"""
            SELECT node, gpu_index, epoch_ms(max(ts)) AS ts_ms, {values} FROM gpu_samples
            WHERE ($node IS NULL OR node = $node) AND ($gpu IS NULL OR gpu_index = $gpu)
            GROUP BY node, gpu_index ORDER BY node, gpu_index""", {"node": node, "gpu": gpu_index})

    def series(
        self,
        node: str,
        gpu_index: int,
        field: str,
        since_ms: int | None = None,
        until_ms: int | None = None,
        limit: int | None = None,
    ) -> pd.DataFrame:
        """One GPU field over time (columns ts_ms, value), oldest first; with ``limit``, the newest rows."""
        if field not in _GPU_FIELD_INDEX:
            raise UserError(f"unknown GPU field {field!r}; fields are listed in gpuwatch.fields")
        df = self.query_df(f"""
            SELECT epoch_ms(ts) AS ts_ms, {field} AS value FROM gpu_samples
            WHERE node = $node AND gpu_index = $gpu AND {field} IS NOT NULL
              AND ($since IS NULL OR ts >= $since) AND ($until IS NULL OR ts <= $until)
            ORDER BY ts DESC LIMIT $limit""",
            {"node": node, "gpu": gpu_index, "since": _ms_or_none(since_ms), "until": _ms_or_none(until_ms),
             "limit": limit if limit else None})
        if df.empty:
            self._check_gpu(node, gpu_index)
        return df.iloc[::-1].reset_index(drop=True)

    def _check_gpu(self, node: str, gpu_index: int | None = None) -> None:
        """NotFound naming a node (or GPU) the store has never heard of, so an empty answer is never a typo."""
        known = self._records("""
            SELECT gpu_index FROM (SELECT node, "index" AS gpu_index FROM gpus UNION
                                   SELECT DISTINCT node, gpu_index FROM gpu_samples UNION
                                   SELECT node, NULL FROM agents) WHERE node = $node""", {"node": node})
        if not known:
            raise NotFound(f"unknown node {node!r}; `gpuwatch nodes` lists the known ones")
        if gpu_index is not None and gpu_index not in {r["gpu_index"] for r in known}:
            raise NotFound(f"node {node!r} has no GPU {gpu_index}; `gpuwatch gpus --node {node}` lists its GPUs")

    def events(
        self, node: str | None = None, kind: str | None = None, since_ms: int | None = None, limit: int | None = None
    ) -> list[dict[str, Any]]:
        """Events newest first, with attrs as a dict and ts as epoch ms."""
        rows = self._records("""
            SELECT node, gpu_index, epoch_ms(ts) AS ts_ms, kind, code, message, attrs FROM events
            WHERE ($node IS NULL OR node = $node) AND ($kind IS NULL OR kind = $kind)
              AND ($since IS NULL OR ts >= $since)
            ORDER BY ts DESC LIMIT $limit""",
            {"node": node, "kind": kind, "since": _ms_or_none(since_ms), "limit": limit if limit else None})
        if not rows:
            self._check_event_filters(node, kind)
        for row in rows:
            row["attrs"] = json.loads(row["attrs"]) if row["attrs"] else {}
        return rows

    def _check_event_filters(self, node: str | None, kind: str | None) -> None:
        """NotFound for an unknown node, UserError for a kind neither defined nor ever stored (a typo)."""
        if node is not None:
            self._check_gpu(node)
        if kind is not None and kind not in KNOWN_EVENT_KINDS and not self._records(
                "SELECT 1 FROM events WHERE kind = $kind LIMIT 1", {"kind": kind}):
            raise UserError(f"event kind {kind!r} is not one of the known kinds: {', '.join(sorted(KNOWN_EVENT_KINDS))}")

    def gpu_samples(
        self,
        since_ms: int | None = None,
        until_ms: int | None = None,
        nodes: Sequence[str] | None = None,
        columns: Sequence[str] | None = None,
    ) -> pd.DataFrame:
        """Wide GPU samples (identity columns plus ``columns``, default all fields) ordered by node, GPU, ts."""
        unknown = [c for c in columns or () if c not in _GPU_FIELD_INDEX]
        if unknown:
            raise UserError(f"unknown GPU field(s) {', '.join(map(repr, unknown))}")
        wanted = ", ".join(columns if columns is not None else fields.GPU_FIELD_NAMES)
        return self.query_df(f"""
            SELECT node, gpu_index, ts, job_id, rank, local_rank{', ' + wanted if wanted else ''} FROM gpu_samples
            WHERE ($since IS NULL OR ts >= $since) AND ($until IS NULL OR ts <= $until)
              AND ($nodes IS NULL OR list_contains($nodes, node))
            ORDER BY node, gpu_index, ts""",
            {"since": _ms_or_none(since_ms), "until": _ms_or_none(until_ms), "nodes": list(nodes) if nodes else None})

    def spans(self, job_id: str | None = None, since_us: float | None = None) -> pd.DataFrame:
        """Op-level spans (the SpanTable columns plus ingest ts) ordered by job, rank, start."""
        return self.query_df("""
            SELECT * FROM spans WHERE ($job IS NULL OR job_id = $job) AND ($since IS NULL OR start_us >= $since)
            ORDER BY job_id, rank, start_us""", {"job": job_id, "since": since_us})

    def jobs_seen(self) -> list[dict[str, Any]]:
        """Jobs seen in GPU samples or spans: nodes, GPUs, ranks, first and last time (ms)."""
        return self._records("""
            WITH rows AS (
                SELECT job_id, node, gpu_index, rank, epoch_ms(ts) AS t FROM gpu_samples WHERE job_id IS NOT NULL
                UNION ALL
                SELECT job_id, nullif(node, ''), NULL, rank, (start_us / 1000)::BIGINT FROM spans WHERE job_id <> '')
            SELECT job_id, count(DISTINCT node) AS nodes, count(DISTINCT (node, gpu_index))
                       FILTER (WHERE gpu_index IS NOT NULL) AS gpus,
                   count(DISTINCT rank) FILTER (WHERE rank >= 0) AS ranks, min(t) AS first_seen_ms,
                   max(t) AS last_seen_ms
            FROM rows GROUP BY job_id ORDER BY job_id""")

    def sample_jobs(self) -> list[dict[str, Any]]:
        """Jobs named on GPU samples: their nodes (sorted list), GPUs, ranks, first and last sample (ms)."""
        return self._records("""
            SELECT job_id, list_sort(list(DISTINCT node)) AS nodes, count(DISTINCT (node, gpu_index)) AS gpus,
                   count(DISTINCT rank) FILTER (WHERE rank >= 0) AS ranks, epoch_ms(min(ts)) AS first_seen_ms,
                   epoch_ms(max(ts)) AS last_seen_ms
            FROM gpu_samples WHERE job_id IS NOT NULL AND job_id <> '' GROUP BY job_id ORDER BY job_id""")

    def has_table(self, name: str) -> bool:
        """Whether ``name`` exists yet (tables that features create on first use, e.g. job_timelines)."""
        return bool(self._records("SELECT 1 FROM duckdb_tables() WHERE table_name = $name", {"name": name}))

    def queue_depth(self) -> int:
        """Batches and tasks waiting for the writer."""
        return self._queue.qsize()

    def xid_counts(self) -> list[dict[str, Any]]:
        """XID events stored per node, GPU and code."""
        return self._records(f"""
            SELECT node, gpu_index, code, count(*) AS n FROM events WHERE kind = '{event_kinds.XID}'
            GROUP BY node, gpu_index, code ORDER BY node, gpu_index, code""")

    def agent_health(self) -> list[dict[str, Any]]:
        """Per node: batches its agent dropped from a full spool (``spool_dropped`` events) and last batch (ms)."""
        return self._records(f"""
            WITH d AS (SELECT node, sum(code)::BIGINT AS dropped FROM events
                       WHERE kind = '{event_kinds.SPOOL_DROPPED}' GROUP BY node)
            SELECT a.node, coalesce(max(d.dropped), 0)::BIGINT AS spool_dropped,
                   epoch_ms(max(a.last_seen)) AS last_seen_ms
            FROM agents a LEFT JOIN d USING (node) GROUP BY a.node ORDER BY a.node""")

    def count(self, table: str) -> int:
        """Rows in one of the store's tables."""
        if table not in {_table_name(s) for s in DDL}:
            raise UserError(f"unknown table {table!r}")
        return int(self.query_df(f"SELECT count(*) AS n FROM {table}")["n"].iloc[0])


# ------------------------------------------------------------------------------ columnar conversion
def _insert_group(con: duckdb.DuckDBPyConnection, group: list[ColumnarBatch],
                  inventory: dict[tuple[str, int], tuple[bytes, pb.GpuInfo]]) -> None:
    """Insert a group of fresh batches (and the ``inventory`` entries to upsert): one Arrow table and one
    INSERT ... SELECT per target table."""
    now = ms_to_datetime(int(time.time() * 1000))
    batches = [b.message for b in group]
    tables = {
        "gpu_samples": _gpu_samples_table(group),
        "host_samples": _host_samples_table(group),
        "events": _events_table(batches),
        "spans": _spans_table(batches, now),
        "ingested": pa.table({
            "agent_id": [b.agent_id for b in batches], "sequence": pa.array([b.sequence for b in batches], pa.uint64()),
            "ingested_at": pa.array([now] * len(batches), pa.timestamp("ms")),
        }),
    }
    for name, table in tables.items():
        if table is not None and table.num_rows:
            _insert_arrow(con, f"INSERT INTO {name} BY NAME SELECT * FROM {{view}}", table)
    _insert_arrow(con, """
        INSERT INTO gpus BY NAME SELECT * FROM {view} ON CONFLICT (node, "index") DO UPDATE SET
            uuid = excluded.uuid, name = excluded.name, pci_bus_id = excluded.pci_bus_id, serial = excluded.serial,
            memory_total_bytes = excluded.memory_total_bytes, architecture = excluded.architecture,
            gpm_supported = excluded.gpm_supported, last_seen = excluded.last_seen""", _gpus_table(inventory, now))
    _insert_arrow(con, """
        INSERT INTO agents BY NAME SELECT * FROM {view} ON CONFLICT (agent_id) DO UPDATE SET
            node = excluded.node, last_sequence = greatest(agents.last_sequence, excluded.last_sequence),
            last_seen = excluded.last_seen""", _agents_table(batches, now))


def _insert_arrow(con: duckdb.DuckDBPyConnection, sql: str, table: pa.Table) -> None:
    if not table.num_rows:
        return
    con.register("_incoming", table)
    try:
        con.execute(sql.format(view="_incoming"))
    finally:
        con.unregister("_incoming")


def _value_arrays(matrices: list[np.ndarray], names: Sequence[str]) -> dict[str, pa.Array]:
    """One nullable Arrow column per field from the batches' (rows x fields) matrices: NaN becomes NULL."""
    by_field = np.concatenate(matrices).T.copy() if matrices else np.empty((len(names), 0))
    missing = np.isnan(by_field)
    return {name: pa.array(by_field[i], mask=missing[i]) for i, name in enumerate(names)}


def _node_column(nodes: list[str], counts: list[int]) -> pa.DictionaryArray:
    """The node name of every row, dictionary-encoded: one string per batch, not per row."""
    dictionary, codes = np.unique(np.asarray(nodes, dtype=object).astype(str), return_inverse=True)
    return pa.DictionaryArray.from_arrays(pa.array(np.repeat(codes.astype(np.int32), counts)), pa.array(dictionary))


def _per_row_ints(blocks: Sequence[Any], attr: str, counts: list[int], total: int) -> pa.Array:
    """An int column sent per row (rank, local_rank); -1 or an omitted column becomes NULL."""
    values = np.fromiter(
        _chain(getattr(s, attr) if len(getattr(s, attr)) else itertools.repeat(-1, n) for s, n in zip(blocks, counts)),
        np.int32, total)
    return pa.array(values, mask=values < 0)


def _gpu_samples_table(batches: list[ColumnarBatch]) -> pa.Table:
    blocks = [(b.message.node.node, s) for b in batches for s in b.message.samples]
    samples = [s for _, s in blocks]
    counts = [len(s.ts_ms) for s in samples]
    total = sum(counts)
    job_ids = pa.array(list(_chain(s.job_id if len(s.job_id) else itertools.repeat("", n)
                                   for s, n in zip(samples, counts))), pa.string())
    columns = {
        "node": _node_column([node for node, _ in blocks], counts),
        "gpu_index": pa.array(np.repeat(np.fromiter((s.gpu_index for s in samples), np.int32, len(samples)), counts)),
        "ts": pa.array(np.fromiter(_chain(s.ts_ms for s in samples), np.int64, total), pa.timestamp("ms")),
        "job_id": pc.if_else(pc.equal(job_ids, ""), None, job_ids),
        "rank": _per_row_ints(samples, "rank", counts, total),
        "local_rank": _per_row_ints(samples, "local_rank", counts, total),
    }
    columns.update(_value_arrays([b.gpu_values for b in batches], fields.GPU_FIELD_NAMES))
    return pa.table(columns)


def _host_samples_table(batches: list[ColumnarBatch]) -> pa.Table:
    counts = [len(b.message.host.ts_ms) for b in batches]
    total = sum(counts)
    columns = {
        "node": _node_column([b.message.node.node for b in batches], counts),
        "ts": pa.array(np.fromiter(_chain(b.message.host.ts_ms for b in batches), np.int64, total),
                       pa.timestamp("ms")),
    }
    columns.update(_value_arrays([b.host_values for b in batches], fields.HOST_FIELD_NAMES))
    return pa.table(columns)


def _events_table(batches: list[pb.TelemetryBatch]) -> pa.Table:
    rows = [(b.node.node, e) for b in batches for e in b.events]
    return pa.table({
        "node": pa.array([node for node, _ in rows], pa.string()),
        "gpu_index": pa.array([e.gpu_index for _, e in rows], pa.int32()),
        "ts": pa.array([e.ts_ms for _, e in rows], pa.timestamp("ms")),
        "kind": pa.array([e.kind for _, e in rows], pa.string()),
        "code": pa.array([e.code for _, e in rows], pa.int64()),
        "message": pa.array([e.message for _, e in rows], pa.string()),
        "attrs": pa.array([json.dumps(dict(e.attrs)) for _, e in rows], pa.string()),
    })


def _spans_table(batches: list[pb.TelemetryBatch], now: dt.datetime) -> pa.Table:
    counts = [len(b.spans.start_us) for b in batches]
    total = sum(counts)
    columns: dict[str, pa.Array] = {}
    for name, (dtype, default) in _SPAN_COLUMNS.items():
        parts = [getattr(b.spans, name) if len(getattr(b.spans, name)) else itertools.repeat(default, n)
                 for b, n in zip(batches, counts)]
        columns[name] = pa.array(list(_chain(parts)), dtype)
    columns["ts"] = pa.array([now] * total, pa.timestamp("ms"))
    return pa.table(columns)


def _gpus_table(inventory: dict[tuple[str, int], tuple[bytes, pb.GpuInfo]], now: dt.datetime) -> pa.Table:
    """Inventory rows to upsert, one per (node, GPU index)."""
    latest = {key: gpu for key, (_, gpu) in inventory.items()}
    table = {"node": [node for node, _ in latest], "index": pa.array([i for _, i in latest], pa.int32())}
    for name in _GPU_INFO_COLUMNS:
        table[name] = [getattr(g, name) for g in latest.values()]
    table["memory_total_bytes"] = pa.array(table["memory_total_bytes"], pa.uint64())
    table["first_seen"] = table["last_seen"] = pa.array([now] * len(latest), pa.timestamp("ms"))
    return pa.table(table)


def _agents_table(batches: list[pb.TelemetryBatch], now: dt.datetime) -> pa.Table:
    last: dict[str, tuple[str, int]] = {}
    for b in batches:
        node, seq = last.get(b.agent_id, (b.node.node, 0))
        last[b.agent_id] = (b.node.node, max(seq, b.sequence))
    return pa.table({
        "agent_id": list(last), "node": [node for node, _ in last.values()],
        "last_sequence": pa.array([seq for _, seq in last.values()], pa.uint64()),
        "last_seen": pa.array([now] * len(last), pa.timestamp("ms")),
    })


# ----------------------------------------------------------------------------------------- helpers
def _stored_keys(con: duckdb.DuckDBPyConnection, keys: list[tuple[str, int]]) -> set[tuple[str, int]]:
    """The (agent_id, sequence) pairs among ``keys`` that the ingested table already holds."""
    if not keys:
        return set()
    probe = pa.table({"agent_id": [k[0] for k in keys], "sequence": pa.array([k[1] for k in keys], pa.uint64())})
    con.register("_probe", probe)
    try:
        rows = con.execute(
            "SELECT DISTINCT i.agent_id, i.sequence FROM ingested i JOIN _probe p USING (agent_id, sequence)"
        ).fetchall()
    finally:
        con.unregister("_probe")
    return {(agent, int(seq)) for agent, seq in rows}


def _delete_before(con: duckdb.DuckDBPyConnection, cutoff: dt.datetime) -> dict[str, int]:
    deleted = {}
    con.begin()
    try:
        for table, column in RETENTION.items():
            deleted[table] = int(con.execute(f"DELETE FROM {table} WHERE {column} < ?", [cutoff]).fetchone()[0])
        con.commit()
    except BaseException:
        con.rollback()
        raise
    log.info("retention before %s deleted %s", cutoff.isoformat(), deleted)
    return deleted


def _resolve(future: Future, fn: Callable, *args: Any) -> None:
    try:
        _settle(future, fn(*args))
    except Exception as exc:
        _settle(future, exception=exc)


def _settle(future: Future, result: Any = None, exception: BaseException | None = None) -> None:
    """Resolve ``future`` unless its waiter cancelled it (a client that went away): the writer must go on."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled: what it waited for is committed all the same
        pass


def ms_to_datetime(ms: int) -> dt.datetime:
    """Epoch ms as a naive UTC datetime (DuckDB TIMESTAMP has no zone)."""
    return dt.datetime(1970, 1, 1) + dt.timedelta(milliseconds=ms)


def _ms_or_none(ms: int | None) -> dt.datetime | None:
    return None if ms is None else ms_to_datetime(ms)


def _table_name(statement: str) -> str:
    return statement.split("EXISTS", 1)[1].split("(", 1)[0].strip()


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
