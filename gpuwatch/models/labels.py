"""Labels and time splits: what counts as "a fault within the horizon", and blocks that cannot leak.

A feature row at t is positive iff a fault episode of its GPU starts in (t + warning, t + horizon]
(docs/background.md §4). Rows during an episode (until its last evidence plus the coalescing gap),
rows in the warning gap just before a fault, and rows whose horizon passes the end of the data are
censored: neither positive nor negative. Splits are forward-chaining in time with a gap of one horizon
before each later block, so no training row's horizon reaches into validation or test.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from gpuwatch.models.faults import COALESCE_S

DEFAULT_HORIZON_S = 3600
DEFAULT_WARNING_S = 300


def label(feats: pd.DataFrame, episodes: pd.DataFrame, *, horizon_s: float = DEFAULT_HORIZON_S,
          warning_s: float = DEFAULT_WARNING_S, data_end_ms: int) -> pd.DataFrame:
    """``feats`` plus ``label`` (0/1), ``censored`` (bool) and ``next_fault_ms`` (NaN when none follows)."""
    out = feats.copy()
    h, w = horizon_s * 1000, warning_s * 1000
    nxt = np.full(len(out), np.nan)
    inside = np.zeros(len(out), bool)
    eps = episodes.sort_values("start_ms")
    for (node, gpu), ep in eps.groupby(["node", "gpu_index"], sort=False):
        rows = np.flatnonzero((out["node"].to_numpy() == node) & (out["gpu_index"].to_numpy() == gpu))
        if not len(rows):
            continue
        t = out["t_ms"].to_numpy()[rows]
        starts = ep["start_ms"].to_numpy()
        k = np.searchsorted(starts, t, side="right")  # first episode starting after t
        nxt[rows] = np.where(k < len(starts), starts[np.minimum(k, len(starts) - 1)], np.nan)
        ends = ep["end_ms"].to_numpy() + COALESCE_S * 1000
        prev = k - 1
        inside[rows] = (prev >= 0) & (t <= ends[np.maximum(prev, 0)])
    until = nxt - out["t_ms"].to_numpy()
    out["next_fault_ms"] = nxt
    out["label"] = ((until > w) & (until <= h)).astype(np.int8)
    out["censored"] = inside | (until <= w) | (out["t_ms"].to_numpy() + h > data_end_ms)
    return out


@dataclass(frozen=True)
class Split:
    """Time blocks for feature rows (half-open [lo, hi) in epoch ms)."""

    train: tuple[int, int]
    validation: tuple[int, int]
    test: tuple[int, int]


def time_split(start_ms: int, end_ms: int, *, horizon_s: float = DEFAULT_HORIZON_S,
               fractions: tuple[float, float] = (0.6, 0.2)) -> Split:
    """Train, validation and test blocks in time order, each later block starting one horizon after the last."""
    span = end_ms - start_ms
    t1 = start_ms + int(span * fractions[0])
    t2 = start_ms + int(span * (fractions[0] + fractions[1]))
    gap = int(horizon_s * 1000)
    return Split((start_ms, t1), (t1 + gap, t2), (t2 + gap, end_ms + 1))


def in_block(feats: pd.DataFrame, block: tuple[int, int]) -> np.ndarray:
    t = feats["t_ms"].to_numpy()
    return (t >= block[0]) & (t < block[1])
