"""Fault taxonomy: which recorded events and counter changes mean a GPU failed, and which only warn.

Labels come from hard evidence only (failure-prediction.md §4): fatal hardware XIDs, a lost GPU, an
uncorrectable ECC error (volatile DBE counter increase) or a row-remap failure. Application XIDs are
features, never labels. Evidence of one GPU closer than ``COALESCE_S`` apart is one fault episode.
XID classes follow the catalog grouping in nvml-and-dcgm.md §6.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from gpuwatch import xids
from gpuwatch.recording import ts_ms

# XID classes (catalog grouping, nvml-and-dcgm.md §6) live with the XID names in gpuwatch.xids.
APPLICATION_XIDS, PRECURSOR_XIDS, FATAL_XIDS = xids.APPLICATION, xids.PRECURSOR, xids.FATAL

COALESCE_S = 3600
#: Counter/flag evidence of a failure, read from gpu_samples.
FAULT_COUNTERS = ("gpu_ecc_dbe_volatile_total",)
FAULT_FLAGS = ("gpu_remapped_rows_failure",)
#: Precursor evidence in samples: (column, minimum growth over the look-back window that counts).
PRECURSOR_COUNTERS = {
    "gpu_ecc_sbe_volatile_total": 10.0,
    "gpu_pcie_replay_total": 10.0,
    "gpu_nvlink_crc_flit_errors_total": 50.0,
    "gpu_nvlink_replay_errors_total": 1.0,
    "gpu_throttle_thermal_seconds_total": 900.0,
}
PRECURSOR_FLAGS = ("gpu_remapped_rows_pending", "gpu_retired_pages_pending")
PRECURSOR_LOOKBACK_S = 6 * 3600


def xid_class(code: int) -> str:
    """'fatal', 'precursor', 'application' or 'unknown' for an XID number."""
    if code in FATAL_XIDS:
        return "fatal"
    if code in PRECURSOR_XIDS:
        return "precursor"
    if code in APPLICATION_XIDS:
        return "application"
    return "unknown"


def _key(df: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({"node": df["node"].astype(str).to_numpy(), "gpu_index": df["gpu_index"].astype(int).to_numpy(),
                         "ts_ms": ts_ms(df["ts"])})


def _sorted_samples(samples: pd.DataFrame, columns: tuple[str, ...]) -> pd.DataFrame:
    s = _key(samples)
    for c in columns:
        s[c] = samples[c].to_numpy(dtype=float)
    return s.sort_values(["node", "gpu_index", "ts_ms"], kind="stable").reset_index(drop=True)


def _rises(s: pd.DataFrame, column: str, flag: bool) -> pd.DataFrame:
    """Rows where a counter grew (reset-aware) or a flag turned on, per GPU."""
    prev = s.groupby(["node", "gpu_index"], sort=False)[column].shift()
    x = s[column]
    grew = (x > 0) & (prev == 0) if flag else (x > prev) & prev.notna()
    return s.loc[grew.fillna(False), ["node", "gpu_index", "ts_ms"]]


def evidence(events: pd.DataFrame, samples: pd.DataFrame) -> pd.DataFrame:
    """Every piece of fault evidence: node, gpu_index, ts_ms, kind ('xid_48', 'gpu_lost', 'dbe', 'remap_failure')."""
    ev = _key(events)
    ev["kind"] = events["kind"].to_numpy()
    ev["code"] = events["code"].to_numpy()
    fatal = ev[((ev["kind"] == "xid") & ev["code"].isin(FATAL_XIDS)) | (ev["kind"] == "gpu_lost")].copy()
    fatal["kind"] = np.where(fatal["kind"] == "xid", "xid_" + fatal["code"].astype(str), fatal["kind"])
    parts = [fatal[["node", "gpu_index", "ts_ms", "kind"]]]
    if len(samples):
        s = _sorted_samples(samples, FAULT_COUNTERS + FAULT_FLAGS)
        parts += [_rises(s, c, False).assign(kind="dbe") for c in FAULT_COUNTERS]
        parts += [_rises(s, c, True).assign(kind="remap_failure") for c in FAULT_FLAGS]
    out = pd.concat(parts, ignore_index=True)
    return out[out["gpu_index"] >= 0].sort_values(["node", "gpu_index", "ts_ms"], kind="stable").reset_index(drop=True)


def fault_events(events: pd.DataFrame, samples: pd.DataFrame, *, coalesce_s: float = COALESCE_S) -> pd.DataFrame:
    """Fault episodes per GPU: node, gpu_index, start_ms, end_ms, kinds, n_evidence, had_precursor.

    Evidence of one GPU within ``coalesce_s`` of the previous piece joins its episode. ``had_precursor``
    says whether the GPU showed any precursor in the ``PRECURSOR_LOOKBACK_S`` before the episode: the
    evaluation reports recall separately for faults with and without warning signs.
    """
    ev = evidence(events, samples)
    cols = ["node", "gpu_index", "start_ms", "end_ms", "kinds", "n_evidence", "had_precursor"]
    if ev.empty:
        return pd.DataFrame(columns=cols)
    gap = ev.groupby(["node", "gpu_index"], sort=False)["ts_ms"].diff()
    ev["episode"] = (gap.isna() | (gap > coalesce_s * 1000)).cumsum()
    ep = ev.groupby("episode").agg(node=("node", "first"), gpu_index=("gpu_index", "first"),
                                   start_ms=("ts_ms", "min"), end_ms=("ts_ms", "max"),
                                   kinds=("kind", lambda k: ",".join(sorted(set(k)))), n_evidence=("kind", "size"))
    ep = ep.reset_index(drop=True)
    ep["had_precursor"] = _had_precursor(ep, events, samples)
    return ep[cols]


def precursor_evidence(events: pd.DataFrame, samples: pd.DataFrame) -> pd.DataFrame:
    """Warning signs (not failures) per GPU and time: precursor XIDs, error-counter growth, pending flags."""
    ev = _key(events)
    keep = (events["kind"].to_numpy() == "xid") & events["code"].isin(PRECURSOR_XIDS).to_numpy()
    parts = [ev.loc[keep, ["node", "gpu_index", "ts_ms"]].assign(amount=np.inf, signal="xid")]
    if len(samples):
        s = _sorted_samples(samples, tuple(PRECURSOR_COUNTERS) + PRECURSOR_FLAGS + ("gpu_pcie_link_width",
                                                                                   "gpu_pcie_link_width_max"))
        grouped = s.groupby(["node", "gpu_index"], sort=False)
        for c in PRECURSOR_COUNTERS:
            d = grouped[c].diff()
            inc = np.where(d >= 0, d, s[c])  # a drop is a reset: count from zero
            rows = s.loc[inc > 0, ["node", "gpu_index", "ts_ms"]]
            parts.append(rows.assign(amount=inc[inc > 0], signal=c))
        for c in PRECURSOR_FLAGS:
            parts.append(s.loc[s[c] > 0, ["node", "gpu_index", "ts_ms"]].assign(amount=np.inf, signal=c))
        down = s["gpu_pcie_link_width"] < s["gpu_pcie_link_width_max"]
        parts.append(s.loc[down, ["node", "gpu_index", "ts_ms"]].assign(amount=np.inf, signal="pcie_width"))
    return pd.concat(parts, ignore_index=True)


def _had_precursor(episodes: pd.DataFrame, events: pd.DataFrame, samples: pd.DataFrame) -> np.ndarray:
    pre = precursor_evidence(events, samples)
    out = np.zeros(len(episodes), bool)
    for i, ep in enumerate(episodes.itertuples(index=False)):
        win = pre[(pre["node"] == ep.node) & (pre["gpu_index"] == ep.gpu_index)
                  & (pre["ts_ms"] < ep.start_ms) & (pre["ts_ms"] >= ep.start_ms - PRECURSOR_LOOKBACK_S * 1000)]
        if win.empty:
            continue
        total = win.groupby("signal")["amount"].sum()
        need = np.array([PRECURSOR_COUNTERS.get(sig, 0.0) for sig in total.index])
        out[i] = bool((total.to_numpy() >= need).any())
    return out
