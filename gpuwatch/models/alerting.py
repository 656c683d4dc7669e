"""Scored feature rows, replayed in time order, to alert episodes: what `gpuwatch score` prints and what the
evaluation counts.

Each evaluation step is one scoring round, as in the collector: the round's threshold comes from the
budget calibrator (models/calibration.py) over the rounds before it (or is fixed), the GPU's alert state
follows the alert policy (models/policy.py), and the round's scores are then shown to the calibrator.
Fault evidence ends a GPU's alert at the fault (the GPU failed) and, once seen, tells the calibrator the
scores before it were true alarms. The collector's live path (collector/scoring.py) uses the same
calibrator and policy round by round; here the policy runs vectorised over each GPU's series, which gives
the same states (tests/test_models_alerting.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from gpuwatch.models.calibration import BudgetCalibrator
from gpuwatch.models.faults import COALESCE_S
from gpuwatch.models.labels import DEFAULT_HORIZON_S
from gpuwatch.models.policy import AlertPolicy

#: A GPU without rows for this many steps (drained, off the bus, not recorded) starts a new series.
ALERT_GAP_STEPS = 6
ALERT_COLUMNS = ["node", "gpu_index", "start_ms", "end_ms", "peak_risk"]


@dataclass
class Replay:
    """Alert episodes (``end_ms`` NaN while still firing at the end of the data) and the per-row threshold
    and state, rows in the order given."""

    alerts: pd.DataFrame
    threshold: np.ndarray
    active: np.ndarray


def replay(rows: pd.DataFrame, risk: np.ndarray, faults: pd.DataFrame, *, policy: AlertPolicy, step_s: float,
           budget: float | None = None, horizon_s: float = DEFAULT_HORIZON_S) -> Replay:
    """Alerts over ``rows`` (node, gpu_index, t_ms) with scores ``risk``; ``faults`` (node, gpu_index, start_ms)
    end alerts. ``budget`` (false alarms per 1,000 GPU-days): calibrate online, starting from
    ``policy.threshold``; None: the policy's threshold throughout. ``horizon_s``: the model's horizon (the
    calibrator counts an alert followed by its GPU's fault within it as a true one, as the evaluation does)."""
    risk = np.asarray(risk, dtype=float)
    t = rows["t_ms"].to_numpy(np.int64)
    gpu = rows["node"].astype(str).to_numpy() + "/" + rows["gpu_index"].astype(str).to_numpy()
    thresholds = (np.full(len(rows), policy.threshold) if budget is None
                  else _calibrated(t, gpu, risk, faults, policy, step_s, budget, horizon_s))
    order = np.lexsort((t, gpu))
    g, ts, r, th = gpu[order], t[order], risk[order], thresholds[order]
    fault_ms = _faults_by_gpu(faults)
    restart = np.r_[True, (g[1:] != g[:-1]) | (np.diff(ts) > ALERT_GAP_STEPS * step_s * 1000)]
    failed_before = _fault_between(g, ts, restart, fault_ms)
    restart |= failed_before
    r = np.where(_just_failed(g, ts, fault_ms), -np.inf, r)
    active = policy.active_mask(ts, r, restart, th)
    alerts = _episodes(rows.iloc[order], ts, r, active, restart, failed_before, fault_ms, g, step_s * 1000)
    out_active = np.empty(len(rows), bool)
    out_active[order] = active
    return Replay(alerts, thresholds, out_active)


def _calibrated(t: np.ndarray, gpu: np.ndarray, risk: np.ndarray, faults: pd.DataFrame, policy: AlertPolicy,
                step_s: float, budget: float, horizon_s: float) -> np.ndarray:
    """Per row, the threshold the calibrator gives at its round from the rounds before it."""
    cal = BudgetCalibrator(budget, policy.threshold, step_s=step_s, keep_firing_for_s=policy.keep_firing_for_s,
                           horizon_s=horizon_s)
    f = faults.sort_values("start_ms") if len(faults) else faults
    f_gpu = (f["node"].astype(str) + "/" + f["gpu_index"].astype(str)).to_numpy() if len(f) else np.zeros(0, str)
    f_t = f["start_ms"].to_numpy(np.int64) if len(f) else np.zeros(0, np.int64)
    order = np.argsort(t, kind="stable")
    ts = t[order]
    bounds = np.flatnonzero(np.r_[True, ts[1:] != ts[:-1], True])
    out = np.empty(len(t))
    told = 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        now = int(ts[a])
        while told < len(f_t) and f_t[told] < now:  # fault evidence seen before this round
            cal.fault(f_gpu[told], int(f_t[told]))
            told += 1
        idx = order[a:b]
        out[idx] = cal.threshold(now)
        cal.observe(now, gpu[idx], risk[idx])
    return out


def _faults_by_gpu(faults: pd.DataFrame) -> dict[str, np.ndarray]:
    if not len(faults):
        return {}
    key = faults["node"].astype(str) + "/" + faults["gpu_index"].astype(str)
    return {k: np.sort(v.to_numpy(np.int64)) for k, v in faults["start_ms"].groupby(key)}


def _just_failed(g: np.ndarray, ts: np.ndarray, fault_ms: dict[str, np.ndarray]) -> np.ndarray:
    """Rows (sorted by GPU, time) less than a fault episode's coalescing time after a fault of their GPU: the
    GPU has failed (live, its alert turns "failed"); its score then describes that fault, and a new "about
    to fail" alert would be a false one."""
    out = np.zeros(len(g), bool)
    bounds = np.flatnonzero(np.r_[True, g[1:] != g[:-1], True]) if len(g) else np.zeros(1, np.int64)
    for a, b in zip(bounds[:-1], bounds[1:]):
        f = fault_ms.get(g[a])
        if f is None:
            continue
        k = np.searchsorted(f, ts[a:b], side="left") - 1  # the last fault strictly before each row
        out[a:b] = (k >= 0) & (ts[a:b] - f[np.maximum(k, 0)] <= COALESCE_S * 1000)
    return out


def _fault_between(g: np.ndarray, ts: np.ndarray, restart: np.ndarray, fault_ms: dict[str, np.ndarray]) -> np.ndarray:
    """Rows (sorted by GPU, time) whose GPU had a fault since its previous row."""
    out = np.zeros(len(g), bool)
    if not len(g):
        return out
    bounds = np.flatnonzero(np.r_[True, g[1:] != g[:-1], True])
    for a, b in zip(bounds[:-1], bounds[1:]):
        f = fault_ms.get(g[a])
        if f is None:
            continue
        k = np.searchsorted(f, ts[a:b], side="left")  # faults before each row
        out[a + 1:b] = k[1:] > k[:-1]
    return out


def _episodes(rows: pd.DataFrame, ts: np.ndarray, risk: np.ndarray, active: np.ndarray, restart: np.ndarray,
              failed_before: np.ndarray, fault_ms: dict[str, np.ndarray], g: np.ndarray, step_ms: float
              ) -> pd.DataFrame:
    """One row per run of active rows: start, end (resolve time, fault time, the end of the last step before
    the GPU's data stopped, or NaN while firing at the end of the data), peak."""
    if not active.any():
        return pd.DataFrame(columns=ALERT_COLUMNS)
    starts = active & (restart | ~np.r_[False, active[:-1]])
    run = np.cumsum(starts)
    idx = np.flatnonzero(active)
    frame = pd.DataFrame({"run": run[idx], "t": ts[idx], "risk": risk[idx], "i": idx})
    ep = frame.groupby("run").agg(first=("i", "min"), last=("i", "max"), peak=("risk", "max"))
    nxt = ep["last"].to_numpy() + 1
    has_next = nxt < len(ts)
    nxt_c = np.minimum(nxt, len(ts) - 1)
    same_gpu = has_next & (g[nxt_c] == g[ep["last"].to_numpy()])
    end = np.full(len(ep), np.nan)
    # resolved at the next row of the same series; a fault ends it at the fault; a gap at its last row
    resolved = same_gpu & ~restart[nxt_c]
    end[resolved] = ts[nxt_c][resolved]
    failed = same_gpu & failed_before[nxt_c]
    for j in np.flatnonzero(failed):
        f = fault_ms[g[ep["last"].iat[j]]]
        end[j] = f[np.searchsorted(f, ts[ep["last"].iat[j]], side="left")]  # as _failed_before counts: f >= row
    gap = same_gpu & restart[nxt_c] & ~failed_before[nxt_c]
    end[gap] = ts[ep["last"].to_numpy()][gap] + step_ms
    last_of_gpu = ~same_gpu  # still firing when the GPU's data ends: a fault after its last row ends it there
    for j in np.flatnonzero(last_of_gpu):
        gpu_faults = fault_ms.get(g[ep["last"].iat[j]])
        t_last = ts[ep["last"].iat[j]]
        if gpu_faults is not None and (k := np.searchsorted(gpu_faults, t_last, side="right")) < len(gpu_faults):
            end[j] = gpu_faults[k]
    first = ep["first"].to_numpy()
    return pd.DataFrame({"node": rows["node"].to_numpy()[first], "gpu_index": rows["gpu_index"].to_numpy()[first],
                         "start_ms": ts[first], "end_ms": end, "peak_risk": ep["peak"].to_numpy()})
