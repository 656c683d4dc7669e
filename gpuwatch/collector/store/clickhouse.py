"""The ClickHouse store, through clickhouse-connect: a ClickHouse server or cluster, or chdb in-process.

``clickhouse://[user:password@]host:8123/db`` (``clickhouses://`` for HTTPS) talks to a server over HTTP;
``chdb:///DIR`` runs the same engine inside the collector (clickhouse-connect's chdb interface), which is
what CI uses. The schema is in ClickHouse idioms (docs/store-schema.md): MergeTree tables ordered by node,
GPU and time, daily partitions, a TTL from ``retention_days``, LowCardinality strings, Gorilla/Delta/DoubleDelta
codecs under ZSTD.

Exactly once without transactions: every table ingest appends to is a ReplacingMergeTree whose sorting key
is the row's natural identity (a GPU's sample at one time, a rank's span at one start), and every read runs
with ``final = 1``, so a batch stored twice (a collector killed between inserting the rows and recording the
batch, or a resend that reached another collector) is seen once. The ``ingested`` table, checked by the
writer before it inserts, answers resends with a duplicate ack and keeps the second copy from being written
at all in the ordinary case. Several collectors may share one database: the batches they store are
deduplicated the same way, and the once-per-cluster work takes a lease (:meth:`ClickHouseStore.take_lease`).
"""
from __future__ import annotations

import datetime as dt
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar
from urllib.parse import urlsplit

import clickhouse_connect
import pandas as pd
import pyarrow as pa

from gpuwatch.core import fields
from gpuwatch.collector.store import owner_tables, rollups
from gpuwatch.collector.store.dialect import CLICKHOUSE
from gpuwatch.collector.store.engine import EngineStore, StoreOptions
from gpuwatch.collector.store.queries import check_fields
from gpuwatch.core.settings import size_bytes
from gpuwatch.collector.store.duckdb import _agents_table, batch_tables, ms_to_datetime
from gpuwatch.core.columnar import ColumnarBatch
from gpuwatch.core.errors import UserError
from gpuwatch.core.spans import SPAN_COLUMNS
from gpuwatch.v1 import telemetry_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_DATABASE = "gpuwatch"
_TS = "DateTime64(3, 'UTC') CODEC(DoubleDelta, ZSTD(1))"
_GAUGE = "Nullable(Float64) CODEC(Gorilla, ZSTD(1))"
_COUNTER = "Nullable(Float64) CODEC(Delta, ZSTD(1))"  # counters only grow: deltas are small and repeat


def _value_columns(names: Sequence[str]) -> str:
    return ",\n    ".join(f"{name} {_COUNTER if fields.BY_NAME[name].kind == fields.Kind.COUNTER else _GAUGE}"
                           for name in names)


def _span_columns() -> str:
    """The span catalogue's columns (gpuwatch.core.spans); steps, times and sequence numbers grow by small
    deltas within a rank's rows, durations are similar floats."""
    types = {"string": "LowCardinality(String)", "int32": "Int32", "int64": "Int64", "double": "Float64"}
    codecs = {"step": "Delta, ZSTD(1)", "start_us": "Delta, ZSTD(1)", "dur_us": "Gorilla, ZSTD(1)",
              "seq": "Delta, ZSTD(1)", "bytes": "ZSTD(1)"}
    return ", ".join(f"{c.name} {types[c.type]}" + (f" CODEC({codecs[c.name]})" if c.name in codecs else "")
                     for c in SPAN_COLUMNS)


def _ddl(ttl_days: float | None) -> dict[str, tuple[str, str]]:
    """Per table: its columns and its engine clause ({engine} stands for the MergeTree variant)."""
    ttl = f" TTL toDateTime(ts) + INTERVAL {int(ttl_days * 86400)} SECOND" if ttl_days else ""
    ttl_ingested = ttl.replace("(ts)", "(ingested_at)")
    return {
        "gpu_samples": (f"""node LowCardinality(String), gpu_index Int32, ts {_TS},
    job_id LowCardinality(Nullable(String)), rank Nullable(Int32), local_rank Nullable(Int32),
    {_value_columns(fields.GPU_FIELD_NAMES)}""",
                        f"Replacing{{engine}} PARTITION BY toDate(ts) ORDER BY (node, gpu_index, ts){ttl}"),
        "host_samples": (f"""node LowCardinality(String), ts {_TS},
    {_value_columns(fields.HOST_FIELD_NAMES)}""",
                         f"Replacing{{engine}} PARTITION BY toDate(ts) ORDER BY (node, ts){ttl}"),
        "events": (f"""node LowCardinality(String), gpu_index Int32, ts {_TS}, kind LowCardinality(String),
    code Nullable(Int64), message String CODEC(ZSTD(3)), attrs String CODEC(ZSTD(3))""",
                   f"Replacing{{engine}} PARTITION BY toDate(ts) ORDER BY (node, gpu_index, ts, kind, ifNull(code, 0), "
                   f"message){ttl}"),
        "spans": (f"""{_span_columns()}, ts {_TS}""",
                  f"Replacing{{engine}} PARTITION BY toDate(ts) "
                  f"ORDER BY (job_id, rank, start_us, kind, name, seq){ttl}"),
        "job_steps": (f"""job_id LowCardinality(String), rank Int32, step Int64 CODEC(Delta, ZSTD(1)),
    kind LowCardinality(String), start_us Float64 CODEC(Delta, ZSTD(1)), dur_us Float64 CODEC(Gorilla, ZSTD(1)),
    world_size Int32, node LowCardinality(String), ts {_TS}""",
                      f"Replacing{{engine}} PARTITION BY toDate(ts) ORDER BY (job_id, rank, step, kind){ttl}"),
        # fingerprint: what the batch held, in brief (writer.fingerprint): a resend matches, a cloned agent's not
        "ingested": ("agent_id String, sequence UInt64, ingested_at DateTime64(3, 'UTC'), fingerprint Nullable(String)",
                     f"Replacing{{engine}} ORDER BY (agent_id, sequence){ttl_ingested}"),
        "gpus": ("""node LowCardinality(String), `index` Int32, uuid String, name LowCardinality(String),
    pci_bus_id String, serial String, memory_total_bytes UInt64, architecture LowCardinality(String),
    gpm_supported Bool, first_seen DateTime64(3, 'UTC'), last_seen DateTime64(3, 'UTC')""",
                 "Replacing{engine}(last_seen) ORDER BY (node, `index`)"),
        "agents": ("agent_id String, node LowCardinality(String), last_sequence UInt64, last_seen DateTime64(3, 'UTC')",
                   "Replacing{engine}(last_sequence) ORDER BY agent_id"),
        "alerts": ("""id String, alertname LowCardinality(String), subject String, status LowCardinality(String),
    starts_at DateTime64(3, 'UTC'), ends_at Nullable(DateTime64(3, 'UTC')), updated_at DateTime64(3, 'UTC'),
    doc String CODEC(ZSTD(3))""", "Replacing{engine}(updated_at) ORDER BY id"),
        "step_breakdowns": (f"""job_id LowCardinality(String), rank Int32, step Nullable(Int64),
    category LowCardinality(String), us Float64 CODEC(Gorilla, ZSTD(1)), ts {_TS}""",
                            f"{{engine}} PARTITION BY toDate(ts) ORDER BY (job_id, rank, ts){ttl}"),
        "job_timelines": ("""job_id String, rank Int32, filename String, timeline String CODEC(ZSTD(3)),
    submitted_at DateTime64(3, 'UTC')""", "Replacing{engine}(submitted_at) ORDER BY (job_id, rank)"),
        "breakdowns": ("""job_id String, source LowCardinality(String), rank Int32, step Nullable(Int64),
    category LowCardinality(String), us Float64, computed_at DateTime64(3, 'UTC')""",
                       "{engine} ORDER BY (job_id, source, rank)"),
        "breakdown_docs": ("job_id String, source LowCardinality(String), doc String CODEC(ZSTD(3)), "
                           "computed_at DateTime64(3, 'UTC')",
                           "Replacing{engine}(computed_at) ORDER BY (job_id, source)"),
        # inserted_ns is the server's clock at insert: claims are ordered as they were stored, whatever the
        # clocks of the collectors that sent them
        "leases": ("name String, holder String, term UInt64, claimed_ms Int64, expires_ms Int64, "
                   "inserted_ns Int64 DEFAULT toUnixTimestamp64Nano(now64(9))",
                   "{engine} ORDER BY (name, term, claimed_ms, holder) TTL toDateTime(intDiv(claimed_ms, 1000)) + "
                   "INTERVAL 1 DAY"),
        **rollups.clickhouse_ddl(),  # the tiers of GPU samples (collector/store/rollups.py)
        **owner_tables.clickhouse_ddl(),  # GPU ownership intervals (collector/store/owner_tables.py)
    }


# Columns added since a table was first created (run after the CREATEs on every open): table, column, type.
MIGRATIONS: list[tuple[str, str, str]] = [
    ("ingested", "fingerprint", "Nullable(String)"),
]

# Table settings applied to every MergeTree table, new or existing, where the server knows them. Each insert is
# a part that background merges rewrite; merge_selector_base sets how many parts of similar size one merge
# takes (the write amplification): 10 instead of the engine's 5 halved the collector's merge CPU at the same
# ingest (docs/scale.md, "The ClickHouse path's cost") while a day's partition still settles to a few parts.
# Older servers lack the setting: they keep their default.
MERGE_SETTINGS: dict[str, int] = {"merge_selector_base": 10}

_ENGINE = re.compile(r"^(Replacing)?\{engine\}(?:\(([\w, ]+)\))?(.*)$", re.S)


def create_statements(database: str, ttl_days: float | None, cluster: str | None = None,
                      merge_settings: Mapping[str, int] | None = None) -> list[str]:
    """Every CREATE statement of the schema: local MergeTree tables, or with ``cluster`` Replicated tables on
    every node of the cluster (``<table>_local``) behind Distributed tables, sharded by node (samples,
    events, inventory) or job (spans), so that one GPU's or one job's rows meet on one shard. Then the
    migrations, and ``merge_settings`` set on every MergeTree table (those that exist from before too)."""
    on_cluster = f" ON CLUSTER {cluster}" if cluster else ""
    statements = [f"CREATE DATABASE IF NOT EXISTS {database}{on_cluster}"]
    for table, (columns, engine) in _ddl(ttl_days).items():
        match = _ENGINE.match(engine)
        assert match is not None, f"engine of {table}: {engine}"
        replacing, version, rest = match.groups()
        kind = replacing or ""
        if cluster is None:
            statements.append(f"CREATE TABLE IF NOT EXISTS {database}.{table} (\n    {columns}\n) ENGINE = "
                              f"{kind}MergeTree{f'({version})' if version else ''}{rest}")
            continue
        zk_path = f"'/clickhouse/tables/{{shard}}/{database}/{table}', '{{replica}}'"
        statements.append(f"CREATE TABLE IF NOT EXISTS {database}.{table}_local{on_cluster} (\n    {columns}\n) "
                          f"ENGINE = Replicated{kind}MergeTree({zk_path}{f', {version}' if version else ''}){rest}")
        key = next((c for c in ("node", "job_id", "agent_id", "id", "name") if re.search(rf"\b{c} ", columns)), None)
        key = "job_id" if table in ("spans", "job_steps", "step_breakdowns") else key
        statements.append(f"CREATE TABLE IF NOT EXISTS {database}.{table}{on_cluster} AS {database}.{table}_local "
                          f"ENGINE = Distributed({cluster}, {database}, {table}_local, cityHash64({key}))")
    for table, column, kind in MIGRATIONS:
        for target in ([f"{table}_local", table] if cluster else [table]):
            statements.append(f"ALTER TABLE {database}.{target}{on_cluster} ADD COLUMN IF NOT EXISTS {column} {kind}")
    if merge_settings:
        values = ", ".join(f"{name} = {value}" for name, value in merge_settings.items())
        local = "_local" if cluster else ""
        statements += [f"ALTER TABLE {database}.{table}{local}{on_cluster} MODIFY SETTING {values}"
                       for table in _ddl(ttl_days)]
    return statements


class ClickHouseStore(EngineStore):
    """A ClickHouse database (server, cluster or in-process chdb), written by one writer thread per collector."""

    dialect = CLICKHOUSE

    # chdb directories open in this process, with how many stores each, and those opened by two stores at once
    # since they were last closed by all: the engine locks its directory against other processes, so only
    # stores in one process can share one (tests run several collectors so)
    _open_chdb: ClassVar[Counter[str]] = Counter()
    _shared_chdb: ClassVar[set[str]] = set()
    _open_chdb_lock: ClassVar[threading.Lock] = threading.Lock()
    linger_s = 0.2  # every insert makes a part that merges rewrite: fewer, larger ones (writer.py)

    def __init__(self, url: str, *, clickhouse_cluster: str | None = None, **options: Any) -> None:
        """``options``: :class:`~gpuwatch.collector.store.engine.StoreOptions`."""
        opts = StoreOptions(**options)
        self.path = url
        self._connect_args, self.database = _connection(url)
        self._chdb_dir = os.path.realpath(url.removeprefix("chdb://")) if url.startswith("chdb://") else None
        # optimize_on_insert=0: an insert does not fold rows of one key within its block (a third of the
        # insert's CPU); merges and the final reads fold them, as they fold a resend's rows across parts
        self._settings = {"final": 1, "max_memory_usage": _bytes(opts.memory_limit), "optimize_on_insert": 0,
                          # a cluster's Distributed inserts land before they are acknowledged
                          **({"insert_distributed_sync": 1} if clickhouse_cluster else {})}
        self._local = threading.local()
        self._clients: list[Any] = []  # every thread's client, closed with the store (chdb: frees the engine)
        self._clients_lock = threading.Lock()
        self.cluster = clickhouse_cluster
        try:
            if url.startswith("chdb://"):
                _private_directory(url.removeprefix("chdb://"))
            admin = clickhouse_connect.get_client(**self._connect_args)
            known = admin.query("SELECT name FROM system.merge_tree_settings WHERE has({names:Array(String)}, name)",
                                parameters={"names": list(MERGE_SETTINGS)}).result_rows
            merge_settings = {name: MERGE_SETTINGS[name] for (name,) in known}
            for statement in create_statements(self.database, opts.retention_days, clickhouse_cluster, merge_settings):
                admin.command(statement)
        except Exception as exc:  # connection refused, authentication, a chdb directory it cannot use
            cause = _chdb_failure_cause(url.removeprefix("chdb://")) if url.startswith("chdb://") else ""
            raise UserError(f"cannot open store {_redacted(url)}: {_first_line(exc)}"
                            + (f"; cause: {cause}" if cause else "")) from None
        self._writer_client = admin
        try:
            self._report_detached_parts()
        except Exception as exc:  # a server user without access to system tables: the store still opens
            log.warning("store %s: cannot list detached parts: %s", _redacted(url), _first_line(exc))
        self._owner_table = owner_tables.ClickHouseOwners(self._query)
        last = self._query("SELECT agent_id, last_sequence FROM agents")
        super().__init__({r.agent_id: int(r.last_sequence) for r in last.itertuples()}, opts)
        if self._chdb_dir is not None:
            with self._open_chdb_lock:
                self._open_chdb[self._chdb_dir] += 1
                if self._open_chdb[self._chdb_dir] > 1:
                    self._shared_chdb.add(self._chdb_dir)

    def sole_writer(self) -> bool:
        """A ClickHouse server may have other collectors storing batches of the same agents: every batch is
        looked up in ``ingested``. A chdb directory has no other writer unless this process opened it twice;
        then, as on DuckDB, only a batch at or below an agent's last stored sequence can be a resend (looking
        up every batch cost the chdb path a seventh of its CPU, more as ``ingested`` grows). Once shared, a
        directory stays so until all its stores are closed: another store's batches are not in this one's
        last sequences."""
        return self._chdb_dir is not None and self._chdb_dir not in self._shared_chdb

    def _report_detached_parts(self) -> None:
        """Log every part the engine set aside (a part found broken at start is moved to
        ``detached/broken-on-start_*`` and its rows vanish from every query) and the rows lost with it: those
        it held (its count.txt, where the files are here) beyond what the active parts of its block range hold."""
        detached = self._query("""
            SELECT table, partition_id, name, reason, path, bytes_on_disk, min_block_number, max_block_number
            FROM system.detached_parts WHERE database = {db:String} AND reason != '' ORDER BY table, name""",
                               {"db": self.database})
        for part in detached.itertuples():
            held = _part_rows(str(part.path))
            # older parts of the same blocks that the engine still had are restored in its place: their rows
            # are not lost (a part merged from them since also holds later blocks: then "at most")
            inside, overlapping = self._query("""
                SELECT toInt64(sumIf(rows, min_block_number >= {lo:Int64} AND max_block_number <= {hi:Int64})) AS n,
                       countIf(min_block_number < {lo:Int64} OR max_block_number > {hi:Int64}) AS wider
                FROM system.parts WHERE active AND database = {db:String} AND table = {t:String}
                  AND partition_id = {p:String} AND max_block_number >= {lo:Int64} AND min_block_number <= {hi:Int64}
                """, {"db": self.database, "t": part.table, "p": part.partition_id, "lo": int(part.min_block_number),
                      "hi": int(part.max_block_number)}).iloc[0]
            lost = ("an unknown number of rows" if held is None else
                    f"{'at most ' if int(overlapping) else ''}{max(0, held - int(inside or 0))} rows")
            log.error("store %s: table %s part %s was set aside by the engine (%s, %d bytes, at %s): %s no longer "
                      "served; restore it from a backup or remove it", _redacted(self.path), part.table, part.name,
                      part.reason, int(part.bytes_on_disk), part.path, lost)

    # ---- connections -----------------------------------------------------------------------------------
    def _client(self) -> Any:
        """A client per thread: clickhouse-connect clients keep per-query state and are not shared."""
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = clickhouse_connect.get_client(
                **self._connect_args, database=self.database, settings=self._settings)
            with self._clients_lock:
                self._clients.append(client)
        return client

    def _query(self, sql: str, params: dict[str, Any] | None = None) -> pd.DataFrame:
        df = self._client().query_df(sql, parameters=params or {})
        if df.columns.empty:  # an empty answer comes without columns; Arrow's keeps the schema
            df = self._client().query_arrow(sql, parameters=params or {}).to_pandas()
        return df

    def _command(self, sql: str, params: dict[str, Any] | None = None) -> Any:
        return self._client().command(sql, parameters=params or {})

    def _insert(self, table: str, data: pa.Table | pd.DataFrame) -> None:
        if not len(data):
            return
        client = self._client()
        if isinstance(data, pd.DataFrame):
            client.insert_df(f"{self.database}.{table}", data)
        else:
            client.insert_arrow(f"{self.database}.{table}", data)

    def query_df(self, sql: str, params: dict[str, Any] | None = None) -> pd.DataFrame:
        """Run a read query (ClickHouse SQL, ``{name:Type}`` parameters) and return a DataFrame."""
        return self._query(sql, params)

    # ---- the writer's hooks ----------------------------------------------------------------------------
    def _commit(self, batches: list[ColumnarBatch]) -> None:
        """Insert the group's rows table by table, the ingested marks last: a crash part way leaves rows
        that a resend writes again identically, which the ReplacingMergeTree keys (and final reads) fold."""
        if not batches:
            return
        if self.raw_retention_s:  # noted first: a minute rebuilt from rows that then failed to land is harmless
            self._dirty.note(batches)
        self._owners_pending.note(batches)
        now = ms_to_datetime(int(time.time() * 1000))
        tables = batch_tables(batches, now)
        ingested = tables.pop("ingested")
        for name, table in tables.items():
            self._insert(name, _plain_strings(table))
        messages = [b.message for b in batches]
        inventory = self._inventory.to_write(batches)
        self._insert("gpus", self._gpus_frame({key: gpu for key, (_, gpu) in inventory.items()}, now))
        self._insert("agents", _agents_table(messages, now))
        self._insert("ingested", ingested)
        self._inventory.written(inventory)

    def _gpus_frame(self, entries: dict[tuple[str, int], pb.GpuInfo], now: dt.datetime) -> pd.DataFrame:
        """The inventory rows to upsert for ``entries`` (new, changed or due for refresh), first_seen kept."""
        latest = entries
        if not latest:
            return pd.DataFrame()
        known = self._query("SELECT node, `index`, first_seen FROM gpus WHERE has({nodes:Array(String)}, node)",
                            {"nodes": sorted({n for n, _ in latest})})
        first = {(r[0], int(r[1])): r[2] for r in known.itertuples(index=False)}
        return pd.DataFrame([{
            "node": node, "index": index, "uuid": g.uuid, "name": g.name, "pci_bus_id": g.pci_bus_id,
            "serial": g.serial, "memory_total_bytes": g.memory_total_bytes, "architecture": g.architecture,
            "gpm_supported": g.gpm_supported, "first_seen": first.get((node, index), now), "last_seen": now,
        } for (node, index), g in latest.items()])

    def _stored_keys(self, keys: list[tuple[str, int]]) -> dict[tuple[str, int], str | None]:
        if not keys:
            return {}
        # one query per group, read as Arrow: its usual answer (fresh batches) is empty, which _query would ask
        # twice; without FINAL (the GROUP BY folds a mark stored twice), which would merge every part of the
        # table on each commit
        rows = self._client().query_arrow("""
            SELECT agent_id, sequence, any(fingerprint) AS fingerprint FROM ingested
            WHERE (agent_id, sequence) IN (SELECT tupleElement(k, 1), tupleElement(k, 2)
                                           FROM (SELECT arrayJoin({keys:Array(Tuple(String, UInt64))}) AS k))
            GROUP BY agent_id, sequence SETTINGS final = 0""", parameters={"keys": [(a, int(s)) for a, s in keys]})
        return {(r["agent_id"], int(r["sequence"])): r["fingerprint"] for r in rows.to_pylist()}

    def _clean_up(self, retention: bool, trim: bool) -> None:
        # retention is the tables' TTL; only the raw spans' window is trimmed here, and GPU samples tiered
        self._build_rollups()
        self._build_owner_intervals()
        if retention and self.raw_retention_s:
            self._expire_tiers(None)
        if trim and self.span_retention_s:
            self._trim(self.span_retention_s)

    def _task_argument(self) -> Any:
        return self._client()

    def _close_engine(self) -> None:
        if self._chdb_dir is not None:
            with self._open_chdb_lock:
                self._open_chdb[self._chdb_dir] -= 1
                if not self._open_chdb[self._chdb_dir]:
                    self._shared_chdb.discard(self._chdb_dir)
        self._writer_client.close()
        with self._clients_lock:
            for client in self._clients:
                client.close()
            self._clients.clear()

    def _trim(self, keep_s: float) -> int:
        """Delete each job's raw spans older than ``keep_s`` before its newest span; return how many."""
        cutoffs = self._query("SELECT job_id, max(start_us) - {keep:Float64} AS cutoff FROM spans GROUP BY job_id",
                              {"keep": keep_s * 1e6})
        if cutoffs.empty:
            return 0
        where = ("start_us < transform(job_id, {jobs:Array(String)}, {cutoffs:Array(Float64)}, "
                 "toFloat64(-inf))")
        params = {"jobs": cutoffs["job_id"].astype(str).tolist(), "cutoffs": cutoffs["cutoff"].astype(float).tolist()}
        old = int(self._query(f"SELECT count() AS n FROM spans WHERE {where}", params)["n"].iloc[0])
        if old:
            self._command(f"DELETE FROM {self._table_for_delete('spans')} WHERE {where}", params)
        return old

    def _table_for_delete(self, table: str) -> str:
        """Where a DELETE goes: the table, or on a cluster its local tables on every node."""
        return f"{table}_local ON CLUSTER {self.cluster}" if self.cluster else table

    # ---- writes other than ingest ----------------------------------------------------------------------
    def build_rollups(self, timeout: float | None = None) -> None:
        """Bring the rollups up to date with every batch committed so far (the writer does it every
        span-trim interval; tests and benchmarks call this)."""
        self.run_write(lambda _: self._build_rollups(), timeout)

    def build_owner_intervals(self, timeout: float | None = None) -> None:
        """Fold every ``gpu_owner`` event committed so far into the ``owner_intervals`` table (the writer does
        it with the rollups; tests and benchmarks call this)."""
        self.run_write(lambda _: self._build_owner_intervals(), timeout)

    def _build_owner_intervals(self) -> None:
        floor = self._retention_cutoff_ms() + owner_tables.LOOKBACK_MS if self.retention_days else None
        owner_tables.maintain(self._owner_table, self.event_attrs, self._owners_pending, floor,
                              lambda start, rows, mark: owner_tables.clickhouse_replace(
                                  self._query, self._insert, start, rows, mark))

    def owner_intervals(self, since_ms: int | None = None) -> pd.DataFrame:
        """The GPU ownership intervals holding any time from ``since_ms`` (owner_tables.intervals)."""
        return owner_tables.intervals(self._owner_table, self.event_attrs, self._owners_pending, since_ms)

    def _raw_cutoff_ms(self) -> int | None:
        df = self._query(f"SELECT max(cutoff_ms) AS c, count() AS n FROM {rollups.STATE_TABLE} WHERE name = 'raw'")
        return int(df["c"].iloc[0]) if int(df["n"].iloc[0]) else None

    def _build_rollups(self, minutes: tuple[int, int] | None = None) -> None:
        if not self.raw_retention_s:
            return
        minutes = minutes or self._dirty.take(self._raw_cutoff_ms())
        if minutes is not None:
            self._command(rollups.clickhouse_build_sql(), {"start": minutes[0], "end": minutes[1]})

    def _expire_tiers(self, now_ms: int | None) -> dict[str, int]:
        """Roll up every minute before the new raw cutoff, record the cutoff, then delete the raw rows before
        it (a crash in between leaves raw rows that reads no longer use and the next run deletes)."""
        assert self.raw_retention_s
        now = int(time.time() * 1000) if now_ms is None else now_ms
        cutoff = rollups.floor_minute(now - int(self.raw_retention_s * 1000))
        self._build_rollups()
        old = self._raw_cutoff_ms()
        deleted = {"gpu_samples": 0, rollups.ROLLUP_TABLE: 0}
        if old is None or cutoff > old:
            self._build_rollups((old if old is not None else 0, cutoff))
            self._insert(rollups.STATE_TABLE, pd.DataFrame({"name": ["raw"], "cutoff_ms": [cutoff]}))
        checks = [("gpu_samples", "ts", cutoff)]
        if self.rollup_retention_s:
            checks.append((rollups.ROLLUP_TABLE, "minute", now - int(self.rollup_retention_s * 1000)))
            # ownership intervals outlive the events, as long as the rollups
            deleted[owner_tables.TABLE] = owner_tables.clickhouse_expire(
                self._query, self._command, self._table_for_delete(owner_tables.TABLE),
                now - int(self.rollup_retention_s * 1000))
        for table, column, before in checks:
            where = f"{column} < fromUnixTimestamp64Milli({{before:Int64}})"
            found = int(self._query(f"SELECT count() AS n FROM {table} WHERE {where}", {"before": before})["n"].iloc[0])
            if found:
                self._command(f"DELETE FROM {self._table_for_delete(table)} WHERE {where}", {"before": before})
            deleted[table] = found
        log.info("tiered retention: raw GPU samples before %s rolled up and deleted %s",
                 ms_to_datetime(cutoff).isoformat(), deleted)
        return deleted

    def _delete_expired(self, now_ms: int | None, timeout: float | None) -> dict[str, int]:
        """Delete rows older than ``retention_days`` before ``now_ms`` at once (the TTL does it on merges), and
        raw GPU samples past ``raw_retention_s`` once rolled up."""
        tiered = self.run_write(lambda _: self._expire_tiers(now_ms), timeout) if self.raw_retention_s else {}
        if not self.retention_days:
            return tiered
        cutoff = ms_to_datetime(self._retention_cutoff_ms(now_ms))

        def delete(_: Any) -> dict[str, int]:
            deleted = {}
            for table, column in (("gpu_samples", "ts"), ("host_samples", "ts"), ("events", "ts"), ("spans", "ts"),
                                  ("ingested", "ingested_at"), ("job_steps", "ts"), ("step_breakdowns", "ts")):
                params = {"cutoff": cutoff}
                where = f"{column} < {{cutoff:DateTime64(3)}}"
                found = self._query(f"SELECT count() AS n FROM {table} WHERE {where}", params)
                deleted[table] = int(found["n"].iloc[0])
                if deleted[table]:
                    self._command(f"DELETE FROM {self._table_for_delete(table)} WHERE {where}", params)
            return deleted

        deleted = self.run_write(delete, timeout)
        return {**deleted, **{k: deleted.get(k, 0) + v for k, v in tiered.items()}}

    def trim_spans(self, timeout: float | None = None) -> int:
        """Delete raw spans older than ``span_retention_s`` before their job's newest span."""
        retention = self.span_retention_s
        if not retention:
            return 0
        return self.run_write(lambda _: self._trim(retention), timeout)

    # ---- telemetry reads -------------------------------------------------------------------------------
    def counter_drops(self, field: str, gpus: Sequence[tuple[str, int]], since_ms: int,
                      until_ms: int | None = None) -> pd.DataFrame:
        check_fields([field])
        return self._query(f"""
            SELECT node, gpu_index, ts_ms FROM (
                SELECT node, gpu_index, toInt64(toUnixTimestamp64Milli(ts)) AS ts_ms, {field} AS value,
                       lagInFrame({field}) OVER (PARTITION BY node, gpu_index ORDER BY ts
                                                 ROWS BETWEEN 1 PRECEDING AND CURRENT ROW) AS before,
                       row_number() OVER (PARTITION BY node, gpu_index ORDER BY ts) AS n
                FROM gpu_samples WHERE has({{gpus:Array(String)}}, concat(toString(node), '/', toString(gpu_index)))
                  AND ts >= fromUnixTimestamp64Milli({{since:Int64}})
                  AND ts <= fromUnixTimestamp64Milli({{until:Int64}}))
            WHERE n > 1 AND value < before""",
            {"gpus": [f"{n}/{g}" for n, g in gpus], "since": since_ms,
             "until": self.dialect.time(until_ms, upper=True)})

    def columns(self, table: str) -> list[str]:
        self.count(table)  # names an unknown table
        return self._query("SELECT name FROM system.columns WHERE database = {db:String} AND table = {t:String} "
                           "ORDER BY position", {"db": self.database, "t": table})["name"].tolist()

    def count(self, table: str) -> int:
        if table not in _ddl(None):
            raise UserError(f"unknown table {table!r}")
        return int(self._query(f"SELECT count() AS n FROM {table}")["n"].iloc[0])

    # ---- jobs ------------------------------------------------------------------------------------------
    def job_progress(self) -> pd.DataFrame:
        df = self._query("""
            SELECT job_id, toInt64(uniqExact(rank)) AS ranks, arraySort(groupUniqArray(node)) AS nodes,
                   max(world_size) AS world_size,
                   toInt64(if(countIf(kind = 'step' AND dur_us >= 0) > 0,
                              maxIf(step, kind = 'step' AND dur_us >= 0) + 1, 0)) AS steps,
                   if(countIf(kind = 'step' AND dur_us >= 0) > 0,
                      maxIf(start_us + dur_us, kind = 'step' AND dur_us >= 0), NULL) AS last_step_us,
                   uniqExactIf(rank, kind = 'end') >= uniqExact(rank) AS finished
            FROM job_steps WHERE job_id <> '' GROUP BY job_id ORDER BY job_id""")
        return df.assign(finished=df["finished"].astype(bool)) if len(df) else df

    def add_step_breakdowns(self, rows: pd.DataFrame) -> None:
        if len(rows):
            table = rows[["job_id", "rank", "step", "category", "us"]].assign(ts=_utc_now())
            self.run_write(lambda _: self._insert("step_breakdowns", table))

    def jobs_seen(self) -> list[dict[str, Any]]:
        return self._records("""
            SELECT job_id, toInt64(uniqExactIf(node, isNotNull(node))) AS nodes,
                   toInt64(uniqExactIf((node, gpu_index), isNotNull(gpu_index))) AS gpus,
                   toInt64(uniqExactIf(rank, rank >= 0)) AS ranks, min(t) AS first_seen_ms, max(t) AS last_seen_ms
            FROM (SELECT assumeNotNull(job_id) AS job_id, toNullable(toString(node)) AS node,
                         toNullable(gpu_index) AS gpu_index, rank, toInt64(toUnixTimestamp64Milli(ts)) AS t
                  FROM gpu_samples WHERE isNotNull(job_id)
                  UNION ALL
                  SELECT toString(job_id), nullIf(toString(node), ''), NULL, toNullable(rank), toInt64(start_us / 1000)
                  FROM spans WHERE job_id <> '')
            WHERE job_id <> '' GROUP BY job_id ORDER BY job_id""")

    # ---- breakdowns of submitted traces ----------------------------------------------------------------
    def job_timelines(self, job_id: str) -> list[bytes]:
        # a timeline is binary: read String as bytes (as text it fails on the first byte that is not UTF-8)
        df = self._client().query_arrow("SELECT timeline FROM job_timelines WHERE job_id = {job:String} ORDER BY rank",
                                        parameters={"job": job_id}, use_strings=False)
        return [bytes(v) for v in df.column("timeline").to_pylist()]

    def save_submission(self, job_id: str, timelines: pd.DataFrame, rows: pd.DataFrame, doc_json: str,
                        source: str) -> None:
        table = pa.table({"job_id": timelines["job_id"].astype(str).tolist(),
                          "rank": pa.array(timelines["rank"].astype(int).tolist(), pa.int32()),
                          "filename": timelines["filename"].astype(str).tolist(),
                          "timeline": pa.array(timelines["timeline"].tolist(), pa.binary()),
                          "submitted_at": pa.array([_utc_now()] * len(timelines), pa.timestamp("ms"))})

        def write(_: Any) -> None:  # the document last: it is what readers look for
            self._insert("job_timelines", table)
            self._replace_breakdown(job_id, source, rows, doc_json)

        self.run_write(write)

    def save_breakdown(self, job_id: str, source: str, rows: pd.DataFrame, doc_json: str) -> None:
        self.run_write(lambda _: self._replace_breakdown(job_id, source, rows, doc_json))

    def _replace_breakdown(self, job_id: str, source: str, rows: pd.DataFrame, doc_json: str) -> None:
        now = _utc_now()
        self._command(f"DELETE FROM {self._table_for_delete('breakdowns')} "
                      "WHERE job_id = {job:String} AND source = {source:String}", {"job": job_id, "source": source})
        frame = rows[["rank", "step", "category", "us"]].assign(job_id=job_id, source=source, computed_at=now)
        self._insert("breakdowns", frame.astype({"rank": "int32"}))
        self._insert("breakdown_docs", pd.DataFrame([{"job_id": job_id, "source": source, "doc": doc_json,
                                                      "computed_at": now}]))

    # ---- alerts and leases -----------------------------------------------------------------------------
    def upsert_alerts(self, rows: pd.DataFrame) -> None:
        if len(rows):
            self.run_write(lambda _: self._insert("alerts", rows))

    def take_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        """Take or renew the lease ``name`` for ``ttl_s`` seconds; False while another holder's is unexpired.

        ClickHouse has no compare-and-set, so a lease is a sequence of terms: whoever sees the current term
        expired claims the next one, and of several claims of one term the one the server stored first wins
        (``inserted_ns``, the server's clock, not the claimant's: a claim stored later can never win, so a
        contender that re-reads after its own claim and sees itself first is the one winner everybody
        else will see too); the holder renews by claiming its term again.

        Another collector claims a lapsed term only ``ttl_s / 3`` after it lapsed: a holder that read its term
        as valid just before it lapsed may still be storing its renewal, and without that grace both would
        hold the lease until the holder's next renewal (takeover stays within ``ttl_s * 5 / 3``, plus one
        try interval). The holder's own lapsed term it claims anew at once."""
        now = int(time.time() * 1000)
        term, winner, expires = self._lease_state(name)
        lapsed_for_others = expires + int(ttl_s * 1000 / 3) < now
        if winner == holder or lapsed_for_others:
            next_term = term if winner == holder and expires >= now else term + 1
            self.run_write(lambda _: self._insert("leases", pd.DataFrame([{
                "name": name, "holder": holder, "term": next_term, "claimed_ms": now,
                "expires_ms": now + int(ttl_s * 1000)}])))
            term, winner, _ = self._lease_state(name)
        return winner == holder

    def _lease_state(self, name: str) -> tuple[int, str | None, int]:
        """The lease's current term, its winner (the claim stored first) and when it expires (the winner's
        latest claim's expiry: renewals extend it, a release sets it to 0)."""
        df = self._query("""
            SELECT term, argMin(holder, (inserted_ns, holder)) AS winner,
                   groupArray((holder, inserted_ns, expires_ms)) AS claims
            FROM leases WHERE name = {name:String}
              AND term = (SELECT max(term) FROM leases WHERE name = {name:String})
            GROUP BY term""", {"name": name})
        if df.empty:
            return 0, None, 0
        winner = str(df["winner"].iloc[0])
        expires = max((c for c in df["claims"].iloc[0] if c[0] == winner), key=lambda c: c[1])[2]
        return int(df["term"].iloc[0]), winner, int(expires)

    def release_lease(self, name: str, holder: str) -> None:
        term, winner, _ = self._lease_state(name)
        if winner == holder:  # expire our term now: the next contender claims the next term at once
            self.run_write(lambda _: self._insert("leases", pd.DataFrame([{
                "name": name, "holder": holder, "term": term, "claimed_ms": int(time.time() * 1000),
                "expires_ms": 0}])))


# ----------------------------------------------------------------------------------------- helpers
def _part_rows(path: str) -> int | None:
    """The rows a part's files say it holds (count.txt), None where they are not readable here."""
    try:
        with open(os.path.join(path, "count.txt")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


# Opens a chdb directory with the engine's log on; its errors name what the plain open reports as "." only.
_CHDB_DIAGNOSE = ("import sys, chdb\ntry:\n    chdb.connect(sys.argv[1] + '?verbose&log-level=error')\n"
                  "except Exception:\n    pass")


def _chdb_failure_cause(path: str) -> str:
    """Why the chdb engine would not open ``path``, from its own log in a separate process (the engine is
    initialised once per process, so it cannot be tried again here); "" when it says nothing more."""
    try:
        run = subprocess.run([sys.executable, "-c", _CHDB_DIAGNOSE, path], capture_output=True, text=True,
                             timeout=120, errors="replace")
    except (OSError, subprocess.SubprocessError):
        return ""
    found = re.search(r"DB::Exception: (?!Error initializing EmbeddedServer)(.*?\([A-Z_]+\))", run.stderr + run.stdout,
                      re.S)
    return " ".join(found.group(1).split()) if found else ""


def _private_directory(path: str) -> None:
    """The in-process engine's directory holds telemetry and alert history: the collector's user only (0700).

    Made before chdb opens it, so its files are never readable by others even for a moment; an existing
    directory is narrowed too, whatever the umask made it.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


def _connection(url: str) -> tuple[dict[str, Any], str]:
    """clickhouse-connect arguments and the database for a --store URL."""
    if url.startswith("chdb://"):
        path = url.removeprefix("chdb://")
        if not path or path == "/":
            raise UserError(f"--store {url}: give a directory, chdb:///DIR")
        return {"dsn": f"chdb://{path}"}, DEFAULT_DATABASE
    parts = urlsplit(url)
    if not parts.hostname:
        raise UserError(f"--store {_redacted(url)}: no host; expected clickhouse://[user:password@]host:8123/db")
    database = parts.path.strip("/") or DEFAULT_DATABASE
    if not database.replace("_", "").isalnum():
        raise UserError(f"--store {_redacted(url)}: database name {database!r} must be letters, digits and _")
    https = parts.scheme == "clickhouses"
    args: dict[str, Any] = {"host": parts.hostname, "port": parts.port or (8443 if https else 8123),
                            "interface": "https" if https else "http"}
    if parts.username:
        args["username"] = parts.username
    if parts.password:
        args["password"] = parts.password
    return args, database


def _redacted(url: str) -> str:
    from gpuwatch.collector.store import redacted

    return redacted(url)


def _bytes(limit: str) -> int:
    try:
        return size_bytes(limit)
    except ValueError as exc:
        raise UserError(f"memory limit {exc}") from None


def _plain_strings(table: pa.Table) -> pa.Table:
    """Dictionary-encoded columns decoded (clickhouse-connect inserts plain Arrow strings into LowCardinality)."""
    return pa.table({name: col.cast(col.type.value_type) if pa.types.is_dictionary(col.type) else col
                     for name, col in zip(table.column_names, table.columns)})




def _utc_now() -> dt.datetime:
    return ms_to_datetime(int(time.time() * 1000))


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__

