"""Train anywhere, score anywhere: fields a fleet never records, too few faults, `gpuwatch score` on a fleet of
another configuration, the simulator's configurations and benign look-alikes, faults as a job sees them."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from gpuwatch.apps.cli import main
from gpuwatch.models.dataset import build_dataset
from gpuwatch.simulator.failing_fleet import PROFILES, FleetConfig, simulate_fleet
from gpuwatch.models.faults import fault_events
from gpuwatch.models.features import features
from gpuwatch.core.recording import RecordingWriter, open_recording
from helpers import MIN, T0, event_rows, minute_samples

# ~30 faults at the real GPU rate
SMALL = dict(nodes=4, gpus_per_node=8, days=6, resolution_s=300, fault_rate_multiplier=1400)
#: Fields a DCGM-exporter site commonly does not export (the independent fleet had 16 such feature columns).
NOT_RECORDED = ["gpu_ecc_sbe_volatile_total", "gpu_ecc_sbe_aggregate_total", "gpu_nvlink_crc_data_errors_total",
                "gpu_nvlink_recovery_errors_total", "gpu_memory_temperature_celsius",
                "gpu_throttle_thermal_seconds_total",
                "gpu_clock_event_reasons", "gpu_pcie_link_gen", "gpu_pcie_link_gen_max"]


@pytest.fixture(scope="module")
def fleets(tmp_path_factory):
    root = tmp_path_factory.mktemp("transfer")
    simulate_fleet(FleetConfig(seed=21, **SMALL), root / "base")
    shifted = {k: v for k, v in vars(PROFILES["shifted"]).items() if k not in SMALL and k != "seed"}
    shifted["lookalikes_per_gpu_day"] = 0.2  # enough of each kind in a tiny fleet
    simulate_fleet(FleetConfig(seed=22, **SMALL, **shifted), root / "shifted")
    return root


def without_fields(src, dst, fields):
    """A copy of a recording whose ``fields`` were never recorded (all empty)."""
    rec = open_recording(src)
    with RecordingWriter(dst, source="test copy", resolution_s=300) as w:
        for table in ("gpus", "gpu_samples", "host_samples", "events"):
            df = rec.table(table)
            if table == "gpu_samples":
                df[fields] = np.nan
            w.append(table, df)


def test_train_on_a_fleet_missing_fields_drops_them_in_one_line(fleets, tmp_path, capsys):
    without_fields(fleets / "base", tmp_path / "sparse", NOT_RECORDED)
    assert main(["train", str(tmp_path / "sparse"), "--horizon", "1h", "-o", str(tmp_path / "m.skops"), "--quiet",
                 "--json", "--prior", "none"]) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and "gpu_ecc_sbe_volatile_total (never recorded)" in lines[0]
    model = json.loads(captured.out)
    assert "sbe_vs_self" in model["training"]["dropped_features"]
    assert main(["score", str(fleets / "shifted"), "--model", str(tmp_path / "m.skops"), "--json", "--quiet"]) == 0


def test_too_few_faults_is_one_clear_line(tmp_path, capsys):
    simulate_fleet(FleetConfig(nodes=2, gpus_per_node=4, days=3, resolution_s=300, seed=3), tmp_path / "calm")
    assert main(["train", str(tmp_path / "calm"), "-o", str(tmp_path / "m.skops"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "too few faults" in err and "Traceback" not in err


def test_score_replays_a_fleet_of_another_configuration(fleets, capsys):
    assert main(["score", str(fleets / "shifted"), "--model", "default", "--false-alarm-budget", "20", "--json",
                 "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpu_days"] == pytest.approx(4 * 8 * 6, rel=0.15)
    assert out["alerts"], "a fleet with hundreds of faults raises alerts under a calibrated threshold"
    for a in out["alerts"]:
        assert set(a) == {"node", "gpu_index", "start_ms", "end_ms", "peak_risk"}
        assert a["end_ms"] is None or a["end_ms"] > a["start_ms"]
        assert 0 < a["peak_risk"] <= 1
    ds = build_dataset(fleets / "shifted", quiet=True)
    warned = ds.episodes[ds.episodes["had_precursor"]]
    alerts = pd.DataFrame(out["alerts"])
    caught = sum(((alerts["node"] == f.node) & (alerts["gpu_index"] == f.gpu_index)
                  & (alerts["start_ms"] <= f.start_ms - 300_000)
                  & (alerts["end_ms"].fillna(np.inf) >= f.start_ms - 3_600_000)).any() for f in warned.itertuples())
    assert caught >= 0.3 * len(warned)  # generous: tiny fleet, shifted configuration, shipped model


def test_shifted_profile_carries_benign_look_alikes(fleets):
    rec = open_recording(fleets / "shifted")
    ev, s = rec.table("events"), rec.table("gpu_samples")
    truth = pd.DataFrame(json.loads((fleets / "shifted" / "simulation_truth.json").read_text()))
    t = ev["ts"].astype("int64") // 1_000_000

    def in_a_precursor(node: str, gpu: int, ms: int) -> bool:
        plans = truth[(truth["node"] == node) & (truth["gpu_index"] == gpu)]
        return bool(((plans["onset_ms"] <= ms) & (ms <= plans["fault_ms"])).any())

    benign = ev[[not in_a_precursor(n, g, ms) for n, g, ms in zip(ev["node"], ev["gpu_index"], t)]]
    assert {63, 92} <= set(benign.loc[benign["kind"] == "xid", "code"])  # remaps and excessive SBE that end nowhere
    reasons = s["gpu_clock_event_reasons"].astype(np.int64)
    assert ((reasons & 0x80) > 0).any() and ((reasons & 0x4) > 0).any()  # power brake, power cap
    sbe = s.sort_values(["node", "gpu_index", "ts"]).groupby(["node", "gpu_index"])["gpu_ecc_sbe_volatile_total"].diff()
    assert (sbe < 0).any()  # driver reloads reset volatile counters


def test_cli_simulate_knobs_are_checked(tmp_path, capsys):
    assert main(["simulate", "--out", str(tmp_path / "x"), "--noise", "-1", "--quiet"]) == 2
    assert "--noise must not be negative" in capsys.readouterr().err


def test_contained_memory_error_is_a_fault_and_thermal_bits_are_a_precursor():
    hot = np.r_[np.zeros(200), np.full(40, 0x40)]  # HW thermal slowdown for 40 min before the fault
    s = pd.concat([minute_samples("n1", 0, 240, gpu_clock_event_reasons=hot), minute_samples("n1", 1, 240)])
    ep = fault_events(event_rows(("n1", 0, T0 + 240 * MIN, "xid", 79), ("n1", 1, T0 + 240 * MIN, "xid", 94)), s)
    assert ep.set_index("gpu_index")["kind"].to_dict() == {0: "bus", 1: "memory"}
    assert ep.set_index("gpu_index")["had_precursor"].to_dict() == {0: True, 1: False}


def test_features_compare_a_gpu_with_its_own_past_and_its_peers():
    minutes = 30 * 60
    noisy = np.cumsum(np.full(minutes, 20.0))  # 20 SBE/min for 30 h: a noisy but steady GPU
    rising = np.cumsum(np.r_[np.zeros(minutes - 120), np.full(120, 20.0)])  # the same rate, new in the last 2 h
    s = pd.concat([minute_samples("n1", 0, minutes, gpu_ecc_sbe_volatile_total=noisy),
                   minute_samples("n1", 1, minutes, gpu_ecc_sbe_volatile_total=rising),
                   *[minute_samples("n1", g, minutes) for g in range(2, 8)]])
    f = features(s, event_rows(), at=T0 + (minutes - 1) * MIN).set_index("gpu_index")
    assert f.loc[1, "sbe_vs_self"] > 3 and abs(f.loc[0, "sbe_vs_self"]) < 0.2  # its own baseline
    assert f.loc[0, "sbe_rank1h"] >= 6 / 7 and f.loc[2, "sbe_rank1h"] == 0  # the fleet's percentile
    scaled = s.assign(gpu_ecc_sbe_volatile_total=s["gpu_ecc_sbe_volatile_total"] * 10)  # a fleet 10x noisier
    g = features(scaled, event_rows(), at=T0 + (minutes - 1) * MIN).set_index("gpu_index")
    assert g.loc[1, "sbe_vs_self"] == pytest.approx(f.loc[1, "sbe_vs_self"] + np.log(10), abs=0.05)
    assert (g["sbe_rank1h"] == f["sbe_rank1h"]).all()  # ranks do not see the fleet's level at all
