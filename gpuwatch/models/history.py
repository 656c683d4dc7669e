"""History across faults: how often this GPU and its node failed in the last weeks, and how long ago the GPU
came back from its last fault.

Kept apart from the within-life windows of models/features.py, which end at a GPU's fault on purpose (the
errors before a fault describe that fault, not the GPU that returns). Across faults the history is the
signal: on real fleets a GPU back from a fault fails again far above the base rate (Titan: about 50x within
7 days, docs/failure-model.md), and bad GPUs and nodes repeat. Only fatal XIDs, lost GPUs and imported
fault-log entries count (the events table: the collector reads the last ``LOOKBACK_S`` of them cheaply every
round, so live scores see the history that training did); evidence closer than ``COALESCE_S`` is one fault.
A recording keys GPUs by node and index, so "this GPU" is its slot: a replaced board inherits its history.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from gpuwatch.core.recording import ts_ms
from gpuwatch.models.faults import COALESCE_S, FATAL_XIDS

WINDOWS_D = (7, 30, 90)
#: How far back the history looks (its longest window); the time since the last fault is capped there.
LOOKBACK_S = max(WINDOWS_D) * 86400


def history_names() -> list[str]:
    """The history columns, in order."""
    return [f"{scope}_faults_{d}d" for scope in ("gpu", "node") for d in WINDOWS_D] + ["days_since_fault"]


def fault_starts(events: pd.DataFrame) -> pd.DataFrame:
    """node, gpu_index, start_ms, end_ms of each fault (fatal XID, GPU lost, or a fault log's entry; evidence within
    ``COALESCE_S`` of the previous is the same fault)."""
    fatal = (events["kind"].isin(["gpu_lost", "fault"])  # "fault": an imported fault log's entry
             | ((events["kind"] == "xid") & events["code"].isin(list(FATAL_XIDS))))
    ev = pd.DataFrame({"node": events.loc[fatal, "node"].astype(str).to_numpy(),
                       "gpu_index": events.loc[fatal, "gpu_index"].astype(int).to_numpy(),
                       "t": ts_ms(events.loc[fatal, "ts"])}).sort_values(["node", "gpu_index", "t"])
    if ev.empty:
        return pd.DataFrame({"node": [], "gpu_index": [], "start_ms": [], "end_ms": []})
    gap = ev.groupby(["node", "gpu_index"], sort=False)["t"].diff()
    episode = (gap.isna() | (gap > COALESCE_S * 1000)).cumsum()
    return ev.groupby(episode.to_numpy()).agg(node=("node", "first"), gpu_index=("gpu_index", "first"),
                                               start_ms=("t", "min"), end_ms=("t", "max")).reset_index(drop=True)


def _count_before(key: np.ndarray, t: np.ndarray, f_key: np.ndarray, f_t: np.ndarray, window_ms: int
                  ) -> np.ndarray:
    """Per row, faults of the same key that started in [t - window, t) (times >= window, in ms)."""
    span = int(max(f_t.max(initial=0), t.max(initial=0))) + 1
    axis = np.sort(f_key * span + f_t)  # one sorted axis: key first, time within it
    hi = np.searchsorted(axis, key * span + t, side="left")
    lo = np.searchsorted(axis, key * span + t - window_ms, side="left")
    return (hi - lo).astype(float)


def with_history(feats: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    """``feats`` (node, gpu_index, t_ms, ...) plus :func:`history_names` from the faults in ``events`` that
    started before each row's time."""
    f = fault_starts(events)
    t = feats["t_ms"].to_numpy(np.int64)
    t0 = int(min(t.min(initial=0), f["start_ms"].min() if len(f) else 0)) - LOOKBACK_S * 1000
    rel, f_rel = t - t0, f["start_ms"].to_numpy(np.int64) - t0
    gpus = pd.Index(pd.concat([feats["node"].astype(str) + "\x00" + feats["gpu_index"].astype(str),
                               f["node"].astype(str) + "\x00" + f["gpu_index"].astype(int).astype(str)]).unique())
    nodes = pd.Index(pd.concat([feats["node"].astype(str), f["node"].astype(str)]).unique())
    g = gpus.get_indexer(feats["node"].astype(str) + "\x00" + feats["gpu_index"].astype(str)).astype(np.int64)
    fg = gpus.get_indexer(f["node"].astype(str) + "\x00" + f["gpu_index"].astype(int).astype(str)).astype(np.int64)
    n = nodes.get_indexer(feats["node"].astype(str)).astype(np.int64)
    fn = nodes.get_indexer(f["node"].astype(str)).astype(np.int64)
    added: dict[str, np.ndarray] = {}
    for d in WINDOWS_D:
        own = _count_before(g, rel, fg, f_rel, d * 86_400_000)
        added[f"gpu_faults_{d}d"] = own
        added[f"node_faults_{d}d"] = _count_before(n, rel, fn, f_rel, d * 86_400_000) - own
    added["days_since_fault"] = _days_since_return(g, rel, fg, f_rel, f["end_ms"].to_numpy(np.int64) - t0)
    return pd.concat([feats.reset_index(drop=True), pd.DataFrame(added)], axis=1).set_axis(feats.index)


def _days_since_return(g: np.ndarray, t: np.ndarray, fg: np.ndarray, f_start: np.ndarray, f_end: np.ndarray
                       ) -> np.ndarray:
    """Days from the end of the GPU's last fault that started before each row, capped at ``LOOKBACK_S``."""
    cap = LOOKBACK_S / 86400
    if not len(fg):
        return np.full(len(g), cap)
    span = int(max(f_start.max(), t.max(initial=0))) + 1
    order = np.argsort(fg * span + f_start)
    axis = (fg * span + f_start)[order]
    k = np.searchsorted(axis, g * span + t, side="left") - 1
    kk = np.maximum(k, 0)
    same = (k >= 0) & (fg[order][kk] == g)
    days = (t - np.maximum(f_end[order][kk], f_start[order][kk])) / 86_400_000
    return np.where(same, np.clip(days, 0.0, cap), cap)
