"""The one feature function of the failure model: training, evaluation and online scoring all call it.

Samples of each GPU are binned into evaluation steps (default 10 min). Features are chosen to travel
between fleets, whose typical counter levels, noise and temperatures differ (docs/failure-model.md §3):

- each GPU against **its own trailing baseline**: counter growth over the last 1 h and 6 h (log scale,
  reset-aware: a drop is a driver reload, the new value is all growth) and the same growth against the
  GPU's own pace over the 18 h before them, and the last hour against the hour before it (a degradation
  keeps rising where a benign burst levels off);
- the **shape of the last hours** of the commoner counters and of temperature: how many of the last six
  hours ran above the GPU's own baseline, the last hour against the mean of those elevated hours and
  against the busiest of the six, the rate 1-3 h ago against the baseline, and the slope of the hourly
  mean temperature. A degradation builds up over hours and is still rising when the GPU fails; a benign
  burst starts at full rate, stays flat and stops; a fan wearing out warms the GPU slowly;
- each GPU against **its peers** at the same step: the fleet percentile of its growth (rank, so a fleet
  whose every GPU logs CRC noise does not look sick), its growth against its node's median, temperature
  and clock against the node median, power and utilisation against its job's median;
- **clock-event (throttle) reasons**: share of time in HW slowdown, thermal slowdown, power brake and power
  cap, and how that share moved against the GPU's own baseline;
- reliability flags (pending remap/retirement), PCIe link width/generation against the maximum, and
  events (precursor, application and fatal XIDs, hours since the last precursor XID);
- apart from these within-life windows, the **history across faults** (models/history.py): faults of the
  GPU and of its node in the last 7/30/90 days, days since the GPU's last fault.

Absolute levels (temperature, lifetime error counts, power) are deliberately not features: they describe
a fleet's hardware and climate more than a GPU's health. Only the past is used, so a feature row at time t
is computable live at t.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from gpuwatch.models.faults import APPLICATION_XIDS, FATAL_XIDS, PRECURSOR_XIDS
from gpuwatch.models.history import history_names, with_history
from gpuwatch.core.recording import ts_ms

DEFAULT_STEP_S = 600
#: How much history a feature row needs; online scoring passes at least this much.
HISTORY_S = 24 * 3600
_CAP_H = 168.0  # "never seen" time-since features are capped at a week
#: Hours of the GPU's own baseline: the 18 h before the last 6 h (a precursor of a few hours stays out of it).
_BASELINE_H = 18

#: Short name -> counter columns summed (reset-aware) into one growth signal.
COUNTERS: dict[str, tuple[str, ...]] = {
    "sbe": ("gpu_ecc_sbe_volatile_total",),
    "dbe": ("gpu_ecc_dbe_volatile_total",),
    "remap": ("gpu_remapped_rows_correctable",),
    "pcie_replay": ("gpu_pcie_replay_total",),
    "nvlink_crc": ("gpu_nvlink_crc_flit_errors_total", "gpu_nvlink_crc_data_errors_total"),
    "nvlink_replay": ("gpu_nvlink_replay_errors_total", "gpu_nvlink_recovery_errors_total"),
    "throttle_thermal": ("gpu_throttle_thermal_seconds_total",),
    "throttle_power": ("gpu_throttle_power_seconds_total",),
}
#: Counters ranked against the fleet and compared with the node (the rest are too rare to rank).
PEER_COUNTERS = ("sbe", "remap", "pcie_replay", "nvlink_crc", "nvlink_replay", "throttle_thermal")
#: Clock-event reason groups (NVML bitmask): share of samples with any of the bits set.
REASONS: dict[str, int] = {"hw_slowdown": 0x8, "thermal_slowdown": 0x20 | 0x40, "power_brake": 0x80,
                           "power_cap": 0x4}
#: Flags read as the last value in the bin.
FLAGS: dict[str, str] = {
    "remap_pending": "gpu_remapped_rows_pending",
    "retired_pending": "gpu_retired_pages_pending",
    "remap_failure": "gpu_remapped_rows_failure",
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
REASON_COLUMN = "gpu_clock_event_reasons"
_MINS = {"pcie_width": "gpu_pcie_link_width", "pcie_gen": "gpu_pcie_link_gen"}
_MAXES = {"pcie_width_max": "gpu_pcie_link_width_max", "pcie_gen_max": "gpu_pcie_link_gen_max"}
SAMPLE_COLUMNS: tuple[str, ...] = tuple(sorted({c for cs in COUNTERS.values() for c in cs} | set(FLAGS.values())
                                              | set(MEANS.values()) | set(_MINS.values()) | set(_MAXES.values())
                                              | {REASON_COLUMN}))
KEY = ["node", "gpu_index", "t_ms"]
#: Per-GPU columns that peer features need and the model does not read.
_PEER_INPUTS = ["temp", "mem_temp", "sm_clock", "power_ratio", "util"]


#: Counters rare enough on a healthy GPU anywhere that their plain growth is a feature; the others enter the
#: model only against the GPU's own baseline and its peers (their typical level differs between fleets).
RARE_COUNTERS = ("dbe", "remap", "nvlink_replay")
#: Counters common enough to have a shape over hours (the rare ones are one-off events).
SHAPE_COUNTERS = ("sbe", "pcie_replay", "nvlink_crc", "throttle_thermal")
#: Hours of the shape features.
_SHAPE_H = 6


def feature_names() -> list[str]:
    """Model input columns, in order."""
    names = [f"{c}_{k}" for c in RARE_COUNTERS for k in ("log1h", "log6h")]
    names += [f"{c}_{k}" for c in COUNTERS for k in ("vs_self", "trend", "accel")]
    names += [f"{c}_{k}" for c in SHAPE_COUNTERS for k in ("vs_run", "from_peak", "persist6h", "before1h")]
    names += [f"{c}_{k}" for c in PEER_COUNTERS for k in ("rank1h", "rank6h", "vs_node")]
    names += [f"{r}_{k}" for r in REASONS for k in ("share1h", "share6h", "vs_self")]
    names += [*FLAGS, "pcie_width_ratio", "pcie_gen_ratio", "pcie_replay_over_limit"]
    names += ["temp_trend", "temp_vs_self", "mem_temp_trend", "temp_slope6h"]
    names += [f"xid_precursor_{w}h" for w in (1, 6, 24)]
    names += ["xid_app_1h", "xid_app_24h", "xid_fatal_1h", "xid_fatal_24h"]
    names += ["hours_since_precursor_xid"]
    names += ["temp_vs_node", "mem_temp_vs_node", "sm_clock_vs_node", "power_vs_job", "util_vs_job"]
    return names + history_names()


def monotone_direction(name: str) -> int:
    """+1 where more of a feature can only mean more risk (error growth, its rank, throttling, warning flags
    and XIDs), else 0: the constraint keeps a model from learning quirks of one fleet's noise."""
    if name.startswith(tuple(f"{c}_" for c in COUNTERS)) or name.startswith(tuple(f"{r}_" for r in REASONS)):
        return 1
    if name in FLAGS or name.startswith("xid_precursor") or name == "pcie_replay_over_limit":
        return 1
    if name in history_names():  # more recent faults, more risk; the longer since the last, the less
        return -1 if name == "days_since_fault" else 1
    return 0


def features(samples: pd.DataFrame, events: pd.DataFrame, *, at: int | pd.Timestamp | None = None,
             step_s: int = DEFAULT_STEP_S) -> pd.DataFrame:
    """Feature rows (node, gpu_index, t_ms, job_id, *feature_names()) from samples and events.

    ``at=None``: one row per GPU and step over the data (training and evaluation). ``at=<time>``: one row
    per GPU at that time (online scoring); pass at least ``HISTORY_S`` of samples before it, and the events of
    the ``history.LOOKBACK_S`` before it (the fault history).
    """
    return add_peer_features(with_history(gpu_window_features(samples, events, at=at, step_s=step_s), events))


def _anchor_ms(at: int | pd.Timestamp | None) -> int | None:
    if at is None:
        return None
    return int(pd.Timestamp(at).value // 1_000_000) if not isinstance(at, (int, np.integer)) else int(at)


#: Rows of one piece of a GPU's data at most; a longer stretch continues in the next piece, which starts with
#: the last ``_CAP_H`` of this one as its history (the longest look-back of any feature).
PIECE_S = 30 * 86400
#: Grid cells (pieces x bins) built at once: the feature arrays of a batch take about 1 KB per cell, so this
#: bounds memory whatever the length, sparsity or number of GPUs of the data.
MAX_CELLS = 400_000


def gpu_window_features(samples: pd.DataFrame, events: pd.DataFrame, *, at: int | pd.Timestamp | None = None,
                        step_s: int = DEFAULT_STEP_S) -> pd.DataFrame:
    """The per-GPU part of :func:`features` (peer columns are added by :func:`add_peer_features`).

    Split out so a large data set can be processed in node chunks and the cross-node job peers added once.
    Over whole data (``at=None``) the bins are built only where a GPU has samples (and the history before
    them), in pieces of bounded size (:func:`pieces`): a sparse recording (a fault log, GPUs seen at insert and
    removal over years) costs what its samples do, not its time span times its GPUs.
    """
    anchor = _anchor_ms(at)
    step = step_s * 1000
    if anchor is not None:
        samples = samples[ts_ms(samples["ts"]) <= anchor]
    t = ts_ms(samples["ts"])
    codes, uniques = pd.factorize(samples["node"].astype(str) + "\x00" + samples["gpu_index"].astype(str))
    ev = events[events["kind"].isin(["xid", "gpu_lost"])]
    ev_gpu = uniques.get_indexer(ev["node"].astype(str) + "\x00" + ev["gpu_index"].astype(str))
    origin = 0 if anchor is None else anchor
    b_abs, ev_b = -((origin - t) // step), -((origin - ts_ms(ev["ts"])) // step)  # ceil: the bin ending at/after
    if anchor is not None:
        lo = min(int(b_abs.min()) if len(t) else 0, -(HISTORY_S * 1000 // step))
        every = np.arange(len(uniques))
        grids = [_Grid(every, np.full(len(every), lo), np.full(len(every), lo), np.ones(len(every), np.int64))]
    else:
        grids = pieces(codes, b_abs, context=int(_CAP_H * 3600 // step_s), history=HISTORY_S // step_s,
                       length=PIECE_S // step_s)
        grids = grids or [_Grid(*(np.zeros(0, np.int64),) * 4)]
    parts = [_grid_rows(samples, codes, b_abs, ev, ev_gpu, ev_b, grid, uniques, step_s, origin,
                        last_only=anchor is not None) for grid in grids]
    return pd.concat(parts, ignore_index=True) if len(parts) > 1 else parts[0]


class _Grid:
    """One batch of pieces: row i holds GPU ``gpu[i]`` in bins [``lo[i]``, ``hi[i]``), at most ``width``;
    rows are emitted from bin ``emit_lo[i]`` on (the bins before are the history of the piece)."""

    def __init__(self, gpu: np.ndarray, lo: np.ndarray, emit_lo: np.ndarray, hi: np.ndarray) -> None:
        self.gpu, self.lo, self.emit_lo, self.hi = gpu, lo, emit_lo, hi
        self.width = int((hi - lo).max()) if len(hi) else 0

    def locate(self, gpu: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(index into the inputs, grid row) of every input that falls in a piece; an input may fall in two
        (the end of one piece is the history of the next)."""
        if not len(self.gpu) or not len(gpu):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        order = np.lexsort((self.lo, self.gpu))
        pg, plo, phi = self.gpu[order], self.lo[order], self.hi[order]
        first = np.searchsorted(pg, gpu, side="left")
        last = np.searchsorted(pg, gpu, side="right")
        idx, rows = [], []
        for k in range(int((last - first).max())):  # pieces of one GPU in a batch: few
            j = first + k
            ok = j < last
            jj = np.minimum(j, len(pg) - 1)
            ok &= (b >= plo[jj]) & (b < phi[jj])
            idx.append(np.flatnonzero(ok))
            rows.append(order[jj[ok]])
        return np.concatenate(idx), np.concatenate(rows)


def pieces(gpu: np.ndarray, b: np.ndarray, *, context: int, history: int, length: int,
           max_cells: int = MAX_CELLS) -> list[_Grid]:
    """Batches of pieces covering every bin that has samples: a GPU's bins split where it has no samples for
    more than ``history`` bins (the windows' look-back), and every ``length`` bins. A piece that continues
    the one before starts ``context`` bins before its first row (the longest look-back, so its rows are
    those of one long grid); one after a gap starts ``history`` bins before (a precursor XID logged more than
    that before a GPU's data resumes is left out of the capped time since one). Pieces of similar width are
    batched up to ``max_cells``."""
    if not len(b):
        return []
    base = int(b.min()) - context - 1
    key = np.unique((gpu.astype(np.int64) << 32) | (b - base))
    g, u = key >> 32, (key & 0xFFFFFFFF) + base
    new_seg = np.r_[True, (g[1:] != g[:-1]) | (np.diff(u) > history)]
    seg_start = u[new_seg][np.cumsum(new_seg) - 1]
    k = (u - seg_start) // length
    new_piece = new_seg | np.r_[True, k[1:] != k[:-1]]
    emit_lo = (seg_start + k * length)[new_piece]
    hi = u[np.r_[new_piece[1:], True]] + 1
    lo = emit_lo - np.where(new_seg[new_piece], history, context)
    width = hi - lo
    order = np.argsort(width, kind="stable")
    batches, start = [], 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end + 1 - start) * width[order[end]] <= max_cells:
            end += 1
        sel = order[start:end]
        batches.append(_Grid(g[new_piece][sel], lo[sel], emit_lo[sel], hi[sel]))
        start = end
    return batches


def _grid_rows(samples: pd.DataFrame, codes: np.ndarray, b_abs: np.ndarray, ev: pd.DataFrame,
               ev_gpu: np.ndarray, ev_b: np.ndarray, grid: _Grid, uniques: pd.Index, step_s: int, origin: int,
               *, last_only: bool = False) -> pd.DataFrame:
    """Feature rows of one grid: every bin with samples from its emit start on, or (``last_only``) the last
    bin of every row."""
    step = step_s * 1000
    si, srow = grid.locate(codes, b_abs)
    samples = samples.iloc[si]
    t = ts_ms(samples["ts"])
    n_gpu, n_bin = len(grid.gpu), grid.width
    b = (b_abs[si] - grid.lo[srow]).astype(np.int64)
    flat = srow.astype(np.int64) * n_bin + b
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

    gpu_sorted = srow[order]

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

    present: np.ndarray = np.zeros(n_gpu * n_bin, bool)
    present[cells] = True
    present = present.reshape(n_gpu, n_bin)
    per_hour = 3600 // step_s
    ei, erow = grid.locate(ev_gpu, ev_b)
    xid_at = (erow, (ev_b[ei] - grid.lo[erow]).astype(np.int64), ev["code"].to_numpy()[ei],
              (ev["kind"] == "xid").to_numpy()[ei])
    floor = _life_start(xid_at, n_gpu, n_bin)
    def win(x: np.ndarray, w: int, back: int = 0) -> np.ndarray:
        return _window_sum(x, w, floor, back)
    cols: dict[str, np.ndarray] = {}
    for short, sources in COUNTERS.items():
        inc = sum((dense_growth(c) for c in sources), np.zeros(()))
        d1, d2, d6, d24 = (win(inc, w * per_hour) for w in (1, 2, 6, 24))
        base = np.log1p(np.maximum(d24 - d6, 0.0) / _BASELINE_H)
        cols[f"{short}_log1h"], cols[f"{short}_log6h"] = np.log1p(d1), np.log1p(d6)
        cols[f"{short}_vs_self"] = np.log1p(d1) - base
        cols[f"{short}_trend"] = np.log1p(d6 / 6) - base
        cols[f"{short}_accel"] = np.log1p(d1) - np.log1p(d2 - d1)  # still rising, not a burst that levelled off
        if short in SHAPE_COUNTERS:
            hourly = np.stack([win(inc, per_hour, k * per_hour) for k in range(_SHAPE_H)])  # [0] = the last hour
            cols[f"{short}_from_peak"] = np.log1p(hourly[0]) - np.log1p(hourly.max(axis=0))
            above = hourly > 2.0 * np.maximum(d24 - d6, 0.0) / _BASELINE_H + 1.0
            n_above = above.sum(axis=0)
            cols[f"{short}_persist6h"] = n_above / _SHAPE_H
            run_mean = _ratio((hourly * above).sum(axis=0), n_above.astype(float))
            cols[f"{short}_vs_run"] = np.where(n_above > 0, np.log1p(hourly[0]) - np.log1p(np.nan_to_num(run_mean)),
                                               0.0)
            cols[f"{short}_before1h"] = np.log1p((hourly[1] + hourly[2]) / 2) - base
        if short in PEER_COUNTERS:
            cols[f"_{short}_d1h"], cols[f"_{short}_d6h"] = d1, d6
    reasons = samples[REASON_COLUMN].to_numpy(dtype=float)
    seen = dense_reduce(REASON_COLUMN, "count")
    for short, bits in REASONS.items():
        hit = np.where(np.isnan(reasons), np.nan, (np.nan_to_num(reasons).astype(np.int64) & bits) > 0)
        hits = np.bincount(flat, weights=np.nan_to_num(hit), minlength=n_gpu * n_bin).reshape(n_gpu, n_bin)
        share = {w: _ratio(win(hits, w * per_hour), win(np.nan_to_num(seen), w * per_hour))
                 for w in (1, 6, 24)}
        cols[f"{short}_share1h"], cols[f"{short}_share6h"] = share[1], share[6]
        counted = np.nan_to_num(seen)
        before = _ratio(win(hits, 24 * per_hour) - win(hits, 6 * per_hour),
                        win(counted, 24 * per_hour) - win(counted, 6 * per_hour))
        cols[f"{short}_vs_self"] = share[6] - before
    for short, column in FLAGS.items():
        cols[short] = _ffill(dense_last(column))
    mins = {k: _ffill(dense_reduce(c, "min")) for k, c in _MINS.items()}
    maxes = {k: _ffill(dense_reduce(c, "max")) for k, c in _MAXES.items()}
    cols["pcie_width_ratio"] = _ratio(mins["pcie_width"], maxes["pcie_width_max"])
    cols["pcie_gen_ratio"] = _ratio(mins["pcie_gen"], maxes["pcie_gen_max"])
    cols["pcie_replay_over_limit"] = (np.expm1(cols["pcie_replay_log1h"]) / 60
                                      / pcie_replay_limit_per_min(mins["pcie_gen"], mins["pcie_width"]))
    means = {k: dense_reduce(c, "mean") for k, c in MEANS.items()}
    for short in ("temp", "mem_temp"):
        m1, m6, m24 = (_window_mean(means[short], w * per_hour, floor) for w in (1, 6, 24))
        cols[f"{short}_trend"] = m1 - m6
        if short == "temp":
            present_h = (~np.isnan(means[short])).astype(float)
            hourly_temp = np.stack([_ratio(win(np.nan_to_num(means[short]), per_hour, k * per_hour),
                                           win(present_h, per_hour, k * per_hour)) for k in range(_SHAPE_H)])
            cols["temp_slope6h"] = _hourly_slope(hourly_temp)
            n6 = win((~np.isnan(means[short])).astype(float), 6 * per_hour)
            n24 = win((~np.isnan(means[short])).astype(float), 24 * per_hour)
            cols["temp_vs_self"] = m1 - _ratio(m24 * n24 - np.nan_to_num(m6) * n6, n24 - n6)
    cols["temp"], cols["mem_temp"], cols["util"], cols["sm_clock"] = (means[k] for k in ("temp", "mem_temp", "util",
                                                                                          "sm_clock"))
    cols["power_ratio"] = _ratio(means["power"], means["power_limit"])
    cols.update(_event_features(xid_at, n_gpu, n_bin, per_hour, floor))
    if last_only:
        gi, bi = np.arange(n_gpu), np.full(n_gpu, n_bin - 1)
    else:
        gi, bi = np.nonzero(present & (np.arange(n_bin)[None, :] >= (grid.emit_lo - grid.lo)[:, None]))
    gpus = grid.gpu[gi]
    node_gpu = uniques[gpus].to_series().str.split("\x00", expand=True) if len(gpus) else pd.DataFrame(
        columns=[0, 1])
    job = dense_job(samples["job_id"].astype(str).to_numpy()[order][last_of_bin], cells, n_gpu, n_bin)[gi, bi]
    return pd.DataFrame({"node": node_gpu[0].to_numpy(), "gpu_index": node_gpu[1].astype(int).to_numpy(),
                         "t_ms": origin + (grid.lo[gi] + bi) * step, "job_id": job,
                         **{name: arr[gi, bi] for name, arr in cols.items()}})


def dense_job(values: np.ndarray, cells: np.ndarray, n_gpu: int, n_bin: int) -> np.ndarray:
    """Job id per GPU and bin, carried forward over bins without samples."""
    out = np.full(n_gpu * n_bin, None, dtype=object)
    out[cells] = values
    return pd.DataFrame(out.reshape(n_gpu, n_bin)).ffill(axis=1).to_numpy()


def pcie_replay_limit_per_min(gen: np.ndarray, width: np.ndarray) -> np.ndarray:
    """DCGM's PCIe replay limit: ceil(rate per lane x lanes), 0.96/lane at Gen4, 1.92/lane at Gen5
    (Gen5 x16 when the link state is not recorded)."""
    per_lane = np.where(np.nan_to_num(gen, nan=5.0) >= 5, 1.92, 0.96)
    return np.ceil(per_lane * np.nan_to_num(width, nan=16.0))


def _cumsum0(x: np.ndarray) -> np.ndarray:
    return np.concatenate([np.zeros((x.shape[0], 1)), np.cumsum(x, axis=1)], axis=1)


def _window_sum(inc: np.ndarray, w: int, floor: np.ndarray | None = None, back: int = 0) -> np.ndarray:
    """Sum over ``w`` bins of each GPU ending ``back`` bins before the current one (0: the last ``w`` bins),
    not reaching back before ``floor`` (its life's first bin)."""
    cs = _cumsum0(inc)
    n = inc.shape[1]
    idx = np.arange(1, n + 1)
    lowest = np.zeros((1, n), np.int64) if floor is None else floor
    end = np.maximum(idx - back, lowest)
    start = np.maximum(idx - back - w, lowest)
    return (np.take_along_axis(cs, np.broadcast_to(end, inc.shape), axis=1)
            - np.take_along_axis(cs, np.broadcast_to(start, inc.shape), axis=1))


def _hourly_slope(hourly: np.ndarray) -> np.ndarray:
    """Least-squares slope per hour of values given newest first (``hourly[0]`` = the last hour), over the
    hours that have a value (NaN where fewer than two have)."""
    seen = ~np.isnan(hourly)
    x = np.broadcast_to(-np.arange(len(hourly), dtype=float).reshape(-1, *[1] * (hourly.ndim - 1)), hourly.shape)
    n = seen.sum(axis=0)
    x_mean = _ratio(np.where(seen, x, 0.0).sum(axis=0), n.astype(float))
    dx = np.where(seen, x - x_mean, 0.0)
    return np.where(n >= 2, _ratio((dx * np.nan_to_num(hourly)).sum(axis=0), (dx ** 2).sum(axis=0)), np.nan)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, NaN where b is 0 or missing (an unsupported field, not a fault)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(b > 0, a / b, np.nan)


def _window_mean(x: np.ndarray, w: int, floor: np.ndarray | None = None) -> np.ndarray:
    return _ratio(_window_sum(np.nan_to_num(x), w, floor), _window_sum((~np.isnan(x)).astype(float), w, floor))


def _ffill(x: np.ndarray) -> np.ndarray:
    return pd.DataFrame(x).ffill(axis=1).to_numpy()


def _life_start(xid_at: tuple[np.ndarray, ...], n_gpu: int, n_bin: int) -> np.ndarray:
    """Per GPU and bin, the first bin of the GPU's current life: the bin after its last fault (a fatal XID or
    GPU lost) before this bin, else 0.

    A fault ends the GPU's life as the model sees it: it is drained, reset or repaired, and the errors
    before it describe the fault, not the GPU that comes back. Windows that reached across it made a
    repaired GPU look as if it were still failing for a day."""
    g, b, code, is_xid = xid_at
    fatal = ~is_xid | np.isin(code, list(FATAL_XIDS))
    marks = np.full((n_gpu, n_bin), np.nan)
    marks[g[fatal], b[fatal]] = b[fatal] + 1.0
    shifted = np.concatenate([np.full((n_gpu, 1), np.nan), marks[:, :-1]], axis=1)  # faults before the bin
    return np.nan_to_num(_ffill(shifted), nan=0.0).astype(np.int64)


def _event_features(xid_at: tuple[np.ndarray, ...], n_gpu: int, n_bin: int, per_hour: int, floor: np.ndarray
                    ) -> dict[str, np.ndarray]:
    g, b, code, is_xid = (a[xid_at[3]] for a in xid_at)
    out = {}
    for name, group, windows in (("precursor", PRECURSOR_XIDS, (1, 6, 24)), ("app", APPLICATION_XIDS, (1, 24)),
                                 ("fatal", FATAL_XIDS, (1, 24))):
        hits = np.zeros((n_gpu, n_bin))
        sel = np.isin(code, list(group))
        np.add.at(hits, (g[sel], b[sel]), 1.0)
        for w in windows:
            out[f"xid_{name}_{w}h"] = _window_sum(hits, w * per_hour, floor)
    last = np.full((n_gpu, n_bin), np.nan)
    sel = np.isin(code, list(PRECURSOR_XIDS))
    last[g[sel], b[sel]] = b[sel]
    last = _ffill(last)
    last = np.where(last < floor, np.nan, last)  # a precursor before the GPU's last fault belongs to that fault
    since_h = (np.arange(n_bin)[None, :] - last) / per_hour
    out["hours_since_precursor_xid"] = np.minimum(np.nan_to_num(since_h, nan=_CAP_H), _CAP_H)
    return out


def add_peer_features(feats: pd.DataFrame) -> pd.DataFrame:
    """The GPU against its peers at the same step: fleet percentile and node-relative counter growth,
    node-relative temperature and clock, job-relative power and utilisation. Drops the per-GPU inputs."""
    out = feats.copy()
    at = out.groupby("t_ms", sort=False)
    peers = out.groupby(["node", "t_ms"], sort=False)
    n = at["t_ms"].transform("size").to_numpy()
    added: dict[str, np.ndarray] = {}
    for short in PEER_COUNTERS:
        for w in ("1h", "6h"):  # share of the fleet's GPUs growing strictly less at this step
            below = at[f"_{short}_d{w}"].rank(method="min").to_numpy() - 1.0
            added[f"{short}_rank{w}"] = below / np.maximum(n - 1, 1)
        added[f"{short}_vs_node"] = (np.log1p(out[f"_{short}_d6h"])
                                     - np.log1p(peers[f"_{short}_d6h"].transform("median"))).to_numpy()
    added["temp_vs_node"] = (out["temp"] - peers["temp"].transform("median")).to_numpy()
    added["mem_temp_vs_node"] = (out["mem_temp"] - peers["mem_temp"].transform("median")).to_numpy()
    added["sm_clock_vs_node"] = (out["sm_clock"] / peers["sm_clock"].transform("median") - 1.0).to_numpy()
    job = out["job_id"].fillna("").replace("", np.nan)
    by_job = out.groupby([job, out["t_ms"]], sort=False, dropna=True)
    added["power_vs_job"] = (out["power_ratio"] - by_job["power_ratio"].transform("median")).to_numpy()
    added["util_vs_job"] = (out["util"] - by_job["util"].transform("median")).to_numpy()
    private = [c for c in out.columns if c.startswith("_")] + _PEER_INPUTS
    return pd.concat([out.drop(columns=private), pd.DataFrame(added, index=out.index)], axis=1)
