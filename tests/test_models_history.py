"""History across faults: counts of the GPU's and its node's earlier faults and the time since the last, from
only what happened before each row."""
from __future__ import annotations

import numpy as np
import pandas as pd

from gpuwatch.models.features import feature_names, monotone_direction
from gpuwatch.models.history import history_names, with_history

DAY = 86_400_000
T0 = 1_700_000_000_000


def _xid(node: str, gpu: int, t: int, code: int = 48) -> dict:
    return {"node": node, "gpu_index": gpu, "ts": pd.Timestamp(t, unit="ms", tz="UTC"), "kind": "xid", "code": code}


def test_counts_only_earlier_faults_of_the_gpu_and_its_node():
    events = pd.DataFrame([_xid("a", 0, T0), _xid("a", 0, T0 + 1000),  # one fault (coalesced)
                           _xid("a", 0, T0 + 20 * DAY, 79), _xid("a", 1, T0 + 25 * DAY),
                           _xid("b", 0, T0 + 25 * DAY), _xid("a", 0, T0 + 26 * DAY, 43)])  # 43: not fatal
    rows = pd.DataFrame({"node": ["a", "a", "a", "a", "a"], "gpu_index": [0, 0, 0, 1, 0],
                         "t_ms": [T0, T0 + 2 * DAY, T0 + 26 * DAY, T0 + 26 * DAY, T0 + 100 * DAY]})
    h = with_history(rows, events)
    assert h["gpu_faults_7d"].tolist() == [0, 1, 1, 1, 0]  # its own fault at T0 is not yet in the past at T0
    assert h["gpu_faults_30d"].tolist() == [0, 1, 2, 1, 0]
    assert h["gpu_faults_90d"].tolist() == [0, 1, 2, 1, 1]
    assert h["node_faults_30d"].tolist() == [0, 0, 1, 2, 0]  # other GPUs of node a only; node b never
    assert h["days_since_fault"].tolist()[:4] == [90.0, 2 * DAY / DAY - 1000 / DAY, 6.0, 1.0]
    assert h["days_since_fault"].iloc[4] == 80.0


def test_history_is_part_of_the_model_inputs_with_its_direction():
    names = feature_names()
    assert names[-len(history_names()):] == history_names()
    assert monotone_direction("gpu_faults_7d") == 1 and monotone_direction("days_since_fault") == -1


def test_no_faults_gives_zero_counts_and_the_cap():
    rows = pd.DataFrame({"node": ["a"], "gpu_index": [0], "t_ms": [T0]})
    h = with_history(rows, pd.DataFrame(columns=["node", "gpu_index", "ts", "kind", "code"]))
    assert h[history_names()].iloc[0].tolist() == [0, 0, 0, 0, 0, 0, 90.0]
    assert np.isfinite(h[history_names()].to_numpy()).all()
