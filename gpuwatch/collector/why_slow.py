"""Why a job is slow: which rank holds it back, since when, the most likely cause, and what it costs.

Pure functions over :mod:`gpuwatch.collector.slow_evidence`'s rank intervals and device evidence. A rank is
*slow* when its own work before each collective rose (a change point against its own past, see
:mod:`gpuwatch.collector.change_point`) and stays above its peers' over the same time by more than both the
noise of single intervals and the dispersion of the peers; or when the efficiency engine names it a
straggler. A rank that only waits is never blamed: one delayed while a peer is slow is ``peer`` (naming that
peer); collectives that slowed for every rank while every rank's own work stayed normal are the path between
them (``nvlink``/``pcie`` where one GPU's link counters say so, else ``network``).

The cause of a slow rank comes from the part of its work that grew (compute, copies, host stalls, where the
source splits them) and the evidence on its GPU and host against its peers in the same window:

- ``thermal``, ``power``, ``clocks``: the SM clock fell enough to explain at least half the slowdown, and
  thermal, power (cap or brake) or HW slowdown reasons were active for most of the time (``clocks`` when
  none was, or HW slowdown was);
- ``memory_errors``: ECC errors or row remaps beyond every peer's (more than chance could add), a remap pending;
- ``pcie``: the link trained below its maximum generation or width, or replays beyond the peers';
- ``nvlink``: NVLink CRC, replay or recovery errors beyond the peers';
- ``host_cpu``: the node's CPUs saturated (most of them busy most of the time); ``host_memory``: memory nearly full;
- ``data_loader``: the growth is host stall on that rank with neither of the above;
- ``unknown``: nothing checked explains it, with what was checked.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from gpuwatch.collector.change_point import Shift, robust_sigma, upward_shift
from gpuwatch.collector.slow_evidence import DeviceEvidence

CAUSES = ("thermal", "power", "clocks", "pcie", "nvlink", "memory_errors", "host_cpu", "host_memory",
          "data_loader", "network", "peer", "unknown")
#: a reason must be active for most of the time the rank was slow to be named its cause
MOST = 0.5
#: the node's CPUs count as saturated above this share busy (and memory as full above HOST_MEMORY_FULL)
HOST_CPU_SATURATED = 0.9
HOST_MEMORY_FULL = 0.95
#: how far above the noise (robust standard deviations) a rank's work must sit to be called slow
MARGIN = 3.0


@dataclass(frozen=True)
class SlowRank:
    """One slow rank (or, for ``network`` with ``rank`` None, the path between the ranks) and why."""

    rank: int | None
    node: str | None
    gpu_index: int | None
    cause: str
    evidence: str
    since_us: float  # onset: first interval at the new level (or the first seen, when it began earlier)
    speedup_without: float  # fraction: the job would run this much faster without the slowdown
    culprit: int | None = None  # for ``peer``: the rank it waits for
    checked: tuple[str, ...] = field(default=())


#: the device evidence of every rank of the job from an onset (epoch us) on
Devices = Callable[[float], Mapping[int, DeviceEvidence]]


def find_slow_ranks(intervals: pd.DataFrame, devices: Devices, delayed: Sequence[int] = ()) -> list[SlowRank]:
    """The slow ranks of one job from its recent ``intervals`` (:func:`rank_intervals`), ``devices``
    (:func:`device_evidence` since an onset), and the engine's ``delayed`` ranks (late more often than
    chance without being busier: they wait)."""
    if intervals.empty or intervals["rank"].nunique() < 2:
        return []
    by_rank = {int(r): g.sort_values("arrive_us") for r, g in intervals.groupby("rank")}
    levels = _Levels(by_rank)
    start = float(intervals["arrive_us"].min())
    slow: dict[int, float] = {}  # slow rank -> onset
    for rank, rows in by_rank.items():
        shift = upward_shift(rows["work_us"].to_numpy())
        since = float(rows["arrive_us"].iloc[shift.index]) if shift else start
        if levels.above_peers(rank, since):
            slow[rank] = since
    found = [_explain(rank, since, by_rank, devices(since)) for rank, since in sorted(slow.items())]
    if not slow:
        found.extend(_path(by_rank, devices))
    for rank in sorted(set(delayed) - set(slow)):
        if rank in by_rank and slow:
            culprit = max(slow, key=lambda r: _median_since(by_rank[r], "work_us", slow[r]))
            own, theirs = (_median_since(by_rank[r], "work_us", slow[culprit]) for r in (rank, culprit))
            dev = devices(slow[culprit]).get(rank)
            found.append(SlowRank(rank, dev.node if dev else None, dev.gpu_index if dev else None, "peer",
                                  f"rank {rank} waits for rank {culprit}; its own work is normal "
                                  f"({_ms(own)} per collective vs rank {culprit}'s {_ms(theirs)})",
                                  slow[culprit], 0.0, culprit=culprit))
    return found


class _Levels:
    """Each rank's median work and single-interval noise since an onset, computed once per onset (ranks
    without a change point share the window's start), so a large job costs one pass per distinct onset."""

    def __init__(self, by_rank: Mapping[int, pd.DataFrame]) -> None:
        self.ranks = list(by_rank)
        self._arrive = [g["arrive_us"].to_numpy(dtype=float) for g in by_rank.values()]
        self._work = [g["work_us"].to_numpy(dtype=float) for g in by_rank.values()]
        self._cache: dict[float, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def since(self, since_us: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(medians, robust sigmas, interval counts) of every rank's work from ``since_us`` on."""
        if since_us not in self._cache:
            parts = [w[np.searchsorted(a, since_us):] for a, w in zip(self._arrive, self._work)]
            self._cache[since_us] = (np.array([np.median(p) if len(p) else np.nan for p in parts]),
                                     np.array([robust_sigma(p) for p in parts]), np.array([len(p) for p in parts]))
        return self._cache[since_us]

    def above_peers(self, rank: int, since_us: float) -> bool:
        """Whether the rank's work since ``since_us`` sits above every peer's and above their level by more
        than MARGIN x the larger of a peer's single-interval noise and the peers' dispersion."""
        medians, sigmas, counts = self.since(since_us)
        i = self.ranks.index(rank)
        others = np.arange(len(self.ranks)) != i
        peers = others & (counts > 0)
        if counts[i] < 3 or not peers.any():
            return False
        peer_medians = medians[peers]
        level = float(np.median(peer_medians))
        unit = max(float(np.median(sigmas[peers])), robust_sigma(peer_medians), 1e-6 * level)
        return float(medians[i]) > max(level + MARGIN * unit, float(peer_medians.max()))


def _median_since(rows: pd.DataFrame, column: str, since_us: float) -> float:
    values = rows.loc[rows["arrive_us"] >= since_us, column]
    return float(values.median()) if len(values) else float("nan")


def _explain(rank: int, since_us: float, by_rank: Mapping[int, pd.DataFrame],
             devices: Mapping[int, DeviceEvidence]) -> SlowRank:
    rows = by_rank[rank]
    peers = [r for r in by_rank if r != rank]

    def peer_median(column: str) -> float:
        return float(np.nanmedian([_median_since(by_rank[r], column, since_us) for r in peers]))

    work, peer_work = _median_since(rows, "work_us", since_us), peer_median("work_us")
    slowdown = work / peer_work if peer_work > 0 else float("nan")
    part = _grown_part(rows, since_us, peer_median)
    head = (f"rank {rank}: {_ms(work)} of own work per collective vs peers' median {_ms(peer_work)}"
            f" ({slowdown:.2f}x)" + (f", the growth in {part}" if part else ""))
    cause, evidence, checked = _cause(rank, part, slowdown, devices)
    transfer = float(np.nanmedian([_median_since(by_rank[r], "coll_us", since_us) for r in by_rank]))
    speedup = (work + transfer) / (peer_work + transfer) - 1 if peer_work + transfer > 0 else 0.0
    dev = devices.get(rank)
    return SlowRank(rank, dev.node if dev else None, dev.gpu_index if dev else None, cause, f"{head}; {evidence}",
                    since_us, max(0.0, speedup), checked=checked)


def _grown_part(rows: pd.DataFrame, since_us: float, peer_median) -> str | None:
    """Which part of the rank's work grew most against its peers: compute, copies or host stall (None when
    the source does not split work)."""
    if rows["compute_us"].isna().all():
        return None
    growth = {part: _median_since(rows, column, since_us) - peer_median(column)
              for part, column in (("compute", "compute_us"), ("copies", "copy_us"), ("host stall", "stall_us"))}
    return max(growth, key=lambda p: growth[p])


def _cause(rank: int, part: str | None, slowdown: float,
           devices: Mapping[int, DeviceEvidence]) -> tuple[str, str, tuple[str, ...]]:
    """(cause, evidence, what was checked) for a slow rank whose ``part`` of the work grew ``slowdown`` times."""
    dev = devices.get(rank)
    peers = [d for r, d in devices.items() if r != rank]
    if dev is None:
        return "unknown", "no GPU samples of this rank in the window", ()
    tests = []
    if part in (None, "compute"):
        tests += [_clocks, _memory_errors]
    if part in (None, "copies"):
        tests += [_pcie]
    if part is None:
        tests += [_nvlink, _pcie]
    if part in (None, "host stall"):
        tests += [_host_cpu, _host_memory]
    checked: list[str] = []
    for test in dict.fromkeys(tests):
        hit = test(dev, peers, slowdown)
        if hit[0]:
            return hit[0], hit[1], tuple(checked)
        checked.append(hit[1])
    if part == "host stall":
        return ("data_loader", "host stall on this rank while its node's CPUs and memory are not saturated ("
                + "; ".join(checked) + ")", tuple(checked))
    return "unknown", "nothing checked explains it: " + "; ".join(checked), tuple(checked)


def _peer(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return float(np.median(finite)) if finite else float("nan")


def _clocks(dev: DeviceEvidence, peers: Sequence[DeviceEvidence], slowdown: float) -> tuple[str, str]:
    peer_clock = _peer([p.sm_clock_mhz for p in peers])
    clock = (f"SM clock {dev.sm_clock_mhz:,.0f} MHz vs peers' median {peer_clock:,.0f} MHz"
             if not math.isnan(dev.sm_clock_mhz) and not math.isnan(peer_clock) else "SM clock not sampled")
    drop = peer_clock / dev.sm_clock_mhz - 1 if dev.sm_clock_mhz > 0 and not math.isnan(peer_clock) else 0.0
    explains = drop > 0 and drop >= 0.5 * (slowdown - 1)
    shares = {"thermal": (dev.thermal_share, _peer([p.thermal_share for p in peers]), "thermal slowdown"),
              "power": (dev.power_share, _peer([p.power_share for p in peers]), "power cap/brake"),
              "clocks": (dev.hw_slowdown_share, _peer([p.hw_slowdown_share for p in peers]), "HW slowdown")}
    cause = max(shares, key=lambda c: shares[c][0] - (0 if math.isnan(shares[c][1]) else shares[c][1]))
    mine, theirs, label = shares[cause]
    above = mine - (0 if math.isnan(theirs) else theirs)
    reason = f"{label} active {mine:.0%} of the window (peers {0 if math.isnan(theirs) else theirs:.0%})"
    if above >= MOST:
        temp = (f"; {dev.temperature_c:.0f} °C vs peers' {_peer([p.temperature_c for p in peers]):.0f} °C"
                if cause == "thermal" and not math.isnan(dev.temperature_c) else "")
        return cause, f"{clock}; {reason}{temp}"
    if explains:
        return "clocks", f"{clock}; no throttle reason active most of the window ({reason})"
    return "", f"{clock}; clock-event reasons normal"


def _beyond(mine: float, peers: Sequence[float]) -> bool:
    """A count beyond every peer's by more than chance would add (Poisson: 3 standard deviations and 3)."""
    top = max([p for p in peers if not math.isnan(p)], default=0.0)
    return mine > top + 3 * math.sqrt(top) + 3


def _memory_errors(dev: DeviceEvidence, peers: Sequence[DeviceEvidence], slowdown: float) -> tuple[str, str]:
    peer_ecc, peer_remaps = [p.ecc_errors for p in peers], [p.row_remaps for p in peers]
    ecc, remaps = _beyond(dev.ecc_errors, peer_ecc), _beyond(dev.row_remaps, peer_remaps)
    text = (f"{dev.ecc_errors:,.0f} ECC errors and {dev.row_remaps:,.0f} row remaps in the window (peers' most "
            f"{max(peer_ecc, default=0):,.0f} and {max(peer_remaps, default=0):,.0f})"
            + ("; a row remap pending" if dev.remap_pending else ""))
    pending = dev.remap_pending and not any(p.remap_pending for p in peers)
    return ("memory_errors" if ecc or remaps or pending else ""), text


def _pcie(dev: DeviceEvidence, peers: Sequence[DeviceEvidence], slowdown: float) -> tuple[str, str]:
    down = dev.pcie_gen < dev.pcie_gen_max or dev.pcie_width < dev.pcie_width_max
    peers_down = any(p.pcie_gen < p.pcie_gen_max or p.pcie_width < p.pcie_width_max for p in peers)
    replays = _beyond(dev.pcie_replays, [p.pcie_replays for p in peers])
    text = (f"PCIe link gen {dev.pcie_gen:.0f} x{dev.pcie_width:.0f} (max gen {dev.pcie_gen_max:.0f} "
            f"x{dev.pcie_width_max:.0f}), {dev.pcie_replays:,.0f} replays (peers' most "
            f"{max([p.pcie_replays for p in peers], default=0):,.0f})")
    return ("pcie" if (down and not peers_down) or replays else ""), text


def _nvlink(dev: DeviceEvidence, peers: Sequence[DeviceEvidence], slowdown: float) -> tuple[str, str]:
    text = (f"{dev.nvlink_errors:,.0f} NVLink CRC/replay/recovery errors in the window (peers' most "
            f"{max([p.nvlink_errors for p in peers], default=0):,.0f})")
    return ("nvlink" if _beyond(dev.nvlink_errors, [p.nvlink_errors for p in peers]) else ""), text


def _host_cpu(dev: DeviceEvidence, peers: Sequence[DeviceEvidence], slowdown: float) -> tuple[str, str]:
    text = f"node {dev.node} CPUs {dev.host_cpu:.0%} busy, load {dev.host_load1:,.0f}"
    return ("host_cpu" if dev.host_cpu >= HOST_CPU_SATURATED else ""), text


def _host_memory(dev: DeviceEvidence, peers: Sequence[DeviceEvidence], slowdown: float) -> tuple[str, str]:
    text = f"node {dev.node} memory {dev.host_memory:.0%} used"
    return ("host_memory" if dev.host_memory >= HOST_MEMORY_FULL else ""), text


def _path(by_rank: Mapping[int, pd.DataFrame], evidence: Devices) -> list[SlowRank]:
    """No rank's own work grew: did the collectives slow for most ranks? Then the path between them did."""
    shifts: dict[int, Shift] = {}
    for rank, rows in by_rank.items():
        s = upward_shift(rows["coll_us"].to_numpy())
        if s is not None:
            shifts[rank] = s
    if len(shifts) * 2 <= len(by_rank):
        return []
    since = float(np.median([by_rank[r]["arrive_us"].iloc[s.index] for r, s in shifts.items()]))
    before = float(np.median([s.before for s in shifts.values()]))
    after = float(np.median([s.after for s in shifts.values()]))
    work = float(np.median([_median_since(g, "work_us", since) for g in by_rank.values()]))
    speedup = (work + after) / (work + before) - 1 if work + before > 0 else 0.0
    devices = evidence(since)
    head = (f"collectives of {len(shifts)} of {len(by_rank)} ranks slowed from {_ms(before)} to {_ms(after)} while "
            f"every rank's own work stayed normal ({_ms(work)} per collective)")
    for test in (_nvlink, _pcie):
        for rank, dev in sorted(devices.items()):
            cause, text = test(dev, [d for r, d in devices.items() if r != rank], 1.0)
            if cause:
                return [SlowRank(rank, dev.node, dev.gpu_index, cause, f"{head}; rank {rank}: {text}", since,
                                 max(0.0, speedup))]
    return [SlowRank(None, None, None, "network", f"{head}; no GPU's link counters stand out", since,
                     max(0.0, speedup))]


def _ms(us: float) -> str:
    return "n/a" if math.isnan(us) else f"{us / 1e3:,.1f} ms"
