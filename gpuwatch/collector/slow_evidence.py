"""Evidence for why a rank is slow, reduced from store rows: its timing per collective, its GPU's and host's counters.

Pure functions over the DataFrames the store returns (probe or NCCL-inspector span rows; ``gpu_samples`` and
``host_samples`` rows), the same on both engines. :mod:`gpuwatch.collector.why_slow` decides from what they
return; the jobs monitor and bench/why_slow.py feed them.

The unit of timing is the interval before each collective on each rank: ``work_us`` is the rank's own time
since its previous collective ended (compute, copies, host stalls: whatever it did before arriving), and
``coll_us`` the collective itself (waiting for the last rank, then the transfer). Compute and memcpy spans,
where the source has them, split ``work_us`` into ``compute_us``, ``copy_us`` and the rest, ``stall_us``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pynvml as N

THERMAL_REASONS = N.nvmlClocksEventReasonHwThermalSlowdown | N.nvmlClocksEventReasonSwThermalSlowdown
POWER_REASONS = N.nvmlClocksEventReasonHwPowerBrakeSlowdown | N.nvmlClocksEventReasonSwPowerCap
HW_SLOWDOWN_REASONS = N.nvmlClocksEventReasonHwSlowdown
BUSY_UTILIZATION = 0.05  # a GPU sample below this was idle (its clock says nothing about the work)
_INTERVAL_COLUMNS = ["rank", "seq", "arrive_us", "work_us", "coll_us", "compute_us", "copy_us", "stall_us"]


def rank_intervals(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per rank and collective (finished ones, ordered by arrival): ``arrive_us``, ``work_us``,
    ``coll_us`` and, where compute spans exist, ``compute_us``, ``copy_us``, ``stall_us`` (else NaN)."""
    done = rows[rows["dur_us"] >= 0]
    coll = done[done["kind"] == "collective"].sort_values(["rank", "start_us"])
    if coll.empty:
        return pd.DataFrame(columns=_INTERVAL_COLUMNS)
    end = coll["start_us"] + coll["dur_us"]
    out = pd.DataFrame({"rank": coll["rank"].astype(int).to_numpy(), "seq": coll["seq"].to_numpy(),
                        "arrive_us": coll["start_us"].to_numpy(dtype=float),
                        "work_us": (coll["start_us"] - end.groupby(coll["rank"]).shift()).to_numpy(dtype=float),
                        "coll_us": coll["dur_us"].to_numpy(dtype=float)})
    out = out[out["work_us"].notna()].reset_index(drop=True)
    work = done[done["kind"].isin(("compute", "memcpy"))]
    if work.empty or out.empty:
        return out.assign(compute_us=np.nan, copy_us=np.nan, stall_us=np.nan)
    # each compute or copy span belongs to the next collective its rank arrives at
    spans = work.assign(rank=work["rank"].astype(int), start_us=work["start_us"].astype(float)).sort_values("start_us")
    arrivals = out[["rank", "arrive_us"]].sort_values("arrive_us")
    owner = pd.merge_asof(spans[["rank", "start_us", "dur_us", "kind"]], arrivals,
                          left_on="start_us", right_on="arrive_us", by="rank", direction="forward")
    sums = owner.pivot_table(index=["rank", "arrive_us"], columns="kind", values="dur_us", aggfunc="sum",
                             fill_value=0.0)
    out = out.merge(sums.reset_index(), on=["rank", "arrive_us"], how="left")
    compute = out["compute"] if "compute" in out else 0.0
    copy = out["memcpy"] if "memcpy" in out else 0.0
    out = out.assign(compute_us=pd.Series(compute, index=out.index).fillna(0.0),
                     copy_us=pd.Series(copy, index=out.index).fillna(0.0))
    return out.assign(stall_us=(out["work_us"] - out["compute_us"] - out["copy_us"]).clip(lower=0.0))[_INTERVAL_COLUMNS]


@dataclass(frozen=True)
class DeviceEvidence:
    """What one rank's GPU and host showed over a window (NaN where nothing was sampled)."""

    node: str
    gpu_index: int
    samples: int
    sm_clock_mhz: float  # median while busy
    temperature_c: float
    thermal_share: float  # share of samples with a thermal clock-event reason
    power_share: float  # ... power cap or power brake
    hw_slowdown_share: float  # ... HW slowdown (not thermal, not power brake)
    pcie_gen: float
    pcie_gen_max: float
    pcie_width: float
    pcie_width_max: float
    pcie_replays: float  # counter increase over the window
    nvlink_errors: float  # CRC flit + CRC data + replay + recovery errors, increase
    ecc_errors: float  # correctable + uncorrectable ECC errors, increase
    row_remaps: float  # rows remapped, increase
    remap_pending: bool
    host_cpu: float  # the node's CPU share in use, median
    host_load1: float
    host_memory: float  # the node's memory share in use, median


_GPU_COLUMNS = ["gpu_utilization_ratio", "gpu_sm_clock_hertz", "gpu_temperature_celsius", "gpu_clock_event_reasons",
                "gpu_pcie_link_gen", "gpu_pcie_link_gen_max", "gpu_pcie_link_width", "gpu_pcie_link_width_max",
                "gpu_pcie_replay_total", "gpu_nvlink_crc_flit_errors_total", "gpu_nvlink_crc_data_errors_total",
                "gpu_nvlink_replay_errors_total", "gpu_nvlink_recovery_errors_total", "gpu_ecc_sbe_volatile_total",
                "gpu_ecc_dbe_volatile_total", "gpu_remapped_rows_correctable", "gpu_remapped_rows_uncorrectable",
                "gpu_remapped_rows_pending"]
GPU_COLUMNS: tuple[str, ...] = tuple(_GPU_COLUMNS)


def epoch_s(ts: pd.Series) -> pd.Series:
    """Sample times as epoch seconds, whatever the engine returned (naive UTC or zone-aware, ms or ns)."""
    stamps = pd.to_datetime(ts, utc=True)
    return (stamps - pd.Timestamp(0, tz="UTC")).dt.total_seconds()


def device_evidence(gpu: pd.DataFrame, host: pd.DataFrame, job_id: str,
                    since_s: float | None = None) -> dict[int, DeviceEvidence]:
    """Per rank of ``job_id``: its GPU's evidence from ``gpu`` rows (``gpu_samples`` with :data:`GPU_COLUMNS`)
    and its node's from ``host`` rows (``host_samples``) from ``since`` on; counters rise from their last
    value before ``since_s`` (the reliability tier is sampled every 30 s, so a short window may hold one)."""
    if gpu.empty:
        return {}
    mine = gpu[(gpu["job_id"] == job_id) & gpu["rank"].notna()]
    mine = mine.assign(ts=epoch_s(mine["ts"]))
    if len(host):
        host = host.assign(ts=epoch_s(host["ts"]))
        if since_s is not None:
            host = host[host["ts"] >= since_s]
    hosts = {str(node): rows for node, rows in host.groupby("node")} if len(host) else {}
    out: dict[int, DeviceEvidence] = {}
    for (rank, node, index), rows in mine.groupby(["rank", "node", "gpu_index"]):
        rows = rows.sort_values("ts")
        recent = rows[rows["ts"] >= since_s] if since_s is not None else rows
        if len(recent):
            out[int(rank)] = _evidence(str(node), int(index), recent, rows, hosts.get(str(node)))
    return out


def _evidence(node: str, index: int, rows: pd.DataFrame, whole: pd.DataFrame,
              host: pd.DataFrame | None) -> DeviceEvidence:
    """Gauges from ``rows`` (the window since onset); counters from the last value in ``whole`` before it."""
    busy = rows[rows["gpu_utilization_ratio"].fillna(0) >= BUSY_UTILIZATION]
    reasons = rows["gpu_clock_event_reasons"].dropna().astype(np.int64)

    def share(mask: int) -> float:
        return float(((reasons & mask) != 0).mean()) if len(reasons) else 0.0

    start = rows["ts"].iloc[0]
    times_all = whole["ts"].to_numpy(dtype=float)

    def since_onset(column: str) -> tuple[np.ndarray, float]:
        """A column's values from the onset on, one sampling interval early (a field of the reliability
        tier is sampled every 30 s or so: the sample after the onset may not have come yet, and the one just
        before it may already hold the change), and its last value before them (the counter's baseline)."""
        values = whole[column].to_numpy(dtype=float)
        sampled = ~np.isnan(values)
        values, times = values[sampled], times_all[sampled]
        cadence = float(np.median(np.diff(times))) if len(times) > 1 else 0.0
        after = times >= start - cadence
        base = values[~after]
        return values[after], float(base[-1]) if len(base) else float(values[0]) if len(values) else 0.0

    def rise(*columns: str) -> float:
        total = 0.0
        for c in columns:
            values, base = since_onset(c)
            total += max(0.0, float(values[-1]) - base) if len(values) else 0.0
        return total

    def low(column: str) -> float:
        values = since_onset(column)[0]
        return float(values.min()) if len(values) else float("nan")

    def high(column: str) -> float:
        values = since_onset(column)[0]
        return float(values.max()) if len(values) else float("nan")

    def median(frame: pd.DataFrame | None, column: str) -> float:
        values = frame[column].dropna() if frame is not None and column in frame else pd.Series(dtype=float)
        return float(values.median()) if len(values) else float("nan")

    used, total = median(host, "host_memory_used_bytes"), median(host, "host_memory_total_bytes")
    return DeviceEvidence(
        node=node, gpu_index=index, samples=len(rows),
        sm_clock_mhz=median(busy, "gpu_sm_clock_hertz") / 1e6, temperature_c=median(busy, "gpu_temperature_celsius"),
        thermal_share=share(THERMAL_REASONS), power_share=share(POWER_REASONS),
        hw_slowdown_share=share(HW_SLOWDOWN_REASONS),
        pcie_gen=low("gpu_pcie_link_gen"), pcie_gen_max=high("gpu_pcie_link_gen_max"),
        pcie_width=low("gpu_pcie_link_width"), pcie_width_max=high("gpu_pcie_link_width_max"),
        pcie_replays=rise("gpu_pcie_replay_total"),
        nvlink_errors=rise("gpu_nvlink_crc_flit_errors_total", "gpu_nvlink_crc_data_errors_total",
                           "gpu_nvlink_replay_errors_total", "gpu_nvlink_recovery_errors_total"),
        ecc_errors=rise("gpu_ecc_sbe_volatile_total", "gpu_ecc_dbe_volatile_total"),
        row_remaps=rise("gpu_remapped_rows_correctable", "gpu_remapped_rows_uncorrectable"),
        remap_pending=bool((since_onset("gpu_remapped_rows_pending")[0] > 0).any()),
        host_cpu=median(host, "host_cpu_utilization_ratio"), host_load1=median(host, "host_load1"),
        host_memory=used / total if total > 0 else float("nan"),
    )
