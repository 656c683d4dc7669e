"""`gpuwatch agent --record`: the rows of every batch also go into a recording (gpuwatch.recording format).

A recording is what replay, training and `import` read, so a node can capture its own telemetry with or
without a collector. Batches are buffered and written ``batches_per_part`` at a time (one Parquet part file
per table), so a recording of a day at 1 Hz is a few thousand files, not hundreds of thousands; ``close``
writes the rest and the manifest.
"""
from __future__ import annotations

import os
from collections import defaultdict

import pandas as pd

from gpuwatch.recording import RecordingWriter
from gpuwatch.v1 import telemetry_pb2 as pb

_SPAN_COLUMNS = tuple(pb.SpanTable.DESCRIPTOR.fields_by_name)
_SPAN_DEFAULTS = {"process_group": "", "node": "", "job_id": "", "kind": "", "name": ""}  # numeric ones: -1


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
            name: list(getattr(batch.spans, name)) or [_SPAN_DEFAULTS.get(name, -1)] * n_spans
            for name in _SPAN_COLUMNS})
    return tables


def _gpu_frame(node: str, s: pb.GpuSamples) -> pd.DataFrame:
    n = len(s.ts_ms)
    return pd.DataFrame({
        "node": node, "gpu_index": s.gpu_index, "ts": list(s.ts_ms),
        "job_id": list(s.job_id) or [""] * n, "rank": list(s.rank) or [-1] * n,
        "local_rank": list(s.local_rank) or [-1] * n,
        **{c.field: list(c.values) for c in s.columns},
    })


def inventory_table(node: str, gpus: list[pb.GpuInfo]) -> pd.DataFrame:
    return pd.DataFrame([{"node": node, "index": g.index, "uuid": g.uuid, "name": g.name, "pci_bus_id": g.pci_bus_id,
                          "serial": g.serial, "memory_total_bytes": g.memory_total_bytes,
                          "architecture": g.architecture, "gpm_supported": g.gpm_supported} for g in gpus])


class BatchRecorder:
    """Appends batches to a recording directory (an existing recording is continued, not overwritten)."""

    def __init__(self, path: str | os.PathLike, *, resolution_s: float | None = None, batches_per_part: int = 12) -> None:
        self.writer = RecordingWriter(path, source="gpuwatch agent", resolution_s=resolution_s)
        self.batches_per_part = batches_per_part
        self.batches = 0
        self._buffered: dict[str, list[pd.DataFrame]] = defaultdict(list)
        self._held = 0
        self._inventory: list[pb.GpuInfo] | None = None

    def add(self, batch: pb.TelemetryBatch) -> None:
        if self._inventory != list(batch.gpus):  # once, and again only when the node's GPUs change
            self._inventory = list(batch.gpus)
            self._buffered["gpus"].append(inventory_table(batch.node.node, self._inventory))
        for table, frame in batch_tables(batch).items():
            if not frame.empty:
                self._buffered[table].append(frame)
        self.batches += 1
        self._held += 1
        if self._held >= self.batches_per_part:
            self.flush()

    def flush(self) -> None:
        """Write what is buffered: one part file per table."""
        for table, frames in self._buffered.items():
            if frames:
                self.writer.append(table, pd.concat(frames, ignore_index=True))
        self._buffered.clear()
        self._held = 0

    def close(self) -> None:
        """Write the rest and the manifest (readers see a complete recording only after this)."""
        self.flush()
        self.writer.close()
