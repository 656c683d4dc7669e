"""`gpuwatch agent --record`: the rows of every batch also go into a recording (gpuwatch.core.recording format).

A recording is what replay, training and `import` read, so a node can capture its own telemetry with or
without a collector. Batches are buffered and written ``batches_per_part`` at a time (one Parquet part file
per table), so a recording of a day at 1 Hz is a few thousand files, not hundreds of thousands. The manifest
is rewritten after each flush and by ``close``, so an agent killed mid-run leaves a recording that replay
reads (minus the batches still buffered) and that its next start continues after the last part.
"""
from __future__ import annotations

import os
from collections import defaultdict

import pandas as pd

from gpuwatch.core.batch_tables import batch_tables, inventory_table
from gpuwatch.core.recording import RecordingWriter
from gpuwatch.v1 import telemetry_pb2 as pb


class BatchRecorder:
    """Appends batches to a recording directory (an existing recording is continued, not overwritten)."""

    def __init__(self, path: str | os.PathLike, *, resolution_s: float | None = None,
                 batches_per_part: int = 12) -> None:
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
        """Write what is buffered (one part file per table), then the manifest."""
        for table, frames in self._buffered.items():
            if frames:
                self.writer.append(table, pd.concat(frames, ignore_index=True))
        self._buffered.clear()
        self._held = 0
        self.writer.write_manifest()

    def close(self) -> None:
        """Write the rest and the manifest."""
        self.flush()
