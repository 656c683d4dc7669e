"""Array helpers the efficiency engine shares."""
from __future__ import annotations

import numpy as np


def distinct(values: np.ndarray) -> np.ndarray:
    """The sorted distinct values of an integer array (any shape, read flat), as `np.unique` gives them.

    `np.unique` without its index options asks numpy.ma whether the array is masked, and importing numpy.ma
    costs 10 ms of CPU, 4 % of a whole `gpuwatch analyze` of a single trace."""
    ordered = np.sort(np.asarray(values).ravel())
    if not len(ordered):
        return ordered
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))]


def median(values: np.ndarray | list[float]) -> float:
    """`np.median` of a non-empty set of numbers, bit for bit (the middle value, or the mean of the two middle
    values of an even count; NaN if any is NaN), without the numpy.ma check `np.median` makes."""
    ordered = np.sort(np.asarray(values, dtype=np.float64).ravel())
    if np.isnan(ordered[-1]):
        return float("nan")
    half = len(ordered) // 2
    return float(ordered[half]) if len(ordered) % 2 else float(np.mean(ordered[half - 1:half + 1]))
