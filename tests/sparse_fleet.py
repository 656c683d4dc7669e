"""Sparse recordings as a real fault log converts to one: per GPU life one all-empty sample at insert and one
at removal, and its faults as XID events (a double-bit error -> XID 48, off the bus -> XID 79)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from gpuwatch.core.recording import RecordingWriter

START = pd.Timestamp("2014-01-01", tz="UTC")


def write_sparse_recording(out: Path, *, nodes: int, gpus_per_node: int, days: float, seed: int = 0,
                           lives_per_gpu: int = 2, fault_share: float = 0.5,
                           telemetry: dict[str, float] | None = None) -> dict:
    """Write the recording; returns {"samples", "faults"} counts. Each slot holds ``lives_per_gpu`` GPUs in turn;
    ``fault_share`` of the lives end in a fault. ``telemetry``: field -> value set on every sample (else all
    fields empty, as a converted fault log has)."""
    rng = np.random.default_rng(seed)
    span_ms = int(days * 86_400_000)
    t0 = int(START.value // 1_000_000)
    samples, events = [], []
    for n in range(nodes):
        for g in range(gpus_per_node):
            cuts = np.sort(rng.integers(0, span_ms, lives_per_gpu - 1)) if lives_per_gpu > 1 else np.zeros(0, int)
            bounds = np.r_[0, cuts, span_ms]
            for a, b in zip(bounds[:-1], bounds[1:]):
                if b - a < 3_600_000:
                    continue
                node = f"n{n:04d}"
                samples += [{"node": node, "gpu_index": g, "ts": t0 + int(a), **(telemetry or {})},
                            {"node": node, "gpu_index": g, "ts": t0 + int(b) - 2_400_000, **(telemetry or {})}]
                if rng.random() < fault_share:
                    code = int(rng.choice([48, 79]))
                    events.append({"node": node, "gpu_index": g, "ts": t0 + int(b) - 600_000, "kind": "xid",
                                   "code": code, "message": f"Xid {code}"})
    with RecordingWriter(out, source="sparse-test", resolution_s=None) as w:
        for table, rows in (("gpu_samples", samples), ("events", events)):
            df = pd.DataFrame(rows)
            if len(df):
                df["ts"] = pd.to_datetime(df["ts"], unit="ms", utc=True)
            w.append(table, df)
    return {"samples": len(samples), "faults": len(events)}
