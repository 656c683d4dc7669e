"""`gpuwatch export`: a collector's DuckDB store written out as a recording (gpuwatch.core.recording format).

The store's telemetry tables have the recording's columns, so export is a read per node and table; the
result replays, trains and imports like any other recording (store -> recording -> replay round-trips).
Minutes whose raw GPU samples expired under tiered retention (``--raw-retention``) are exported from their
per-minute rollups: one row per GPU and minute at its newest sample's time, gauges as the minute's mean and
counters as its last value. The store is opened read-only, which DuckDB allows only while no collector holds
the file: export a stopped collector's store, or a copy of a running one's.
"""
from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd

from gpuwatch.collector.store import rollups
from gpuwatch.core.errors import UserError
from gpuwatch.core.fields import GPU_FIELD_NAMES, HOST_FIELD_NAMES
from gpuwatch.core.progress import Progress
from gpuwatch.core.recording import check_new_recording, new_recording

SOURCE = "gpuwatch collector export"

# Per recording table: the SELECT list over the store table of the same name, and the time column.
_SELECTS: dict[str, tuple[str, str]] = {
    "gpu_samples": (", ".join(["node", "gpu_index", "ts", "coalesce(job_id, '') AS job_id",
                               "coalesce(rank, -1) AS rank", "coalesce(local_rank, -1) AS local_rank",
                               *GPU_FIELD_NAMES]), "ts"),
    "host_samples": (", ".join(["node", "ts", *HOST_FIELD_NAMES]), "ts"),
    "events": ("node, gpu_index, ts, kind, code, message, CAST(attrs AS VARCHAR) AS attrs", "ts"),
}
# GPU samples of the minutes before the raw cutoff: their rollups, in the recording's columns.
_ROLLED_UP = ", ".join(["node", "gpu_index", "ts", "coalesce(job_id, '') AS job_id", "coalesce(rank, -1) AS rank",
                        "-1 AS local_rank", *(f"{rollups.column(f, rollups.series_stat(f))} AS {f}"
                                              for f in GPU_FIELD_NAMES)])
_ORDER = {"gpu_samples": "gpu_index, ts", "host_samples": "ts", "events": "ts"}
_SPANS = "job_id, rank, step, kind, name, start_us, dur_us, process_group, seq, bytes, world_size, node, peer"
_GPUS = ('node, "index", uuid, name, pci_bus_id, serial, memory_total_bytes::BIGINT AS memory_total_bytes, '
         "architecture, gpm_supported")


def export_store(db_path: str | os.PathLike, out: str | os.PathLike, *, since_ms: int | None = None,
                 until_ms: int | None = None, quiet: bool = False) -> dict[str, Any]:
    """Write the store's telemetry (optionally only ``since_ms`` <= time <= ``until_ms``) to a new recording.

    One part file per node and table; spans are kept when their start lies in the range. Returns the rows
    written per table and the nodes. UserError when the store is missing, locked or not a gpuwatch store,
    or ``out`` already holds something.
    """
    out = Path(out)
    check_new_recording(out)
    con = _connect(Path(db_path))
    window = {"since": _datetime(since_ms), "until": _datetime(until_ms)}
    in_range = "($since IS NULL OR {col} >= $since) AND ($until IS NULL OR {col} <= $until)"
    rows = {"gpu_samples": 0, "host_samples": 0, "events": 0, "spans": 0, "gpus": 0}
    rolled_up = 0
    try:
        cutoff = _raw_cutoff(con)
        nodes = [r[0] for r in con.execute(
            "SELECT node FROM gpu_samples UNION SELECT node FROM host_samples UNION SELECT node FROM events "
            "UNION SELECT node FROM gpus ORDER BY 1").fetchall()]
        with new_recording(out, source=SOURCE, extra={"export": {
                "store": str(Path(db_path).resolve()), "since_ms": since_ms, "until_ms": until_ms}}) as writer, \
                Progress("export", total=len(nodes), unit="nodes", quiet=quiet) as progress:
            exported = set()
            for node in nodes:
                for table, (columns, ts) in _SELECTS.items():
                    sql = f"SELECT {columns} FROM {table} WHERE node = $node AND {in_range.format(col=ts)}"
                    params = {**window, "node": node}
                    if table == "gpu_samples" and cutoff is not None:
                        sql = (f"SELECT {_ROLLED_UP}, true AS rolled FROM {rollups.ROLLUP_TABLE} WHERE node = $node "
                               f"AND minute < $cutoff AND {in_range.format(col='ts')} UNION ALL "
                               f"SELECT {columns}, false AS rolled FROM ({sql})")
                        params["cutoff"] = cutoff
                    df = _fetch(con, f"{sql} ORDER BY {_ORDER[table]}", params)
                    if "rolled" in df:
                        rolled_up += int(df.pop("rolled").sum())
                    writer.append(table, df)
                    rows[table] += len(df)
                    exported.update(df["node"])
                progress.advance()
            spans = _fetch(con, f"SELECT {_SPANS} FROM spans WHERE {in_range.format(col='start_us')} "
                           "ORDER BY job_id, rank, start_us", _span_window(since_ms, until_ms))
            writer.append("spans", spans)
            gpus = _fetch(con, f'SELECT {_GPUS} FROM gpus ORDER BY node, "index"', {})
            gpus = gpus[gpus["node"].isin(exported)]
            writer.append("gpus", gpus)
            rows.update(spans=len(spans), gpus=len(gpus))
    finally:
        con.close()
    return {"out": str(out), "store": str(db_path), "nodes": sorted(exported), "rows": rows,
            "gpu_rows_from_rollups": rolled_up}


def _raw_cutoff(con: duckdb.DuckDBPyConnection) -> dt.datetime | None:
    """The tiered store's raw cutoff (None: every sample is raw, or a store from before tiered retention)."""
    tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    cutoff = rollups.duckdb_cutoff(con) if rollups.STATE_TABLE in tables else None
    return None if cutoff is None else _datetime(cutoff)


def _connect(path: Path) -> duckdb.DuckDBPyConnection:
    if not path.is_file():
        raise UserError(f"{path}: no such collector store file")
    try:
        con = duckdb.connect(str(path), read_only=True)
    except duckdb.IOException as exc:
        if "lock" in str(exc).lower():
            raise UserError(f"{path}: the store is in use (a running collector holds its lock); stop the collector "
                            "or export a copy of the file") from None
        raise UserError(f"{path}: cannot open the store: {str(exc).splitlines()[0]}") from None
    except duckdb.Error as exc:
        raise UserError(f"{path}: not a DuckDB database: {str(exc).splitlines()[0]}") from None
    missing = {"gpu_samples", "host_samples", "events", "spans", "gpus"} - {
        r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    if missing:
        con.close()
        raise UserError(f"{path}: not a gpuwatch collector store (no table {', '.join(sorted(missing))})")
    return con


def _fetch(con: duckdb.DuckDBPyConnection, sql: str, params: dict[str, Any]) -> pd.DataFrame:
    return con.sql(sql, params=params).to_arrow_table().to_pandas()


def _datetime(ms: int | None) -> dt.datetime | None:
    return None if ms is None else dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).replace(tzinfo=None)


def _span_window(since_ms: int | None, until_ms: int | None) -> dict[str, float | None]:
    """Span times are epoch µs, not timestamps."""
    return {"since": None if since_ms is None else since_ms * 1000.0,
            "until": None if until_ms is None else until_ms * 1000.0}
