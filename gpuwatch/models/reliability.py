"""Fleet reliability statistics: exposure, fault rates with exact intervals, repair times, repeats and lemons.

What real fleets publish is counted the same way here, so a site can set its own numbers beside them
(docs/failure-model.md §1): a rate is fault episodes per 1,000 GPU-days of exposure with an exact Poisson
(Garwood) interval; a *lemon* is a GPU or node whose fault count is improbable under the fleet's own rate
(Poisson upper tail, Holm-corrected over every unit of the fleet); the *repeat hazard* compares how often a
unit fails again soon after returning from a fault with how often any unit fails in a window of that length.

Input is two frames: fault episodes (node, gpu_index -1 when only the node is known, start_ms, end_ms NaN
when the repair end is unknown, kind, gpu: whether the GPU is the cause) and exposure per GPU (node,
gpu_index, first_ms, last_ms). Episodes come from telemetry (models/faults.py) or from an operator's fault
log (:func:`classify_fault`, events of kind ``fault``).
"""
from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from gpuwatch.core import events as event_kinds
from gpuwatch.core.recording import ts_ms

DAY_MS = 86_400_000
HOUR_MS = 3_600_000

#: OLCF Titan (Ostrouchov et al., SC20): DBE and off-the-bus events of 30,207 GPUs over 36.8 M GPU-days.
TITAN_GPU_FAULTS_PER_1000_GPU_DAYS = 0.149
#: StepFun InfiniteHBD-Trace (SIGCOMM'25): 158 GPU-class faults, 400 servers x 8 GPUs x 348 days.
STEPFUN_GPU_FAULTS_PER_1000_GPU_DAYS = 0.142
#: The GPU fault rate the simulated fleets assume: between the two published ones.
GPU_FAULTS_PER_GPU_HOUR = 0.145 / 1000 / 24

EPISODE_COLUMNS = ["node", "gpu_index", "start_ms", "end_ms", "kind", "gpu"]
EXPOSURE_COLUMNS = ["node", "gpu_index", "first_ms", "last_ms"]
REPEAT_WINDOWS_D = (7, 30)
LEMON_ALPHA = 0.05

# ------------------------------------------------------------------------------ fault-log taxonomy
#: Logged fault text -> gpuwatch fault kind, first match wins. The kinds are those of models/faults.py
#: (memory, bus, nvlink, gsp_driver) plus pcie (a link running degraded, which operators drain on), thermal
#: and unknown (the GPU failed and the log says no more).
_KIND_PATTERNS: tuple[tuple[str, str], ...] = (
    ("nvlink", r"nvlink|nv-link|p2p|peer.?to.?peer"),
    ("memory", r"\bdbe\b|\bsbe\b|double.?bit|single.?bit|\becc\b|hbm|remap|uncorrectable|page retire|memory"),
    ("pcie", r"link width|link speed|width low|pci.?e?.*(degrad|low|width|speed)"),
    ("bus", r"fall(en)? off|off the bus|gpu lost|lost|not found|missing|disappear"),
    ("thermal", r"thermal|temperature|overheat|too hot|\bhot\b"),
    ("gsp_driver", r"\bgsp\b|driver|firmware"),
)
#: The class names a fault log uses for "the GPU itself is the cause".
_GPU_CLASS = re.compile(r"^\s*gpu", re.IGNORECASE)
_GPU_WORDS = re.compile(r"\bgpu|\bxid|nvidia|\bhbm|\bnvlink|\bdbe\b|\bsbe\b|\becc\b", re.IGNORECASE)
_XID_IN_TEXT = re.compile(r"xid\D{0,3}(\d{1,3})", re.IGNORECASE)


def classify_fault(text: str | None, xid: int | None = None, fault_class: str | None = None) -> tuple[str, bool]:
    """(kind, whether the GPU is the cause) of one logged fault from its description, XID and class.

    An XID decides the kind through models/faults.py's catalogue grouping; otherwise the description's words
    do. A class column decides GPU or not; without one, an XID or GPU words in the text make it a GPU fault.
    A fault that is not the GPU's keeps its class (or description) as its kind, lower-cased.
    """
    from gpuwatch.models.faults import FAULT_XID_KINDS

    words = (text or "").strip()
    if xid is None and (m := _XID_IN_TEXT.search(words)):
        xid = int(m.group(1))
    is_gpu = bool(_GPU_CLASS.match(fault_class)) if fault_class else (xid is not None or bool(_GPU_WORDS.search(words)))
    if not is_gpu:
        return _slug(fault_class or words or "unknown"), False
    if xid is not None and xid in FAULT_XID_KINDS:
        return FAULT_XID_KINDS[xid], True
    low = words.lower()
    for kind, pattern in _KIND_PATTERNS:
        if re.search(pattern, low):
            return kind, True
    return "unknown", True


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "unknown"


def logged_episodes(events: pd.DataFrame) -> pd.DataFrame:
    """Episodes of ``fault`` events (an imported fault log): kind, cause and repair end from their attrs."""
    rows = events[events["kind"] == event_kinds.FAULT] if len(events) else events
    if rows is None or not len(rows):
        return pd.DataFrame(columns=EPISODE_COLUMNS)
    attrs = [json.loads(a) if isinstance(a, str) and a else (a or {}) for a in rows["attrs"]]
    end = [a.get("end_ms") for a in attrs]
    return pd.DataFrame({"node": rows["node"].astype(str).to_numpy(), "gpu_index": rows["gpu_index"].astype(int).to_numpy(),
                         "start_ms": ts_ms(rows["ts"]), "end_ms": np.array([np.nan if e in (None, "") else float(e)
                                                                            for e in end]),
                         "kind": [str(a.get("kind", "unknown")) for a in attrs],
                         "gpu": [str(a.get("gpu", "true")).lower() == "true" for a in attrs]})


def telemetry_episodes(faults: pd.DataFrame) -> pd.DataFrame:
    """Episodes of models/faults.py's ``fault_events`` (all the GPU's own): the repair end is not known."""
    if not len(faults):
        return pd.DataFrame(columns=EPISODE_COLUMNS)
    return pd.DataFrame({"node": faults["node"].astype(str).to_numpy(), "gpu_index": faults["gpu_index"].astype(int).to_numpy(),
                         "start_ms": faults["start_ms"].astype(float).to_numpy(), "end_ms": np.nan,
                         "kind": faults["kind"].astype(str).to_numpy(), "gpu": True})


def exposure_of(samples: pd.DataFrame) -> pd.DataFrame:
    """Per GPU the first and last sample (ms): a GPU is exposed from its first sample to its last."""
    if not len(samples):
        return pd.DataFrame(columns=EXPOSURE_COLUMNS)
    frame = pd.DataFrame({"node": samples["node"].astype(str).to_numpy(),
                          "gpu_index": samples["gpu_index"].astype(int).to_numpy(), "ts": ts_ms(samples["ts"])})
    out = frame.groupby(["node", "gpu_index"], sort=True)["ts"].agg(first_ms="min", last_ms="max").reset_index()
    return out[EXPOSURE_COLUMNS]


# ------------------------------------------------------------------------------------- statistics
def poisson_interval(k: int, exposure: float, confidence: float = 0.95) -> tuple[float, float]:
    """Exact (Garwood) interval of a Poisson rate with ``k`` events over ``exposure``: chi-square quantiles."""
    if exposure <= 0:
        return (float("nan"), float("nan"))
    a = (1 - confidence) / 2
    lo = stats.chi2.ppf(a, 2 * k) / 2 if k > 0 else 0.0
    hi = stats.chi2.ppf(1 - a, 2 * k + 2) / 2
    return (float(lo) / exposure, float(hi) / exposure)


def rate(k: int, gpu_days: float, confidence: float = 0.95) -> dict[str, Any]:
    """Episodes, rate per 1,000 GPU-days and its exact interval."""
    lo, hi = poisson_interval(k, gpu_days / 1000, confidence)
    return {"episodes": int(k), "rate_per_1000_gpu_days": _round(k / gpu_days * 1000 if gpu_days > 0 else float("nan")),
            "ci": [_round(lo), _round(hi)]}


def _round(x: float, digits: int = 4) -> float | None:
    return None if x != x else float(f"{x:.{digits}g}")


def repair_times(episodes: pd.DataFrame) -> dict[str, Any]:
    """Hours from fault to repair where the end is known: count, median, p75, p90, mean."""
    hours = ((episodes["end_ms"] - episodes["start_ms"]) / HOUR_MS).dropna()
    hours = hours[hours >= 0]
    if not len(hours):
        return {"known": 0}
    q = np.percentile(hours, [50, 75, 90])
    return {"known": int(len(hours)), "median_h": _round(q[0], 3), "p75_h": _round(q[1], 3), "p90_h": _round(q[2], 3),
            "mean_h": _round(float(hours.mean()), 3)}


def _units(episodes: pd.DataFrame, exposure: pd.DataFrame, by_gpu: bool) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(episodes with their unit, units with exposure days and last exposed ms): a unit is a GPU or a node."""
    key = ["node", "gpu_index"] if by_gpu else ["node"]
    units = exposure.assign(days=(exposure["last_ms"] - exposure["first_ms"]) / DAY_MS).groupby(key, sort=True).agg(
        days=("days", "sum"), last_ms=("last_ms", "max")).reset_index()
    units["unit"] = list(zip(*(units[k] for k in key)))
    eps = episodes.assign(unit=list(zip(*(episodes[k] for k in key)))) if len(episodes) else episodes.assign(unit=[])
    return eps, units


def repeat_hazard(episodes: pd.DataFrame, exposure: pd.DataFrame, by_gpu: bool) -> dict[str, Any]:
    """P(the unit faults again within 7/30 days of returning from a fault) against the base probability of a
    fault in any 7/30-day window, 1 - exp(-rate x window), at the fleet's rate per unit.

    A return is the repair end where known, else the fault's start. Only returns followed by a full window
    of exposure count (no censoring bias); the next fault must start after the return.
    """
    eps, units = _units(episodes, exposure, by_gpu)
    out: dict[str, Any] = {"unit": "gpu" if by_gpu else "node"}
    unit_days = float(units["days"].sum())
    per_unit_day = len(eps) / unit_days if unit_days > 0 else 0.0
    last = dict(zip(units["unit"], units["last_ms"]))
    starts = {u: np.sort(g["start_ms"].to_numpy(float)) for u, g in eps.groupby("unit", sort=False)} if len(eps) else {}
    for window in REPEAT_WINDOWS_D:
        hits = n = 0
        for row in eps.itertuples(index=False):
            back = row.end_ms if row.end_ms == row.end_ms else row.start_ms
            if back + window * DAY_MS > last.get(row.unit, -np.inf):
                continue
            n += 1
            s = starts[row.unit]
            hits += bool(((s > back) & (s <= back + window * DAY_MS)).any())
        base = 1 - np.exp(-per_unit_day * window)
        p = hits / n if n else None
        suffix = "" if window == REPEAT_WINDOWS_D[0] else f"_{window}d"
        out[f"within_{window}d"] = _round(p) if p is not None else None
        out[f"returns_{window}d"] = n
        out[f"base{suffix}"] = _round(base)
        out[f"ratio_{window}d"] = _round(p / base) if p is not None and base > 0 else None
    # overdispersion: units with two or more faults, seen against what Poisson at each unit's exposure expects
    counts = eps.groupby("unit").size() if len(eps) else pd.Series(dtype=int)
    mu = units["days"].to_numpy() * per_unit_day
    out["units_with_2_or_more"] = int((counts >= 2).sum())
    out["expected_with_2_or_more"] = _round(float(stats.poisson.sf(1, mu).sum()), 3)
    return out


def holm(p: np.ndarray) -> np.ndarray:
    """Holm's step-down adjusted p-values (family-wise error over all ``p``)."""
    m = len(p)
    if not m:
        return p
    order = np.argsort(p)
    adjusted = np.minimum(1.0, np.maximum.accumulate(p[order] * (m - np.arange(m))))
    out = np.empty(m)
    out[order] = adjusted
    return out


def lemons(episodes: pd.DataFrame, exposure: pd.DataFrame, *, by_gpu: bool, causes: str,
           alpha: float = LEMON_ALPHA) -> list[dict[str, Any]]:
    """Units whose fault count is improbable under the fleet's rate at their own exposure.

    p_raw = P(N >= k) for N ~ Poisson(rate x unit exposure); p_value is Holm-adjusted over every unit of the
    fleet (those without faults included); a lemon has p_value < ``alpha``. The evidence: count, expected
    count, kinds and fault times.
    """
    eps, units = _units(episodes, exposure, by_gpu)
    total_days = float(units["days"].sum())
    if not len(eps) or total_days <= 0:
        return []
    per_day = len(eps) / total_days
    counts = eps.groupby("unit").size()
    k = units["unit"].map(counts).fillna(0).to_numpy(int)
    mu = units["days"].to_numpy() * per_day
    p_raw = np.where(k > 0, stats.poisson.sf(k - 1, mu), 1.0)
    p_adj = holm(p_raw)
    out = []
    for i in np.flatnonzero(p_adj < alpha):
        unit = units["unit"].iloc[i]
        mine = eps[eps["unit"] == unit].sort_values("start_ms")
        out.append({"node": unit[0], "gpu_index": int(unit[1]) if by_gpu else None, "episodes": int(k[i]),
                    "expected": _round(float(mu[i]), 3), "p_value": float(f"{p_adj[i]:.3g}"),
                    "p_raw": float(f"{p_raw[i]:.3g}"), "causes": causes,
                    "kinds": mine["kind"].value_counts().to_dict(),
                    "fault_times_ms": [int(t) for t in mine["start_ms"]]})
    return sorted(out, key=lambda r: (r["p_value"], -r["episodes"]))


def fleet_report(episodes: pd.DataFrame, exposure: pd.DataFrame, confidence: float = 0.95) -> dict[str, Any]:
    """The whole report `gpuwatch fleet` prints (docs/failure-model.md §1 defines every number)."""
    exposure = exposure[exposure["last_ms"] > exposure["first_ms"]]
    gpu_hours = float(((exposure["last_ms"] - exposure["first_ms"]) / HOUR_MS).sum())
    gpu_days = gpu_hours / 24
    episodes = episodes.sort_values(["start_ms", "node", "gpu_index"], kind="stable").reset_index(drop=True)
    gpu_eps = episodes[episodes["gpu"].astype(bool)]
    by_gpu = bool(len(gpu_eps)) and bool((gpu_eps["gpu_index"] >= 0).all())
    headline = rate(len(gpu_eps), gpu_days, confidence)
    by_kind = {}
    for kind, rows in sorted(episodes.groupby("kind"), key=lambda kv: -len(kv[1])):
        gpu = bool(rows["gpu"].all())
        by_kind[str(kind)] = {**rate(len(rows), gpu_days, confidence), "gpu": gpu,
                              "share_of_gpu_faults": _round(len(rows) / len(gpu_eps)) if gpu and len(gpu_eps) else None,
                              "repair": repair_times(rows)}
    found = [*lemons(gpu_eps[gpu_eps["gpu_index"] >= 0], exposure, by_gpu=True, causes="gpu"),
             *lemons(gpu_eps, exposure, by_gpu=False, causes="gpu")]
    if len(episodes) > len(gpu_eps):
        found += lemons(episodes, exposure, by_gpu=False, causes="all")
    return {
        "gpus": int(len(exposure)), "nodes": int(exposure["node"].nunique()),
        "exposure_gpu_hours": round(gpu_hours, 1), "exposure_gpu_days": round(gpu_days, 1),
        "period": {"start_ms": int(exposure["first_ms"].min()) if len(exposure) else None,
                   "end_ms": int(exposure["last_ms"].max()) if len(exposure) else None},
        "confidence": confidence,
        "episodes": headline["episodes"], "rate_per_1000_gpu_days": headline["rate_per_1000_gpu_days"],
        "rate_ci": headline["ci"], "faults_per_gpu_hour": _round(len(gpu_eps) / gpu_hours) if gpu_hours else None,
        "all_causes": {**rate(len(episodes), gpu_days, confidence), "repair": repair_times(episodes)},
        "by_kind": by_kind,
        "repair": repair_times(gpu_eps),
        "repeat_hazard": repeat_hazard(gpu_eps[gpu_eps["gpu_index"] >= 0] if by_gpu else gpu_eps, exposure, by_gpu),
        "lemons": found,
        "published": {"titan_gpu_faults_per_1000_gpu_days": TITAN_GPU_FAULTS_PER_1000_GPU_DAYS,
                      "stepfun_gpu_faults_per_1000_gpu_days": STEPFUN_GPU_FAULTS_PER_1000_GPU_DAYS},
    }
