"""Telemetry batches <-> DataFrames in the recording's tables: the one conversion pair.

`gpuwatch agent --record` turns every batch into table rows (:func:`batch_tables`); replay turns a node's
table rows back into the batches its agent would have sent (:func:`frames_batches`). Both sides use the
recording schemas (gpuwatch.core.recording.SCHEMAS), so a recording replays into the rows it was made from.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from gpuwatch import __version__
from gpuwatch.core.batches import BatchBuilder
from gpuwatch.core.fields import GPU_FIELD_NAMES, HOST_FIELD_NAMES
from gpuwatch.core.recording import conform, ts_ms
from gpuwatch.core.spans import SPAN_COLUMNS, SPAN_COLUMN_NAMES, SPAN_UNSET
from gpuwatch.v1 import telemetry_pb2 as pb

#: Sample ticks per batch: a 1 Hz agent recording replays as one-minute batches (what an agent sends).
DEFAULT_TICKS_PER_BATCH = 60
#: Probe spans per batch; a busy tick's spans beyond this follow in extra batches of the same time.
SPANS_PER_BATCH = 50_000


# ------------------------------------------------------------------------------------ batch -> tables
def batch_tables(batch: pb.TelemetryBatch) -> dict[str, pd.DataFrame]:
    """The batch's rows as DataFrames in the recording's tables (``ts`` as epoch ms; absent fields left out)."""
    node = batch.node.node
    tables = {"gpu_samples": pd.concat([_gpu_frame(node, s) for s in batch.samples], ignore_index=True)
              if batch.samples else pd.DataFrame()}
    if len(batch.host.ts_ms):
        tables["host_samples"] = pd.DataFrame(
            {"node": node, "ts": list(batch.host.ts_ms), **{c.field: list(c.values) for c in batch.host.columns}})
    if batch.events:
        tables["events"] = pd.DataFrame([
            {"node": node, "gpu_index": e.gpu_index, "ts": e.ts_ms, "kind": e.kind, "code": e.code,
             "message": e.message, "attrs": dict(e.attrs)} for e in batch.events])
    n_spans = len(batch.spans.start_us)
    if n_spans:
        tables["spans"] = pd.DataFrame({
            name: list(getattr(batch.spans, name)) or [SPAN_UNSET[name]] * n_spans for name in SPAN_COLUMN_NAMES})
    return tables


def _gpu_frame(node: str, s: pb.GpuSamples) -> pd.DataFrame:
    n = len(s.ts_ms)
    return pd.DataFrame({
        "node": node, "gpu_index": s.gpu_index, "ts": list(s.ts_ms),
        "job_id": list(s.job_id) or [""] * n, "rank": list(s.rank) or [-1] * n,
        "local_rank": list(s.local_rank) or [-1] * n,
        **{c.field: list(c.values) for c in s.columns},
    })


def inventory_table(node: str, gpus: Sequence[pb.GpuInfo]) -> pd.DataFrame:
    """The ``gpus`` table rows of a batch's inventory."""
    return pd.DataFrame([{"node": node, "index": g.index, "uuid": g.uuid, "name": g.name, "pci_bus_id": g.pci_bus_id,
                          "serial": g.serial, "memory_total_bytes": g.memory_total_bytes,
                          "architecture": g.architecture, "gpm_supported": g.gpm_supported} for g in gpus])


# ------------------------------------------------------------------------------------ tables -> batches
@dataclass(frozen=True)
class TimedBatch:
    """A batch and the recorded time (epoch ms) at which its agent would have sent it."""

    ts_ms: int
    batch: pb.TelemetryBatch


def frames_batches(node: str, agent_id: str, *, gpu_samples: pd.DataFrame | None = None,
                   host_samples: pd.DataFrame | None = None, events: pd.DataFrame | None = None,
                   spans: pd.DataFrame | None = None, gpus: pd.DataFrame | None = None,
                   ticks_per_batch: int = DEFAULT_TICKS_PER_BATCH) -> Iterator[TimedBatch]:
    """One node's table rows as the batches its agent would have sent, sequence 1, 2, ... in time order.

    Frames are rows of the recording tables of the same name (missing optional columns are filled as a
    recording writer fills them). Rows are cut every ``ticks_per_batch`` sample timestamps; events and spans
    go into the batch covering their time. NaN/NULL values stay missing (a field never set in a batch is
    left out of it). The inventory is ``gpus``' last entry per GPU plus a bare entry per sampled GPU.
    """
    frames = {name: conform(name, df) for name, df in (("gpu_samples", gpu_samples), ("host_samples", host_samples),
                                                        ("events", events), ("spans", spans), ("gpus", gpus))}
    gpu = frames["gpu_samples"].sort_values(["ts", "gpu_index"], kind="stable")
    host = frames["host_samples"].sort_values("ts", kind="stable")
    evts = frames["events"].sort_values("ts", kind="stable")
    spns = frames["spans"].sort_values("start_us", kind="stable")
    times = {"gpus": ts_ms(gpu["ts"]), "host": ts_ms(host["ts"]), "events": ts_ms(evts["ts"]),
             "spans": (spns["start_us"].to_numpy(dtype=float) // 1000).astype(np.int64)}
    ticks = np.unique(np.concatenate([times["gpus"], times["host"]]))
    if not len(ticks):  # a node that only has events or spans
        ticks = np.unique(np.concatenate([times["events"], times["spans"]]))
    if not len(ticks):
        return
    starts = ticks[::ticks_per_batch]
    chunk_of = {name: np.clip(np.searchsorted(starts, t, side="right") - 1, 0, None) for name, t in times.items()}
    bounds = {name: np.searchsorted(c, np.arange(len(starts) + 1)) for name, c in chunk_of.items()}
    identity = pb.NodeIdentity(node=node, agent_version=f"gpuwatch {__version__} replay")
    builder = BatchBuilder(identity, agent_id, _inventory(frames["gpus"], gpu["gpu_index"].unique()))
    gpu_blocks = _GpuBlocks(gpu, times["gpus"], chunk_of["gpus"])
    host_values = np.ascontiguousarray(host[list(HOST_FIELD_NAMES)].to_numpy(dtype=float).T)  # field x row
    sequence = 0
    for i in range(len(starts)):
        part = {name: slice(b[i], b[i + 1]) for name, b in bounds.items()}
        gpu_blocks.add(builder, part["gpus"])
        _add_host_rows(builder, host_values[:, part["host"]], times["host"][part["host"]])
        _add_events(builder, evts.iloc[part["events"]], times["events"][part["events"]])
        chunk_spans = spns.iloc[part["spans"]]
        sent_at = int(ticks[min((i + 1) * ticks_per_batch, len(ticks)) - 1])
        for first in range(0, max(len(chunk_spans), 1), SPANS_PER_BATCH):
            if len(chunk_spans):
                builder.add_spans(_span_table(chunk_spans.iloc[first:first + SPANS_PER_BATCH]))
            sequence += 1
            yield TimedBatch(sent_at, builder.build(sequence, created_ms=sent_at))


def _inventory(table: pd.DataFrame, sampled: Iterable[int]) -> list[pb.GpuInfo]:
    """The last inventory entry per GPU, plus bare entries for sampled GPUs it lacks (the collector refuses
    samples of a GPU missing from a batch's inventory)."""
    info = {}
    for row in table.drop_duplicates("index", keep="last").itertuples(index=False):
        info[int(row.index)] = pb.GpuInfo(
            index=int(row.index), uuid=_text(row.uuid), name=_text(row.name), pci_bus_id=_text(row.pci_bus_id),
            serial=_text(row.serial), architecture=_text(row.architecture),
            memory_total_bytes=0 if pd.isna(row.memory_total_bytes) else int(row.memory_total_bytes),
            gpm_supported=bool(row.gpm_supported) if not pd.isna(row.gpm_supported) else False)
    for index in sampled:
        info.setdefault(int(index), pb.GpuInfo(index=int(index)))
    return [info[i] for i in sorted(info)]


class _GpuBlocks:
    """A node's GPU sample rows converted to arrays once, handed to batches as per-GPU columnar blocks.

    Rows arrive sorted by (ts, gpu_index) and grouped into batches by ``chunk``; within a batch each GPU's
    rows become one block in time order. A field without any value in a batch stays out of it (missing, not
    NaN-filled), as :func:`_add_host_rows` leaves out host fields. Values go to the builder as float64 arrays,
    which it copies into the batch as packed bytes.
    """

    def __init__(self, rows: pd.DataFrame, ts: np.ndarray, chunk: np.ndarray) -> None:
        gpu_index = rows["gpu_index"].to_numpy(dtype=np.int64)
        self._order = np.lexsort((ts, gpu_index, chunk))  # by batch, then GPU, then time
        self._gpu = gpu_index[self._order]
        self._ts = ts[self._order]
        self._values = rows[list(GPU_FIELD_NAMES)].to_numpy(dtype=float)[self._order]
        self._job = rows["job_id"].fillna("").astype(str).to_numpy()[self._order]
        self._rank = rows["rank"].fillna(-1).astype(np.int64).to_numpy()[self._order]
        self._local_rank = rows["local_rank"].fillna(-1).astype(np.int64).to_numpy()[self._order]

    def add(self, builder: BatchBuilder, rows: slice) -> None:
        """Add the rows of one batch (a slice of the time-sorted rows, the same positions in batch order)."""
        gpus = self._gpu[rows]
        if not len(gpus):
            return
        values = self._values[rows]
        sampled = np.flatnonzero(~np.isnan(values).all(axis=0))
        names = [GPU_FIELD_NAMES[j] for j in sampled]
        by_field = np.ascontiguousarray(values[:, sampled].T)  # a block's column is a contiguous slice of a row
        ts, job = self._ts[rows].tolist(), self._job[rows].tolist()
        rank, local_rank = self._rank[rows].tolist(), self._local_rank[rows].tolist()
        cuts = np.flatnonzero(np.diff(gpus)) + 1
        for lo, hi in zip(np.r_[0, cuts].tolist(), np.r_[cuts, len(gpus)].tolist()):
            builder.add_gpu_block(int(gpus[lo]), ts[lo:hi], dict(zip(names, by_field[:, lo:hi])),
                                  job[lo:hi], rank[lo:hi], local_rank[lo:hi])


def _add_host_rows(builder: BatchBuilder, values: np.ndarray, ts: np.ndarray) -> None:
    """Add one batch's host rows (``values``: one row per host field, one column per time in ``ts``); fields
    without any value in them stay out of the batch."""
    if len(ts):
        sampled = np.flatnonzero(~np.isnan(values).all(axis=1))
        builder.add_host_block(ts.tolist(), {HOST_FIELD_NAMES[j]: values[j] for j in sampled})


def _add_events(builder: BatchBuilder, rows: pd.DataFrame, ts: np.ndarray) -> None:
    if not len(rows):
        return  # itertuples builds a row type even for no rows
    for i, row in enumerate(rows.itertuples(index=False)):
        builder.add_event(_text(row.kind), int(ts[i]), gpu_index=int(row.gpu_index),
                          code=0 if pd.isna(row.code) else int(row.code), message=_text(row.message),
                          attrs=_attrs(row.attrs))


def _attrs(text: Any) -> dict[str, str]:
    if not isinstance(text, str) or not text:
        return {}
    try:
        parsed = json.loads(text)
    except ValueError:
        return {"attrs": text}
    if not isinstance(parsed, dict):
        return {}
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in parsed.items()}


def _span_table(rows: pd.DataFrame) -> pb.SpanTable:
    columns = {}
    for column in SPAN_COLUMNS:
        col = rows[column.name]
        if column.is_text:
            columns[column.name] = col.fillna(column.unset).astype(str).tolist()
        elif column.type == "double":
            columns[column.name] = col.astype(float).tolist()
        else:
            columns[column.name] = col.fillna(column.unset).astype(np.int64).tolist()
    return pb.SpanTable(**columns)


def _text(value: Any) -> str:
    return "" if value is None or (isinstance(value, float) and np.isnan(value)) else str(value)
