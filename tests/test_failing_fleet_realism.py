"""The simulated fleet against what real fleets publish: rate, repeats, concentration, idle time, profiles."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from gpuwatch.core.recording import open_recording
from gpuwatch.models import reliability
from gpuwatch.models.faults import fault_events
from gpuwatch.simulator.failing_fleet import (DAY_MS, FLEET_KNOBS, PROFILES, RANDOM_KNOB_RANGES, FleetConfig,
                                              plan_faults, randomized_config, simulate_fleet)


def _planned(cfg: FleetConfig) -> dict:
    """§7's report over the fault plans alone (no telemetry): cheap enough for a large, long fleet."""
    rng = np.random.default_rng(3)
    plans = [p for n in range(cfg.nodes) for p in plan_faults(cfg, n, rng) if not p.near_miss]
    episodes = pd.DataFrame({"node": [p.node for p in plans], "gpu_index": [p.gpu_index for p in plans],
                             "start_ms": [float(p.fault_ms) for p in plans],
                             "end_ms": [float(p.recover_ms) for p in plans], "kind": [p.mechanism for p in plans],
                             "gpu": True})
    exposure = pd.DataFrame([{"node": f"node-{n:04d}", "gpu_index": g, "first_ms": cfg.start_ms,
                              "last_ms": cfg.start_ms + cfg.days * DAY_MS}
                             for n in range(cfg.nodes) for g in range(cfg.gpus_per_node)])
    return reliability.fleet_report(episodes, exposure)


def test_default_fleet_fails_at_the_real_gpu_rate_and_repeats_as_titan_did():
    report = _planned(FleetConfig(nodes=500, gpus_per_node=8, days=2190))
    assert 0.13 < report["rate_per_1000_gpu_days"] < 0.165  # 0.145 configured, repeats included
    hazard = report["repeat_hazard"]
    assert 0.03 < hazard["within_7d"] < 0.08 and hazard["ratio_7d"] > 25
    assert hazard["within_30d"] > hazard["within_7d"]
    assert 0.07 < hazard["top_1pct_share"] < 0.2
    shares = {k: v["share_of_gpu_faults"] for k, v in report["by_kind"].items()}
    assert shares["memory"] == pytest.approx(0.38, abs=0.05) and shares["sudden"] == pytest.approx(0.385, abs=0.05)
    assert shares["pcie_width"] == pytest.approx(0.16, abs=0.04)  # StepFun: "PCIe link width low", a fault
    assert report["repair"]["median_h"] == pytest.approx(16.8, rel=0.3) and report["repair"]["p90_h"] > 150


def test_without_repeats_nothing_follows_a_return_within_a_week():
    report = _planned(FleetConfig(nodes=300, gpus_per_node=8, days=1000, repeat_probability=0.0))
    assert report["repeat_hazard"]["within_7d"] < 0.01


def test_profiles_keep_their_names_and_the_new_ones_differ_in_their_false_alarm_tail():
    assert {"base", "noisy", "subtle", "shifted", "validation", "real", "busy-idle"} <= set(PROFILES)
    real, busy = PROFILES["real"], PROFILES["busy-idle"]
    assert busy.idle_fraction > real.idle_fraction and busy.lookalikes_per_gpu_day > real.lookalikes_per_gpu_day
    assert busy.app_xids_per_node_day > real.app_xids_per_node_day
    assert {"frailty_sigma", "repeat_probability", "repair_median_h", "idle_fraction"} <= set(FLEET_KNOBS)


@pytest.mark.parametrize("profile", ["real", "busy-idle"])
def test_telemetry_idles_a_quarter_of_the_time_with_a_wide_temperature_spread(profile, tmp_path):
    simulate_fleet(replace(PROFILES[profile], nodes=4, days=6, resolution_s=900, seed=2), tmp_path, quiet=True)
    g = open_recording(tmp_path).table("gpu_samples", ["gpu_utilization_ratio", "gpu_temperature_celsius"])
    assert (g["gpu_utilization_ratio"] == 0).mean() >= 0.2
    t = g["gpu_temperature_celsius"]
    assert 20 < t.quantile(0.9) - t.quantile(0.1) < 45


def test_a_pcie_width_drop_is_the_fault_and_the_taxonomy_reads_it_so(tmp_path):
    """The simulated link trains down to fewer lanes at the fault (no XID) and the GPU keeps reporting until its
    node is drained; models/faults.py finds each such fault as a pcie episode at that time, warned by the replay
    bursts before it."""
    cfg = replace(PROFILES["base"], nodes=6, days=12, resolution_s=300, seed=4, fault_rate_multiplier=300)
    simulate_fleet(cfg, tmp_path, quiet=True)
    rec = open_recording(tmp_path)
    truth = pd.read_json(tmp_path / "simulation_truth.json")
    width = truth[(truth["mechanism"] == "pcie_width") & ~truth["near_miss"]]
    assert len(width) >= 2 and (width["final_xid"] == 0).all()
    episodes = fault_events(rec.table("events"), rec.table("gpu_samples"))
    found = episodes[episodes["kind"] == "pcie"]
    for plan in width.itertuples():
        mine = found[(found["node"] == plan.node) & (found["gpu_index"] == plan.gpu_index)
                     & (found["start_ms"] >= plan.fault_ms) & (found["start_ms"] <= plan.fault_ms + 300_000)]
        assert len(mine) == 1 and mine["kinds"].item() == "pcie_width", plan
        assert mine["had_precursor"].item()
    assert len(found) == len(width)  # no other mechanism narrows the link


def test_randomized_configurations_draw_every_site_knob_within_its_range_and_repeat_by_seed():
    """Domain randomisation for training mixtures: each seed its own site, the same seed the same site."""
    drawn = [randomized_config(s) for s in range(20)]
    assert randomized_config(3) == drawn[3] and drawn[3] != drawn[4]
    for knob, (lo, hi) in RANDOM_KNOB_RANGES.items():
        values = [getattr(c, knob) for c in drawn]
        assert all(lo <= v <= hi for v in values) and len(set(values)) == 20, knob
    assert set(RANDOM_KNOB_RANGES) <= set(FLEET_KNOBS)
