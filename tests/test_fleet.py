"""`gpuwatch fleet` and `gpuwatch import --format faults`: the statistics, a real fault log, stores of both engines."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from gpuwatch.apps.cli import main
from gpuwatch.collector.store import open_store
from gpuwatch.core.recording import new_recording
from gpuwatch.models import reliability
from helpers import STORE_KINDS, T0, degrading_node, sim_batches, store_url

STEPFUN = Path("/work/shared/data/fleet-faults/stepfun/fault_trace.json")
DAY = 86_400_000


def _json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


# ------------------------------------------------------------------------------------------ statistics
def test_poisson_interval_is_garwoods_exact_interval():
    lo, hi = reliability.poisson_interval(0, 1.0)
    assert lo == 0 and hi == pytest.approx(3.689, abs=1e-3)  # the "rule of three" bound
    lo, hi = reliability.poisson_interval(10, 2.0)
    assert (lo, hi) == pytest.approx((4.795 / 2, 18.39 / 2), abs=2e-3)


def test_holm_adjusts_step_down():
    assert list(reliability.holm(np.array([0.01, 0.04, 0.03]))) == pytest.approx([0.03, 0.06, 0.06])


def _fleet(counts: dict[tuple[str, int], list[float]], gpus: int = 200, days: float = 100.0):
    """Exposure of ``gpus`` GPUs (8 per node) over ``days`` and episodes at the given day offsets."""
    exposure = pd.DataFrame([{"node": f"n{g // 8}", "gpu_index": g % 8, "first_ms": T0, "last_ms": T0 + days * DAY}
                             for g in range(gpus)])
    episodes = pd.DataFrame([{"node": n, "gpu_index": g, "start_ms": T0 + d * DAY, "end_ms": T0 + d * DAY + 3_600_000,
                              "kind": "memory", "gpu": True} for (n, g), days_ in counts.items() for d in days_],
                            columns=reliability.EPISODE_COLUMNS)
    return episodes, exposure


def test_a_gpu_failing_again_and_again_is_a_lemon_and_its_repeats_show():
    singles = {(f"n{k}", 1): [10.0 + k] for k in range(1, 20)}
    episodes, exposure = _fleet({("n0", 3): [5.0, 6.0, 8.0, 30.0, 31.0], **singles})
    report = reliability.fleet_report(episodes, exposure)
    assert report["episodes"] == 24 and report["exposure_gpu_hours"] == pytest.approx(200 * 100 * 24)
    assert report["rate_per_1000_gpu_days"] == pytest.approx(24 / 20_000 * 1000, rel=1e-3)
    lo, hi = report["rate_ci"]
    assert lo < report["rate_per_1000_gpu_days"] < hi
    gpu_lemons = [x for x in report["lemons"] if x["gpu_index"] is not None]
    assert [(x["node"], x["gpu_index"], x["episodes"]) for x in gpu_lemons] == [("n0", 3, 5)]
    assert gpu_lemons[0]["p_value"] < 0.05 and gpu_lemons[0]["p_value"] >= gpu_lemons[0]["p_raw"]
    hazard = report["repeat_hazard"]
    assert hazard["unit"] == "gpu"
    # returns of n0/3 at days 5, 6, 8 (+1 h) have another fault within 7 days; 30 and 31's window of 7 days ends
    # before day 100; the 19 singles have none: 3 of 24 returns
    assert hazard["within_7d"] == pytest.approx(3 / 24, abs=1e-3)
    assert hazard["base"] == pytest.approx(1 - np.exp(-24 / 20_000 * 7), rel=1e-3)
    assert hazard["within_7d"] > 10 * hazard["base"]


def test_an_even_fleet_has_no_lemons():
    episodes, exposure = _fleet({(f"n{k % 25}", k % 8): [float(k)] for k in range(40)})
    assert reliability.fleet_report(episodes, exposure)["lemons"] == []


@pytest.mark.parametrize(("text", "xid", "cls", "expected"), [
    ("GPU DBE(Double Bit ECC) > Threshold", None, "GPU", ("memory", True)),
    ("GPU PCI link width low", None, "GPU", ("pcie", True)),
    ("GPU Lost", None, "GPU", ("bus", True)),
    ("GPU P2P Bandwidth Low", None, "GPU", ("nvlink", True)),
    ("GPU Temperature High", None, "GPU", ("thermal", True)),
    ("GPU device unknow error", None, "GPU", ("unknown", True)),
    ("NIC PCI link Width low", None, "NIC", ("nic", False)),
    ("", 79, None, ("bus", True)),
    ("Xid 48 on GPU", None, None, ("memory", True)),
    ("power supply failed", None, None, ("power_supply_failed", False)),
])
def test_logged_faults_are_classified_by_xid_words_and_class(text, xid, cls, expected):
    assert reliability.classify_fault(text, xid, cls) == expected


# ------------------------------------------------------------------------------------- a real fault log
@pytest.mark.skipif(not STEPFUN.is_file(), reason="the StepFun fault log is not here")
def test_stepfun_log_reproduces_the_published_rates_and_repairs(tmp_path, capsys):
    out = tmp_path / "stepfun"
    imported = _json(capsys, ["import", str(STEPFUN), "--format", "faults", "--nodes", "400", "--start", "2024-03-30",
                              "--out", str(out), "--json", "--quiet"])
    assert (imported["faults"], imported["gpu_faults"], imported["nodes_in_log"]) == (584, 158, 231)
    assert imported["unmatched_ends"] == 0 and imported["faults_with_end"] == 584
    report = _json(capsys, ["fleet", str(out), "--json", "--quiet"])
    # the period runs to the last event, day 348.98 of the log (the paper says 348 days)
    assert report["exposure_gpu_hours"] == pytest.approx(400 * 8 * 348.98 * 24, rel=1e-4)
    assert report["episodes"] == 158 and report["rate_per_1000_gpu_days"] == pytest.approx(0.142, abs=0.001)
    assert report["all_causes"]["rate_per_1000_gpu_days"] == pytest.approx(0.524, abs=0.002)
    repair = report["repair"]
    assert (repair["median_h"], repair["p75_h"], repair["p90_h"]) == pytest.approx((16.8, 73, 431), rel=0.01)
    shares = {k: v["share_of_gpu_faults"] for k, v in report["by_kind"].items() if v["gpu"]}
    assert shares["memory"] == pytest.approx(0.386, abs=0.005) and shares["pcie"] == pytest.approx(0.158, abs=0.005)
    hazard = report["repeat_hazard"]
    assert hazard["unit"] == "node" and {"within_7d", "within_30d", "base"} <= set(hazard)
    assert hazard["within_7d"] > 5 * hazard["base"]
    assert hazard["units_with_2_or_more"] == 33 and hazard["expected_with_2_or_more"] == pytest.approx(24, abs=0.5)
    assert report["lemons"] and all({"node", "gpu_index", "episodes", "p_value"} <= set(x) for x in report["lemons"])
    worst = report["lemons"][0]
    assert worst["episodes"] >= 8 and worst["p_value"] < 1e-6 and worst["gpu_index"] is None
    advice = _json(capsys, ["advise", "--gpus", "1024", "--data", str(out), "--json"])["rate"]
    assert advice["counts"] == "all interruptions" and advice["fault_episodes"] == 584
    assert advice["gpu_fault_episodes"] == 158
    assert advice["faults_per_gpu_hour"] == pytest.approx(584 / report["exposure_gpu_hours"], rel=1e-4)


def test_csv_fault_log_with_gpus_xids_and_ends(tmp_path, capsys):
    log = tmp_path / "faults.csv"
    rows = [("a", 1, "2025-01-01T00:00:00Z", "48", "", "2025-01-01T10:00:00Z"),
            ("a", 1, "2025-01-03T00:00:00Z", "", "GPU fell off the bus", "2025-01-03T20:00:00Z"),
            ("a", 1, "2025-01-05T00:00:00Z", "", "DBE", ""),
            ("b", 0, "2025-01-20T00:00:00Z", "", "NIC link down", "2025-01-20T01:00:00Z")]
    pd.DataFrame(rows, columns=["host", "gpu", "time", "xid", "reason", "repaired_at"]).to_csv(log, index=False)
    imported = _json(capsys, ["import", str(log), "--format", "faults", "--nodes", "4", "--gpus-per-node", "4",
                              "--start", "2025-01-01", "--end", "2025-02-01", "--out", str(tmp_path / "r"), "--json"])
    assert imported["by_kind"] == {"memory": 2, "bus": 1, "nic_link_down": 1} and imported["gpus"] == 16
    report = _json(capsys, ["fleet", str(tmp_path / "r"), "--json"])
    assert report["exposure_gpu_hours"] == pytest.approx(16 * 31 * 24)
    assert report["episodes"] == 3 and report["all_causes"]["episodes"] == 4
    assert report["repair"] == {"known": 2, "median_h": 15.0, "p75_h": 17.5, "p90_h": 19.0, "mean_h": 15.0}
    assert report["repeat_hazard"]["unit"] == "gpu"


def test_bad_fault_logs_get_one_line(tmp_path, capsys):
    log = tmp_path / "f.csv"
    pd.DataFrame({"host": ["a"], "when": ["2025-01-01"], "xid": [79]}).to_csv(log, index=False)
    assert main(["import", str(log), "--format", "faults", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpuwatch import: error:") and "no time column" in err and "\n" not in err
    pd.DataFrame({"host": ["a"], "time": ["2025-01-01"], "gpu": [9], "xid": [79]}).to_csv(log, index=False)
    assert main(["import", str(log), "--format", "faults", "--out", str(tmp_path / "r2")]) == 2
    assert "the period is empty" in capsys.readouterr().err  # one fault, no --end: nothing to count it against
    assert main(["import", str(log), "--format", "faults", "--days", "30", "--out", str(tmp_path / "r2")]) == 2
    assert "GPU index 9 with --gpus-per-node 8" in capsys.readouterr().err
    assert main(["fleet", str(tmp_path / "nothing")]) == 2
    assert "no such recording directory or store" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- telemetry, stores
@pytest.fixture(scope="module")
def telemetry():
    gpu, events = degrading_node(T0, hours=30, fault_after_h=20, failing_gpu=1)
    narrow = (gpu["gpu_index"] == 3) & (gpu["ts"] >= pd.Timestamp(T0 + 10 * 3_600_000, unit="ms", tz="UTC"))
    gpu.loc[narrow, "gpu_pcie_link_width"] = 8.0  # GPU 3's link trains down to x8: a fault of its own
    return gpu, events


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_fleet_reads_a_store_of_either_engine_as_it_reads_the_recording(kind, telemetry, tmp_path, capsys):
    gpu, events = telemetry
    with new_recording(tmp_path / "rec", source="test", extra={}) as writer:
        writer.append("gpu_samples", gpu)
        writer.append("events", events)
    url = store_url(kind, tmp_path)
    store = open_store(url)
    for batch in sim_batches(gpu, events):
        store.write(batch)
    store.close()
    from_store = _json(capsys, ["fleet", url, "--json", "--quiet"])
    from_recording = _json(capsys, ["fleet", str(tmp_path / "rec"), "--json", "--quiet"])
    assert from_store["episodes"] == from_recording["episodes"] == 2
    assert from_store["by_kind"].keys() == from_recording["by_kind"].keys() == {"memory", "pcie"}
    assert from_store["gpus"] == 4
    for key in ("exposure_gpu_hours", "rate_per_1000_gpu_days"):
        assert from_store[key] == pytest.approx(from_recording[key], rel=1e-6)
    assert from_store["exposure_gpu_hours"] == pytest.approx(4 * 30, rel=0.02)  # failed GPU: less after its fault
