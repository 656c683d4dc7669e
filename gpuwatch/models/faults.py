"""Fault taxonomy: which recorded events and counter changes mean a GPU failed, and which only warn.

A fault is an event that stops the job on that GPU (docs/background.md §4), from hard evidence only:
an XID of NVIDIA's catalogue that kills the job or takes the GPU away — uncorrectable memory errors
whether contained (94) or not (48, 95), fell off the bus (79), NVLink fatal, GSP/driver fatal — a lost
GPU, an uncorrectable ECC error (volatile DBE counter increase), a row-remap failure, or a PCIe link that fell
below its maximum width (StepFun's fleet drained the node for it: 16 % of its GPU faults). Application XIDs
are features, never labels. Evidence of one GPU closer than ``COALESCE_S`` apart is one fault episode.
XID classes follow the catalogue grouping in docs/background.md §2, extended in docs/failure-model.md §2.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from gpuwatch.core import xids
from gpuwatch.core.recording import ts_ms

#: Llama 3 (arXiv 2407.21783): 419 unexpected interruptions, ~78% hardware, 16,384 GPUs, 54 days: the fault
#: rate the checkpoint advice and the simulated fleets assume unless told otherwise.
LLAMA3_FAULTS_PER_GPU_HOUR = 1.97e-5

#: The job on that GPU stops, by subsystem (the fault's kind in the per-kind recall): the catalogue's fatal
#: XIDs (gpuwatch.core.xids, docs/background.md §2) plus XID 94, which the catalogue files under "degrading" for
#: the GPU but which kills the job using that memory.
FAULT_XID_KINDS: dict[int, str] = {
    **dict.fromkeys((48, 64, 94, 95, 140), "memory"),  # DBE, remap failure, contained/uncontained ECC, ECC escape
    **dict.fromkeys((79, 167, 136), "bus"),  # fell off the bus, PCIe fatal, link training
    **dict.fromkeys((74, *range(144, 151)), "nvlink"),
    **dict.fromkeys((46, 62, 109, 119, 120, 143, 154, 158), "gsp_driver"),  # timeouts, PMU halt, GSP, init
}
FATAL_XIDS = frozenset(FAULT_XID_KINDS)
#: One hit does not indict the GPU (application or sympathetic errors).
APPLICATION_XIDS = xids.APPLICATION
#: The GPU is degrading but the job goes on: remaps recorded, excessive SBE, InfoROM wear, C2C, resource
#: retirement, power-smoothing wear.
PRECURSOR_XIDS = xids.PRECURSOR - FATAL_XIDS
#: Fault evidence that is not an XID, by kind.
EVIDENCE_KINDS = {"gpu_lost": "bus", "dbe": "memory", "remap_failure": "memory", "pcie_width": "pcie"}

COALESCE_S = 3600
#: Counter/flag evidence of a failure, read from gpu_samples.
FAULT_COUNTERS = ("gpu_ecc_dbe_volatile_total",)
FAULT_FLAGS = ("gpu_remapped_rows_failure",)
#: The PCIe link width and its maximum: the link training down to fewer lanes is a fault of its own (the
#: generation is not: it drops at idle to save power on healthy GPUs).
LINK_WIDTH = ("gpu_pcie_link_width", "gpu_pcie_link_width_max")
#: Every sample column the fault evidence reads.
FAULT_COLUMNS = FAULT_COUNTERS + FAULT_FLAGS + LINK_WIDTH
#: Precursor evidence in samples: (column, minimum growth over the look-back window that counts).
PRECURSOR_COUNTERS = {
    "gpu_ecc_sbe_volatile_total": 10.0,
    "gpu_pcie_replay_total": 10.0,
    "gpu_nvlink_crc_flit_errors_total": 50.0,
    "gpu_nvlink_replay_errors_total": 1.0,
    "gpu_throttle_thermal_seconds_total": 900.0,
    "gpu_remapped_rows_correctable": 1.0,
}
PRECURSOR_FLAGS = ("gpu_remapped_rows_pending", "gpu_retired_pages_pending")
#: Clock-event (throttle) reasons that warn of a thermal or power-delivery problem: HW slowdown (0x8),
#: SW thermal (0x20), HW thermal (0x40), HW power brake (0x80). Minutes with one of them set count towards
#: the thermal-violation need above where the counter is not recorded.
THERMAL_REASON_BITS = 0x8 | 0x20 | 0x40 | 0x80
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


def fault_kind(kinds: str) -> str:
    """The subsystem of an episode from its evidence kinds ('xid_79,gpu_lost' -> 'bus'); 'other' if unknown."""
    for k in kinds.split(","):
        if k.startswith("xid_") and int(k[4:]) in FAULT_XID_KINDS:
            return FAULT_XID_KINDS[int(k[4:])]
        if k in EVIDENCE_KINDS:
            return EVIDENCE_KINDS[k]
    return "other"


def _key(df: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({"node": df["node"].astype(str).to_numpy(), "gpu_index": df["gpu_index"].astype(int).to_numpy(),
                         "ts_ms": ts_ms(df["ts"])})


def _sorted_samples(samples: pd.DataFrame, columns: tuple[str, ...]) -> pd.DataFrame:
    s = _key(samples)
    for c in columns:  # a field the source never recorded reads as missing, not as an error
        s[c] = samples[c].to_numpy(dtype=float) if c in samples else np.nan
    return s.sort_values(["node", "gpu_index", "ts_ms"], kind="stable").reset_index(drop=True)


def _rises(s: pd.DataFrame, column: str, flag: bool) -> pd.DataFrame:
    """Rows where a counter grew (reset-aware) or a flag turned on, per GPU (a flag already on in a GPU's first
    sample is no rise: nothing says when it turned on)."""
    prev = s.groupby(["node", "gpu_index"], sort=False)[column].shift()
    x = s[column]
    grew = (x > 0) & (prev == 0) if flag else (x > prev) & prev.notna()
    return s.loc[grew.fillna(False), ["node", "gpu_index", "ts_ms"]]


def evidence(events: pd.DataFrame, samples: pd.DataFrame) -> pd.DataFrame:
    """Every piece of fault evidence: node, gpu_index, ts_ms, kind ('xid_48', 'gpu_lost', 'dbe', 'remap_failure',
    'pcie_width': the link fell from its maximum width to fewer lanes)."""
    ev = _key(events)
    ev["kind"] = events["kind"].to_numpy()
    ev["code"] = events["code"].to_numpy()
    fatal = ev[((ev["kind"] == "xid") & ev["code"].isin(FATAL_XIDS)) | (ev["kind"] == "gpu_lost")].copy()
    fatal["kind"] = np.where(fatal["kind"] == "xid", "xid_" + fatal["code"].astype(str), fatal["kind"])
    parts = [fatal[["node", "gpu_index", "ts_ms", "kind"]]]
    if len(samples):
        s = _sorted_samples(samples, FAULT_COLUMNS)
        parts += [_rises(s, c, False).assign(kind="dbe") for c in FAULT_COUNTERS]
        parts += [_rises(s, c, True).assign(kind="remap_failure") for c in FAULT_FLAGS]
        # the link is read on the slow tier: a sample without both gauges keeps the GPU's last known state
        width, widest = (s[c] for c in LINK_WIDTH)
        low = pd.Series(np.where(width.notna() & widest.notna(), (width < widest).astype(float), np.nan))
        s["link_width_low"] = low.groupby([s["node"], s["gpu_index"]], sort=False).ffill()
        parts.append(_rises(s, "link_width_low", True).assign(kind="pcie_width"))
    out = pd.concat(parts, ignore_index=True)
    return out[out["gpu_index"] >= 0].sort_values(["node", "gpu_index", "ts_ms"], kind="stable").reset_index(drop=True)


def fault_events(events: pd.DataFrame, samples: pd.DataFrame, *, coalesce_s: float = COALESCE_S) -> pd.DataFrame:
    """Fault episodes per GPU: node, gpu_index, start_ms, end_ms, kinds, n_evidence, had_precursor.

    Evidence of one GPU within ``coalesce_s`` of the previous piece joins its episode. ``had_precursor``
    says whether the GPU showed any precursor in the ``PRECURSOR_LOOKBACK_S`` before the episode: the
    evaluation reports recall separately for faults with and without warning signs.
    """
    ev = evidence(events, samples)
    cols = ["node", "gpu_index", "start_ms", "end_ms", "kinds", "kind", "n_evidence", "had_precursor"]
    if ev.empty:
        return pd.DataFrame(columns=cols)
    gap = ev.groupby(["node", "gpu_index"], sort=False)["ts_ms"].diff()
    ev["episode"] = (gap.isna() | (gap > coalesce_s * 1000)).cumsum()
    ep = ev.groupby("episode").agg(node=("node", "first"), gpu_index=("gpu_index", "first"),
                                   start_ms=("ts_ms", "min"), end_ms=("ts_ms", "max"),
                                   kinds=("kind", lambda k: ",".join(sorted(set(k)))), n_evidence=("kind", "size"))
    ep = ep.reset_index(drop=True)
    ep["kind"] = ep["kinds"].map(fault_kind)
    ep["had_precursor"] = _had_precursor(ep, events, samples)
    return ep[cols]


def precursor_evidence(events: pd.DataFrame, samples: pd.DataFrame) -> pd.DataFrame:
    """Warning signs (not failures) per GPU and time: precursor XIDs, error-counter growth, pending flags."""
    ev = _key(events)
    keep = (events["kind"].to_numpy() == "xid") & events["code"].isin(PRECURSOR_XIDS).to_numpy()
    parts = [ev.loc[keep, ["node", "gpu_index", "ts_ms"]].assign(amount=np.inf, signal="xid")]
    if len(samples):
        s = _sorted_samples(samples, tuple(PRECURSOR_COUNTERS) + PRECURSOR_FLAGS + ("gpu_clock_event_reasons",))
        grouped = s.groupby(["node", "gpu_index"], sort=False)
        reasons = s["gpu_clock_event_reasons"].fillna(0).astype(np.int64)
        interval_s = np.clip(grouped["ts_ms"].diff().fillna(0).to_numpy() / 1000, 0, 300)
        hot = (reasons & THERMAL_REASON_BITS).to_numpy() > 0
        parts.append(s.loc[hot, ["node", "gpu_index", "ts_ms"]].assign(
            amount=interval_s[hot], signal="gpu_throttle_thermal_seconds_total"))
        for c in PRECURSOR_COUNTERS:
            d = grouped[c].diff()
            inc = np.where(d >= 0, d, s[c])  # a drop is a reset: count from zero
            rows = s.loc[inc > 0, ["node", "gpu_index", "ts_ms"]]
            parts.append(rows.assign(amount=inc[inc > 0], signal=c))
        for c in PRECURSOR_FLAGS:
            parts.append(s.loc[s[c] > 0, ["node", "gpu_index", "ts_ms"]].assign(amount=np.inf, signal=c))
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
