"""Event-level evaluation of a failure predictor (model or rule baseline), as docs/background.md §4 asks.

Scores are per feature row (GPU x evaluation step) and become alert episodes exactly as they would live
(models/alerting.py: the alert policy, and with a budget the online threshold calibration). A fault is
predicted when an alert of its GPU is active at some time in [fault - horizon, fault - warning]; the lead
time runs from that alert's start. An alert is false when no fault of its GPU starts between its start and
its end plus the horizon. False alarms are counted per alert episode (per 1,000 GPU-days) **and** by the
hours they stayed on (an alert left on all month costs a month), so a policy cannot look good by never
resolving. Thresholds for side-by-side comparisons are chosen on the training data only (stored in the
model at training time), never on the data being evaluated.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from sklearn.metrics import average_precision_score

from gpuwatch.models.alerting import replay
from gpuwatch.core.errors import UserError
from gpuwatch.core.settings import DEFAULT_FALSE_ALARM_BUDGET
from gpuwatch.models.dataset import Dataset
from gpuwatch.models.labels import in_block
from gpuwatch.models.model import FailureModel
from gpuwatch.models.policy import AlertPolicy
from gpuwatch.models.rules import rule_scores

METRIC_KEYS = ("event_recall", "event_recall_sudden", "precision", "false_alarms_per_1000_gpu_days",
               "false_alert_hours_per_1000_gpu_days", "false_alert_hour_share", "median_lead_time_s", "pr_auc")


def block_faults(episodes: pd.DataFrame, block: tuple[int, int], horizon_s: float) -> pd.DataFrame:
    """Fault episodes whose whole warning window falls inside the block."""
    if not len(episodes):
        return pd.DataFrame(columns=["node", "gpu_index", "start_ms", "kind", "had_precursor"])
    s = episodes["start_ms"]
    return episodes[(s - horizon_s * 1000 >= block[0]) & (s < block[1])]


def metrics(alerts: pd.DataFrame, faults: pd.DataFrame, rows: pd.DataFrame, scores: np.ndarray,
            block: tuple[int, int], *, horizon_s: float, warning_s: float, step_s: float,
            all_faults: pd.DataFrame | None = None, truth: pd.DataFrame | None = None) -> dict:
    """All METRIC_KEYS, recall per fault kind and counts for the alerts overlapping ``block``.

    ``rows`` (with label, censored) and ``scores`` give the GPU-days and the row-level PR AUC; ``faults`` are
    the episodes of the block (:func:`block_faults`), ``all_faults`` every episode (an alert just before the
    block's end is true if a fault follows after it); ``truth`` (optional, a simulation's) adds a kind per
    fault from the generator (e.g. thermal, which leaves no kind of its own in the evidence).
    """
    sel = in_block(rows, block)
    live = sel & ~rows["censored"].to_numpy()
    gpu_days = live.sum() * step_s / 86400
    end = alerts["end_ms"].fillna(block[1]).to_numpy(float) if len(alerts) else np.zeros(0)
    a = alerts.assign(end=np.minimum(end, block[1]))
    a = a[(a["start_ms"] < block[1]) & (a["end"] > block[0])].copy()
    a["gpu"] = a["node"].astype(str) + "/" + a["gpu_index"].astype(str)
    f = faults.assign(gpu=faults["node"].astype(str) + "/" + faults["gpu_index"].astype(str))
    h, w = horizon_s * 1000, warning_s * 1000
    every = f if all_faults is None or not len(all_faults) else all_faults.assign(
        gpu=all_faults["node"].astype(str) + "/" + all_faults["gpu_index"].astype(str))
    fault_starts = {k: g["start_ms"].to_numpy() for k, g in every.groupby("gpu")} if len(every) else {}
    true = np.array([((st := fault_starts.get(r.gpu)) is not None)
                     and bool(((st > r.start_ms) & (st <= r.end + h)).any()) for r in a.itertuples()], bool)
    by_gpu = {k: g for k, g in a.groupby("gpu")} if len(a) else {}
    caught = np.zeros(len(f), bool)
    leads = np.full(len(f), np.nan)
    for i, fr in enumerate(f.itertuples()):
        g = by_gpu.get(fr.gpu)
        if g is None:
            continue
        hit = g[(g["start_ms"] <= fr.start_ms - w) & (g["end"] >= fr.start_ms - h)]
        if len(hit):
            caught[i] = True
            leads[i] = (fr.start_ms - hit["start_ms"].min()) / 1000
    hours = ((a["end"] - np.maximum(a["start_ms"], block[0])) / 3_600_000).to_numpy(float)
    with_pre = f["had_precursor"].to_numpy(bool) if len(f) else np.zeros(0, bool)
    n_alerts, n_false = len(a), int((~true).sum())
    labels = rows.loc[live, "label"].to_numpy()
    kinds = f["kind"].to_numpy() if len(f) else np.zeros(0, str)
    out = {
        "event_recall": _share(caught[with_pre]),
        "event_recall_sudden": _share(caught[~with_pre]),
        "recall_by_kind": _by_kind(kinds, caught, with_pre),
        "precision": (n_alerts - n_false) / n_alerts if n_alerts else None,
        "false_alarms_per_1000_gpu_days": n_false / gpu_days * 1000 if gpu_days else None,
        "false_alert_hours_per_1000_gpu_days": float(hours[~true].sum()) / gpu_days * 1000 if gpu_days else None,
        "false_alert_hour_share": float(hours[~true].sum() / hours.sum()) if hours.sum() > 0 else None,
        "median_lead_time_s": float(np.median(leads[caught & with_pre])) if (caught & with_pre).any() else None,
        "pr_auc": float(average_precision_score(labels, np.asarray(scores)[live])) if labels.any() else None,
        "faults": int(with_pre.sum()), "faults_sudden": int((~with_pre).sum()),
        "alerts": int(n_alerts), "false_alarms": n_false, "gpu_days": round(float(gpu_days), 1),
    }
    if truth is not None and len(f):
        mech = _truth_kinds(f, truth)
        out["recall_by_mechanism"] = _by_kind(mech, caught, with_pre)
    return out


def _share(x: np.ndarray) -> float | None:
    return float(x.mean()) if len(x) else None


def _by_kind(kinds: np.ndarray, caught: np.ndarray, with_pre: np.ndarray) -> dict:
    """Per kind: faults with precursors caught / all of them (sudden faults are reported apart)."""
    return {str(k): f"{int(caught[(kinds == k) & with_pre].sum())}/{int(((kinds == k) & with_pre).sum())}"
            for k in sorted(set(kinds[with_pre]))}


def _truth_kinds(faults: pd.DataFrame, truth: pd.DataFrame) -> np.ndarray:
    """The simulator's mechanism of each fault episode (nearest planned fault of its GPU within an hour)."""
    out = np.full(len(faults), "unknown", dtype=object)
    for i, fr in enumerate(faults.itertuples()):
        t = truth[(truth["node"] == fr.node) & (truth["gpu_index"] == fr.gpu_index) & ~truth["near_miss"]]
        if len(t):
            j = (t["fault_ms"] - fr.start_ms).abs().idxmin()
            if abs(t.at[j, "fault_ms"] - fr.start_ms) <= 3_600_000:
                out[i] = t.at[j, "mechanism"]
    return out.astype(str)


def predictor_metrics(ds: Dataset, scores: np.ndarray, block: tuple[int, int], *, threshold: float,
                      budget: float | None, truth: pd.DataFrame | None = None) -> dict:
    """Replay ``scores`` over all of ``ds`` (the calibrator may learn from data before the block, as it
    would live) and measure the alerts of ``block``."""
    policy = AlertPolicy(threshold)
    r = replay(ds.rows, scores, ds.episodes, policy=policy, step_s=ds.step_s, budget=budget, horizon_s=ds.horizon_s)
    faults = block_faults(ds.episodes, block, ds.horizon_s)
    out = metrics(r.alerts, faults, ds.rows, scores, block, horizon_s=ds.horizon_s, warning_s=ds.warning_s,
                  step_s=ds.step_s, all_faults=ds.episodes, truth=truth)
    sel = in_block(ds.rows, block)
    out["threshold"] = float(np.median(r.threshold[sel])) if sel.any() else float(threshold)
    out["budget"] = budget
    return out


def threshold_for_budget(ds: Dataset, scores: np.ndarray, block: tuple[int, int], budget: float) -> float:
    """The lowest fixed threshold whose false alarms in ``block`` of labelled (training) data fit the budget."""
    sel = in_block(ds.rows, block)
    rows, s = ds.rows[sel], np.asarray(scores)[sel]
    sub = Dataset(rows, ds.episodes, ds.source, ds.horizon_s, ds.warning_s, ds.step_s)
    live = s[~rows["censored"].to_numpy()]
    if not len(live):
        return 1.0
    candidates = np.unique(np.r_[np.quantile(live, np.linspace(0.99, 1.0, 40)), np.unique(live)[-24:]])
    best = float(np.nextafter(candidates.max(), np.inf))
    lo, hi = 0, len(candidates) - 1
    while lo <= hi:  # false alarms fall as the threshold rises: binary search the first that fits
        mid = (lo + hi) // 2
        fa = predictor_metrics(sub, s, block, threshold=candidates[mid], budget=None)["false_alarms_per_1000_gpu_days"]
        if (fa or 0.0) <= budget:
            best, hi = float(candidates[mid]), mid - 1
        else:
            lo = mid + 1
    return best


def evaluate_model(model: FailureModel, ds: Dataset, *, budget: float = DEFAULT_FALSE_ALARM_BUDGET,
                   truth: pd.DataFrame | None = None) -> dict:
    """Model vs rule baseline on ``ds``: its test block if the model was trained on this data, else all of it.

    Top level: the model with the threshold calibrated online to ``budget``. ``fixed_threshold``: the model
    at the threshold chosen on its training data. ``baseline``: the DCGM-style rules at the threshold chosen
    on the same training data for the same budget; ``baseline_calibrated``: the rules calibrated online.
    """
    if model.baseline_threshold is None:
        raise UserError("the model file predates the rule baseline saved with it: retrain it to evaluate")
    same = model.training.fingerprint == ds.source.fingerprint
    block = model.training.test_ms if same else (ds.source.start_ms, ds.source.end_ms + 1)
    ours, rules = model.risk(ds.rows), rule_scores(ds.rows)
    result = predictor_metrics(ds, ours, block, threshold=model.threshold, budget=budget, truth=truth)
    result["fixed_threshold"] = predictor_metrics(ds, ours, block, threshold=model.threshold, budget=None,
                                                  truth=truth)
    result["baseline"] = predictor_metrics(ds, rules, block, threshold=model.baseline_threshold, budget=None,
                                           truth=truth)
    result["baseline_calibrated"] = predictor_metrics(ds, rules, block, threshold=model.baseline_threshold,
                                                      budget=budget, truth=truth)
    result["evaluated_on"] = {"source": str(ds.source.path), "block_ms": list(block),
                              "held_out": "test block of the training data" if same else "whole data set",
                              "horizon_s": ds.horizon_s, "warning_s": ds.warning_s, "step_s": ds.step_s}
    return result


COLUMNS = (("model (budget)", None), ("model (fixed)", "fixed_threshold"), ("rules (fixed)", "baseline"),
           ("rules (budget)", "baseline_calibrated"))


def format_table(result: dict) -> str:
    """Human table: one line per metric, the model and the rules side by side."""
    def fmt(v: object) -> str:
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    cols = [(name, result if key is None else result[key]) for name, key in COLUMNS]
    keys = list(METRIC_KEYS) + ["threshold", "faults", "faults_sudden", "alerts", "false_alarms", "gpu_days"]
    lines = [f"{'metric':36}" + "".join(f"{n:>16}" for n, _ in cols)]
    lines += [f"{k:36}" + "".join(f"{fmt(c.get(k)):>16}" for _, c in cols) for k in keys]
    for group in ("recall_by_kind", "recall_by_mechanism"):
        kinds = sorted({k for _, c in cols for k in (c.get(group) or {})})
        lines += [f"{group.replace('_by_', ' ') + ' ' + k:36}" + "".join(f"{(c.get(group) or {}).get(k, '-'):>16}"
                                                                        for _, c in cols) for k in kinds]
    return "\n".join(lines)
