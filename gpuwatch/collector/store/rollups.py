"""Tiered retention of GPU samples: raw rows for a short window, per-minute rollups for a long one.

Both engines keep ``gpu_rollups``: one row per GPU and minute with every field's min, max, mean and last
value (the aggregates the scorer's features read; a counter's increase over a range is the difference of its
``last`` values). Rollups are recomputed from the raw rows of the minutes that fresh batches touched, so
building them is idempotent: a resent batch, or rows a ClickHouse collector wrote twice, never count twice
(the raw reads fold them). Before raw rows expire, every minute about to lose them is recomputed once more
and the cutoff is recorded in ``tier_state``; reads use rollups before that cutoff and raw rows from it on
(:func:`split`), and say which resolution each row has.
"""
from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from gpuwatch.core import fields
from gpuwatch.core.columnar import ColumnarBatch

if TYPE_CHECKING:
    import duckdb

ROLLUP_TABLE = "gpu_rollups"
STATE_TABLE = "tier_state"
MINUTE_MS = 60_000
#: ``resolution_s`` of a rolled-up row.
ROLLUP_RESOLUTION_S = 60
STATS = ("min", "max", "mean", "last")


def column(field: str, stat: str) -> str:
    """The rollup column holding ``stat`` of ``field``."""
    return f"{field}__{stat}"


def value_columns() -> list[tuple[str, str, str]]:
    """(column, field, stat) of every rollup value column."""
    return [(column(f, s), f, s) for f in fields.GPU_FIELD_NAMES for s in STATS]


def floor_minute(ms: int) -> int:
    return ms - ms % MINUTE_MS


class DirtyMinutes:
    """The span of sample times the writer committed since the rollups were last built (writer thread only)."""

    def __init__(self) -> None:
        self.range: tuple[int, int] | None = None

    def note(self, batches: Sequence[ColumnarBatch]) -> None:
        times = [b.gpu_ts for b in batches if len(b.gpu_ts)]
        if not times:
            return
        lo, hi = int(min(np.min(t) for t in times)), int(max(np.max(t) for t in times))
        if self.range is not None:
            lo, hi = min(lo, self.range[0]), max(hi, self.range[1])
        self.range = (lo, hi)

    def take(self, cutoff_ms: int | None) -> tuple[int, int] | None:
        """The minutes to rebuild, [start, end) in epoch ms, none before the raw cutoff (those minutes are
        final: their raw rows are gone, a late row there is deleted by the next retention run)."""
        found, self.range = self.range, None
        if found is None:
            return None
        start, end = floor_minute(found[0]), floor_minute(found[1]) + MINUTE_MS
        if cutoff_ms is not None:
            start = max(start, cutoff_ms)
        return (start, end) if start < end else None


def aggregates(dialect: str) -> str:
    """The SELECT list aggregating raw ``gpu_samples`` rows of one GPU and minute into a rollup row, the
    same expressions ``gpu_minutes`` uses on raw rows, so rollups answer it with the same numbers. (ClickHouse
    inserts by position: its newest-sample column is aliased apart from ``ts``, which its GROUP BY would take
    for the aggregate.)"""
    if dialect == "duckdb":
        last, head = "arg_max({c}, ts)", ("max(ts) AS ts, count(*) AS samples, arg_max(job_id, ts) AS job_id, "
                                          "arg_max(rank, ts) AS rank")
    else:
        last = "argMaxIf({c}, g.ts, isNotNull({c}))"
        head = ("max(g.ts) AS newest, toInt64(count()) AS samples, argMax(job_id, g.ts) AS job_id, "
                "argMax(rank, g.ts) AS rank")
    exprs = {"min": "min({c})", "max": "max({c})", "mean": "avg({c})", "last": last}
    return head + "".join(f", {exprs[s].format(c=f)} AS {name}" for name, f, s in value_columns())


def minute_columns(last: Sequence[str], means: Sequence[str], mins: Sequence[str],
                   maxs: Sequence[str]) -> str:
    """The rollup columns answering ``gpu_minutes``' per-minute aggregates, under the fields' names."""
    picks = ([(c, "last") for c in last] + [(c, "mean") for c in means] + [(c, "min") for c in mins]
             + [(c, "max") for c in maxs])
    return "".join(f", {column(c, s)} AS {c}" for c, s in picks)


def series_stat(field: str) -> str:
    """What a rolled-up series point of ``field`` shows: a gauge's mean over the minute, a counter's last value
    (so a counter's increase between points reads the same on either tier)."""
    return "last" if fields.BY_NAME[field].kind is fields.Kind.COUNTER else "mean"


def sample_columns() -> str:
    """The rollup columns a rolled-up minute shows as one sample, under the fields' names (each field's
    :func:`series_stat`), so a rolled-up row reads like a raw ``gpu_samples`` row."""
    return "".join(f", {column(f, series_stat(f))} AS {f}" for f in fields.GPU_FIELD_NAMES)


def join_samples(rolled: pd.DataFrame, raw: pd.DataFrame) -> pd.DataFrame:
    """GPU sample rows from both tiers, ordered by node, GPU and time, with ``rolled_up`` saying which rows
    stand for a whole minute (from its rollup) and which are raw samples."""
    parts = [p.assign(rolled_up=flag) for p, flag in ((rolled, True), (raw, False)) if len(p)]
    if not parts:
        return raw.assign(rolled_up=pd.Series(dtype=bool))
    both = pd.concat(parts, ignore_index=True) if len(parts) > 1 else parts[0]
    return both.sort_values(["node", "gpu_index", "ts"], kind="stable").reset_index(drop=True)


def join_series(rolled: pd.DataFrame, raw: pd.DataFrame, limit: int | None) -> pd.DataFrame:
    """One series (ts_ms, value, resolution_s), oldest first, from the rolled-up points before the raw cutoff
    and the raw points after it (their resolution: the GPU's sample interval, whole seconds, at least 1)."""
    raw = raw.copy()
    gaps = np.diff(raw["ts_ms"].to_numpy(np.int64)) if len(raw) else np.empty(0, np.int64)
    raw["resolution_s"] = max(1, int(round(float(np.median(gaps)) / 1000))) if len(gaps) else 1
    rolled = rolled.assign(resolution_s=ROLLUP_RESOLUTION_S)
    parts = [p for p in (rolled, raw) if len(p)]
    out = pd.concat(parts, ignore_index=True) if parts else raw
    out = out.astype({"ts_ms": "int64", "resolution_s": "int64"})
    return (out.tail(limit) if limit else out).reset_index(drop=True)


# ---- DuckDB ------------------------------------------------------------------------------------------------
def duckdb_ddl() -> list[str]:
    values = ", ".join(f"{name} DOUBLE" for name, _, _ in value_columns())
    return [f"""CREATE TABLE IF NOT EXISTS {ROLLUP_TABLE} (
    node VARCHAR NOT NULL, gpu_index INTEGER NOT NULL, minute TIMESTAMP NOT NULL, ts TIMESTAMP NOT NULL,
    samples BIGINT NOT NULL, job_id VARCHAR, rank INTEGER, {values})""",
            f"CREATE TABLE IF NOT EXISTS {STATE_TABLE} (name VARCHAR PRIMARY KEY, cutoff_ms BIGINT NOT NULL)"]


def duckdb_cutoff(con: duckdb.DuckDBPyConnection) -> int | None:
    """The raw cutoff (epoch ms): minutes before it are answered from rollups; None while nothing expired."""
    row = con.execute(f"SELECT cutoff_ms FROM {STATE_TABLE} WHERE name = 'raw'").fetchone()
    return None if row is None else int(row[0])


def duckdb_build(con: duckdb.DuckDBPyConnection, start_ms: int, end_ms: int) -> None:
    """Recompute the rollups of the minutes in [start_ms, end_ms) from the raw rows (inside the caller's
    transaction)."""
    params = {"start": _datetime(start_ms), "end": _datetime(end_ms)}
    con.execute(f"DELETE FROM {ROLLUP_TABLE} WHERE minute >= $start AND minute < $end", params)
    con.execute(f"""INSERT INTO {ROLLUP_TABLE} BY NAME
        SELECT node, gpu_index, date_trunc('minute', ts) AS minute, {aggregates('duckdb')}
        FROM gpu_samples WHERE ts >= $start AND ts < $end GROUP BY node, gpu_index, minute""", params)


def duckdb_expire(con: duckdb.DuckDBPyConnection, cutoff_ms: int, rollup_cutoff_ms: int | None) -> dict[str, int]:
    """Roll up every minute before ``cutoff_ms`` not yet final, record the cutoff, then delete the raw rows
    before it (and rollups before ``rollup_cutoff_ms``), in the caller's transaction."""
    old = duckdb_cutoff(con)
    deleted = {"gpu_samples": 0, ROLLUP_TABLE: 0}
    if old is None or cutoff_ms > old:
        duckdb_build(con, old if old is not None else 0, cutoff_ms)
        con.execute(f"INSERT OR REPLACE INTO {STATE_TABLE} VALUES ('raw', ?)", [cutoff_ms])
        deleted["gpu_samples"] = int(con.execute("DELETE FROM gpu_samples WHERE ts < ?",
                                                 [_datetime(cutoff_ms)]).fetchall()[0][0])
    if rollup_cutoff_ms is not None:
        deleted[ROLLUP_TABLE] = int(con.execute(f"DELETE FROM {ROLLUP_TABLE} WHERE minute < ?",
                                                [_datetime(rollup_cutoff_ms)]).fetchall()[0][0])
    return deleted


def _datetime(ms: int) -> dt.datetime:
    return dt.datetime(1970, 1, 1) + dt.timedelta(milliseconds=ms)


# ---- ClickHouse ----------------------------------------------------------------------------------------------
def clickhouse_ddl() -> dict[str, tuple[str, str]]:
    """The two tables in clickhouse.py's ``_ddl`` form: a recomputed minute replaces the older row (by
    ``built_ns``), the raw cutoff only grows."""
    values = ", ".join(f"{name} Nullable(Float64) CODEC(Gorilla, ZSTD(1))" for name, _, _ in value_columns())
    return {
        ROLLUP_TABLE: (f"""node LowCardinality(String), gpu_index Int32, minute DateTime64(3, 'UTC'),
    ts DateTime64(3, 'UTC'), samples Int64, job_id LowCardinality(Nullable(String)), rank Nullable(Int32),
    {values}, built_ns Int64""", "Replacing{engine}(built_ns) PARTITION BY toYYYYMM(minute) "
                                 "ORDER BY (node, gpu_index, minute)"),
        STATE_TABLE: ("name String, cutoff_ms Int64", "Replacing{engine}(cutoff_ms) ORDER BY name"),
    }


def clickhouse_build_sql() -> str:
    """INSERT recomputing the minutes in [{start}, {end}) from the raw rows (run with ``final = 1``, so rows a
    collector wrote twice count once)."""
    names = ", ".join(name for name, _, _ in value_columns())
    return f"""INSERT INTO {ROLLUP_TABLE} (node, gpu_index, minute, ts, samples, job_id, rank, {names}, built_ns)
        SELECT node, gpu_index, toStartOfMinute(g.ts) AS minute, {aggregates('clickhouse')},
               toUnixTimestamp64Nano(now64(9)) AS built_ns
        FROM gpu_samples AS g WHERE g.ts >= fromUnixTimestamp64Milli({{start:Int64}})
          AND g.ts < fromUnixTimestamp64Milli({{end:Int64}}) GROUP BY node, gpu_index, minute"""
