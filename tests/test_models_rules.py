"""Rule baseline after DCGM health: states with reasons, PCIe replay limits, vectorised scores."""
from __future__ import annotations

import numpy as np
import pandas as pd

from gpuwatch.models.features import features
from gpuwatch.models.rules import health, pcie_replay_limit_per_min, rule_scores
from helpers import MIN, T0, event_rows, minute_samples

HOURS = 26 * 60  # minutes of history: a day of look-back plus the last hours


def fleet() -> pd.DataFrame:
    ramp = np.r_[np.zeros(HOURS - 30), np.arange(30)]
    replays = np.r_[np.zeros(HOURS - 60), np.cumsum(np.full(60, 40.0))]  # 40/min > the Gen5 x16 limit of 31
    return pd.concat([
        minute_samples("n1", 0, HOURS),
        minute_samples("n1", 1, HOURS, gpu_remapped_rows_pending=np.r_[np.zeros(HOURS - 5), np.ones(5)]),
        minute_samples("n1", 2, HOURS, gpu_remapped_rows_failure=np.r_[np.zeros(HOURS - 5), np.ones(5)]),
        minute_samples("n1", 3, HOURS, gpu_pcie_replay_total=replays, gpu_pcie_link_gen=5.0, gpu_pcie_link_gen_max=5.0),
        minute_samples("n1", 4, HOURS, gpu_pcie_link_width=np.r_[np.full(HOURS - 10, 16.0), np.full(10, 8.0)]),
        minute_samples("n1", 5, HOURS, gpu_throttle_thermal_seconds_total=ramp * 30),
        minute_samples("n1", 6, HOURS, gpu_ecc_dbe_volatile_total=np.r_[np.zeros(HOURS - 10), np.ones(10)]),
    ], ignore_index=True)


def test_health_states_and_reasons():
    ev = event_rows(("n1", 0, T0 + (HOURS - 20) * MIN, "xid", 13))
    h = health(fleet(), ev, at=T0 + (HOURS - 1) * MIN).set_index("gpu_index")
    assert h.loc[0, "state"] == "warn" and h.loc[0, "reasons"] == ["XID 31/32/43/63/92 in the last hour"]
    assert h.loc[1, "state"] == "warn" and "row remap or page retirement pending" in h.loc[1, "reasons"]
    assert h.loc[2, "state"] == "fail" and "row-remap failure (RMA path)" in h.loc[2, "reasons"]
    assert h.loc[3, "state"] == "warn" and "PCIe replay rate over the DCGM limit" in h.loc[3, "reasons"]
    assert "PCIe link below its maximum width or generation" in h.loc[4, "reasons"]
    assert h.loc[5, "reasons"] == ["thermal violation time grew"]
    assert h.loc[6, "state"] == "fail" and "uncorrectable ECC error in the last hour" in h.loc[6, "reasons"]


def test_healthy_gpu_is_ok_and_scores_are_per_row():
    feats = features(fleet(), event_rows())
    scores = rule_scores(feats)
    assert len(scores) == len(feats)
    healthy = feats["gpu_index"].to_numpy() == 0
    assert (scores[healthy] < 1e-5).all() and scores.max() > 0.95  # nothing found vs a FAIL finding


def test_pcie_replay_limit_matches_dcgm():
    gen, width = pd.Series([4.0, 5.0, 5.0]), pd.Series([16.0, 16.0, 8.0])
    assert pcie_replay_limit_per_min(gen, width).tolist() == [16.0, 31.0, 16.0]


def test_rule_score_orders_by_how_far_over_the_dcgm_limit():
    feats = features(fleet(), event_rows()).set_index(["gpu_index", "t_ms"])
    last = feats.groupby(level=0).tail(1).reset_index()
    scores = pd.Series(rule_scores(last), index=last["gpu_index"])
    assert scores[6] > scores[3] > scores[0]  # a DBE (FAIL) over replays 1.3x the limit over nothing
