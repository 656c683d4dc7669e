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
                               fault_rate_multiplier=2000), tmp_path)
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
