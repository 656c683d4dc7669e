"""A simulated GPU fleet with failures: healthy telemetry, benign noise and failure processes with precursors.

No public data set pairs per-GPU telemetry with hardware-failure labels (docs/background.md §6), so the
failure model is trained and evaluated on this generative model, documented in docs/failure-model.md. The
fleet is generated node by node with vectorised numpy over the whole time axis; each failure is a
:class:`FaultPlan` whose effects on one GPU over any time range come from :func:`plan_effects`, so the live
demo can drive a single degrading GPU tick by tick with the same process.
"""
from __future__ import annotations

import heapq
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from gpuwatch.core.errors import UserError
from gpuwatch.core.fields import GPU_FIELD_NAMES, HOST_FIELD_NAMES
from gpuwatch.core.progress import Progress
from gpuwatch.core.recording import RecordingWriter
from gpuwatch.models.reliability import GPU_FAULTS_PER_GPU_HOUR

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS


@dataclass(frozen=True)
class Mechanism:
    """One way a GPU fails: its share of faults, precursor duration and the XIDs that end it (none: the fault
    shows in a gauge), and how long the GPU still reports after the fault before it is taken out."""

    name: str
    share: float
    precursor_median_h: float  # 0: sudden, nothing to see before the fault
    final_xids: tuple[int, ...]
    gpu_lost: bool
    reports_after_fault_s: float = 0.0


#: Shares follow StepFun's 158 GPU faults (docs/failure-model.md §1): memory/DBE 38 %, no XID or unknown cause
#: 38 % (sudden), PCIe link width low 16 % (pcie_width: replay bursts, then the link trains down to fewer lanes,
#: the fault itself; the GPU still answers, slower, until its node is drained half an hour later), lost / not
#: found 4 % (pcie: replay bursts, then it falls off the bus), NVLink 2 %, thermal 1.5 %.
MECHANISMS: dict[str, Mechanism] = {m.name: m for m in (
    Mechanism("memory", 0.38, 8.0, (48, 64), False),
    Mechanism("pcie_width", 0.16, 6.0, (), False, reports_after_fault_s=1800.0),
    Mechanism("pcie", 0.04, 6.0, (79,), True),
    Mechanism("nvlink", 0.02, 6.0, (74,), False),
    Mechanism("thermal", 0.015, 4.0, (79,), True),
    Mechanism("sudden", 0.385, 0.0, (119, 120, 79), False),
)}


@dataclass(frozen=True)
class FleetConfig:
    """One fleet configuration. The knobs after ``nodes_per_job`` (FLEET_KNOBS) make fleets that differ the
    way real sites do, for domain-shift testing; their defaults follow published real fleets
    (docs/failure-model.md §1: rate, repairs, repeats, idle time)."""

    nodes: int = 4
    gpus_per_node: int = 8
    days: float = 2.0
    resolution_s: float = 60.0
    seed: int = 0
    fault_rate_per_gpu_hour: float = GPU_FAULTS_PER_GPU_HOUR
    fault_rate_multiplier: float = 1.0
    near_miss_fraction: float = 0.1  # precursor processes that stop on their own
    start_ms: int = 1_767_225_600_000  # 2026-01-01T00:00:00Z
    nodes_per_job: int = 4
    noise: float = 1.0
    counter_level: float = 1.0
    resets_per_gpu_day: float = 0.0
    app_xids_per_node_day: float = 0.05
    power_capping: float = 0.0
    hot_aisle: float = 0.0
    noisy_gpu_fraction: float = 0.0
    lead_time_scale: float = 1.0
    precursor_strength: float = 1.0
    lookalikes_per_gpu_day: float = 0.0
    frailty_sigma: float = 0.8
    repeat_probability: float = 0.08
    repeat_decay_days: float = 7.0
    repair_median_h: float = 16.8
    repair_sigma: float = 2.4
    idle_fraction: float = 0.3
    job_util_spread: float = 0.5


#: Knobs of a fleet configuration that `gpuwatch simulate` exposes as options.
FLEET_KNOBS: dict[str, str] = {
    "noise": "scale of gauge noise (temperature, power, utilisation, clocks); 1 = the base fleet",
    "counter_level": "scale of the benign background rates of SBE, PCIe replay and NVLink CRC errors",
    "resets_per_gpu_day": "driver reloads per GPU-day (volatile counters restart)",
    "app_xids_per_node_day": "application crashes per node-day (XID 13/31 on one GPU, 43 on all)",
    "power_capping": "share of jobs heavy enough to run into the power cap (power-cap clock events)",
    "hot_aisle": "degrees C added to the inlet of every fourth node",
    "noisy_gpu_fraction": "share of GPUs that log correctable errors all the time, with XID 92, and never fail",
    "lead_time_scale": "scale of precursor durations (fault lead times)",
    "precursor_strength": "scale of precursor intensity (error rates, temperature rise)",
    "lookalikes_per_gpu_day": "benign look-alike episodes per GPU-day: remaps with XID 63 that end nowhere, "
                              "power-brake HW slowdown, PCIe replay and NVLink CRC bursts that stop, "
                              "a fan drifting warm",
    "frailty_sigma": "spread (log-normal sigma) of per-GPU frailty: how unequal GPUs are (0: all alike)",
    "repeat_probability": "expected further faults of a GPU each fault brings after its return (self-excitation)",
    "repeat_decay_days": "mean delay of those repeat faults after the return, days",
    "repair_median_h": "median repair time (GPU out of service after a fault), hours",
    "repair_sigma": "log-normal sigma of repair times (2.4: p75 ~5x, p90 ~22x the median)",
    "idle_fraction": "share of time nodes run no job (0 % utilisation, idle power and temperature)",
    "job_util_spread": "jobs' utilisation is uniform between 1 - spread and 1",
}


#: Named fleet configurations. The shipped model is trained on "base", "noisy" and "subtle"; "shifted" is
#: the held-out configuration it is judged on (bench/predict.py), different in every knob at once;
#: "validation" is where changes to features and calibration are chosen before "shifted" is looked at.
#: "real" and "busy-idle" are further unseen fleets built from published telemetry (docs/failure-model.md §3):
#: "real" a well-run site with a modest benign tail, "busy-idle" a heavily shared one whose false-alarm tail is
#: much longer (half the time idle, jobs of any intensity, crashes, resets, noisy GPUs and look-alikes).
PROFILES: dict[str, FleetConfig] = {
    "base": FleetConfig(),
    "noisy": FleetConfig(noise=1.8, counter_level=3.0, resets_per_gpu_day=0.05, app_xids_per_node_day=0.2,
                         hot_aisle=6.0, noisy_gpu_fraction=0.03, lookalikes_per_gpu_day=0.03, precursor_strength=0.8),
    "subtle": FleetConfig(counter_level=0.5, power_capping=0.3, lead_time_scale=1.6, precursor_strength=0.5,
                          noisy_gpu_fraction=0.02, lookalikes_per_gpu_day=0.02),
    "shifted": FleetConfig(noise=2.0, counter_level=4.0, resets_per_gpu_day=0.1, app_xids_per_node_day=0.3,
                           power_capping=0.4, hot_aisle=10.0, noisy_gpu_fraction=0.04, lead_time_scale=0.7,
                           precursor_strength=0.8, lookalikes_per_gpu_day=0.01),
    # Design choices (features, calibration) are judged here, never on "shifted": a fleet neither trained on
    # nor held out, with more look-alikes than any other configuration.
    "validation": FleetConfig(noise=1.4, counter_level=2.0, resets_per_gpu_day=0.03, app_xids_per_node_day=0.1,
                              power_capping=0.2, hot_aisle=8.0, noisy_gpu_fraction=0.02, lead_time_scale=1.2,
                              precursor_strength=0.7, lookalikes_per_gpu_day=0.04),
    "real": FleetConfig(noise=1.3, counter_level=1.5, resets_per_gpu_day=0.02, app_xids_per_node_day=0.1,
                        noisy_gpu_fraction=0.02, lookalikes_per_gpu_day=0.02, power_capping=0.1, hot_aisle=4.0),
    "busy-idle": FleetConfig(noise=1.6, counter_level=3.0, resets_per_gpu_day=0.08, app_xids_per_node_day=0.4,
                             power_capping=0.3, hot_aisle=8.0, noisy_gpu_fraction=0.05, precursor_strength=0.7,
                             lookalikes_per_gpu_day=0.05, idle_fraction=0.45, job_util_spread=0.8),
}


#: Domain randomisation (Tobin et al., 2017): the range each site knob is drawn from, log-uniform where the
#: range is a ratio (low > 0), else uniform. Wide on purpose — from a quiet, busy site to a noisy, half-idle
#: one — so a model trained on many draws cannot lean on one fleet's levels; chosen from what the knobs mean,
#: not from any held-out fleet's values.
RANDOM_KNOB_RANGES: dict[str, tuple[float, float]] = {
    "noise": (0.7, 2.4), "counter_level": (0.4, 5.0), "resets_per_gpu_day": (0.0, 0.12),
    "app_xids_per_node_day": (0.02, 0.5), "power_capping": (0.0, 0.5), "hot_aisle": (0.0, 12.0),
    "noisy_gpu_fraction": (0.0, 0.06), "lead_time_scale": (0.6, 1.8), "precursor_strength": (0.4, 1.2),
    "lookalikes_per_gpu_day": (0.0, 0.06), "idle_fraction": (0.1, 0.6), "job_util_spread": (0.2, 0.9),
}


def randomized_config(seed: int, base: FleetConfig | None = None) -> FleetConfig:
    """A fleet configuration with every knob of RANDOM_KNOB_RANGES drawn at random (same seed, same draw)."""
    rng = np.random.default_rng([seed, 0x5EED])
    knobs: dict[str, Any] = {k: float(np.exp(rng.uniform(math.log(lo), math.log(hi))) if lo > 0
                                      else rng.uniform(lo, hi)) for k, (lo, hi) in RANDOM_KNOB_RANGES.items()}
    return replace(base or FleetConfig(), seed=seed, **knobs)


@dataclass
class FaultPlan:
    """One GPU's failure (or near miss): precursor from ``onset_ms`` to ``fault_ms``, then down until ``recover_ms``."""

    node: str
    gpu_index: int
    mechanism: str
    onset_ms: int
    fault_ms: int
    recover_ms: int
    final_xid: int
    near_miss: bool = False
    seed: int = 0
    strength: float = 1.0

    def intensity(self, ts_ms: np.ndarray) -> np.ndarray:
        """Precursor strength 0..1, accelerating towards the fault (0 outside the precursor)."""
        span = max(self.fault_ms - self.onset_ms, 1)
        s = np.clip((ts_ms - self.onset_ms) / span, 0.0, 1.0)
        s[(ts_ms < self.onset_ms) | (ts_ms >= self.fault_ms)] = 0.0
        return s ** 2


@dataclass
class Effects:
    """What a plan adds to one GPU over a time axis: counter increments, gauge offsets, flags, events."""

    increments: dict[str, np.ndarray] = field(default_factory=dict)
    offsets: dict[str, np.ndarray] = field(default_factory=dict)
    flags: dict[str, np.ndarray] = field(default_factory=dict)
    events: list[tuple[int, str, int, str]] = field(default_factory=list)  # (ts_ms, kind, code, message)
    reason_bits: np.ndarray | None = None  # clock-event reasons to set (NVML bitmask) per tick


def plan_effects(plan: FaultPlan, ts_ms: np.ndarray | list[int], dt_s: float) -> Effects:
    """The plan's effect on its GPU at the ticks ``ts_ms`` (each covering ``dt_s`` seconds before it).

    Works on any time range: a whole recording at once, or one tick at a time for a live simulated GPU.
    Random counts are drawn per tick from the same distributions either way; one-off events (the fault's
    XIDs, XID 92 when the SBE rate turns excessive) fall in the tick that covers their time, so a
    tick-by-tick caller sees each exactly once.
    """
    ts_ms = np.asarray(ts_ms, dtype=np.int64)
    progress = plan.intensity(ts_ms)
    s = progress * plan.strength  # how strongly the precursor shows; flags follow the progress itself
    rng = np.random.default_rng([plan.seed, int(ts_ms[0]) if len(ts_ms) else 0, len(ts_ms)])
    minutes = dt_s / 60.0
    eff = Effects()
    active = s > 0

    def poisson(rate_per_min: np.ndarray) -> np.ndarray:
        return rng.poisson(rate_per_min * minutes).astype(float)

    def flag_after(level: float) -> np.ndarray:
        return (progress >= level) & active

    mech = plan.mechanism
    if mech == "memory":
        sbe = poisson(0.02 + 30.0 * s) * active
        eff.increments["gpu_ecc_sbe_volatile_total"] = sbe
        eff.increments["gpu_ecc_sbe_aggregate_total"] = sbe
        remaps = (rng.random(len(s)) < 0.02 * s * minutes * 10) & active
        eff.increments["gpu_remapped_rows_correctable"] = remaps.astype(float)
        eff.flags["gpu_remapped_rows_pending"] = flag_after(0.35)
        eff.events += [(int(t), "xid", 63, "Row remapper: new row marked for remapping, reset gpu to activate.")
                       for t in ts_ms[remaps]]
        eff.events += _crossing(plan, ts_ms, dt_s, 0.6, "xid", 92, "High single-bit ECC error rate")
    elif mech in ("pcie", "pcie_width"):
        burst = (rng.random(len(s)) < 0.3 + 0.6 * s) & active
        eff.increments["gpu_pcie_replay_total"] = poisson(2.0 + 120.0 * s) * burst
    elif mech == "nvlink":
        crc = poisson(1.0 + 400.0 * s) * active
        eff.increments["gpu_nvlink_crc_flit_errors_total"] = crc
        eff.increments["gpu_nvlink_crc_data_errors_total"] = np.floor(crc / 10.0)
        eff.increments["gpu_nvlink_replay_errors_total"] = poisson(3.0 * s) * flag_after(0.5)
    elif mech == "thermal":
        eff.offsets["gpu_temperature_celsius"] = 22.0 * s
        eff.offsets["gpu_memory_temperature_celsius"] = 18.0 * s
        throttled = np.clip(s * 1.5 - 0.2, 0.0, 1.0) * dt_s
        eff.increments["gpu_throttle_thermal_seconds_total"] = throttled
        eff.offsets["gpu_sm_clock_hertz"] = -6.0e8 * np.clip(s * 1.5 - 0.2, 0.0, 1.0)
        eff.reason_bits = np.where(throttled > 0, 0x20 | 0x40, 0)  # SW and HW thermal slowdown
    if not plan.near_miss:
        eff.events += _fault_events(plan, ts_ms, dt_s)
        if mech == "pcie_width":  # x16 -> x8 (or x4 for one plan in three) from the fault until the repair
            lanes = 12.0 if plan.seed % 3 == 0 else 8.0
            eff.offsets["gpu_pcie_link_width"] = np.where((ts_ms >= plan.fault_ms) & (ts_ms < plan.recover_ms),
                                                          -lanes, 0.0)
        if mech == "memory" and plan.final_xid == 48:
            eff.increments["gpu_ecc_dbe_volatile_total"] = _at_fault(plan, ts_ms, dt_s, 1.0 + plan.seed % 3)
            eff.increments["gpu_ecc_dbe_aggregate_total"] = eff.increments["gpu_ecc_dbe_volatile_total"]
        if mech == "memory" and plan.final_xid == 64:
            eff.flags["gpu_remapped_rows_failure"] = (ts_ms >= plan.fault_ms) & (ts_ms < plan.recover_ms)
    return eff


def _crossing(plan: FaultPlan, ts_ms: np.ndarray, dt_s: float, level: float, kind: str, code: int,
              message: str) -> list:
    """One event at the time the precursor intensity crosses ``level``, if a tick in ``ts_ms`` covers it."""
    t = plan.onset_ms + int(np.sqrt(level) * (plan.fault_ms - plan.onset_ms))  # intensity = progress ** 2
    covered = len(ts_ms) and ts_ms[0] - dt_s * 1000 < t <= ts_ms[-1]
    return [(t, kind, code, message)] if covered and t < plan.fault_ms else []


def _at_fault(plan: FaultPlan, ts_ms: np.ndarray, dt_s: float, amount: float) -> np.ndarray:
    """``amount`` at the tick that covers the fault time."""
    hit = (ts_ms >= plan.fault_ms) & (ts_ms - dt_s * 1000 < plan.fault_ms)
    return np.where(hit, amount, 0.0)


_XID_TEXT = {48: "DBE (Double Bit Error) ECC Error", 64: "Row remapping failure", 74: "NVLink Error",
             79: "GPU has fallen off the bus", 119: "Timeout waiting for GSP", 120: "GSP Error"}


def _fault_events(plan: FaultPlan, ts_ms: np.ndarray, dt_s: float) -> list:
    """The fault's XID, once (one fault, one report: a second XID 48 would read as a second uncorrectable error),
    and the GPU-lost event or the context-killed XID that follows, if in range. A fault without an XID (a PCIe
    width drop) raises no event: it shows in the samples."""
    if not plan.final_xid:
        return []
    lo = int(ts_ms[0]) - int(dt_s * 1000) if len(ts_ms) else 0
    hi = int(ts_ms[-1]) if len(ts_ms) else -1
    text = _XID_TEXT.get(plan.final_xid, "")
    out = [(plan.fault_ms, "xid", plan.final_xid, text)]
    if MECHANISMS[plan.mechanism].gpu_lost or plan.final_xid == 79:
        out.append((plan.fault_ms + 1_000, "gpu_lost", 0, "GPU is lost"))
    else:
        out.append((plan.fault_ms + 2_000, "xid", 43, "Reset channel verif error (context killed)"))
    return [e for e in out if lo < e[0] <= hi]


# --------------------------------------------------------------------------------------------------- fleet


def node_name(i: int) -> str:
    return f"node-{i:04d}"


def plan_faults(cfg: FleetConfig, node: int, rng: np.random.Generator) -> list[FaultPlan]:
    """Faults and near misses of one node's GPUs: Poisson in time with a per-GPU frailty, and each fault
    bringing ``repeat_probability`` further faults on average, ``repeat_decay_days`` after its return (real
    GPUs that failed fail again soon: docs/failure-model.md §1)."""
    hours = cfg.days * 24
    end_ms = cfg.start_ms + int(cfg.days * DAY_MS)
    names = list(MECHANISMS)
    shares = np.array([MECHANISMS[n].share for n in names])
    plans: list[FaultPlan] = []
    sigma = cfg.frailty_sigma
    for g in range(cfg.gpus_per_node):
        frailty = rng.lognormal(-sigma ** 2 / 2, sigma) if sigma > 0 else 1.0  # mean 1
        rate = cfg.fault_rate_per_gpu_hour * cfg.fault_rate_multiplier * frailty
        # each fault brings repeat_probability more on average, so spontaneous faults come at (1 - that) of the
        # rate and the total, repeats included, is the configured rate
        n_fault = rng.poisson(rate * hours * max(1.0 - cfg.repeat_probability, 0.0))
        # near misses follow the published rate: the multiplier only gives small fleets enough faults to learn
        # from, it must not also multiply the GPUs that degrade and recover (false alarms by construction)
        n_miss = rng.poisson(rate / max(cfg.fault_rate_multiplier, 1.0) * hours * cfg.near_miss_fraction)
        times = rng.uniform(cfg.start_ms, end_ms, n_fault + n_miss).astype(np.int64)
        queue = [(int(t), k >= n_fault) for k, t in enumerate(times)]  # (time, near miss)
        heapq.heapify(queue)
        free_from = cfg.start_ms - 10 * DAY_MS
        while queue:
            t, near = heapq.heappop(queue)
            mech = names[rng.choice(len(names), p=shares / shares.sum())]
            m = MECHANISMS[mech]
            if near and m.precursor_median_h == 0:
                continue  # a sudden near miss leaves no trace at all
            dur_h = (max(1.5 * cfg.lead_time_scale, rng.lognormal(math.log(m.precursor_median_h * cfg.lead_time_scale),
                                                                  0.6)) if m.precursor_median_h else 0)
            onset = int(t - dur_h * HOUR_MS)
            if onset < free_from:
                continue  # overlaps the previous fault's precursor or repair: the GPU fails once at a time
            repair = 0 if near else int(min(rng.lognormal(math.log(cfg.repair_median_h), cfg.repair_sigma),
                                            365 * 24.0) * HOUR_MS)
            plans.append(FaultPlan(node_name(node), g, mech, onset, t, t + repair,
                                   int(rng.choice(m.final_xids)) if m.final_xids else 0, near,
                                   int(rng.integers(2**31)),
                                   cfg.precursor_strength * rng.uniform(0.6, 1.4)))
            free_from = t + repair
            if not near:
                for _ in range(rng.poisson(cfg.repeat_probability)):
                    after = t + repair + int(rng.exponential(cfg.repeat_decay_days) * DAY_MS)
                    if after < end_ms:
                        heapq.heappush(queue, (after, False))
    return plans


def _job_schedule(cfg: FleetConfig, group: int, ts: np.ndarray, rng: np.random.Generator):
    """Job id per tick for a group of nodes (one multi-node job at a time, idle gaps between) and its intensity."""
    job = np.full(len(ts), -1, dtype=np.int64)
    intensity = np.zeros(len(ts))
    heavy = np.zeros(len(ts), bool)
    # jobs last 16.5 h on average (log-normal, median 12 h); gaps between them make up ``idle_fraction``
    idle = min(max(cfg.idle_fraction, 0.0), 0.95)
    idle_h = max(16.5 * idle / (1 - idle), 0.01)
    t = cfg.start_ms - int(rng.uniform(0, 12) * HOUR_MS)
    end = ts[-1] + 1
    k = 0
    while t < end:
        dur = int(rng.lognormal(math.log(12), 0.8) * HOUR_MS)
        sel = (ts >= t) & (ts < t + dur)
        job[sel] = group * 100_000 + k
        intensity[sel] = rng.uniform(1.0 - min(cfg.job_util_spread, 0.95), 1.0)
        heavy[sel] = rng.random() < cfg.power_capping
        t += dur + int(rng.exponential(idle_h) * HOUR_MS)
        k += 1
    return job, intensity, heavy


def simulate_node(cfg: FleetConfig, node: int, ts: np.ndarray, job: np.ndarray, job_intensity: np.ndarray,
                  plans: list[FaultPlan], rng: np.random.Generator, heavy: np.ndarray | None = None):
    """One node's gpu_samples, host_samples and events DataFrames; ``heavy`` marks ticks of jobs that run
    into the power cap (none by default)."""
    heavy = np.zeros(len(ts), bool) if heavy is None else heavy
    G, T = cfg.gpus_per_node, len(ts)
    dt = cfg.resolution_s
    busy = (job >= 0)[None, :].repeat(G, 0)
    inten = job_intensity[None, :] * rng.uniform(0.93, 1.0, (G, 1))
    noise = lambda scale: rng.normal(0.0, scale * cfg.noise, (G, T))  # noqa: E731
    level = cfg.counter_level
    cols: dict[str, np.ndarray] = {}
    util = np.where(busy, np.clip(inten * 0.97 + noise(0.02), 0, 1), 0.0)
    cols["gpu_utilization_ratio"] = util
    cols["gpu_memory_utilization_ratio"] = np.clip(util * 0.45 + noise(0.03), 0, 1) * busy
    total = 80 * 2**30
    cols["gpu_memory_total_bytes"] = np.full((G, T), float(total))
    cols["gpu_memory_used_bytes"] = np.where(busy, total * np.clip(0.7 + 0.2 * inten + noise(0.01), 0, 0.98), 5e8)
    efficiency = rng.normal(1.0, 0.03, (G, 1))
    power = np.where(busy, 120 + 560 * util * efficiency + 90 * heavy[None, :] + noise(15), 70 + noise(3))
    limit = 700.0
    power_capped = power > limit - 5
    power = np.minimum(power, limit)
    cols["gpu_power_watts"] = power
    cols["gpu_power_limit_watts"] = np.full((G, T), limit)
    # idle ~30 C, busy ~60 C: a p10-p90 spread near 30 C once a quarter of the time is idle (AcmeTrace)
    inlet = rng.normal(27, 2.5) + rng.normal(0, 1.5, (G, 1)) + (cfg.hot_aisle if node % 4 == 0 else 0.0)
    temp = inlet + 0.05 * power + noise(0.8)
    blips = _blips(rng, G, T, dt, per_day=0.15, length_ticks=max(1, int(1200 / dt)))
    temp = temp + 12.0 * blips
    cols["gpu_temperature_celsius"] = temp
    cols["gpu_memory_temperature_celsius"] = temp + 6 + noise(0.8)
    sm = np.where(busy, 1.98e9 - 1.5e8 * power_capped + noise(1e7), 3.45e8)
    cols["gpu_sm_clock_hertz"] = sm
    cols["gpu_memory_clock_hertz"] = np.full((G, T), 2.619e9)
    incr: dict[str, np.ndarray] = {
        "gpu_energy_joules_total": power * dt,
        "gpu_throttle_power_seconds_total": power_capped * dt * rng.uniform(0.2, 1.0, (G, T)),
        "gpu_throttle_thermal_seconds_total": blips * dt * 0.5,
        "gpu_pcie_tx_bytes_total": util * 2e9 * dt * rng.uniform(0.8, 1.2, (G, T)),
        "gpu_pcie_rx_bytes_total": util * 3e9 * dt * rng.uniform(0.8, 1.2, (G, T)),
        "gpu_nvlink_tx_bytes_total": util * 1.5e11 * dt * rng.uniform(0.8, 1.2, (G, T)),
        "gpu_nvlink_rx_bytes_total": util * 1.5e11 * dt * rng.uniform(0.8, 1.2, (G, T)),
        # benign noise: isolated SBE bursts on SBE-prone GPUs (~5%, Zhu et al.), rare PCIe replays and CRC errors
        "gpu_ecc_sbe_volatile_total": _blips(rng, G, T, dt, 0.3 * level, max(1, int(1800 / dt)))
        * rng.poisson(2.0 * level, (G, T)) * (rng.random((G, 1)) < 0.05),
        "gpu_ecc_dbe_volatile_total": np.zeros((G, T)),
        "gpu_pcie_replay_total": _blips(rng, G, T, dt, 0.4 * level, 1) * rng.integers(1, 6, (G, T)),
        "gpu_nvlink_crc_flit_errors_total": _blips(rng, G, T, dt, 0.3 * level, 1) * rng.integers(1, 20, (G, T)),
        "gpu_nvlink_crc_data_errors_total": np.zeros((G, T)),
        "gpu_nvlink_replay_errors_total": np.zeros((G, T)),
        "gpu_nvlink_recovery_errors_total": np.zeros((G, T)),
        "gpu_remapped_rows_correctable": np.zeros((G, T)),
    }
    incr["gpu_ecc_sbe_aggregate_total"] = incr["gpu_ecc_sbe_volatile_total"].copy()
    incr["gpu_ecc_dbe_aggregate_total"] = np.zeros((G, T))
    cols["gpu_clock_event_reasons"] = np.where(power_capped, 4.0, 0.0) + np.where(blips > 0, 32.0, 0.0)
    for name, util_share in (("gpu_sm_active_ratio", 0.92), ("gpu_sm_occupancy_ratio", 0.45),
                             ("gpu_tensor_active_ratio", 0.55), ("gpu_dram_bandwidth_utilization_ratio", 0.4)):
        cols[name] = np.clip(util * util_share * inten + noise(0.02), 0, 1) * busy
    for name, src in (("gpu_pcie_tx_bytes_per_second", "gpu_pcie_tx_bytes_total"),
                      ("gpu_pcie_rx_bytes_per_second", "gpu_pcie_rx_bytes_total"),
                      ("gpu_nvlink_tx_bytes_per_second", "gpu_nvlink_tx_bytes_total"),
                      ("gpu_nvlink_rx_bytes_per_second", "gpu_nvlink_rx_bytes_total")):
        cols[name] = incr[src] / dt
    flags = {n: np.zeros((G, T), bool) for n in ("gpu_remapped_rows_pending", "gpu_remapped_rows_failure",
                                                 "gpu_retired_pages_pending")}
    cols["gpu_pcie_link_gen"] = np.full((G, T), 5.0)
    cols["gpu_pcie_link_gen_max"] = np.full((G, T), 5.0)
    cols["gpu_pcie_link_width"] = np.full((G, T), 16.0)
    cols["gpu_pcie_link_width_max"] = np.full((G, T), 16.0)
    prior_sbe = rng.poisson(rng.exponential(5.0, (G, 1)) * (rng.random((G, 1)) < 0.1))
    alive = np.ones((G, T), bool)
    resets = [sorted(np.flatnonzero(rng.random(T) < cfg.resets_per_gpu_day * dt / 86400).tolist()) for _ in range(G)]
    node_events: list[tuple[int, int, str, int, str]] = []
    node_events += _noisy_gpus(cfg, rng, ts, dt, incr)
    node_events += _lookalikes(cfg, rng, ts, dt, cols, incr, flags)
    for plan in plans:
        g = plan.gpu_index
        eff = plan_effects(plan, ts, dt)
        for name, inc in eff.increments.items():
            incr[name][g] += inc
        for name, off in eff.offsets.items():
            cols[name][g] += off
        for name, flag in eff.flags.items():
            flags[name][g] |= flag
        if eff.reason_bits is not None:
            cols["gpu_clock_event_reasons"][g] = np.bitwise_or(cols["gpu_clock_event_reasons"][g].astype(np.int64),
                                                               eff.reason_bits.astype(np.int64))
        node_events += [(t, g, kind, code, msg) for t, kind, code, msg in eff.events]
        if not plan.near_miss:
            taken_out = plan.fault_ms + int(MECHANISMS[plan.mechanism].reports_after_fault_s * 1000)
            down = (ts >= taken_out) & (ts < plan.recover_ms)
            alive[g] &= ~down
            resets[g] = sorted(resets[g] + [int(np.searchsorted(ts, plan.recover_ms))])
    for name, inc in incr.items():
        cols[name] = _counter(inc, resets, volatile="aggregate" not in name and "remapped" not in name)
    cols["gpu_ecc_sbe_aggregate_total"] = cols["gpu_ecc_sbe_aggregate_total"] + prior_sbe
    for name, flag in flags.items():
        cols[name] = flag.astype(float)
    cols["gpu_remapped_rows_uncorrectable"] = np.zeros((G, T))
    cols["gpu_retired_pages_sbe"] = np.zeros((G, T))
    cols["gpu_retired_pages_dbe"] = np.zeros((G, T))
    node_events += _app_xids(rng, ts, G, job, dt, cfg.app_xids_per_node_day)
    return _frames(cfg, node, ts, job, cols, alive, node_events)


def _blips(rng: np.random.Generator, G: int, T: int, dt: float, per_day: float, length_ticks: int) -> np.ndarray:
    """0/1 array of short episodes starting at ``per_day`` per GPU-day, each ``length_ticks`` long."""
    starts = rng.random((G, T)) < per_day * dt / 86400
    if length_ticks <= 1:
        return starts.astype(float)
    c = np.cumsum(starts, axis=1)
    lagged = np.concatenate([np.zeros((G, length_ticks)), c[:, :-length_ticks]], axis=1)
    return ((c - lagged) > 0).astype(float)


def _counter(inc: np.ndarray, resets: list[list[int]], volatile: bool) -> np.ndarray:
    """Cumulative counter per GPU; volatile counters restart at each repair (driver reload)."""
    cum = np.cumsum(inc, axis=1)
    for g, points in enumerate(resets):
        for r in points:
            if 0 < r < cum.shape[1]:
                cum[g, r:] -= cum[g, r - 1] if volatile else 0.0
    return cum


def _noisy_gpus(cfg: FleetConfig, rng: np.random.Generator, ts: np.ndarray, dt: float, incr: dict) -> list:
    """Noisy-but-healthy GPUs: a steady correctable-error rate, XID 92 now and then, and no fault ever."""
    G, T = incr["gpu_ecc_sbe_volatile_total"].shape
    events = []
    for g in np.flatnonzero(rng.random(G) < cfg.noisy_gpu_fraction):
        rate = rng.uniform(0.3, 4.0)  # per minute
        sbe = rng.poisson(rate * dt / 60 * rng.lognormal(0, 0.8, T)).astype(float)
        incr["gpu_ecc_sbe_volatile_total"][g] += sbe
        incr["gpu_ecc_sbe_aggregate_total"][g] += sbe
        for i in np.flatnonzero(rng.random(T) < 1.5 * dt / 86400):  # ~1.5 XID 92 per day
            events.append((int(ts[i]), int(g), "xid", 92, "High single-bit ECC error rate"))
    return events


def _episode(rng: np.random.Generator, T: int, dt: float, min_s: float, max_s: float) -> slice:
    length = max(1, int(rng.uniform(min_s, max_s) / dt))
    start = int(rng.integers(0, max(T - length, 1)))
    return slice(start, min(start + length, T))


def _lookalikes(cfg: FleetConfig, rng: np.random.Generator, ts: np.ndarray, dt: float, cols: dict, incr: dict,
                flags: dict) -> list:
    """Benign episodes that look like precursors and end nowhere (real fleets have them all the time)."""
    G, T = cols["gpu_temperature_celsius"].shape
    events = []
    n = rng.poisson(cfg.lookalikes_per_gpu_day * G * T * dt / 86400)
    for _ in range(n):
        g = int(rng.integers(G))
        kind = rng.choice(["remap", "power_brake", "pcie_burst", "crc_burst", "fan_drift"])
        if kind == "remap":  # a few rows remapped with XID 63, pending until a reset that never comes soon
            span = _episode(rng, T, dt, 600, 6 * 3600)
            hits = rng.choice(np.arange(span.start, span.stop),
                              size=min(int(rng.integers(1, 4)), span.stop - span.start), replace=False)
            incr["gpu_remapped_rows_correctable"][g, hits] += 1
            flags["gpu_remapped_rows_pending"][g, span] = True
            events += [(int(ts[i]), g, "xid", 63, "Row remapper: new row marked for remapping, reset gpu to activate.")
                       for i in hits]
        elif kind == "power_brake":  # the node's power delivery brakes every GPU for a while
            span = _episode(rng, T, dt, 600, 3600)
            cols["gpu_clock_event_reasons"][:, span] = np.bitwise_or(
                cols["gpu_clock_event_reasons"][:, span].astype(np.int64), 0x80 | 0x8)
            cols["gpu_sm_clock_hertz"][:, span] *= 0.6
        elif kind == "pcie_burst":
            span = _episode(rng, T, dt, 1800, 3 * 3600)
            incr["gpu_pcie_replay_total"][g, span] += rng.poisson(rng.uniform(5, 80) * dt / 60, span.stop - span.start)
        elif kind == "crc_burst":
            span = _episode(rng, T, dt, 1800, 3 * 3600)
            incr["gpu_nvlink_crc_flit_errors_total"][g, span] += rng.poisson(rng.uniform(10, 300) * dt / 60,
                                                                             span.stop - span.start)
        else:  # a fan wearing out: the GPU drifts warmer over a day or two and stays there, without failing
            start = int(rng.integers(0, T))
            ramp = np.clip((np.arange(T) - start) * dt / (rng.uniform(1, 2) * 86400), 0, 1) * rng.uniform(6, 14)
            cols["gpu_temperature_celsius"][g] += ramp
            cols["gpu_memory_temperature_celsius"][g] += ramp
    return events


def _app_xids(rng: np.random.Generator, ts: np.ndarray, G: int, job: np.ndarray, dt: float, per_node_day: float
              ) -> list:
    """Application crashes: XID 13/31 on one GPU and XID 43 on all of the node's GPUs (benign for the GPU)."""
    busy = np.flatnonzero(job >= 0)
    n = rng.poisson(per_node_day * len(ts) * dt / 86400)
    out = []
    for i in rng.choice(busy, min(n, len(busy)), replace=False) if len(busy) else []:
        t = int(ts[i]) - int(rng.uniform(0, dt * 1000))
        culprit = int(rng.integers(G))
        out.append((t, culprit, "xid", int(rng.choice([13, 31])), "application fault"))
        out += [(t + 500, g, "xid", 43, "Reset channel verif error (context killed)") for g in range(G)]
    return out


def _frames(cfg: FleetConfig, node: int, ts: np.ndarray, job: np.ndarray, cols: dict, alive: np.ndarray,
            events: list) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    G, T = alive.shape
    name = node_name(node)
    keep = alive.ravel()
    group_rank = (node % cfg.nodes_per_job) * G
    jobs = np.where(job >= 0, np.char.add("job-", job.astype(str)), "")
    gpu = pd.DataFrame({
        "node": name,
        "gpu_index": np.repeat(np.arange(G, dtype=np.int32), T)[keep],
        "ts": pd.to_datetime(np.tile(ts, G)[keep], unit="ms", utc=True),
        "job_id": np.tile(jobs, G)[keep],
        "rank": np.where(np.tile(job, G) >= 0, group_rank + np.repeat(np.arange(G), T), -1)[keep].astype(np.int32),
        "local_rank": np.where(np.tile(job, G) >= 0, np.repeat(np.arange(G), T), -1)[keep].astype(np.int32),
    })
    gpu = pd.concat([gpu, pd.DataFrame({f: cols[f].ravel()[keep] for f in GPU_FIELD_NAMES})], axis=1)
    busy_share = (job >= 0).astype(float)
    host = pd.DataFrame({"node": name, "ts": pd.to_datetime(ts, unit="ms", utc=True),
                         "host_cpu_utilization_ratio": 0.05 + 0.3 * busy_share,
                         "host_load1": 2 + 30 * busy_share,
                         "host_memory_used_bytes": 2e11 + 6e11 * busy_share,
                         "host_memory_total_bytes": np.full(T, 2.0e12),
                         "host_network_rx_bytes_total": np.cumsum(busy_share * 2e10 * cfg.resolution_s),
                         "host_network_tx_bytes_total": np.cumsum(busy_share * 2e10 * cfg.resolution_s),
                         "host_disk_read_bytes_total": np.cumsum(busy_share * 1e8 * cfg.resolution_s),
                         "host_disk_write_bytes_total": np.cumsum(busy_share * 5e7 * cfg.resolution_s)})
    assert set(host.columns) - {"node", "ts"} == set(HOST_FIELD_NAMES)
    ev = pd.DataFrame(events, columns=["ts", "gpu_index", "kind", "code", "message"])
    ev.insert(0, "node", name)
    ev["ts"] = pd.to_datetime(ev["ts"].astype("int64"), unit="ms", utc=True)
    ev["attrs"] = "{}"
    return gpu, host, ev.sort_values("ts").reset_index(drop=True)


def _inventory(cfg: FleetConfig) -> pd.DataFrame:
    rows = [{"node": node_name(n), "index": g, "uuid": f"GPU-sim-{cfg.seed:04d}-{n:04d}-{g}",
             "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": f"00000000:{0x18 + 0x10 * g:02X}:00.0",
             "serial": f"SIM{cfg.seed:04d}{n:04d}{g}", "memory_total_bytes": 80 * 2**30,
             "architecture": "hopper", "gpm_supported": True}
            for n in range(cfg.nodes) for g in range(cfg.gpus_per_node)]
    return pd.DataFrame(rows)


def simulate_fleet(cfg: FleetConfig, out: str | Path, quiet: bool = False) -> dict:
    """Write a recording of the simulated fleet to ``out``; returns a summary (faults by mechanism, rows).
    Progress by node on a terminal unless ``quiet``."""
    target = Path(out)
    if target.exists() and not target.is_dir():
        raise UserError(f"{out}: exists and is not a directory; simulate into a new directory")
    if target.exists() and any(target.iterdir()):
        raise UserError(f"{out}: already exists and is not empty; simulate into a new directory")
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{out}: cannot create the recording directory: {exc.strerror}") from None
    step = int(cfg.resolution_s * 1000)
    ts = np.arange(cfg.start_ms + step, cfg.start_ms + int(cfg.days * DAY_MS) + 1, step, dtype=np.int64)
    root = np.random.SeedSequence(cfg.seed)
    group_seeds = root.spawn(math.ceil(cfg.nodes / cfg.nodes_per_job))
    node_seeds = np.random.SeedSequence([cfg.seed, 1]).spawn(cfg.nodes)
    summary: dict[str, Any] = {"faults": {}, "near_misses": 0, "gpu_rows": 0, "events": 0}
    all_plans: list[FaultPlan] = []
    with RecordingWriter(out, source="gpuwatch simulate", resolution_s=cfg.resolution_s,
                         extra={"simulation": asdict(cfg)}) as writer, \
            Progress("simulate", total=cfg.nodes, unit="nodes", quiet=quiet) as progress:
        writer.append("gpus", _inventory(cfg))
        schedules = {}
        for n in range(cfg.nodes):
            group = n // cfg.nodes_per_job
            if group not in schedules:
                schedules = {group: _job_schedule(cfg, group, ts, np.random.default_rng(group_seeds[group]))}
            rng = np.random.default_rng(node_seeds[n])
            plans = plan_faults(cfg, n, rng)
            all_plans += plans
            job, intensity, heavy = schedules[group]
            gpu, host, ev = simulate_node(cfg, n, ts, job, intensity, plans, rng, heavy)
            writer.append("gpu_samples", gpu)
            writer.append("host_samples", host)
            writer.append("events", ev)
            summary["gpu_rows"] += len(gpu)
            summary["events"] += len(ev)
            progress.advance()
    for p in all_plans:
        if p.near_miss:
            summary["near_misses"] += 1
        else:
            summary["faults"][p.mechanism] = summary["faults"].get(p.mechanism, 0) + 1
    (Path(out) / "simulation_truth.json").write_text(json.dumps([asdict(p) for p in all_plans], indent=1))
    return summary
