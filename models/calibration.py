"""An alert budget instead of a fixed threshold: the threshold is recalibrated on the fleet's own recent,
unlabelled scores so that false alarms stay near what the operator accepts.

A model's probabilities do not travel between fleets: on a fleet with other noise the same model may score
every GPU lower (or higher) than on the fleets it was trained on, and a threshold saved at training time
then alerts on nothing (or everything). What does travel is the *ranking*. So the operator states a budget
(false alarms per 1,000 GPU-days) and the threshold becomes the score that the fleet's recent history
crosses that rarely.

How (a peaks-over-threshold estimate, in logit space):

1. Take every GPU's scores in a trailing window (default 30 days) — only observations strictly before the
   decision time, and only **settled** ones: older than two days, so that a fault that would make them true
   alarms has had its chance to show. Scores of a GPU in the two days before one of its faults (fault
   evidence already seen) are left out: those alarms would have been true ones. Without the settling, the
   GPUs degrading right now (whose faults are still to come) sat among the highest "false" peaks, and the
   threshold rose with every precursor in progress and fell after each fault. So are its scores in the fault episode's hour after
   it: those rows describe the fault itself (its XIDs, the precursor in the windows), and the alert policy
   opens no alert on a GPU that has just failed (models/alerting.py).
2. Decluster: the rows above a high base level (the 99.5th percentile) form runs per GPU, split where the GPU
   stayed below for the policy's keep-firing time; each run's peak is one would-be alert episode.
3. The threshold lets ``budget x GPU-days / 1000`` peaks through. Where the window holds enough peaks
   that is an empirical order statistic; where it does not (a small or young fleet, a strict budget), the
   tail above the k-th largest peak is taken as exponential in logit space (the generalised Pareto tail
   with shape 0), whose scale is the mean excess, and the threshold is extrapolated from it.

Until the window holds ``MIN_GPU_DAYS`` of settled scores the model's saved threshold is used: it is only the
start value. (With fewer, a budget of one alarm per 1,000 GPU-days is extrapolated from a few hours of a
fleet and the threshold swings from one refresh to the next.)
"""
from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence

import numpy as np

from gpuwatch.models.faults import COALESCE_S

WINDOW_S = 30 * 86400.0
MIN_GPU_DAYS = 100.0
REFRESH_S = 3600.0
#: Rows a GPU's own fault makes "true": the alerts before it were right, whatever they cost.
FAULT_LOOKBACK_S = 48 * 3600.0
#: Scores younger than this are not yet known to be false alarms (their GPU may fail within the lookback).
SETTLE_S = FAULT_LOOKBACK_S
#: Rows after a fault that belong to its episode (faults.COALESCE_S): the fault, not a false alarm.
FAULT_AFTERMATH_S = float(COALESCE_S)
BASE_QUANTILE = 0.995
TAIL_PEAKS = 12
_EPS = 1e-9


def logit(p: np.ndarray | float) -> np.ndarray:
    p = np.clip(np.asarray(p, dtype=float), _EPS, 1 - _EPS)
    return np.log(p / (1 - p))


def sigmoid(x: float) -> float:
    return float(1.0 / (1.0 + np.exp(-x)))


def cluster_peaks(gpu: np.ndarray, t_ms: np.ndarray, score: np.ndarray, merge_gap_ms: float) -> np.ndarray:
    """Peak score of each run of rows per GPU (rows closer than ``merge_gap_ms`` join one run)."""
    if not len(score):
        return np.zeros(0)
    order = np.lexsort((t_ms, gpu))
    g, t, s = gpu[order], t_ms[order], score[order]
    new = np.r_[True, (g[1:] != g[:-1]) | (np.diff(t) > merge_gap_ms)]
    run = np.cumsum(new) - 1
    peaks = np.full(run[-1] + 1, -np.inf)
    np.maximum.at(peaks, run, s)
    return peaks


def budget_threshold(peaks_logit: np.ndarray, gpu_days: float, budget: float) -> float:
    """The threshold (a probability) that ``budget`` false alarms per 1,000 GPU-days of these peaks cross."""
    peaks = np.sort(peaks_logit)[::-1]
    allowed = budget * gpu_days / 1000.0
    k = min(len(peaks), TAIL_PEAKS)
    if k == 0:
        return 1.0 - _EPS
    if allowed >= 1 and int(allowed) < k:  # enough peaks: the order statistic, just above the first one left out
        return sigmoid(float(np.nextafter(peaks[int(allowed)], np.inf)))
    u = peaks[k - 1]
    scale = max(float(np.mean(peaks[:k] - u)), 0.05)
    return sigmoid(u + scale * np.log(k / max(allowed, _EPS)))


class BudgetCalibrator:
    """Online threshold for an alert budget, from the scores it is shown (one call per scoring round).

    ``observe`` a round of scores *after* deciding on it with ``threshold``: a decision never sees its own
    round or anything later. ``fault`` tells it a GPU failed (fault evidence seen), so that GPU's scores just
    before count as true alarms and are left out of the false-alarm estimate.
    """

    def __init__(self, budget: float, start_threshold: float, *, step_s: float, keep_firing_for_s: float,
                 window_s: float = WINDOW_S, refresh_s: float = REFRESH_S, min_gpu_days: float = MIN_GPU_DAYS) -> None:
        if budget <= 0:
            raise ValueError(f"false-alarm budget must be positive, got {budget}")
        self.budget = budget
        self.start_threshold = float(start_threshold)
        self.step_ms = step_s * 1000
        self.merge_gap_ms = keep_firing_for_s * 1000
        self.window_ms = window_s * 1000
        self.refresh_ms = refresh_s * 1000
        self.min_gpu_days = min_gpu_days
        self._rounds: deque[tuple[int, np.ndarray, np.ndarray]] = deque()  # (t_ms, gpu codes, logits)
        self._codes: dict[Hashable, int] = {}
        self._faults: list[tuple[int, int]] = []  # (gpu code, t_ms)
        self._last_kept_ms: int | None = None
        self._current = self.start_threshold
        self._computed_at_ms: int | None = None

    def _code(self, gpu: Hashable) -> int:
        return self._codes.setdefault(gpu, len(self._codes))

    def observe(self, t_ms: int, gpus: Sequence[Hashable], scores: np.ndarray) -> None:
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
        """The threshold for decisions at ``now_ms``, from the rounds observed before it (refreshed hourly)."""
        if self._computed_at_ms is not None and 0 <= now_ms - self._computed_at_ms < self.refresh_ms:
            return self._current
        while self._rounds and self._rounds[0][0] < now_ms - self.window_ms:
            self._rounds.popleft()
        self._computed_at_ms = int(now_ms)
        past = [r for r in self._rounds if r[0] < now_ms - SETTLE_S * 1000]
        n_rows = sum(len(r[1]) for r in past)
        gpu_days = n_rows * self.step_ms / 86_400_000
        if gpu_days < self.min_gpu_days:
            self._current = self.start_threshold
            return self._current
        gpu = np.concatenate([r[1] for r in past])
        t = np.concatenate([np.full(len(r[1]), r[0], dtype=np.int64) for r in past])
        s = np.concatenate([r[2] for r in past])
        keep = self._not_before_a_fault(gpu, t, now_ms)
        gpu, t, s = gpu[keep], t[keep], s[keep]
        base = np.quantile(s, BASE_QUANTILE)
        above = s >= base
        peaks = cluster_peaks(gpu[above], t[above], s[above], self.merge_gap_ms)
        self._current = budget_threshold(peaks, gpu_days, self.budget)
        return self._current

    def _not_before_a_fault(self, gpu: np.ndarray, t: np.ndarray, now_ms: int) -> np.ndarray:
        keep = np.ones(len(gpu), bool)
        for code, ft in self._faults:
            if ft < now_ms:
                keep &= ~((gpu == code) & (t <= ft + FAULT_AFTERMATH_S * 1000) & (t > ft - FAULT_LOOKBACK_S * 1000))
        return keep
