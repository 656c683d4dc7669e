"""`gpuwatch export`: a collector's store (DuckDB or ClickHouse) written out as a recording
(gpuwatch.core.recording format).

The store's telemetry tables have the recording's columns, so export is the store's own reads, one node at a
time; the result replays, trains and imports like any other recording (store -> recording -> replay
round-trips), and the same data gives the same recording on either engine. Minutes whose raw GPU samples
expired under tiered retention (``--raw-retention``) are exported from their per-minute rollups: one row per
GPU and minute at its newest sample's time, gauges as the minute's mean and counters as its last value. A
store held by a running collector is refused (each engine locks its store to one process): export a stopped
collector's store, or a copy of a running one's.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pandas as pd

from gpuwatch.collector.store.existing import open_existing
from gpuwatch.core.fields import GPU_FIELD_NAMES, HOST_FIELD_NAMES
from gpuwatch.core.progress import Progress
from gpuwatch.core.recording import check_new_recording, new_recording

SOURCE = "gpuwatch collector export"

_GPU_COLUMNS = ["node", "gpu_index", "ts", "job_id", "rank", "local_rank", *GPU_FIELD_NAMES]
_HOST_COLUMNS = ["node", "ts", *HOST_FIELD_NAMES]
_EVENT_COLUMNS = ["node", "gpu_index", "ts", "kind", "code", "message", "attrs"]
_SPAN_COLUMNS = ["job_id", "rank", "step", "kind", "name", "start_us", "dur_us", "process_group", "seq", "bytes",
                 "world_size", "node", "peer"]
_INVENTORY_COLUMNS = ["node", "index", "uuid", "name", "pci_bus_id", "serial", "memory_total_bytes",
                      "architecture", "gpm_supported"]


def export_store(store: str | os.PathLike, out: str | os.PathLike, *, since_ms: int | None = None,
                 until_ms: int | None = None, quiet: bool = False) -> dict[str, Any]:
    """Write the store's telemetry (optionally only ``since_ms`` <= time <= ``until_ms``) to a new recording.

    ``store`` is a DuckDB file or a store URL (``chdb:///DIR``, ``clickhouse://...``). One part file per node
    and table; spans are kept when their start lies in the range. Returns the rows written per table, the
    nodes and the GPU rows that came from rollups. UserError when the store is missing, held by a running
    collector or not a gpuwatch store, or ``out`` already holds something.
    """
    out, url = Path(out), os.fspath(store)
    check_new_recording(out)
    opened = open_existing(url)
    rows = {"gpu_samples": 0, "host_samples": 0, "events": 0, "spans": 0, "gpus": 0}
    rolled_up = 0
    try:
        inventory = pd.DataFrame(opened.gpus(), columns=_INVENTORY_COLUMNS)
        nodes = sorted({n["node"] for n in opened.nodes()} | set(inventory["node"]))
        name = url if "://" in url else str(Path(url).resolve())
        with new_recording(out, source=SOURCE, extra={"export": {
                "store": name, "since_ms": since_ms, "until_ms": until_ms}}) as writer, \
                Progress("export", total=len(nodes), unit="nodes", quiet=quiet) as progress:
            exported: set[str] = set()
            for node in nodes:
                gpu = opened.tiered_gpu_samples(since_ms, until_ms, nodes=[node])
                rolled_up += int(gpu.pop("rolled_up").sum())
                frames = {"gpu_samples": _recording_samples(gpu),
                          "host_samples": _in_range(opened.host_samples(since_ms, nodes=[node]), "ts", until_ms),
                          "events": _events(opened.events(node=node, since_ms=since_ms), until_ms)}
                for table, df in frames.items():
                    writer.append(table, df)
                    rows[table] += len(df)
                    exported.update(df["node"])
                progress.advance()
            spans = opened.spans(since_us=None if since_ms is None else since_ms * 1000.0)
            if until_ms is not None:
                spans = spans[spans["start_us"] <= until_ms * 1000.0]
            spans = spans[_SPAN_COLUMNS].reset_index(drop=True)
            writer.append("spans", spans)
            gpus = inventory[inventory["node"].isin(exported)].reset_index(drop=True)
            writer.append("gpus", gpus)
            rows.update(spans=len(spans), gpus=len(gpus))
    finally:
        opened.close()
    return {"out": str(out), "store": url, "nodes": sorted(exported), "rows": rows,
            "gpu_rows_from_rollups": rolled_up}


def _recording_samples(df: pd.DataFrame) -> pd.DataFrame:
    """GPU sample rows as a recording holds them: no job is '', no rank -1."""
    df = df[_GPU_COLUMNS].copy()
    df["job_id"] = df["job_id"].astype(object).where(df["job_id"].notna(), "")
    for column in ("rank", "local_rank"):
        df[column] = df[column].astype("Float64").fillna(-1).astype("int64")
    return df


def _events(rows: list[dict[str, Any]], until_ms: int | None) -> pd.DataFrame:
    """The store's events (newest first, times in ms) as a recording's rows, oldest first."""
    df = pd.DataFrame(rows[::-1], columns=["node", "gpu_index", "ts_ms", "kind", "code", "message", "attrs"])
    df["ts"] = pd.to_datetime(df.pop("ts_ms"), unit="ms")
    return _in_range(df[_EVENT_COLUMNS], "ts", until_ms)


def _in_range(df: pd.DataFrame, column: str, until_ms: int | None) -> pd.DataFrame:
    """``df``'s rows up to ``until_ms`` (the store reads bound only the start)."""
    if until_ms is None or df.empty:
        return df.reset_index(drop=True)
    times = pd.to_datetime(df[column], utc=True)
    return df[times <= pd.Timestamp(until_ms, unit="ms", tz="UTC")].reset_index(drop=True)
