"""The one feature function of the failure model: training, evaluation and online scoring all call it.

Samples of each GPU are binned into evaluation steps (default 10 min); per bin and GPU the features look
back over windows of 1 h, 6 h and 24 h: growth of error counters, reliability flags, thermal and power
behaviour, events (precursor and application XIDs, time since the last warning sign) and the GPU against
its node and job peers. Only the past is used, so a feature row at time t is computable live at t.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from gpuwatch.models.faults import APPLICATION_XIDS, FATAL_XIDS, PRECURSOR_XIDS
from gpuwatch.recording import ts_ms

DEFAULT_STEP_S = 600
WINDOWS_H = (1, 6, 24)
#: How much history a feature row needs; online scoring passes at least this much.
HISTORY_S = 24 * 3600
_CAP_H = 168.0  # "never seen" time-since features are capped at a week

#: Short name -> counter columns summed (reset-aware) into one growth signal.
COUNTERS: dict[str, tuple[str, ...]] = {
    "sbe": ("gpu_ecc_sbe_volatile_total",),
    "dbe": ("gpu_ecc_dbe_volatile_total",),
    "pcie_replay": ("gpu_pcie_replay_total",),
    "nvlink_crc": ("gpu_nvlink_crc_flit_errors_total", "gpu_nvlink_crc_data_errors_total"),
    "nvlink_replay": ("gpu_nvlink_replay_errors_total", "gpu_nvlink_recovery_errors_total"),
    "throttle_thermal": ("gpu_throttle_thermal_seconds_total",),
    "throttle_power": ("gpu_throttle_power_seconds_total",),
}
#: Counters whose last-hour growth is compared with their 6-hour pace (a degrading part accelerates).
ACCELERATING = ("sbe", "pcie_replay", "nvlink_crc", "throttle_thermal")
#: Levels read as the last value in the bin.
LEVELS: dict[str, str] = {
    "sbe_lifetime": "gpu_ecc_sbe_aggregate_total",
    "dbe_lifetime": "gpu_ecc_dbe_aggregate_total",
    "remap_correctable": "gpu_remapped_rows_correctable",
    "remap_uncorrectable": "gpu_remapped_rows_uncorrectable",
    "remap_pending": "gpu_remapped_rows_pending",
    "remap_failure": "gpu_remapped_rows_failure",
    "retired_pending": "gpu_retired_pages_pending",
}
#: Gauges averaged over the bin.
MEANS: dict[str, str] = {
    "temp": "gpu_temperature_celsius",
    "mem_temp": "gpu_memory_temperature_celsius",
    "power": "gpu_power_watts",
    "power_limit": "gpu_power_limit_watts",
    "util": "gpu_utilization_ratio",
    "sm_clock": "gpu_sm_clock_hertz",
}
_MINS = {"pcie_width": "gpu_pcie_link_width", "pcie_gen": "gpu_pcie_link_gen"}
_MAXES = {"pcie_width_max": "gpu_pcie_link_width_max", "pcie_gen_max": "gpu_pcie_link_gen_max"}
SAMPLE_COLUMNS: tuple[str, ...] = tuple(sorted({c for cs in COUNTERS.values() for c in cs} | set(LEVELS.values())
                                              | set(MEANS.values()) | set(_MINS.values()) | set(_MAXES.values())))
KEY = ["node", "gpu_index", "t_ms"]


def feature_names() -> list[str]:
    """Model input columns, in order."""
    names = [f"{c}_d{w}h" for c in COUNTERS for w in WINDOWS_H]
    names += [f"{c}_accel" for c in ACCELERATING]
    names += [*LEVELS, "pcie_width", "pcie_gen", "pcie_width_ratio", "pcie_gen_ratio"]
    names += ["temp", "temp_max_1h", "temp_trend", "mem_temp", "power_ratio", "util"]
    names += [f"xid_{c}_{w}h" for c in ("precursor", "app", "fatal") for w in (1, 24)]
    names += ["hours_since_precursor_xid"]
    names += ["temp_vs_node", "mem_temp_vs_node", "sm_clock_vs_node", "power_vs_job", "util_vs_job"]
    return names


def features(samples: pd.DataFrame, events: pd.DataFrame, *, at: int | pd.Timestamp | None = None,
             step_s: int = DEFAULT_STEP_S) -> pd.DataFrame:
    """Feature rows (node, gpu_index, t_ms, job_id, *feature_names()) from samples and events.

    ``at=None``: one row per GPU and step over the data (training and evaluation). ``at=<time>``: one row
    per GPU at that time (online scoring); pass at least ``HISTORY_S`` of history before it.
    """
    return add_peer_features(gpu_window_features(samples, events, at=at, step_s=step_s))


def _anchor_ms(at: int | pd.Timestamp | None) -> int | None:
    if at is None:
        return None
    return int(pd.Timestamp(at).value // 1_000_000) if not isinstance(at, (int, np.integer)) else int(at)


def gpu_window_features(samples: pd.DataFrame, events: pd.DataFrame, *, at: int | pd.Timestamp | None = None,
                        step_s: int = DEFAULT_STEP_S) -> pd.DataFrame:
    """The per-GPU part of :func:`features` (peer columns are added by :func:`add_peer_features`).

    Split out so a large data set can be processed in node chunks and the cross-node job peers added once.
    """
    anchor = _anchor_ms(at)
    step = step_s * 1000
    t = ts_ms(samples["ts"])
    origin = anchor if anchor is not None else 0
    b_abs = -((origin - t) // step)  # ceil: a sample belongs to the bin that ends at or after it
    lo = int(b_abs.min()) if len(t) else 0
    hi = int(b_abs.max()) + 1 if len(t) else 0
    if anchor is not None:
        lo, hi = min(lo, -(HISTORY_S * 1000 // step)), 1
        keep = b_abs <= 0
        samples, t, b_abs = samples[keep], t[keep], b_abs[keep]
    gpu_key = samples["node"].astype(str) + "\x00" + samples["gpu_index"].astype(str)
    codes, uniques = pd.factorize(gpu_key)
    n_gpu, n_bin = len(uniques), hi - lo
    b = (b_abs - lo).astype(np.int64)
    flat = codes.astype(np.int64) * n_bin + b
    order = np.lexsort((t, flat))
    flat_sorted = flat[order]
    last_of_bin = np.r_[flat_sorted[1:] != flat_sorted[:-1], True] if len(flat) else np.zeros(0, bool)
    cells = flat_sorted[last_of_bin]

    def dense_last(column: str) -> np.ndarray:
        out = np.full(n_gpu * n_bin, np.nan)
        out[cells] = samples[column].to_numpy(dtype=float)[order][last_of_bin]
        return out.reshape(n_gpu, n_bin)

    def dense_reduce(column: str, how: str) -> np.ndarray:
        grouped = pd.Series(samples[column].to_numpy(dtype=float)).groupby(flat)
        agg = getattr(grouped, how)()
        out = np.full(n_gpu * n_bin, np.nan)
        out[agg.index.to_numpy()] = agg.to_numpy()
        return out.reshape(n_gpu, n_bin)

    gpu_sorted = codes[order]

    def dense_growth(column: str) -> np.ndarray:
        """Counter growth per bin from consecutive samples; a drop is a reset (the new value is all growth).

        The first sample of a GPU is a baseline, not growth (it counts since the driver loaded).
        """
        x = samples[column].to_numpy(dtype=float)[order]
        valid = ~np.isnan(x)
        xv, gv = x[valid], gpu_sorted[valid]
        d = np.diff(xv, prepend=np.nan)
        same_gpu = np.r_[False, gv[1:] == gv[:-1]]
        inc = np.where(same_gpu, np.where(d >= 0, d, xv), 0.0)
        return np.bincount(flat_sorted[valid], weights=inc, minlength=n_gpu * n_bin).reshape(n_gpu, n_bin)

    present = np.zeros(n_gpu * n_bin, bool)
    present[cells] = True
    present = present.reshape(n_gpu, n_bin)
    cols: dict[str, np.ndarray] = {}
    for short, sources in COUNTERS.items():
        inc = sum(dense_growth(c) for c in sources)
        for w in WINDOWS_H:
            cols[f"{short}_d{w}h"] = _window_sum(inc, w * 3600 // step_s)
    for short in ACCELERATING:
        cols[f"{short}_accel"] = cols[f"{short}_d1h"] * 6 / (cols[f"{short}_d6h"] + 1.0)
    for short, column in LEVELS.items():
        cols[short] = _ffill(dense_last(column))
    mins = {k: _ffill(dense_reduce(c, "min")) for k, c in _MINS.items()}
    maxes = {k: _ffill(dense_reduce(c, "max")) for k, c in _MAXES.items()}
    cols["pcie_width"] = mins["pcie_width"]
    cols["pcie_gen"] = mins["pcie_gen"]
    cols["pcie_width_ratio"] = _ratio(mins["pcie_width"], maxes["pcie_width_max"])
    cols["pcie_gen_ratio"] = _ratio(mins["pcie_gen"], maxes["pcie_gen_max"])
    means = {k: dense_reduce(c, "mean") for k, c in MEANS.items()}
    per_hour = 3600 // step_s
    cols["temp"] = means["temp"]
    cols["temp_max_1h"] = _window_max(dense_reduce("gpu_temperature_celsius", "max"), per_hour)
    cols["temp_trend"] = _window_mean(means["temp"], per_hour) - _window_mean(means["temp"], 6 * per_hour)
    cols["mem_temp"] = means["mem_temp"]
    cols["power_ratio"] = _ratio(means["power"], means["power_limit"])
    cols["util"] = means["util"]
    cols["sm_clock"] = means["sm_clock"]
    cols.update(_event_features(events, uniques, lo, n_bin, origin, step, per_hour))
    gi, bi = np.nonzero(present) if anchor is None else (np.arange(n_gpu), np.full(n_gpu, n_bin - 1))
    node_gpu = uniques.to_series().str.split("\x00", expand=True) if n_gpu else pd.DataFrame(columns=[0, 1])
    out = pd.DataFrame({"node": node_gpu[0].to_numpy()[gi], "gpu_index": node_gpu[1].astype(int).to_numpy()[gi],
                        "t_ms": origin + (bi + lo) * step})
    out["job_id"] = dense_job(samples["job_id"].astype(str).to_numpy()[order][last_of_bin], cells, n_gpu, n_bin)[gi, bi]
    for name, arr in cols.items():
        out[name] = arr[gi, bi]
    return out


def dense_job(values: np.ndarray, cells: np.ndarray, n_gpu: int, n_bin: int) -> np.ndarray:
    """Job id per GPU and bin, carried forward over bins without samples."""
    out = np.full(n_gpu * n_bin, None, dtype=object)
    out[cells] = values
    return pd.DataFrame(out.reshape(n_gpu, n_bin)).ffill(axis=1).to_numpy()


def _cumsum0(x: np.ndarray) -> np.ndarray:
    return np.concatenate([np.zeros((x.shape[0], 1)), np.cumsum(x, axis=1)], axis=1)


def _window_sum(inc: np.ndarray, w: int) -> np.ndarray:
    cs = _cumsum0(inc)
    n = inc.shape[1]
    idx = np.arange(1, n + 1)
    return cs[:, idx] - cs[:, np.maximum(idx - w, 0)]


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, NaN where b is 0 or missing (an unsupported field, not a fault)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(b > 0, a / b, np.nan)


def _window_mean(x: np.ndarray, w: int) -> np.ndarray:
    return _ratio(_window_sum(np.nan_to_num(x), w), _window_sum((~np.isnan(x)).astype(float), w))


def _window_max(x: np.ndarray, w: int) -> np.ndarray:
    padded = np.concatenate([np.full((x.shape[0], w - 1), -np.inf), np.nan_to_num(x, nan=-np.inf)], axis=1)
    windows = np.lib.stride_tricks.sliding_window_view(padded, w, axis=1)
    out = windows.max(axis=2)
    return np.where(np.isinf(out), np.nan, out)


def _ffill(x: np.ndarray) -> np.ndarray:
    return pd.DataFrame(x).ffill(axis=1).to_numpy()


def _event_features(events: pd.DataFrame, uniques: pd.Index, lo: int, n_bin: int, origin: int, step: int,
                    per_hour: int) -> dict[str, np.ndarray]:
    n_gpu = len(uniques)
    xid = events[events["kind"] == "xid"]
    key = xid["node"].astype(str) + "\x00" + xid["gpu_index"].astype(str)
    g = uniques.get_indexer(key)
    b = -((origin - ts_ms(xid["ts"])) // step) - lo
    ok = (g >= 0) & (b >= 0) & (b < n_bin)
    g, b, code = g[ok], b[ok], xid["code"].to_numpy()[ok]
    out = {}
    for name, group in (("precursor", PRECURSOR_XIDS), ("app", APPLICATION_XIDS), ("fatal", FATAL_XIDS)):
        hits = np.zeros((n_gpu, n_bin))
        sel = np.isin(code, list(group))
        np.add.at(hits, (g[sel], b[sel]), 1.0)
        for w in (1, 24):
            out[f"xid_{name}_{w}h"] = _window_sum(hits, w * per_hour)
    last = np.full((n_gpu, n_bin), np.nan)
    sel = np.isin(code, list(PRECURSOR_XIDS))
    last[g[sel], b[sel]] = b[sel]
    last = _ffill(last)
    since_h = (np.arange(n_bin)[None, :] - last) / per_hour
    out["hours_since_precursor_xid"] = np.minimum(np.nan_to_num(since_h, nan=_CAP_H), _CAP_H)
    return out


def add_peer_features(feats: pd.DataFrame) -> pd.DataFrame:
    """The GPU against its peers at the same step: node median (temperature, clock), job median (power, util)."""
    out = feats.copy()
    by_node = out.groupby(["node", "t_ms"], sort=False)
    out["temp_vs_node"] = out["temp"] - by_node["temp"].transform("median")
    out["mem_temp_vs_node"] = out["mem_temp"] - by_node["mem_temp"].transform("median")
    out["sm_clock_vs_node"] = out["sm_clock"] / by_node["sm_clock"].transform("median") - 1.0
    job = out["job_id"].fillna("").replace("", np.nan)
    by_job = out.groupby([job, out["t_ms"]], sort=False, dropna=True)
    out["power_vs_job"] = out["power_ratio"] - by_job["power_ratio"].transform("median")
    out["util_vs_job"] = out["util"] - by_job["util"].transform("median")
    return out.drop(columns=["sm_clock"])
