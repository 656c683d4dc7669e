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
import shutil
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from gpuwatch.core import fields
from gpuwatch.collector.store import owner_tables, rollups
from gpuwatch.collector.store.dialect import DUCKDB, ms_to_datetime
from gpuwatch.collector.store.base import STEP_MARK_KINDS, StoreDamaged
from gpuwatch.collector.store.engine import EngineStore, StoreOptions
from gpuwatch.collector.store.queries import check_fields
from gpuwatch.collector.store.writer import (GroupWriter, IngestCounters, StoreClosed, WriteResult,  # noqa: F401
                                             fingerprint)
from gpuwatch.core.batches import check_name_lengths
from gpuwatch.core.columnar import ColumnarBatch
from gpuwatch.core.errors import UserError
from gpuwatch.core.spans import SPAN_COLUMNS, SPAN_UNSET, span_arrow_schema
from gpuwatch.v1 import telemetry_pb2 as pb

log = logging.getLogger(__name__)

# the kinds gpuwatch/core/events.py defines (its upper-case string constants): the wire contract of Event.kind

_chain = itertools.chain.from_iterable


def _value_columns(names: Iterable[str]) -> str:
    return ",\n    ".join(f"{name} DOUBLE" for name in names)


def _span_columns() -> str:
    types = {"string": "VARCHAR", "int32": "INTEGER", "int64": "BIGINT", "double": "DOUBLE"}
    return ", ".join(f"{c.name} {types[c.type]}" for c in SPAN_COLUMNS)


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
    f"""CREATE TABLE IF NOT EXISTS spans ({_span_columns()}, ts TIMESTAMP NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS alerts (
    id VARCHAR PRIMARY KEY, alertname VARCHAR NOT NULL, subject VARCHAR NOT NULL, status VARCHAR NOT NULL,
    starts_at TIMESTAMP NOT NULL, ends_at TIMESTAMP, updated_at TIMESTAMP NOT NULL, doc JSON NOT NULL)""",
    # the step marks ("step" and "end" span rows) of every job: kept as long as samples, while the raw spans
    # are trimmed to a window (steps, step rate and finished ranks over a job's whole life come from here)
    """CREATE TABLE IF NOT EXISTS job_steps (
    job_id VARCHAR, rank INTEGER, step BIGINT, kind VARCHAR, start_us DOUBLE, dur_us DOUBLE, world_size INTEGER,
    node VARCHAR, ts TIMESTAMP NOT NULL)""",
    # per-step efficiency of live jobs (category -> us), written by the jobs monitor from the spans it analysed
    """CREATE TABLE IF NOT EXISTS step_breakdowns (
    job_id VARCHAR NOT NULL, rank INTEGER NOT NULL, step BIGINT, category VARCHAR NOT NULL, us DOUBLE NOT NULL,
    ts TIMESTAMP NOT NULL)""",
    # submitted traces (one compact timeline per job and rank) and the breakdowns computed from them
    """CREATE TABLE IF NOT EXISTS job_timelines (
    job_id VARCHAR NOT NULL, rank INTEGER NOT NULL, filename VARCHAR, timeline BLOB NOT NULL,
    submitted_at TIMESTAMP NOT NULL, PRIMARY KEY (job_id, rank))""",
    """CREATE TABLE IF NOT EXISTS breakdowns (
    job_id VARCHAR NOT NULL, source VARCHAR NOT NULL, rank INTEGER NOT NULL, step BIGINT, category VARCHAR NOT NULL,
    us DOUBLE NOT NULL, computed_at TIMESTAMP NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS breakdown_docs (
    job_id VARCHAR NOT NULL, source VARCHAR NOT NULL, doc JSON NOT NULL, computed_at TIMESTAMP NOT NULL,
    PRIMARY KEY (job_id, source))""",
    # who runs the once-per-cluster work (scoring, jobs monitor, alert delivery) until when (epoch ms)
    """CREATE TABLE IF NOT EXISTS leases (
    name VARCHAR PRIMARY KEY, holder VARCHAR NOT NULL, expires_ms BIGINT NOT NULL)""",
]

# the tiers of GPU samples: per-minute rollups and the raw cutoff (collector/store/rollups.py)
DDL.extend(rollups.duckdb_ddl())
# GPU ownership intervals folded from the gpu_owner events (collector/store/owner_tables.py)
DDL.extend(owner_tables.duckdb_ddl())

# Run after DDL on every open: columns added since a table was first created.
MIGRATIONS: list[str] = [
    # What a batch held, in brief (_fingerprint): a resend matches it, a cloned agent's batch does not.
    "ALTER TABLE ingested ADD COLUMN IF NOT EXISTS fingerprint VARCHAR",
]

# Tables that retention trims, with the timestamp column it compares.
RETENTION: dict[str, str] = {
    "gpu_samples": "ts", "host_samples": "ts", "events": "ts", "spans": "ts", "ingested": "ingested_at",
    "job_steps": "ts", "step_breakdowns": "ts",
}

# SpanTable column (gpuwatch.core.spans) -> (Arrow type, value used when a batch leaves the column empty).
_SPAN_COLUMNS: dict[str, tuple[pa.DataType, Any]] = {f.name: (f.type, SPAN_UNSET[f.name]) for f in span_arrow_schema()}

_GPU_INFO_COLUMNS = ("uuid", "name", "pci_bus_id", "serial", "memory_total_bytes", "architecture", "gpm_supported")


class DuckDBStore(EngineStore):
    """One DuckDB database file (or ":memory:"), written by one writer thread, read through cursors."""

    dialect = DUCKDB

    unstorable_errors: tuple[type[BaseException], ...] = (duckdb.ConversionException, duckdb.OutOfRangeException,
                                                          duckdb.InvalidInputException, duckdb.ConstraintException)

    def __init__(self, path: str, **options: Any) -> None:
        """``options``: :class:`~gpuwatch.collector.store.engine.StoreOptions`."""
        opts = StoreOptions(**options)
        try:
            self._con = duckdb.connect(path, config={"memory_limit": opts.memory_limit})
        except duckdb.IOException as exc:
            raise UserError(f"cannot open store {path}: {_first_line(exc)}") from None
        except duckdb.Error as exc:  # an invalid memory_limit: DuckDB names the setting
            raise UserError(f"cannot open store {path}: {_first_line(exc)}") from None
        if path != ":memory:":
            _check_size(self._con, path)
        for statement in [*DDL, *MIGRATIONS]:
            self._con.execute(statement)
        if path != ":memory:":
            _private(path)
        self.path = path
        self.damaged = ""  # why the file was found unreadable since it opened; then no batch is taken
        self._cursor_lock = threading.Lock()
        self._owner_table = owner_tables.DuckDBOwners(self.query_df)
        super().__init__(dict(self._con.execute("SELECT agent_id, last_sequence FROM agents").fetchall()), opts)

    # ----------------------------------------------------------------------------------------- writes
    def _delete_expired(self, now_ms: int | None, timeout: float | None) -> dict[str, int]:
        """Delete rows older than ``retention_days`` before ``now_ms``, and raw GPU samples past
        ``raw_retention_s`` once rolled up; return rows deleted per table."""
        tiered = self.run_write(lambda con: self._expire_tiers(now_ms), timeout) if self.raw_retention_s else {}
        if not self.retention_days:
            return tiered
        cutoff = ms_to_datetime(self._retention_cutoff_ms(now_ms))
        deleted = self.run_write(lambda con: _delete_before(con, cutoff), timeout)
        return {**deleted, **{k: deleted.get(k, 0) + v for k, v in tiered.items()}}

    def build_rollups(self, timeout: float | None = None) -> None:
        """Bring the rollups up to date with every batch committed so far (the writer does it every
        span-trim interval; tests and benchmarks call this)."""
        self.run_write(lambda con: self._build_rollups(), timeout)

    def _build_rollups(self) -> None:
        if not self.raw_retention_s:
            return
        minutes = self._dirty.take(rollups.duckdb_cutoff(self._con))
        if minutes is None:
            return
        self._con.begin()
        try:
            rollups.duckdb_build(self._con, *minutes)
            self._con.commit()
        except BaseException:
            _rollback_keeping_cause(self._con)
            raise

    def build_owner_intervals(self, timeout: float | None = None) -> None:
        """Fold every ``gpu_owner`` event committed so far into the ``owner_intervals`` table (the writer does
        it with the rollups; tests and benchmarks call this)."""
        self.run_write(lambda con: self._build_owner_intervals(), timeout)

    def _build_owner_intervals(self) -> None:
        floor = self._retention_cutoff_ms() + owner_tables.LOOKBACK_MS if self.retention_days else None
        owner_tables.maintain(self._owner_table, self.event_attrs, self._owners_pending, floor,
                              lambda start, rows, mark: owner_tables.duckdb_replace(self._con, start, rows, mark))

    def owner_intervals(self, since_ms: int | None = None) -> pd.DataFrame:
        """The GPU ownership intervals holding any time from ``since_ms`` (owner_tables.intervals)."""
        return owner_tables.intervals(self._owner_table, self.event_attrs, self._owners_pending, since_ms)

    def _expire_tiers(self, now_ms: int | None) -> dict[str, int]:
        now = int(time.time() * 1000) if now_ms is None else now_ms
        assert self.raw_retention_s
        cutoff = rollups.floor_minute(now - int(self.raw_retention_s * 1000))
        keep = now - int(self.rollup_retention_s * 1000) if self.rollup_retention_s else None
        self._build_rollups()
        self._con.begin()
        try:
            deleted = rollups.duckdb_expire(self._con, cutoff, keep)
            if keep is not None:  # ownership intervals outlive the events, as long as the rollups
                deleted[owner_tables.TABLE] = owner_tables.duckdb_expire(self._con, keep)
            self._con.commit()
        except BaseException:
            _rollback_keeping_cause(self._con)
            raise
        log.info("tiered retention: raw GPU samples before %s rolled up and deleted %s",
                 ms_to_datetime(cutoff).isoformat(), deleted)
        return deleted

    def trim_spans(self, timeout: float | None = None) -> int:
        """Delete the raw spans older than ``span_retention_s`` before their job's newest span (the job's own
        clock, so replayed or simulated time is trimmed like live time); return how many were deleted."""
        retention = self.span_retention_s
        if not retention:
            return 0
        return self.run_write(lambda con: _trim_spans(con, retention), timeout)

    def _clean_up(self, retention: bool, trim: bool) -> None:
        self._build_rollups()
        self._build_owner_intervals()
        if retention and self.raw_retention_s:
            self._expire_tiers(None)
        if retention and self.retention_days:
            _delete_before(self._con, ms_to_datetime(self._retention_cutoff_ms()))
        if trim and self.span_retention_s:
            _trim_spans(self._con, self.span_retention_s)

    def _task_argument(self) -> duckdb.DuckDBPyConnection:
        return self._con

    def _close_engine(self) -> None:
        self._con.close()

    def _commit(self, batches: list[ColumnarBatch]) -> None:
        """Insert ``batches`` in one transaction; nothing of them is stored if any part fails."""
        if not batches:
            return
        if self.damaged:
            raise StoreDamaged(self.damaged)
        inventory = self._inventory.to_write(batches)
        self._owners_pending.note(batches)
        self._con.begin()
        try:
            _insert_group(self._con, batches, inventory)
            self._con.commit()
        except BaseException as exc:
            _rollback_keeping_cause(self._con)
            self._note_damage(exc)
            raise
        if self.raw_retention_s:
            self._dirty.note(batches)
        self._inventory.written(inventory)
        if self.path != ":memory:":
            _private(self.path)  # DuckDB recreates the WAL after each checkpoint, with the umask's mode

    def _stored_keys(self, keys: list[tuple[str, int]]) -> dict[tuple[str, int], str | None]:
        return _stored_keys(self._con, keys)

    def _failure_hint(self, exc: BaseException) -> str:
        return _space_hint(self.path, exc)

    # ------------------------------------------------------------------------------------------ reads
    def query_df(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> pd.DataFrame:
        """Run a read query on its own cursor and return a DataFrame (the generic entry for analyses)."""
        with self._cursor_lock:
            cur = self._con.cursor()
        try:
            return cur.execute(sql, params or []).df()
        except duckdb.IOException as exc:
            self._note_damage(exc)
            if self.damaged:
                raise StoreDamaged(self.damaged) from None
            raise
        finally:
            cur.close()

    def _note_damage(self, exc: BaseException) -> None:
        """Remember (and log once) that the file is unreadable when ``exc`` says so (a read past its end)."""
        if self.damaged or not isinstance(exc, duckdb.IOException) or "Could not read" not in str(exc):
            return
        self.damaged = (f"the store file {self.path} is damaged ({_first_line(exc)}); stop the collector and "
                        "restore it from a backup (agents keep their batches meanwhile)")
        log.error("%s", self.damaged)

    def _raw_cutoff_ms(self) -> int | None:
        with self._cursor_lock:
            cursor = self._con.cursor()
        try:
            return rollups.duckdb_cutoff(cursor)
        finally:
            cursor.close()

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

    def columns(self, table: str) -> list[str]:
        """The column names of one of the store's tables, in order."""
        self.count(table)  # names an unknown table
        return self.query_df(f"SELECT * FROM {table} LIMIT 0").columns.tolist()

    def count(self, table: str) -> int:
        """Rows in one of the store's tables."""
        if table not in {_table_name(s) for s in DDL}:
            raise UserError(f"unknown table {table!r}")
        return int(self.query_df(f"SELECT count(*) AS n FROM {table}")["n"].iloc[0])

    # ---- scoring ---------------------------------------------------------------------------------------
    def counter_drops(self, field: str, gpus: Sequence[tuple[str, int]], since_ms: int,
                      until_ms: int | None = None) -> pd.DataFrame:
        """Samples of ``gpus`` where the counter ``field`` went back (a driver reload restarts NVML's counters),
        between the two times: node, gpu_index, ts_ms."""
        check_fields([field])
        return self.query_df(f"""
            WITH c AS (
                SELECT node, gpu_index, ts, {field} AS value,
                       lag({field}) OVER (PARTITION BY node, gpu_index ORDER BY ts) AS before
                FROM gpu_samples WHERE list_contains($gpus, node || '/' || gpu_index)
                  AND ts >= $since AND ($until IS NULL OR ts <= $until))
            SELECT node, gpu_index, epoch_ms(ts) AS ts_ms FROM c WHERE value < before""",
            {"gpus": [f"{n}/{g}" for n, g in gpus], "since": ms_to_datetime(since_ms),
             "until": _ms_or_none(until_ms)})

    # ---- jobs ------------------------------------------------------------------------------------------
    def job_progress(self) -> pd.DataFrame:
        """Per job, from its step marks over its whole life: ranks, nodes (sorted list), world_size, steps
        (last finished step + 1), last_step_us (end of the last finished step) and finished (every rank
        sent its end mark)."""
        return self.query_df("""
            SELECT job_id, count(DISTINCT rank) AS ranks, list_sort(list(DISTINCT node)) AS nodes,
                   max(world_size) AS world_size,
                   coalesce(max(step) FILTER (WHERE kind = 'step' AND dur_us >= 0) + 1, 0) AS steps,
                   max(start_us + dur_us) FILTER (WHERE kind = 'step' AND dur_us >= 0) AS last_step_us,
                   count(DISTINCT rank) FILTER (WHERE kind = 'end') >= count(DISTINCT rank) AS finished
            FROM job_steps WHERE job_id <> '' GROUP BY job_id ORDER BY job_id""")

    def add_step_breakdowns(self, rows: pd.DataFrame) -> None:
        """Append per-step efficiency rows (job_id, rank, step, category, us)."""
        if len(rows):
            table = rows[["job_id", "rank", "step", "category", "us"]].assign(ts=_utc_now())
            self.run_write(lambda con: _insert_frame(con, "INSERT INTO step_breakdowns BY NAME SELECT * FROM {view}",
                                                     table))

    # ---- breakdowns of submitted traces ----------------------------------------------------------------
    def job_timelines(self, job_id: str) -> list[bytes]:
        """The job's submitted rank timelines (serialized), by rank."""
        df = self.query_df("SELECT timeline FROM job_timelines WHERE job_id = ? ORDER BY rank", [job_id])
        return [bytes(blob) for blob in df["timeline"]]

    def save_submission(self, job_id: str, timelines: pd.DataFrame, rows: pd.DataFrame, doc_json: str,
                        source: str) -> None:
        """Store submitted rank timelines (job_id, rank, filename, timeline) and the job's new breakdown,
        in one transaction."""
        timelines = timelines.assign(submitted_at=_utc_now())

        def write(con: duckdb.DuckDBPyConnection) -> None:
            con.begin()
            try:
                _insert_frame(con, "INSERT OR REPLACE INTO job_timelines BY NAME SELECT * FROM {view}", timelines)
                _replace_breakdown(con, job_id, source, rows, doc_json)
                con.commit()
            except BaseException:
                con.rollback()
                raise

        self.run_write(write)

    def save_breakdown(self, job_id: str, source: str, rows: pd.DataFrame, doc_json: str) -> None:
        """Replace the job's breakdown from ``source``: its rows (rank, step, category, us) and document."""
        self.run_write(lambda con: _replace_breakdown(con, job_id, source, rows, doc_json))

    # ---- alerts ----------------------------------------------------------------------------------------
    def upsert_alerts(self, rows: pd.DataFrame) -> None:
        """Insert or update alert rows (id, alertname, subject, status, starts_at, ends_at, updated_at, doc)."""
        if not len(rows):
            return
        self.run_write(lambda con: _insert_frame(con, """
            INSERT INTO alerts BY NAME SELECT * REPLACE (doc::JSON AS doc) FROM {view}
            ON CONFLICT (id) DO UPDATE SET status = excluded.status, ends_at = excluded.ends_at,
                updated_at = excluded.updated_at, doc = excluded.doc""", rows))

    # ---- leases ----------------------------------------------------------------------------------------
    def take_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        """Take or renew the lease ``name`` for ``ttl_s`` seconds; False while another holder's is unexpired.
        One DuckDB file has one collector, so this always succeeds unless a caller in it holds the lease."""
        now = int(time.time() * 1000)

        def write(con: duckdb.DuckDBPyConnection) -> bool:
            con.execute("""
                INSERT INTO leases VALUES ($name, $holder, $expires) ON CONFLICT (name) DO UPDATE
                SET holder = excluded.holder, expires_ms = excluded.expires_ms
                WHERE leases.holder = excluded.holder OR leases.expires_ms < $now""",
                        {"name": name, "holder": holder, "expires": now + int(ttl_s * 1000), "now": now})
            return con.execute("SELECT holder FROM leases WHERE name = ?", [name]).fetchall()[0][0] == holder

        return self.run_write(write)

    def release_lease(self, name: str, holder: str) -> None:
        """Give the lease up (a clean stop), so another collector takes over at once."""
        self.run_write(lambda con: con.execute("DELETE FROM leases WHERE name = ? AND holder = ?", [name, holder])
                       .fetchall())


# ------------------------------------------------------------------------------ columnar conversion
def batch_tables(group: list[ColumnarBatch], now: dt.datetime) -> dict[str, pa.Table]:
    """The rows a group of batches adds to each append-only table, as Arrow tables (both engines insert these)."""
    batches = [b.message for b in group]
    spans = _spans_table(batches, now)
    return {
        "gpu_samples": _gpu_samples_table(group),
        "host_samples": _host_samples_table(group),
        "events": _events_table(batches),
        "spans": spans,
        "job_steps": spans.filter(pc.is_in(spans["kind"], pa.array(STEP_MARK_KINDS))).select(
            ["job_id", "rank", "step", "kind", "start_us", "dur_us", "world_size", "node", "ts"]),
        "ingested": pa.table({
            "agent_id": [b.agent_id for b in batches], "sequence": pa.array([b.sequence for b in batches], pa.uint64()),
            "ingested_at": pa.array([now] * len(batches), pa.timestamp("ms")),
            "fingerprint": [fingerprint(b) for b in group],
        }),
    }


def _insert_group(con: duckdb.DuckDBPyConnection, group: list[ColumnarBatch],
                  inventory: dict[tuple[str, int], tuple[bytes, pb.GpuInfo]]) -> None:
    """Insert a group of fresh batches (and the ``inventory`` entries to upsert): one Arrow table and one
    INSERT ... SELECT per target table."""
    now = ms_to_datetime(int(time.time() * 1000))
    tables = batch_tables(group, now)
    batches = [b.message for b in group]
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


def _insert_arrow(con: duckdb.DuckDBPyConnection, sql: str, _incoming: pa.Table) -> None:
    """Run ``sql`` with ``{view}`` reading ``_incoming``. DuckDB finds the table as this function's local
    variable of that name (a replacement scan; no table of the store may be named so): registering and
    unregistering a view instead cost as much again as the INSERT itself, with the GIL held, for every table
    of every group."""
    if _incoming.num_rows:
        con.execute(sql.format(view="_incoming"))


def _value_arrays(matrices: list[np.ndarray], names: Sequence[str]) -> dict[str, pa.Array]:
    """One nullable Arrow column per field from the batches' (rows x fields) matrices: NaN becomes NULL
    (not sampled, or ±inf, which gpuwatch.core.columnar turned into NaN: no gauge or counter is infinite)."""
    by_field = np.concatenate(matrices).T.copy() if matrices else np.empty((len(names), 0))
    missing = np.isnan(by_field)
    return {name: pa.array(by_field[i], mask=missing[i]) for i, name in enumerate(names)}


def _node_column(nodes: list[str], counts: list[int]) -> pa.DictionaryArray:
    """The node name of every row, dictionary-encoded: one string per batch, not per row."""
    dictionary, codes = np.unique(np.asarray(nodes, dtype=object).astype(str), return_inverse=True)
    return pa.DictionaryArray.from_arrays(pa.array(np.repeat(codes.astype(np.int32), counts)), pa.array(dictionary))


def _per_row_ints(blocks: Sequence[Any], attr: str, counts: list[int], total: int) -> pa.Array:
    """An int column sent per row (rank, local_rank); -1 or an omitted column becomes NULL."""
    columns = [getattr(s, attr) for s in blocks]
    if sum(map(len, columns)) != total:  # a block left the column out (a block sends it for all rows or none)
        columns = [c if len(c) else itertools.repeat(-1, n) for c, n in zip(columns, counts)]
    values = np.fromiter(_chain(columns), np.int32, total)
    return pa.array(values, mask=values < 0)


def _gpu_samples_table(batches: list[ColumnarBatch]) -> pa.Table:
    samples = [s for b in batches for s in b.message.samples]
    counts = [len(s.ts_ms) for s in samples]
    total = sum(counts)
    job_ids = [s.job_id for s in samples]
    if sum(map(len, job_ids)) != total:  # a block left job_id out
        job_ids = [j if len(j) else itertools.repeat("", n) for j, n in zip(job_ids, counts)]
    job_ids = pa.array(list(_chain(job_ids)), pa.string())
    check_name_lengths("samples: job_id", pc.max(pc.utf8_length(job_ids)).as_py())  # refused: INVALID_ARGUMENT
    columns = {
        "node": _node_column([b.message.node.node for b in batches], [len(b.gpu_ts) for b in batches]),
        "gpu_index": pa.array(np.repeat(np.fromiter((s.gpu_index for s in samples), np.int32, len(samples)), counts)),
        "ts": pa.array(np.concatenate([b.gpu_ts for b in batches]), pa.timestamp("ms")),
        "job_id": pc.if_else(pc.equal(job_ids, ""), None, job_ids),
        "rank": _per_row_ints(samples, "rank", counts, total),
        "local_rank": _per_row_ints(samples, "local_rank", counts, total),
    }
    columns.update(_value_arrays([b.gpu_values for b in batches], fields.GPU_FIELD_NAMES))
    return pa.table(columns)


def _host_samples_table(batches: list[ColumnarBatch]) -> pa.Table:
    columns = {
        "node": _node_column([b.message.node.node for b in batches], [len(b.host_ts) for b in batches]),
        "ts": pa.array(np.concatenate([b.host_ts for b in batches]), pa.timestamp("ms")),
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
    batches = [b for b in batches if b.HasField("spans") and len(b.spans.start_us)]  # most batches carry none
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
def _stored_keys(con: duckdb.DuckDBPyConnection, keys: list[tuple[str, int]]) -> dict[tuple[str, int], str | None]:
    """The (agent_id, sequence) pairs among ``keys`` that the ingested table already holds, with fingerprints."""
    if not keys:
        return {}
    probe = pa.table({"agent_id": [k[0] for k in keys], "sequence": pa.array([k[1] for k in keys], pa.uint64())})
    con.register("_probe", probe)
    try:
        rows = con.execute(
            "SELECT i.agent_id, i.sequence, any_value(i.fingerprint) FROM ingested i "
            "JOIN _probe p USING (agent_id, sequence)"
            " GROUP BY ALL").fetchall()
    finally:
        con.unregister("_probe")
    return {(agent, int(seq)): fingerprint for agent, seq, fingerprint in rows}


def _insert_frame(con: duckdb.DuckDBPyConnection, sql: str, frame: pd.DataFrame | pa.Table) -> None:
    con.register("_frame", frame)
    try:
        con.execute(sql.format(view="_frame"))
    finally:
        con.unregister("_frame")


def _replace_breakdown(con: duckdb.DuckDBPyConnection, job_id: str, source: str, rows: pd.DataFrame,
                       doc_json: str) -> None:
    now = _utc_now()
    con.execute("DELETE FROM breakdowns WHERE job_id = ? AND source = ?", [job_id, source])
    _insert_frame(con, "INSERT INTO breakdowns BY NAME SELECT * FROM {view}",
                  rows[["rank", "step", "category", "us"]].assign(job_id=job_id, source=source, computed_at=now))
    con.execute("INSERT OR REPLACE INTO breakdown_docs VALUES (?, ?, ?, ?)", [job_id, source, doc_json, now])


def _utc_now() -> dt.datetime:
    return ms_to_datetime(int(time.time() * 1000))


def _trim_spans(con: duckdb.DuckDBPyConnection, keep_s: float) -> int:
    deleted = con.execute("""
        DELETE FROM spans USING (SELECT job_id, max(start_us) AS newest FROM spans GROUP BY job_id) AS j
        WHERE spans.job_id = j.job_id AND spans.start_us < j.newest - $keep""", {"keep": keep_s * 1e6}).fetchall()[0][0]
    if deleted:
        log.debug("trimmed %d spans older than %g s before their job's newest", deleted, keep_s)
    return int(deleted)


def _delete_before(con: duckdb.DuckDBPyConnection, cutoff: dt.datetime) -> dict[str, int]:
    deleted = {}
    con.begin()
    try:
        for table, column in RETENTION.items():
            deleted[table] = int(con.execute(f"DELETE FROM {table} WHERE {column} < ?", [cutoff]).fetchall()[0][0])
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


def _check_size(con: duckdb.DuckDBPyConnection, path: str) -> None:
    """UserError when the file is shorter than the blocks its header counts (truncated: cut by a copy or a
    full disk): served, it answered every query with an IO error and took batches into a broken file."""
    row = con.execute("SELECT total_blocks, block_size FROM pragma_database_size()").fetchone()
    assert row is not None, "pragma_database_size has a row per attached database"
    blocks, block_size = row
    needed = _HEADER_BYTES + int(blocks) * int(block_size)
    size = os.path.getsize(path)
    if size < needed:
        con.close()
        raise UserError(f"cannot open store {path}: the file is truncated ({size} of {needed} bytes); restore it "
                        "from a backup or move it away to start an empty store")


_HEADER_BYTES = 3 * 4096  # DuckDB's file header and its two database headers, before the first block


def _private(path: str) -> None:
    """Telemetry and alert history are for the collector's user only (0600), whatever the umask (two stat
    calls when they are already)."""
    for name in (path, path + ".wal"):
        try:
            if os.stat(name).st_mode & 0o077:
                os.chmod(name, 0o600)
        except FileNotFoundError:
            pass


def _ms_or_none(ms: int | None) -> dt.datetime | None:
    return None if ms is None else ms_to_datetime(ms)


def _table_name(statement: str) -> str:
    return statement.split("EXISTS", 1)[1].split("(", 1)[0].strip()


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
