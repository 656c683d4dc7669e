"""Step-time A/B statistics: is the probe's overhead resolved to 1 %, and what is it?

The A/B runs interleaved rounds: each round times one block of steps without the probe and one with it, so
slow drift of the machine (clocks, temperature, other tenants) hits both variants alike. The unit of
analysis is therefore the round: its overhead is ``with / without - 1``. The mean overhead gets a
Student-t interval (rounds are independent, their ratios near normal) and a bootstrap interval (no
normality assumed), both from scipy (a dependency of scikit-learn). A 1 % overhead is *resolved* when the
t interval is at most 1 percentage point wide, so 0 % and 1 % cannot both lie inside it.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import stats as sps

RESOLUTION_PCT = 1.0
MIN_ROUNDS = 20


def paired_overhead(without_s: Sequence[float], with_s: Sequence[float], *, confidence: float = 0.95,
                    resamples: int = 4000, seed: int = 0) -> dict:
    """Overhead of ``with_s`` over ``without_s`` (per-round mean step times, paired by index), in %.

    Returns rounds, mean and median overhead, the t and bootstrap confidence intervals, the interval's
    width and whether it resolves RESOLUTION_PCT. Raises ValueError for unpaired or too few rounds."""
    a, b = np.asarray(without_s, dtype=float), np.asarray(with_s, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"rounds must pair up: {a.shape} without, {b.shape} with")
    if len(a) < 3:
        raise ValueError(f"need at least 3 rounds for an interval, got {len(a)}")
    if not (np.all(a > 0) and np.all(np.isfinite(b))):
        raise ValueError("step times must be positive and finite")
    ratio_pct = 100.0 * (b / a - 1.0)
    t_low, t_high = sps.ttest_1samp(ratio_pct, 0.0).confidence_interval(confidence)
    if np.ptp(ratio_pct) == 0:  # every round the same: the bootstrap has nothing to resample
        boot_low = boot_high = float(ratio_pct[0])
    else:
        boot = _bootstrap_mean(ratio_pct, confidence, resamples, seed)
        boot_low, boot_high = boot.confidence_interval
    width = float(t_high - t_low)
    return {
        "rounds": int(len(a)),
        "confidence": confidence,
        "mean_step_s_without": float(a.mean()),
        "mean_step_s_with": float(b.mean()),
        "overhead_pct_mean": float(ratio_pct.mean()),
        "overhead_pct_median": float(np.median(ratio_pct)),
        "t_ci_pct": [float(t_low), float(t_high)],
        "bootstrap_ci_pct": [float(boot_low), float(boot_high)],
        "ci_width_pct": width,
        "resolves_1pct": bool(width <= RESOLUTION_PCT),
    }


def _bootstrap_mean(values: np.ndarray, confidence: float, resamples: int, seed: int):
    kwargs = dict(n_resamples=resamples, confidence_level=confidence, method="percentile")
    try:
        return sps.bootstrap((values,), np.mean, rng=np.random.default_rng(seed), **kwargs)
    except TypeError:  # scipy < 1.15 names the generator random_state
        return sps.bootstrap((values,), np.mean, random_state=np.random.default_rng(seed), **kwargs)


def resolved(without_s: Sequence[float], with_s: Sequence[float]) -> bool:
    """True once MIN_ROUNDS ran and the t interval resolves RESOLUTION_PCT (the A/B's stop rule; the minimum
    keeps a lucky early interval from stopping it)."""
    if len(without_s) < MIN_ROUNDS:
        return False
    return paired_overhead(without_s, with_s, resamples=200)["resolves_1pct"]


def percentiles_us(samples_ns: Sequence[int]) -> dict:
    """count, median and p99 (µs) of latencies given in ns; None values for no samples."""
    if not len(samples_ns):
        return {"count": 0, "median_us": None, "p99_us": None}
    values = np.asarray(samples_ns, dtype=float) / 1000.0
    return {"count": int(len(values)), "median_us": float(np.median(values)),
            "p99_us": float(np.percentile(values, 99))}
