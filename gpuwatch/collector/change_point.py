"""Fail-slow onset on a time series: one upward level change in a rank's own work or collective time.

A slow-but-alive GPU shows as a step change, not a spike: from some moment on, every interval of that rank
takes longer. CUSUM of the deviations from the series' median is lowest where the level rises (Page's
change-point estimate), which gives a first onset. CUSUM sides every interval above the series' median with
the new level, so a few noisy intervals just before a change (a loaded host's hiccups) pull it early; the
onset is therefore refitted as the split of least absolute deviation from the two levels, where each interval
sides with the level it is nearer to. A robust two-window test then keeps the change only when it is
material against the series' own noise: the median after exceeds the median before by ``z_min`` times the
spread of single intervals before (1.4826 x MAD, a robust standard deviation). Every number is relative to
the series itself, so the same test serves a 50 ms and a 5 s step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAD_TO_SIGMA = 1.4826
#: an upward change must exceed this many robust standard deviations of single intervals before it
Z_MIN = 4.0
#: each side of a change holds at least this many intervals (fewer cannot give a median worth trusting)
MIN_SIDE = 5
#: at most this many refits of the onset to the two levels (they stop once the onset stays put)
REFITS = 3


@dataclass(frozen=True)
class Shift:
    """An upward level change: from ``index`` on the series runs at ``after`` instead of ``before``."""

    index: int
    before: float
    after: float
    z: float  # (after - before) / robust spread of the intervals before

    @property
    def ratio(self) -> float:
        return self.after / self.before if self.before > 0 else float("inf")


def robust_sigma(values: np.ndarray) -> float:
    """1.4826 x the median absolute deviation: the standard deviation of normal noise, unmoved by outliers."""
    x = np.asarray(values, dtype=float)
    return float(MAD_TO_SIGMA * np.median(np.abs(x - np.median(x)))) if len(x) else 0.0


def upward_shift(values: np.ndarray, *, z_min: float = Z_MIN, min_side: int = MIN_SIDE) -> Shift | None:
    """The onset of the most likely rise in ``values`` (oldest first) if it is material, else None."""
    x = np.asarray(values, dtype=float)
    n = len(x)
    if n < 2 * min_side:
        return None
    cusum = np.cumsum(x - np.median(x))
    k = _split(cusum, min_side)
    for _ in range(REFITS):
        refit = _split(np.cumsum(np.abs(x - np.median(x[:k])) - np.abs(x - np.median(x[k:]))), min_side)
        if refit == k:
            break
        k = refit
    before, after = x[:k], x[k:]
    level, new_level = float(np.median(before)), float(np.median(after))
    # a series without noise (simulated, or integer-valued) still needs a unit to measure a change in
    spread = max(robust_sigma(before), 1e-6 * abs(level), 1e-12)
    z = (new_level - level) / spread
    return Shift(k, level, new_level, z) if z >= z_min else None


def _split(prefix_cost: np.ndarray, min_side: int) -> int:
    """The first index of the new level: where the cost of the intervals up to it, summed, is lowest,
    leaving ``min_side`` intervals on either side."""
    return int(np.argmin(prefix_cost[min_side - 1:len(prefix_cost) - min_side])) + min_side
