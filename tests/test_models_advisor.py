"""Checkpoint advisor against the worked numbers of docs/background.md §5 (M = 3.09 h)."""
from __future__ import annotations

import json

import pytest

from gpuwatch.models.advisor import (advise, break_even_precision_checkpoint, break_even_precision_drain,
                                     daly_interval_s, job_mtbf_s, predicted_interval_s, waste, young_interval_s)

M = 3.09 * 3600
MIN = 60


def test_llama3_job_mtbf():
    assert job_mtbf_s(16384) / 3600 == pytest.approx(3.09, abs=0.01)


@pytest.mark.parametrize("c_s, young_min, waste_share", [(5 * MIN, 43, 0.23), (MIN, 19, 0.10), (10, 7.9, 0.04)])
def test_young_interval_and_waste(c_s, young_min, waste_share):
    t = young_interval_s(c_s, M)
    assert t / MIN == pytest.approx(young_min, rel=0.02)
    assert waste(c_s, t, M) == pytest.approx(waste_share, abs=0.006)


def test_daly_interval():
    assert daly_interval_s(5 * MIN, M) / MIN == pytest.approx(40, abs=0.5)
    assert daly_interval_s(3 * M, M) == M  # C >= 2M: checkpointing cannot keep up


@pytest.mark.parametrize("recall, t_min, waste_share, alert_cost", [(0.5, 61, 0.16, 0.027), (0.9, 136, 0.07, 0.049)])
def test_predictor_stretches_the_interval(recall, t_min, waste_share, alert_cost):
    t = predicted_interval_s(5 * MIN, M, recall)
    assert t / MIN == pytest.approx(t_min, abs=0.5)
    base = waste(5 * MIN, t, M, recall=recall)
    assert base == pytest.approx(waste_share, abs=0.005)
    with_alerts = waste(5 * MIN, t, M, recall=recall, precision=0.5, action_s=5 * MIN)
    assert with_alerts - base == pytest.approx(alert_cost, abs=0.001)


def test_break_even_precisions():
    assert break_even_precision_checkpoint(5 * MIN, 43 * MIN) == pytest.approx(0.23, abs=0.005)
    assert break_even_precision_checkpoint(MIN, 19 * MIN) == pytest.approx(0.10, abs=0.006)
    assert break_even_precision_drain(5 * MIN, 43 * MIN, 10 * MIN, 5 * MIN) == pytest.approx(0.14, abs=0.005)


def test_advise_combines_them():
    a = advise(16384, 5 * MIN, recall=0.9, precision=0.5)
    assert a.young_interval_s / MIN == pytest.approx(43, rel=0.02)
    assert a.interval_with_predictor_s / MIN == pytest.approx(136, abs=0.5)
    assert a.waste_with_predictor < a.waste
    with pytest.raises(ValueError):
        predicted_interval_s(60, M, 1.0)


def test_advise_cli_json_against_the_reference_numbers(capsys):
    from gpuwatch.apps.cli import main

    assert main(["advise", "--gpus", "16384", "--checkpoint-cost", "5m", "--recall", "0.95", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rate"]["source"] == "published Llama 3 rate" and out["mtbf_s"] / 3600 == pytest.approx(3.09, abs=0.01)
    assert out["young_interval_s"] / MIN == pytest.approx(43, rel=0.02)
    assert out["daly_interval_s"] / MIN == pytest.approx(40, abs=0.5)
    assert out["waste"] == pytest.approx(0.23, abs=0.006)
    rows = {round(r["recall"], 2): r for r in out["by_recall"]}
    assert {0.0, 0.5, 0.8, 0.9, 0.95} <= set(rows) and sum(r.get("model", False) for r in out["by_recall"]) == 1
    assert rows[0.5]["interval_s"] / MIN == pytest.approx(61, abs=0.5) and rows[0.5]["waste"] == pytest.approx(0.16, abs=0.005)
    assert rows[0.9]["interval_s"] / MIN == pytest.approx(136, abs=0.5) and rows[0.9]["waste"] == pytest.approx(0.07, abs=0.005)


def test_advise_rate_from_data_and_bad_input(tmp_path, capsys):
    from gpuwatch.apps.cli import main
    from gpuwatch.simulator.failing_fleet import FleetConfig, simulate_fleet

    simulate_fleet(FleetConfig(nodes=2, gpus_per_node=4, days=2, resolution_s=600, fault_rate_multiplier=6000,
                               repair_median_h=4.0, repair_sigma=0.5, seed=5), tmp_path / "rec", quiet=True)
    assert main(["advise", "--gpus", "1024", "--data", str(tmp_path / "rec"), "--json"]) == 0
    rate = json.loads(capsys.readouterr().out)["rate"]
    assert rate["fault_episodes"] > 0 and 0.9 * 8 * 48 < rate["gpu_hours"] <= 8 * 48  # failed GPUs stop reporting
    assert rate["faults_per_gpu_hour"] == pytest.approx(rate["fault_episodes"] / rate["gpu_hours"], rel=0.01)
    assert main(["advise", "--gpus", "0"]) == 2
    assert capsys.readouterr().err.strip() == "gpuwatch advise: error: --gpus must be positive, got 0"
    (tmp_path / "x.json").write_text("{}")
    assert main(["advise", "--gpus", "8", "--data", str(tmp_path / "x.json")]) == 2
    assert "neither a recording directory nor a collector .duckdb store" in capsys.readouterr().err
