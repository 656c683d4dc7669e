"""Event-level evaluation of a failure predictor (model or rule baseline), as failure-prediction.md §4 asks.

Scores are per feature row (GPU x evaluation step). Alerts follow the alert engine's rule
(models/policy.py: fire at the threshold, resolve after the score stayed below half of it for 2 h), and
end when the GPU has no rows for ``ALERT_GAP_STEPS`` steps. A fault is predicted when an alert is active at
some row in [fault - horizon, fault - warning]; the lead time runs from the first such row. An alert is false when no
fault of that GPU starts between its first row and its last row plus the horizon.
False alarms are counted per 1,000 GPU-days of uncensored rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from sklearn.metrics import average_precision_score

from gpuwatch.models.dataset import Dataset
from gpuwatch.models.labels import in_block
from gpuwatch.models.model import score
from gpuwatch.models.policy import AlertPolicy
from gpuwatch.models.rules import rule_scores

ALERT_GAP_STEPS = 6
#: The rules alert on any finding (DCGM health not OK).
BASELINE_THRESHOLD = 0.5
METRIC_KEYS = ("event_recall", "event_recall_sudden", "precision", "false_alarms_per_1000_gpu_days",
               "median_lead_time_s", "pr_auc")


@dataclass(frozen=True)
class Scored:
    """Rows of one evaluation block with scores, and the faults whose warning window lies in the block."""

    rows: pd.DataFrame  # node, gpu_index, t_ms, label, censored, score
    faults: pd.DataFrame  # node, gpu_index, start_ms, had_precursor
    horizon_s: float
    warning_s: float
    step_s: int


def scored_block(rows: pd.DataFrame, episodes: pd.DataFrame, scores: np.ndarray, block: tuple[int, int],
                 *, horizon_s: float, warning_s: float, step_s: int) -> Scored:
    """Restrict rows and faults to a time block (faults whose whole warning window falls inside it)."""
    sel = in_block(rows, block)
    r = rows.loc[sel, ["node", "gpu_index", "t_ms", "label", "censored"]].copy()
    r["score"] = np.asarray(scores)[sel]
    h = horizon_s * 1000
    starts = episodes["start_ms"] if len(episodes) else pd.Series(dtype="int64")
    f = episodes[(starts - h >= block[0]) & (starts < block[1])] if len(episodes) else episodes
    return Scored(r, f, horizon_s, warning_s, step_s)


def metrics(s: Scored, threshold: float) -> dict:
    """All METRIC_KEYS (and counts) at one threshold."""
    live = s.rows[~s.rows["censored"].to_numpy()].sort_values(["node", "gpu_index", "t_ms"])
    active, restart = _active(live, threshold, s.step_s)
    starts = active & (restart | ~np.r_[False, active[:-1]])
    alert = live[active].assign(run=np.cumsum(starts)[active])
    gpu_days = len(live) * s.step_s / 86400
    caught, leads = _caught(alert, s)
    n_true, n_alerts = _alert_episodes(alert, s)
    with_pre = s.faults["had_precursor"].to_numpy(bool) if len(s.faults) else np.zeros(0, bool)
    labels = live["label"].to_numpy()
    return {
        "event_recall": _share(caught[with_pre]),
        "event_recall_sudden": _share(caught[~with_pre]),
        "precision": n_true / n_alerts if n_alerts else None,
        "false_alarms_per_1000_gpu_days": (n_alerts - n_true) / gpu_days * 1000 if gpu_days else None,
        "median_lead_time_s": float(np.median(leads[caught])) if caught.any() else None,
        "pr_auc": float(average_precision_score(labels, live["score"])) if labels.any() else None,
        "threshold": float(threshold),
        "faults": int(with_pre.sum()),
        "faults_sudden": int((~with_pre).sum()),
        "alerts": int(n_alerts),
        "false_alarms": int(n_alerts - n_true),
        "gpu_days": round(gpu_days, 1),
    }


def _active(rows: pd.DataFrame, threshold: float, step_s: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows (sorted by GPU and time) at which the GPU's alert is active under the alert policy, and the rows
    where a GPU's series restarts (a new GPU, or no rows for ``ALERT_GAP_STEPS`` steps), which ends any alert."""
    gpu = (rows["node"].astype(str) + "/" + rows["gpu_index"].astype(str)).to_numpy()
    t = rows["t_ms"].to_numpy()
    restart = np.r_[True, (gpu[1:] != gpu[:-1]) | (np.diff(t) > ALERT_GAP_STEPS * step_s * 1000)]
    return AlertPolicy(threshold).active_mask(t, rows["score"].to_numpy(), restart), restart


def _share(x: np.ndarray) -> float | None:
    return float(x.mean()) if len(x) else None


def _caught(alert: pd.DataFrame, s: Scored) -> tuple[np.ndarray, np.ndarray]:
    """Per fault: predicted in its warning window? and lead time (s) of the first alerting row in it."""
    caught = np.zeros(len(s.faults), bool)
    leads = np.full(len(s.faults), np.nan)
    by_gpu = {k: g["t_ms"].to_numpy() for k, g in alert.groupby(["node", "gpu_index"], sort=False)}
    for i, f in enumerate(s.faults.itertuples(index=False)):
        t = by_gpu.get((f.node, f.gpu_index))
        if t is None:
            continue
        win = t[(t >= f.start_ms - s.horizon_s * 1000) & (t <= f.start_ms - s.warning_s * 1000)]
        if len(win):
            caught[i] = True
            leads[i] = (f.start_ms - win.min()) / 1000
    return caught, leads


def _alert_episodes(alert: pd.DataFrame, s: Scored) -> tuple[int, int]:
    """(true alerts, all alerts): runs of alerting rows of a GPU, true when a fault follows in time."""
    if alert.empty:
        return 0, 0
    gpu = alert["node"].astype(str) + "/" + alert["gpu_index"].astype(str)
    runs = pd.DataFrame({"gpu": gpu.to_numpy(), "t": alert["t_ms"].to_numpy(), "run": alert["run"]}).groupby("run").agg(
        gpu=("gpu", "first"), first=("t", "min"), last=("t", "max"))
    faults = s.faults.assign(gpu=s.faults["node"].astype(str) + "/" + s.faults["gpu_index"].astype(str))
    starts = {k: g["start_ms"].to_numpy() for k, g in faults.groupby("gpu")}
    h = s.horizon_s * 1000
    true = sum(1 for r in runs.itertuples() if ((st := starts.get(r.gpu)) is not None)
               and ((st > r.first) & (st <= r.last + h)).any())
    return true, len(runs)


def threshold_for_false_alarms(s: Scored, max_per_1000_gpu_days: float) -> float:
    """The lowest threshold whose false-alarm rate stays within the budget (search over score quantiles)."""
    live = s.rows.loc[~s.rows["censored"].to_numpy(), "score"].to_numpy()
    candidates = np.unique(np.quantile(live, np.linspace(0.9, 1.0, 400))) if len(live) else np.array([1.0])
    candidates = np.unique(np.r_[candidates, np.unique(live)[-200:]])
    best = float(np.nextafter(candidates.max(), np.inf))
    lo, hi = 0, len(candidates) - 1
    while lo <= hi:  # false alarms fall as the threshold rises: binary search the first that fits
        mid = (lo + hi) // 2
        fa = metrics(s, candidates[mid])["false_alarms_per_1000_gpu_days"] or 0.0
        if fa <= max_per_1000_gpu_days:
            best, hi = float(candidates[mid]), mid - 1
        else:
            lo = mid + 1
    return best


def compare(model: Scored, baseline: Scored, model_threshold: float, baseline_threshold: float) -> dict:
    """Model and rule-baseline metrics side by side, and each one's recall at the other's false-alarm rate."""
    out = metrics(model, model_threshold)
    out["baseline"] = metrics(baseline, baseline_threshold)
    for ours, theirs, key in ((model, out["baseline"], "event_recall_at_baseline_false_alarm_rate"),
                              (baseline, out, "baseline_event_recall_at_model_false_alarm_rate")):
        fa = theirs["false_alarms_per_1000_gpu_days"]
        if fa is not None:
            out[key] = metrics(ours, threshold_for_false_alarms(ours, fa))["event_recall"]
    return out


def format_table(result: dict) -> str:
    """Human table: one line per metric, model beside baseline."""
    def fmt(v: object) -> str:
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    keys = list(METRIC_KEYS) + ["threshold", "faults", "faults_sudden", "alerts", "false_alarms", "gpu_days"]
    lines = [f"{'metric':34} {'model':>12} {'rules':>12}"]
    lines += [f"{k:34} {fmt(result.get(k)):>12} {fmt(result['baseline'].get(k)):>12}" for k in keys]
    lines.append(f"{'event_recall at the other FA rate':34} "
                 f"{fmt(result.get('event_recall_at_baseline_false_alarm_rate')):>12} "
                 f"{fmt(result.get('baseline_event_recall_at_model_false_alarm_rate')):>12}")
    return "\n".join(lines)


def evaluate_model(model: dict, ds: Dataset) -> dict:
    """Model vs rule baseline on ``ds``: its test block if the model was trained on this data, else all of it."""
    same = model["training"]["fingerprint"] == ds.source.fingerprint
    block = tuple(model["training"]["test_ms"]) if same else (ds.source.start_ms, ds.source.end_ms + 1)
    common = {"horizon_s": ds.horizon_s, "warning_s": ds.warning_s, "step_s": ds.step_s}
    ours = scored_block(ds.rows, ds.episodes, score(model, ds.rows), block, **common)
    rules = scored_block(ds.rows, ds.episodes, rule_scores(ds.rows), block, **common)
    result = compare(ours, rules, model["threshold"], BASELINE_THRESHOLD)
    result["evaluated_on"] = {"source": str(ds.source.path), "block_ms": list(block),
                              "held_out": "test block of the training data" if same else "whole data set",
                              **common}
    return result
