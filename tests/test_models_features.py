"""The one feature function: online rows equal training rows, counters are reset-aware, no look-ahead."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from gpuwatch.simulator.failing_fleet import FaultPlan, FleetConfig, plan_effects, simulate_fleet
from gpuwatch.models.features import feature_names, features
from gpuwatch.core.recording import open_recording
from helpers import MIN, T0, event_rows, minute_samples


def test_online_row_equals_training_row(tmp_path):
    simulate_fleet(FleetConfig(nodes=2, gpus_per_node=4, days=2, resolution_s=120, seed=5,
                               fault_rate_multiplier=6000, repair_median_h=4.0, repair_sigma=0.5), tmp_path)
    rec = open_recording(tmp_path)
    s, e = rec.table("gpu_samples"), rec.table("events")
    batch = features(s, e)
    at = int(batch["t_ms"].quantile(0.8) // 600_000 * 600_000)
    online = features(s, e, at=at).set_index(["node", "gpu_index"])
    same_time = batch[batch["t_ms"] == at].set_index(["node", "gpu_index"])
    common = same_time.index.intersection(online.index)
    assert len(common) >= 6
    pd.testing.assert_frame_equal(online.loc[common, feature_names()], same_time.loc[common, feature_names()],
                                  check_dtype=False)


def test_counter_reset_is_growth_not_a_drop_and_future_is_ignored():
    sbe = np.r_[np.arange(60) * 2.0, np.arange(60) * 1.0]  # driver reload at minute 60 resets the counter
    s = minute_samples("n1", 0, 120, gpu_ecc_sbe_volatile_total=sbe)
    f = features(s, event_rows(("n1", 0, T0 + 200 * MIN, "xid", 63))).set_index("t_ms")
    assert (f["sbe_log1h"] >= 0).all()
    assert np.expm1(f["sbe_log6h"].iloc[-1]) == pytest.approx(2 * 59 + 59)  # growth before and after the reset
    assert (f["xid_precursor_24h"] == 0).all()  # an event after the last row is not seen


def test_plan_effects_tick_by_tick_emits_each_event_once():
    plan = FaultPlan("n1", 0, "memory", onset_ms=T0, fault_ms=T0 + 6 * 3_600_000,
                     recover_ms=T0 + 8 * 3_600_000, final_xid=48, seed=7)
    ticks = T0 + 60_000 * np.arange(1, 8 * 60)
    whole = plan_effects(plan, ticks, 60)
    one_by_one = [ev for t in ticks for ev in plan_effects(plan, np.array([t]), 60).events]
    fixed = lambda evs: sorted(e for e in evs if e[2] != 63)  # noqa: E731 (XID 63 follows random remaps)
    assert fixed(whole.events) == fixed(one_by_one)
    assert [e[2] for e in fixed(whole.events)] == [92, 48, 43, 48]
    sbe = whole.increments["gpu_ecc_sbe_volatile_total"]
    assert sbe[:60].sum() < sbe[240:300].sum()  # the correctable-error rate rises towards the fault
    assert whole.flags["gpu_remapped_rows_pending"][300:359].all()


def test_assess_scores_every_gpu_live_with_the_default_model(tmp_path):
    from gpuwatch.models.model import load_model
    from gpuwatch.models.online import assess

    simulate_fleet(FleetConfig(nodes=2, gpus_per_node=4, days=1.5, resolution_s=60, seed=8), tmp_path)
    rec = open_recording(tmp_path)
    at = rec.manifest["end_ms"]
    out = assess(load_model(), rec.table("gpu_samples"), rec.table("events"), at=at)
    assert len(out) == 8 and (out["t_ms"] == at).all()
    assert out["risk"].between(0, 1).all() and set(out["state"]) <= {"ok", "warn", "fail"}
    assert all(isinstance(s, list) for s in out["signals"])


def test_windows_do_not_reach_back_across_a_fault():
    """A GPU that failed and came back (reset, repaired) is judged on its new life, not the errors of its fault."""
    minutes = 8 * 60
    sbe = np.where(np.arange(minutes) < 180, np.arange(minutes) * 5.0, 0.0)  # rising errors, then the fault
    s = minute_samples("n1", 0, minutes, gpu_ecc_sbe_volatile_total=sbe)
    ev = event_rows(("n1", 0, T0 + 170 * MIN, "xid", 92), ("n1", 0, T0 + 181 * MIN, "xid", 48))
    f = features(s, ev).set_index("t_ms")
    before, after = f.loc[T0 + 180 * MIN], f.loc[T0 + 300 * MIN]
    assert before["sbe_log6h"] > 5 and before["xid_precursor_6h"] == 1
    assert after["sbe_log6h"] == 0 and after["xid_precursor_6h"] == 0 and after["xid_fatal_24h"] == 0
    assert after["hours_since_precursor_xid"] == 168.0  # the precursor belonged to the fault
    no_fault = features(s, ev.iloc[:1]).set_index("t_ms").loc[T0 + 300 * MIN]
    assert no_fault["xid_precursor_6h"] == 1  # without the fault the window reaches back as before


def test_accel_tells_a_rising_rate_from_one_that_levelled_off():
    minutes = 4 * 60
    rising = np.cumsum(np.arange(minutes) / 10.0)
    flat = np.arange(minutes) * 10.0
    f = features(pd.concat([minute_samples("n1", 0, minutes, gpu_pcie_replay_total=rising),
                            minute_samples("n1", 1, minutes, gpu_pcie_replay_total=flat)]), event_rows())
    last = f[f["t_ms"] == f["t_ms"].max()].set_index("gpu_index")
    assert last.loc[0, "pcie_replay_accel"] > 0.3 > abs(last.loc[1, "pcie_replay_accel"])


def test_shape_tells_a_building_degradation_from_a_burst_that_stopped_and_a_slow_drift():
    """Over 6 h: errors building up hour by hour, a flat burst that ran 2 h and stopped 30 min ago, and a GPU
    warming 8 C over two days against one heating 15 C in its last 3 h."""
    minutes = 8 * 60
    m = np.arange(minutes)
    building = np.cumsum(np.clip(m - 120, 0, None) / 60.0)  # rate rising from minute 120 to the end
    burst = np.cumsum(np.where((m >= minutes - 150) & (m < minutes - 30), 40.0, 0.0))
    drift = 50 + 8 * m / (48 * 60)
    heating = 50 + 15 * np.clip((m - (minutes - 180)) / 180, 0, 1) ** 2
    f = features(pd.concat([minute_samples("n1", 0, minutes, gpu_pcie_replay_total=building),
                            minute_samples("n1", 1, minutes, gpu_pcie_replay_total=burst),
                            minute_samples("n1", 2, minutes, gpu_temperature_celsius=drift),
                            minute_samples("n1", 3, minutes, gpu_temperature_celsius=heating)]), event_rows())
    last = f[f["t_ms"] == f["t_ms"].max()].set_index("gpu_index")
    assert last.loc[0, "pcie_replay_vs_run"] > 0.3 > 0 > last.loc[1, "pcie_replay_vs_run"]
    assert last.loc[0, "pcie_replay_from_peak"] == 0 > -0.5 > last.loc[1, "pcie_replay_from_peak"]
    assert last.loc[0, "pcie_replay_persist6h"] > last.loc[1, "pcie_replay_persist6h"] > 0
    assert last.loc[3, "temp_slope6h"] > 1.0 > 0.5 > last.loc[2, "temp_slope6h"] > 0
    first_hours = f[f["t_ms"] <= f["t_ms"].min() + 3_600_000 * 2]
    assert (first_hours["pcie_replay_persist6h"] == 0).all()  # the future is not seen
    assert (first_hours.loc[first_hours["gpu_index"] == 3, "temp_slope6h"].fillna(0) == 0).all()
