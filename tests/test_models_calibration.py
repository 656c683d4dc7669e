"""Alert budget: the threshold comes from the fleet's own past scores (never the future), meets the budget,
moves with a fleet's score level, ignores true alarms, and the replay follows the alert policy row by row."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from gpuwatch.models.alerting import replay
from gpuwatch.models.calibration import BudgetCalibrator, budget_threshold, logit, poisson_upper
from gpuwatch.models.policy import AlertPolicy
from helpers import T0

STEP_S = 600
HOUR = 3_600_000


def fleet_scores(n_gpus: int = 64, days: float = 20, level: float = -6.0, seed: int = 0) -> pd.DataFrame:
    """Healthy-fleet scores: AR(1) noise in logit space around ``level`` per GPU, one row per GPU and step."""
    rng = np.random.default_rng(seed)
    steps = int(days * 86400 / STEP_S)
    z = np.zeros((n_gpus, steps))
    for i in range(1, steps):
        z[:, i] = 0.9 * z[:, i - 1] + rng.normal(0, 0.45, n_gpus)
    t = T0 + STEP_S * 1000 * np.arange(1, steps + 1)
    return pd.DataFrame({"node": np.repeat([f"n{g // 8}" for g in range(n_gpus)], steps),
                         "gpu_index": np.repeat(np.arange(n_gpus) % 8, steps), "t_ms": np.tile(t, n_gpus),
                         "risk": 1 / (1 + np.exp(-(level + z.ravel())))})


NO_FAULTS = pd.DataFrame(columns=["node", "gpu_index", "start_ms"])


def false_alarms_per_1000(rows: pd.DataFrame, budget: float, start: float = 0.5) -> float:
    r = replay(rows, rows["risk"].to_numpy(), NO_FAULTS, policy=AlertPolicy(start), step_s=STEP_S, budget=budget)
    late = r.alerts[r.alerts["start_ms"] > T0 + 3 * 86_400_000]  # after the calibrator's first days
    gpu_days = (rows["t_ms"] > T0 + 3 * 86_400_000).sum() * STEP_S / 86400
    return len(late) / gpu_days * 1000


def test_budget_threshold_extrapolates_an_exponential_tail():
    rng = np.random.default_rng(1)
    peaks = 2.0 + rng.exponential(0.5, 400)  # 400 peaks above 2.0 over 2,000 GPU-days = 200 per 1,000
    th = logit(budget_threshold(peaks, 2000.0, budget=0.5))  # one alarm allowed: too few to count, extrapolated
    point = 2.0 + 0.5 * np.log(400)  # where the tail has 0.5 per 1,000 GPU-days
    assert point - 0.3 < th < point + 1.2  # at or a margin above it (the upper bound), not far off
    assert logit(budget_threshold(peaks, 2000.0, budget=50.0)) < th  # a looser budget, a lower threshold


def test_false_alarms_follow_the_budget_whatever_the_fleet_score_level():
    rows = fleet_scores()
    strict, loose = false_alarms_per_1000(rows, 1.0), false_alarms_per_1000(rows, 20.0)
    assert strict <= 5.0 and loose > 2 * strict and loose <= 60
    # the same fleet scored 3 logits higher by a model that does not know it: same alerts, not 30x more
    shifted = rows.assign(risk=1 / (1 + np.exp(-(logit(rows["risk"].to_numpy()) + 3.0))))
    assert false_alarms_per_1000(shifted, 20.0) == pytest.approx(loose, rel=0.5, abs=3)


def test_threshold_uses_only_rounds_before_the_decision():
    rows = fleet_scores(n_gpus=16, days=6)
    cut = T0 + 4 * 86_400_000
    past_only = BudgetCalibrator(1.0, 0.5, step_s=STEP_S, keep_firing_for_s=4 * 3600, min_gpu_days=2)
    with_future = BudgetCalibrator(1.0, 0.5, step_s=STEP_S, keep_firing_for_s=4 * 3600, min_gpu_days=2)
    for t, g in rows.groupby("t_ms"):
        keys = list(zip(g["node"], g["gpu_index"]))
        if t < cut:
            past_only.observe(t, keys, g["risk"].to_numpy())
        with_future.observe(t, keys, np.full(len(g), 0.999) if t >= cut else g["risk"].to_numpy())
    assert with_future.threshold(cut) == past_only.threshold(cut) != 0.5
    young = BudgetCalibrator(1.0, 0.37, step_s=STEP_S, keep_firing_for_s=4 * 3600)
    young.observe(T0, [("n", 0)], np.array([0.9]))
    assert young.threshold(T0 + HOUR) == 0.37  # too little history: the model's saved threshold


def test_scores_before_a_seen_fault_do_not_count_as_false_alarms():
    rows = fleet_scores(n_gpus=32, days=8)
    bad = (rows["node"] == "n0") & (rows["gpu_index"] == 0) & (rows["t_ms"].between(T0 + 3 * 86_400_000,
                                                                                     T0 + 3 * 86_400_000 + 6 * HOUR))
    rows.loc[bad, "risk"] = 0.99
    fault = pd.DataFrame({"node": ["n0"], "gpu_index": [0], "start_ms": [T0 + 3 * 86_400_000 + 6 * HOUR + 1]})
    later = T0 + 6 * 86_400_000
    told = replay(rows, rows["risk"].to_numpy(), fault, policy=AlertPolicy(0.5), step_s=STEP_S, budget=5.0)
    untold = replay(rows, rows["risk"].to_numpy(), NO_FAULTS, policy=AlertPolicy(0.5), step_s=STEP_S, budget=5.0)
    at = rows["t_ms"].to_numpy() == later
    assert told.threshold[at][0] < untold.threshold[at][0]  # the failed GPU's true alarm does not raise the bar


def test_vectorised_replay_equals_the_policy_stepped_row_by_row():
    rng = np.random.default_rng(4)
    n = 400
    t = T0 + STEP_S * 1000 * np.arange(n)
    risk = np.clip(0.3 + 0.25 * np.sin(np.arange(n) / 9) + rng.normal(0, 0.1, n), 0, 1)
    thresholds = np.where(np.arange(n) < 200, 0.45, 0.6)
    rows = pd.DataFrame({"node": "n", "gpu_index": 0, "t_ms": t})
    policy = AlertPolicy(0.45, keep_firing_for_s=3600)
    mask = policy.active_mask(t, risk, np.r_[True, np.zeros(n - 1, bool)], thresholds)
    active, last_high, stepped = False, None, []
    for i in range(n):
        active, last_high = policy.with_threshold(thresholds[i]).step(active, risk[i], int(t[i]), last_high)
        stepped.append(active)
    assert mask.tolist() == stepped and 0 < sum(stepped) < n
    fixed = replay(rows, risk, NO_FAULTS, policy=policy, step_s=STEP_S)
    assert fixed.active.tolist() == policy.active_mask(t, risk, np.r_[True, np.zeros(n - 1, bool)]).tolist()


def test_alert_stays_firing_through_degradation_and_ends_at_the_fault():
    n = 60
    t = T0 + STEP_S * 1000 * np.arange(n)
    risk = np.full(n, 0.01)
    risk[10:40] = np.where(np.arange(30) % 4 == 0, 0.2, 0.7)  # degrading: bursts above and dips below
    rows = pd.DataFrame({"node": "n", "gpu_index": 0, "t_ms": t})
    fault = pd.DataFrame({"node": ["n"], "gpu_index": [0], "start_ms": [int(t[40]) - 1000]})
    r = replay(rows, risk, fault, policy=AlertPolicy(0.5), step_s=STEP_S)
    assert len(r.alerts) == 1
    a = r.alerts.iloc[0]
    assert a["start_ms"] == t[11] and a["end_ms"] == t[40] - 1000 and a["peak_risk"] == pytest.approx(0.7)
    open_ended = replay(rows.iloc[:30], risk[:30], NO_FAULTS, policy=AlertPolicy(0.5), step_s=STEP_S)
    assert np.isnan(open_ended.alerts.iloc[0]["end_ms"])  # still firing when the data ends


def test_a_fault_found_at_a_row_time_ends_the_alert_there():
    """Evidence read from samples (a DBE count, a PCIe width drop) can start a fault exactly at a row's time."""
    t = T0 + STEP_S * 1000 * np.arange(60)
    risk = np.where((np.arange(60) >= 10) & (np.arange(60) < 40), 0.7, 0.01)
    rows = pd.DataFrame({"node": "n", "gpu_index": 0, "t_ms": t})
    fault = pd.DataFrame({"node": ["n"], "gpu_index": [0], "start_ms": [int(t[39])]})
    r = replay(rows, risk, fault, policy=AlertPolicy(0.5), step_s=STEP_S)
    assert r.alerts[["start_ms", "end_ms"]].values.tolist() == [[t[10], t[39]]]


def test_scores_just_after_a_fault_neither_alert_nor_raise_the_bar():
    """The rounds right after a fault score the fault itself (its XIDs, the precursor in the windows): the GPU
    has failed, so no new "about to fail" alert, and the calibrator does not count them as false alarms."""
    rows = fleet_scores(n_gpus=32, days=8)
    fault_ms = T0 + 3 * 86_400_000
    gpu0 = (rows["node"] == "n0") & (rows["gpu_index"] == 0)
    rows.loc[gpu0 & rows["t_ms"].between(fault_ms - 2 * HOUR, fault_ms + HOUR - 1), "risk"] = 0.99
    fault = pd.DataFrame({"node": ["n0"], "gpu_index": [0], "start_ms": [fault_ms - 1]})
    told = replay(rows, rows["risk"].to_numpy(), fault, policy=AlertPolicy(0.5), step_s=STEP_S, budget=5.0)
    untold = replay(rows, rows["risk"].to_numpy(), NO_FAULTS, policy=AlertPolicy(0.5), step_s=STEP_S, budget=5.0)
    mine = told.alerts[(told.alerts["node"] == "n0") & (told.alerts["gpu_index"] == 0)
                       & told.alerts["start_ms"].between(fault_ms - 3 * HOUR, fault_ms + 2 * HOUR)]
    assert len(mine) == 1 and mine["end_ms"].iloc[0] == fault_ms - 1  # one alert, ended by the fault
    at = rows["t_ms"].to_numpy() == T0 + 6 * 86_400_000
    assert told.threshold[at][0] < untold.threshold[at][0]


def test_scores_count_as_false_alarms_only_once_settled():
    """A GPU scoring high right now may be failing (its fault still to come): its scores join the false-alarm
    estimate only once two days have passed without a fault of it."""
    rows = fleet_scores(n_gpus=32, days=10)
    later = T0 + 9 * 86_400_000

    def threshold_with_a_burst(ends_before_ms: int) -> float:
        r = rows.copy()
        burst = (r["node"] == "n0") & (r["gpu_index"] == 0) & r["t_ms"].between(ends_before_ms - 6 * HOUR,
                                                                              ends_before_ms)
        r.loc[burst, "risk"] = 0.99
        rep = replay(r, r["risk"].to_numpy(), NO_FAULTS, policy=AlertPolicy(0.5), step_s=STEP_S, budget=5.0)
        return float(rep.threshold[r["t_ms"].to_numpy() == later][0])

    quiet = threshold_with_a_burst(T0)  # no burst inside the data
    assert threshold_with_a_burst(later - 12 * HOUR) == quiet  # too recent to be known false
    assert threshold_with_a_burst(later - 3 * 86_400_000) > quiet  # settled: a false alarm raises the bar


def test_budget_is_met_with_confidence_and_the_margin_shrinks_with_more_history():
    """The threshold keeps an upper confidence bound of the false-alarm rate within the budget: with few settled
    GPU-days it sits further above the fleet's own tail (more conservative) than with many, and the rate it
    really lets through exceeds the budget in under half of the fleets (aiming at the budget: about half)."""
    budget, rate_above_2, scale = 1.0, 100.0, 0.5  # peaks above logit 2.0: 100 per 1,000 GPU-days, exponential

    def true_rate(gpu_days: float, seed: int) -> float:
        rng = np.random.default_rng(seed)
        peaks = 2.0 + rng.exponential(scale, rng.poisson(rate_above_2 * gpu_days / 1000))
        th = logit(budget_threshold(peaks, gpu_days, budget))
        return rate_above_2 * np.exp(-(th - 2.0) / scale)  # per 1,000 GPU-days, the fleet's true tail

    few = np.array([true_rate(300.0, s) for s in range(40)])
    many = np.array([true_rate(30_000.0, s) for s in range(40)])
    assert np.median(few) < np.median(many) <= budget
    assert np.median(many) > 0.5 * budget  # the margin has shrunk: close to the budget, not far below it
    assert (many > budget).mean() <= 0.25  # counted: Garwood's bound (80%), discrete, so a little more
    assert (few > budget).mean() < 0.45  # extrapolated: a delta-method bound, an approximation (about 65%)
    assert poisson_upper(0) > poisson_upper(100) / 100 > 1  # the bound's relative margin shrinks with counts


def test_only_alerts_the_evaluation_would_call_true_are_left_out_and_only_faults_already_seen():
    """A high run on a GPU that ends well before that GPU's fault was a false alarm the operator paid for; one
    that runs into the fault was true. A fault after the decision time changes nothing."""
    rows = fleet_scores(n_gpus=32, days=8)
    fault_ms = T0 + 4 * 86_400_000
    later = T0 + 7 * 86_400_000

    def threshold(burst_end_ms: int, faults: list[int], now_ms: int = later) -> float:
        cal = BudgetCalibrator(5.0, 0.5, step_s=STEP_S, keep_firing_for_s=4 * 3600)
        r = rows.copy()
        burst = (r["node"] == "n0") & (r["gpu_index"] == 0) & r["t_ms"].between(burst_end_ms - 6 * HOUR, burst_end_ms)
        r.loc[burst, "risk"] = 0.99
        for ft in faults:
            cal.fault(("n0", 0), ft)
        for t, g in r[r["t_ms"] < now_ms].groupby("t_ms"):
            cal.observe(t, list(zip(g["node"], g["gpu_index"])), g["risk"].to_numpy())
        return cal.threshold(now_ms)

    into_fault = threshold(fault_ms - STEP_S * 1000, [fault_ms])
    resolved_long_before = threshold(fault_ms - 30 * HOUR, [fault_ms])
    assert resolved_long_before > into_fault  # the earlier run counts as a false alarm and raises the bar
    assert into_fault == pytest.approx(threshold(T0, [fault_ms]), rel=0.05)  # the true one is left out
    now = T0 + 3 * 86_400_000
    assert threshold(now - 3 * 86_400_000 + 6 * HOUR, [now + HOUR], now) == threshold(
        now - 3 * 86_400_000 + 6 * HOUR, [], now)  # a fault still to come is not known


def test_one_outlying_peak_does_not_set_the_threshold_when_few_peaks_may_pass():
    """With room for two false alarms in the window, counting would place the threshold above the single
    highest false peak however far out it lies; the tail of the top peaks decides instead."""
    rng = np.random.default_rng(2)
    peaks = np.r_[2.0 + rng.exponential(0.5, 400), 12.0]  # 2,000 GPU-days, one outlier far above the tail
    th = logit(budget_threshold(peaks, 2000.0, budget=1.0))  # 2 allowed: Garwood's n = 0 fits (1.61)
    point = 2.0 + 0.5 * np.log(401 / 2)
    assert point - 0.3 < th < (point + 12.0) / 2  # the outlier widens the tail's scale, it does not set the bar


def test_threshold_follows_a_new_false_alarm_over_a_day_not_in_one_step():
    """Each hourly estimate moves with the peaks that enter or settle; the threshold used is their mean over
    the last day, so one settled burst raises it step by step, and fully after a day."""
    rows = fleet_scores(n_gpus=32, days=12)
    burst_end = T0 + 5 * 86_400_000
    burst = (rows["node"] == "n0") & (rows["gpu_index"] == 0) & rows["t_ms"].between(burst_end - 6 * HOUR, burst_end)
    rows.loc[burst, "risk"] = 0.99
    rep = replay(rows, rows["risk"].to_numpy(), NO_FAULTS, policy=AlertPolicy(0.5), step_s=STEP_S, budget=5.0)
    t = rows["t_ms"].to_numpy()

    def at(ms: int) -> float:
        return float(rep.threshold[t == t[np.argmin(np.abs(t - ms))]][0])

    settled = burst_end + 48 * HOUR  # the burst joins the estimate once it is two days old
    before, early = at(settled - HOUR), at(settled + 3 * HOUR)
    later, day_after = at(settled + 12 * HOUR), at(settled + 26 * HOUR)
    assert before < early < later < day_after
    assert day_after == pytest.approx(at(settled + 30 * HOUR), abs=0.02)  # a day on: the new level, held


def test_a_window_whose_high_runs_all_end_in_faults_gives_no_estimate_not_a_silenced_fleet():
    """On a fleet with many faults the top half percent of a young window may all be precursors: no false peak
    to estimate from. That hour adds no estimate (the start value holds), rather than a threshold of 1 that
    would silence every alert for the day it is averaged over."""
    rows = fleet_scores(n_gpus=8, days=5)
    fault_ms = T0 + 2 * 86_400_000
    burst = (rows["node"] == "n0") & (rows["gpu_index"] == 0) & rows["t_ms"].between(fault_ms - 8 * HOUR, fault_ms)
    rows.loc[burst, "risk"] = 0.99  # 48 rows: more than the top 0.5 % of the window, all before the fault
    cal = BudgetCalibrator(1.0, 0.4, step_s=STEP_S, keep_firing_for_s=4 * 3600, min_gpu_days=2)
    cal.fault(("n0", 0), fault_ms + 1)
    now = T0 + 5 * 86_400_000 - STEP_S * 1000
    for t, g in rows[rows["t_ms"] < now].groupby("t_ms"):
        cal.observe(t, list(zip(g["node"], g["gpu_index"])), g["risk"].to_numpy())
    assert cal.threshold(now) == 0.4
