"""An alert budget instead of a fixed threshold: the threshold is recalibrated on the fleet's own recent,
unlabelled scores so that false alarms stay near what the operator accepts.

A model's probabilities do not travel between fleets: on a fleet with other noise the same model may score
every GPU lower (or higher) than on the fleets it was trained on, and a threshold saved at training time
then alerts on nothing (or everything). What does travel is the *ranking*. So the operator states a budget
(false alarms per 1,000 GPU-days) and the threshold becomes the score that the fleet's recent history
crosses that rarely.

How (a peaks-over-threshold estimate, in logit space, bounded from above):

1. Take every GPU's scores in a trailing window (default 30 days) — only observations strictly before the
   decision time, and only **settled** ones: older than two days, so that a fault that would make them true
   alarms has had its chance to show. Without the settling, the GPUs degrading right now (whose faults are
   still to come) sat among the highest "false" peaks, and the threshold rose with every precursor in
   progress and fell after each fault. A GPU's scores in the fault episode's hour after one of its faults
   are left out: they describe the fault itself, and the alert policy opens no alert on a GPU that has just
   failed (models/alerting.py).
2. Decluster: the rows above a high base level (the 99.5th percentile) form runs per GPU, split where the GPU
   stayed below for the policy's keep-firing time; each run is one would-be alert episode and its peak is
   what a threshold must stay above. A run is a **true** alarm, and left out, exactly when the evaluation
   would call its alert true: a fault of its GPU starts between the run's start and its last row plus the
   keep-firing time plus the horizon. (Leaving out everything in the two days before a fault, as before,
   also dropped alerts that had resolved hours before an unrelated fault — false alarms the operator pays
   for — and the threshold came out too low on fleets with many faults.)
3. **At most the budget, with confidence.** The threshold is the lowest one at which an upper confidence
   bound (one-sided, ``CONFIDENCE`` = 80%) of the false-alarm rate stays within ``budget x GPU-days / 1000``.
   The tail above the k-th largest peak (k = ``TAIL_PEAKS``) is taken as exponential in logit space (the
   generalised Pareto tail with shape 0; scale = mean excess) and the threshold is placed where the
   delta-method upper bound of the rate, ``log(k/allowed) - L + z sqrt((1 + L^2) / k)`` with L the distance
   in scales, meets the budget. Only where the budget lets at least k peaks through is the rate counted
   instead: a threshold just above the n+1-th highest peak has n peaks over it, and Garwood's bound on their
   Poisson rate is chi2(CONFIDENCE, 2n + 2) / 2. (Counting a handful of peaks, as before, let the single
   highest false peak of a month set the threshold: on a 128-GPU validation fleet it held the threshold at
   0.96 for twelve days, above most precursors, while the k peaks of the tail put it near 0.75.) Both margins
   shrink as the window holds more GPU-days: the rule does not depend on the fleet's size or score level,
   only on how much settled history it has. Aiming exactly at the budget exceeded it about half the time,
   and a budget means "at most".
4. **Smoothed over a day.** Each hourly estimate moves with the few peaks that enter, settle or turn out
   true; the threshold used is the mean (in logit) of the estimates of the last ``SMOOTHING_S`` (a day, so a
   daily cycle of load or temperature is averaged out). Alerts open where the threshold dips and stay open
   when it rises again, so an estimate that swings hour to hour pays for its lows: on 128-GPU validation
   fleets, hourly estimates swung between 0.37 and 0.96 within a day, and the dips raised most false alarms.
   An hour whose high runs all ended in faults (a young window on a fleet with many faults) has no false peak
   to estimate from and adds no estimate; with none in the last day, the start value holds.

Until the window holds ``MIN_GPU_DAYS`` of settled scores the model's saved threshold is used: it is only the
start value. (With fewer, a budget of one alarm per 1,000 GPU-days is extrapolated from a few hours of a
fleet and the threshold swings from one refresh to the next.)
"""
from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq
from scipy.stats import chi2, norm

from gpuwatch.models.faults import COALESCE_S
from gpuwatch.models.labels import DEFAULT_HORIZON_S

WINDOW_S = 30 * 86400.0
MIN_GPU_DAYS = 100.0
REFRESH_S = 3600.0
#: Scores younger than this are not yet known to be false alarms (a long precursor may still end in a fault).
SETTLE_S = 48 * 3600.0
#: Rows after a fault that belong to its episode (faults.COALESCE_S): the fault, not a false alarm.
FAULT_AFTERMATH_S = float(COALESCE_S)
BASE_QUANTILE = 0.995
TAIL_PEAKS = 12
#: One-sided confidence that the false-alarm rate of the chosen threshold is within the budget.
CONFIDENCE = 0.8
#: The threshold used is the mean, in logit, of the hourly estimates of this trailing span.
SMOOTHING_S = 24 * 3600.0
_EPS = 1e-9


def logit(p: np.ndarray | float) -> np.ndarray:
    p = np.clip(np.asarray(p, dtype=float), _EPS, 1 - _EPS)
    return np.log(p / (1 - p))


def sigmoid(x: float) -> float:
    return float(1.0 / (1.0 + np.exp(-x)))


@dataclass
class Runs:
    """Runs of high rows per GPU (would-be alert episodes): GPU code, first and last row time, peak score."""

    gpu: np.ndarray
    start_ms: np.ndarray
    last_ms: np.ndarray
    peak: np.ndarray


def cluster_runs(gpu: np.ndarray, t_ms: np.ndarray, score: np.ndarray, merge_gap_ms: float) -> Runs:
    """Runs of rows per GPU (rows closer than ``merge_gap_ms`` join one run)."""
    if not len(score):
        empty = np.zeros(0, np.int64)
        return Runs(empty, empty, empty, np.zeros(0))
    order = np.lexsort((t_ms, gpu))
    g, t, s = gpu[order], t_ms[order], score[order]
    new = np.r_[True, (g[1:] != g[:-1]) | (np.diff(t) > merge_gap_ms)]
    last = np.r_[new[1:], True]
    run = np.cumsum(new) - 1
    peaks = np.full(run[-1] + 1, -np.inf)
    np.maximum.at(peaks, run, s)
    return Runs(g[new], t[new], t[last], peaks)


def poisson_upper(n: int, confidence: float = CONFIDENCE) -> float:
    """Garwood's one-sided upper confidence bound of a Poisson mean, given ``n`` events seen."""
    return float(chi2.ppf(confidence, 2 * n + 2) / 2)


def budget_threshold(peaks_logit: np.ndarray, gpu_days: float, budget: float,
                     confidence: float = CONFIDENCE) -> float:
    """The lowest threshold (a probability) whose false-alarm rate over these peaks is within ``budget`` per
    1,000 GPU-days at the given one-sided ``confidence``: along the exponential tail of the top
    ``TAIL_PEAKS`` peaks, or counted where the budget lets at least that many through."""
    peaks = np.sort(peaks_logit)[::-1]
    allowed = budget * gpu_days / 1000.0
    if not len(peaks):
        return 1.0 - _EPS
    passed = -1  # the most peaks that may lie over the threshold with the bound still within the budget
    while passed + 1 < len(peaks) and poisson_upper(passed + 1, confidence) <= allowed:
        passed += 1
    if passed + 1 >= TAIL_PEAKS:  # enough peaks let through to count: just above the first peak left out
        return sigmoid(float(np.nextafter(peaks[passed], np.inf)))
    k = min(len(peaks), TAIL_PEAKS)
    u = peaks[k - 1]
    scale = max(float(np.mean(peaks[:k] - u)), 0.05)
    z, log_ratio = norm.ppf(confidence), np.log(k / max(allowed, _EPS))

    def bound_over_budget(distance: float) -> float:  # log(upper bound of the rate / allowed), distance in scales
        return log_ratio - distance + z * np.sqrt((1 + distance ** 2) / k)

    distance = brentq(bound_over_budget, 0.0, 100.0) if bound_over_budget(0.0) > 0 else 0.0
    return sigmoid(u + scale * distance)


class BudgetCalibrator:
    """Online threshold for an alert budget, from the scores it is shown (one call per scoring round).

    ``observe`` a round of scores *after* deciding on it with ``threshold``: a decision never sees its own
    round or anything later. ``fault`` tells it a GPU failed (fault evidence seen): the runs of that GPU it
    would make true alarms are left out of the false-alarm estimate (``horizon_s``: the model's horizon).
    """

    def __init__(self, budget: float, start_threshold: float, *, step_s: float, keep_firing_for_s: float,
                 window_s: float = WINDOW_S, refresh_s: float = REFRESH_S, min_gpu_days: float = MIN_GPU_DAYS,
                 horizon_s: float = DEFAULT_HORIZON_S) -> None:
        if budget <= 0:
            raise ValueError(f"false-alarm budget must be positive, got {budget}")
        self.budget = budget
        self.start_threshold = float(start_threshold)
        self.step_ms = step_s * 1000
        self.merge_gap_ms = keep_firing_for_s * 1000
        self.window_ms = window_s * 1000
        self.refresh_ms = refresh_s * 1000
        self.min_gpu_days = min_gpu_days
        self.horizon_ms = horizon_s * 1000
        self._rounds: deque[tuple[int, np.ndarray, np.ndarray]] = deque()  # (t_ms, gpu codes, logits)
        self._codes: dict[Hashable, int] = {}
        self._faults: list[tuple[int, int]] = []  # (gpu code, t_ms)
        self._last_kept_ms: int | None = None
        self._current = self.start_threshold
        self._computed_at_ms: int | None = None
        self._estimates: deque[tuple[int, float]] = deque()  # (t_ms, logit of the hourly estimate)

    def _code(self, gpu: Hashable) -> int:
        return self._codes.setdefault(gpu, len(self._codes))

    def observe(self, t_ms: int, gpus: Sequence[Hashable] | np.ndarray, scores: np.ndarray) -> None:
        """Keep one round of scores (at most one round per model step: a live collector scores more often)."""
        if self._last_kept_ms is not None and t_ms - self._last_kept_ms < self.step_ms:
            return
        self._last_kept_ms = int(t_ms)
        codes = np.fromiter((self._code(g) for g in gpus), dtype=np.int64, count=len(gpus))
        ok = ~np.isnan(np.asarray(scores, float))
        self._rounds.append((int(t_ms), codes[ok], logit(np.asarray(scores, float)[ok])))

    def fault(self, gpu: Hashable, t_ms: int) -> None:
        self._faults.append((self._code(gpu), int(t_ms)))

    def threshold(self, now_ms: int) -> float:
        """The threshold for decisions at ``now_ms``, from the rounds observed before it: refreshed hourly,
        the mean (in logit) of the estimates of the last ``SMOOTHING_S``."""
        if self._computed_at_ms is not None and 0 <= now_ms - self._computed_at_ms < self.refresh_ms:
            return self._current
        self._computed_at_ms = int(now_ms)
        estimate = self._estimate(now_ms)
        if estimate is not None:
            self._estimates.append((int(now_ms), float(logit(estimate))))
        while self._estimates and self._estimates[0][0] <= now_ms - SMOOTHING_S * 1000:
            self._estimates.popleft()
        # With no estimate in the last day (too little history, or no false peak yet): the start value.
        self._current = (sigmoid(float(np.mean([value for _, value in self._estimates]))) if self._estimates
                         else self.start_threshold)
        return self._current

    def _estimate(self, now_ms: int) -> float | None:
        """The budget's threshold from the settled rounds of the window before ``now_ms``; None while they
        hold fewer than ``min_gpu_days`` or no false peak."""
        while self._rounds and self._rounds[0][0] < now_ms - self.window_ms:
            self._rounds.popleft()
        past = [r for r in self._rounds if r[0] < now_ms - SETTLE_S * 1000]
        n_rows = sum(len(r[1]) for r in past)
        gpu_days = n_rows * self.step_ms / 86_400_000
        if gpu_days < self.min_gpu_days:
            return None
        gpu = np.concatenate([r[1] for r in past])
        t = np.concatenate([np.full(len(r[1]), r[0], dtype=np.int64) for r in past])
        s = np.concatenate([r[2] for r in past])
        keep = self._not_just_after_a_fault(gpu, t, now_ms)
        gpu, t, s = gpu[keep], t[keep], s[keep]
        base = np.quantile(s, BASE_QUANTILE)
        above = s >= base
        runs = cluster_runs(gpu[above], t[above], s[above], self.merge_gap_ms)
        false = ~self._true_alarms(runs, now_ms)
        if not false.any():  # every high run so far was a fault's precursor: no estimate this hour
            return None
        return budget_threshold(runs.peak[false], gpu_days, self.budget)

    def _known_faults(self, now_ms: int) -> list[tuple[int, int]]:
        return [(code, ft) for code, ft in self._faults if ft < now_ms]

    def _not_just_after_a_fault(self, gpu: np.ndarray, t: np.ndarray, now_ms: int) -> np.ndarray:
        keep = np.ones(len(gpu), bool)
        for code, ft in self._known_faults(now_ms):
            keep &= ~((gpu == code) & (t > ft) & (t <= ft + FAULT_AFTERMATH_S * 1000))
        return keep

    def _true_alarms(self, runs: Runs, now_ms: int) -> np.ndarray:
        """Runs the evaluation would call true alerts: a fault of the GPU between the run's start and its last
        row + keep-firing time + horizon (only faults seen before ``now_ms``)."""
        true = np.zeros(len(runs.peak), bool)
        for code, ft in self._known_faults(now_ms):
            true |= (runs.gpu == code) & (runs.start_ms <= ft) & (ft <= runs.last_ms + self.merge_gap_ms
                                                                    + self.horizon_ms)
        return true
