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
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from gpuwatch import events as event_kinds
from gpuwatch import fields
from gpuwatch.collector.exporter import LatencyHistogram
from gpuwatch.errors import AgentIdConflict, NotFound, UserError
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
    agent_id VARCHAR NOT NULL, sequence UBIGINT NOT NULL, ingested_at TIMESTAMP NOT NULL, fingerprint VARCHAR)""",
    """CREATE TABLE IF NOT EXISTS spans (
    job_id VARCHAR, rank INTEGER, step BIGINT, kind VARCHAR, name VARCHAR, start_us DOUBLE, dur_us DOUBLE,
    process_group VARCHAR, seq BIGINT, bytes BIGINT, world_size INTEGER, node VARCHAR, peer INTEGER,
    ts TIMESTAMP NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS alerts (
    id VARCHAR PRIMARY KEY, alertname VARCHAR NOT NULL, subject VARCHAR NOT NULL, status VARCHAR NOT NULL,
    starts_at TIMESTAMP NOT NULL, ends_at TIMESTAMP, updated_at TIMESTAMP NOT NULL, doc JSON NOT NULL)""",
]

# Run after DDL on every open: columns added since a table was first created.
MIGRATIONS: list[str] = [
    # What a batch held, in brief (_fingerprint): a resend matches it, a cloned agent's batch does not.
    "ALTER TABLE ingested ADD COLUMN IF NOT EXISTS fingerprint VARCHAR",
]

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
_HOST_FIELD_INDEX = {name: i for i, name in enumerate(fields.HOST_FIELD_NAMES)}
_GPU_INFO_COLUMNS = ("uuid", "name", "pci_bus_id", "serial", "memory_total_bytes", "architecture", "gpm_supported")


@dataclass(frozen=True)
class WriteResult:
    """What the writer did with one batch: stored it, or recognised it as already stored."""

    agent_id: str
    sequence: int
    duplicate: bool


@dataclass
class _Pending:
    batch: pb.TelemetryBatch
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
        for statement in [*DDL, *MIGRATIONS]:
            self._con.execute(statement)
        if path != ":memory:":
            _private(path)
        self.path = path
        self.retention_days = retention_days
        self._retention_interval_s = retention_interval_s
        self._max_group = max_group_batches
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued_batches)
        self._cursor_lock = threading.Lock()
        self._closed = False
        self.counters = IngestCounters()
        self._last_sequence: dict[str, int] = dict(
            self._con.execute("SELECT agent_id, last_sequence FROM agents").fetchall()
        )
        self._writer = threading.Thread(target=self._write_loop, name="store-writer", daemon=True)
        self._writer.start()

    # ----------------------------------------------------------------------------------------- writes
    def submit(self, batch: pb.TelemetryBatch) -> Future:
        """Queue a validated batch; the future resolves to a :class:`WriteResult` once it is committed.

        Blocks while the queue is full, which pushes back on the senders instead of growing memory.
        """
        if self._closed:
            raise StoreClosed("the store is closed")
        pending = _Pending(batch)
        self._queue.put(pending)
        return pending.future

    def write(self, batch: pb.TelemetryBatch, timeout: float | None = None) -> WriteResult:
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
            log.error("batch %d of agent %s cannot be stored: %s%s", group[0].batch.sequence, group[0].batch.agent_id,
                      _first_line(exc), _space_hint(self.path, exc))
            group[0].future.set_exception(exc)
            return
        duplicates = sum(isinstance(r, WriteResult) and r.duplicate for r in results)
        self.counters.committed([p.batch for p in fresh], duplicates, time.perf_counter() - started)
        for p in fresh:
            self._last_sequence[p.batch.agent_id] = max(self._last_sequence.get(p.batch.agent_id, 0), p.batch.sequence)
        for p, result in zip(group, results):
            if isinstance(result, AgentIdConflict):
                p.future.set_exception(result)
            else:
                p.future.set_result(result)

    def _commit(self, batches: list[pb.TelemetryBatch]) -> None:
        """Insert ``batches`` in one transaction; nothing of them is stored if any part fails."""
        if not batches:
            return
        self._con.begin()
        try:
            _insert_group(self._con, batches)
            self._con.commit()
        except BaseException:
            _rollback_keeping_cause(self._con)
            raise

    def _deduplicate(self, group: list[_Pending]) -> tuple[list[WriteResult], list[_Pending]]:
        """Mark batches stored before, or earlier in the same group, as duplicates; return the rest to write."""
        maybe_stored = [p for p in group if p.batch.sequence <= self._last_sequence.get(p.batch.agent_id, 0)]
        stored = _stored_keys(self._con, [(p.batch.agent_id, p.batch.sequence) for p in maybe_stored])
        results, fresh = [], []
        for p in group:
            key = (p.batch.agent_id, p.batch.sequence)
            duplicate = key in stored
            fingerprint = _fingerprint(p.batch)
            if duplicate and stored[key] is not None and fingerprint != stored[key]:
                results.append(AgentIdConflict(*key))  # another agent's batch under this id: not a resend
                continue
            stored.setdefault(key, fingerprint)
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
            WITH d AS (SELECT node, greatest(sum(code), max(TRY_CAST(attrs->>'dropped_total' AS BIGINT)))::BIGINT
                              AS dropped
                       FROM events WHERE kind = '{event_kinds.SPOOL_DROPPED}' GROUP BY node)
            SELECT a.node, coalesce(max(d.dropped), 0)::BIGINT AS spool_dropped,
                   epoch_ms(max(a.last_seen)) AS last_seen_ms
            FROM agents a LEFT JOIN d USING (node) GROUP BY a.node ORDER BY a.node""")

    def count(self, table: str) -> int:
        """Rows in one of the store's tables."""
        if table not in {_table_name(s) for s in DDL}:
            raise UserError(f"unknown table {table!r}")
        return int(self.query_df(f"SELECT count(*) AS n FROM {table}")["n"].iloc[0])


# ------------------------------------------------------------------------------ columnar conversion
def _insert_group(con: duckdb.DuckDBPyConnection, batches: list[pb.TelemetryBatch]) -> None:
    """Insert a group of fresh batches: one Arrow table and one INSERT ... SELECT per target table."""
    now = ms_to_datetime(int(time.time() * 1000))
    tables = {
        "gpu_samples": _gpu_samples_table(batches),
        "host_samples": _host_samples_table(batches),
        "events": _events_table(batches),
        "spans": _spans_table(batches, now),
        "ingested": pa.table({
            "agent_id": [b.agent_id for b in batches], "sequence": pa.array([b.sequence for b in batches], pa.uint64()),
            "ingested_at": pa.array([now] * len(batches), pa.timestamp("ms")),
            "fingerprint": [_fingerprint(b) for b in batches],
        }),
    }
    for name, table in tables.items():
        if table is not None and table.num_rows:
            _insert_arrow(con, f"INSERT INTO {name} BY NAME SELECT * FROM {{view}}", table)
    _insert_arrow(con, """
        INSERT INTO gpus BY NAME SELECT * FROM {view} ON CONFLICT (node, "index") DO UPDATE SET
            uuid = excluded.uuid, name = excluded.name, pci_bus_id = excluded.pci_bus_id, serial = excluded.serial,
            memory_total_bytes = excluded.memory_total_bytes, architecture = excluded.architecture,
            gpm_supported = excluded.gpm_supported, last_seen = excluded.last_seen""", _gpus_table(batches, now))
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


def _values_matrix(blocks: list[tuple[int, Any]], field_index: dict[str, int]) -> np.ndarray:
    """Stack blocks of (rows, packed columns) into a (fields x rows) float matrix, NaN where not sent."""
    total = sum(n for n, _ in blocks)
    out = np.full((len(field_index), total), np.nan)
    layouts: dict[tuple[str, ...], np.ndarray] = {}
    start = 0
    for n, columns in blocks:
        names = tuple(c.field for c in columns)
        rows = layouts.get(names)
        if rows is None:
            rows = layouts[names] = np.fromiter((field_index[f] for f in names), np.intp, len(names))
        if names and n:
            flat = np.fromiter(_chain(c.values for c in columns), np.float64, n * len(names))
            out[rows, start:start + n] = flat.reshape(len(names), n)
        start += n
    return out


def _value_arrays(matrix: np.ndarray, names: Sequence[str]) -> dict[str, pa.Array]:
    """One nullable Arrow column per field: NaN (not sampled) becomes NULL, and so does ±inf (a broken reading:
    no gauge or counter is infinite, and stored it would turn averages into ±inf and JSON into non-JSON)."""
    missing = ~np.isfinite(matrix)
    return {name: pa.array(matrix[i], mask=missing[i]) for i, name in enumerate(names)}


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


def _gpu_samples_table(batches: list[pb.TelemetryBatch]) -> pa.Table:
    blocks = [(b.node.node, s) for b in batches for s in b.samples]
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
    matrix = _values_matrix([(n, s.columns) for s, n in zip(samples, counts)], _GPU_FIELD_INDEX)
    columns.update(_value_arrays(matrix, fields.GPU_FIELD_NAMES))
    return pa.table(columns)


def _host_samples_table(batches: list[pb.TelemetryBatch]) -> pa.Table:
    counts = [len(b.host.ts_ms) for b in batches]
    total = sum(counts)
    columns = {
        "node": _node_column([b.node.node for b in batches], counts),
        "ts": pa.array(np.fromiter(_chain(b.host.ts_ms for b in batches), np.int64, total), pa.timestamp("ms")),
    }
    matrix = _values_matrix([(n, b.host.columns) for b, n in zip(batches, counts)], _HOST_FIELD_INDEX)
    columns.update(_value_arrays(matrix, fields.HOST_FIELD_NAMES))
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


def _gpus_table(batches: list[pb.TelemetryBatch], now: dt.datetime) -> pa.Table:
    """The newest inventory entry per (node, GPU index) of the group (one upsert per key per transaction)."""
    latest = {(b.node.node, g.index): g for b in batches for g in b.gpus}
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
def _stored_keys(con: duckdb.DuckDBPyConnection, keys: list[tuple[str, int]]) -> dict[tuple[str, int], str | None]:
    """The (agent_id, sequence) pairs among ``keys`` that the ingested table already holds, with fingerprints."""
    if not keys:
        return {}
    probe = pa.table({"agent_id": [k[0] for k in keys], "sequence": pa.array([k[1] for k in keys], pa.uint64())})
    con.register("_probe", probe)
    try:
        rows = con.execute(
            "SELECT i.agent_id, i.sequence, any_value(i.fingerprint) FROM ingested i JOIN _probe p USING (agent_id, sequence)"
            " GROUP BY ALL").fetchall()
    finally:
        con.unregister("_probe")
    return {(agent, int(seq)): fingerprint for agent, seq, fingerprint in rows}


def _fingerprint(batch: pb.TelemetryBatch) -> str:
    """Node, row and event counts and the first and last sample time: the same for a resend (or a rebuild of
    the same data), different for another agent's batch under the same (agent id, sequence)."""
    times = [t for s in batch.samples for t in (min(s.ts_ms, default=0), max(s.ts_ms, default=0))]
    times += [min(batch.host.ts_ms, default=0), max(batch.host.ts_ms, default=0)]
    times += [min((e.ts_ms for e in batch.events), default=0), min(batch.spans.start_us, default=0)]
    rows = sum(len(s.ts_ms) for s in batch.samples)
    return (f"{batch.node.node}|{rows}|{len(batch.host.ts_ms)}|{len(batch.events)}|{len(batch.spans.start_us)}|"
            f"{min(times)}|{max(times)}")


def _delete_before(con: duckdb.DuckDBPyConnection, cutoff: dt.datetime) -> dict[str, int]:
    deleted = {}
    con.begin()
    try:
        for table, column in RETENTION.items():
            deleted[table] = int(con.execute(f"DELETE FROM {table} WHERE {column} < ?", [cutoff]).fetchone()[0])
        con.commit()
    except BaseException:
        _rollback_keeping_cause(con)
        raise
    log.info("retention before %s deleted %s", cutoff.isoformat(), deleted)
    return deleted


def _rollback_keeping_cause(con: duckdb.DuckDBPyConnection) -> None:
    """Roll back after a failed write; a failure that already ended the transaction (a full disk does) makes
    the rollback fail too, and that second error must not hide the first, which names the cause."""
    try:
        con.rollback()
    except duckdb.Error as exc:
        log.debug("rollback after a failed write: %s", _first_line(exc))


def _space_hint(path: str, exc: BaseException) -> str:
    """" (the disk ... is full ...)" when the store's disk has no room left, else ""."""
    if path == ":memory:":
        return ""
    try:
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    except OSError:
        return ""
    if "No space left" in str(exc) or free < 16 * 2**20:
        return f" (the disk holding {path} is full: {free} bytes free; free space there and the agents resend)"
    return ""


def _private(path: str) -> None:
    """Telemetry and alert history are for the collector's user only (0600), whatever the umask."""
    for name in (path, path + ".wal"):
        try:
            os.chmod(name, 0o600)
        except FileNotFoundError:
            pass


def _resolve(future: Future, fn: Callable, *args: Any) -> None:
    try:
        future.set_result(fn(*args))
    except Exception as exc:
        future.set_exception(exc)


def ms_to_datetime(ms: int) -> dt.datetime:
    """Epoch ms as a naive UTC datetime (DuckDB TIMESTAMP has no zone)."""
    return dt.datetime(1970, 1, 1) + dt.timedelta(milliseconds=ms)


def _ms_or_none(ms: int | None) -> dt.datetime | None:
    return None if ms is None else ms_to_datetime(ms)


def _table_name(statement: str) -> str:
    return statement.split("EXISTS", 1)[1].split("(", 1)[0].strip()


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
