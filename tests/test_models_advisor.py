"""Checkpoint advisor against the worked numbers of failure-prediction.md §5 (M = 3.09 h)."""
from __future__ import annotations

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
