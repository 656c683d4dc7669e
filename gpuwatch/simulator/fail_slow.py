"""Fail-slow injection on a simulated node: ``--sim-fail-slow gpu=3,kind=thermal,after=5m[,until=20m][,factor=1.6]``.

A GPU (or its host) that is slow but alive, as Greyhound and Holmes describe them: the cause shows in the
counters the agent reads as a real one would, and the rank on that GPU takes ``factor`` times as long for the
part of its step the cause touches, so every other rank of the job waits for it in each collective.

==============  ====================================================  =============================================
kind            what NVML / the host show                             what the rank on that GPU does
==============  ====================================================  =============================================
thermal         HW + SW thermal slowdown reasons, SM clock / factor,   compute x factor
                temperature up, thermal throttle time counting
power           HW power-brake + SW power-cap reasons, SM clock /      compute x factor
                factor, power throttle time counting
clocks          HW slowdown reason, SM clock / factor                  compute x factor
pcie            link trained down (gen 1, x4), replay bursts           host-to-device copies of (factor - 1) x compute
nvlink          CRC flit/data, replay and recovery errors counting     every rank's collective transfer slower
                                                                       (the ring runs at its slowest link)
memory_errors   correctable ECC storm, rows remapped, remap pending    compute x factor
host_cpu        the node's CPUs saturated, load far above the cores    host stalls of (factor - 1) x compute
data_loader     nothing (the input pipeline is slow)                   host stalls of (factor - 1) x compute
==============  ====================================================  =============================================

``data_loader`` is the control: a rank slowed for a reason no counter shows. Times count from the clock's
start (``--sim-start``), as ``--sim-fault``'s do.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pynvml as N

from gpuwatch.core.times import parse_duration

if TYPE_CHECKING:
    from gpuwatch.simulator.faults import FaultScripting

KINDS = ("thermal", "power", "clocks", "pcie", "nvlink", "memory_errors", "host_cpu", "data_loader")
#: kinds that slow the rank's compute (its GPU runs slower)
COMPUTE_KINDS = frozenset({"thermal", "power", "clocks", "memory_errors"})
#: kinds that stall the rank's host before its GPU work
STALL_KINDS = frozenset({"host_cpu", "data_loader"})
_KEYS = ("gpu", "kind", "after", "until", "factor")
DEFAULT_FACTOR = 1.6
_REASONS = {
    "thermal": N.nvmlClocksEventReasonHwThermalSlowdown | N.nvmlClocksEventReasonSwThermalSlowdown,
    "power": N.nvmlClocksEventReasonHwPowerBrakeSlowdown | N.nvmlClocksEventReasonSwPowerCap,
    "clocks": N.nvmlClocksEventReasonHwSlowdown,
}
# error rates while a storm lasts, per simulated second
_NVLINK_PER_S = {"nvlink_crc_flit": 40.0, "nvlink_crc_data": 12.0, "nvlink_replay": 6.0, "nvlink_recovery": 0.2}
_ECC_SBE_PER_S = 25.0
_REMAPS_PER_S = 0.05
_PCIE_REPLAYS_PER_S = 8.0


@dataclass(frozen=True)
class FailSlowSpec:
    """GPU ``gpu`` (or its host) is slow from ``after_s`` to ``until_s`` (None: to the end) after the clock's start."""

    gpu: int
    kind: str
    after_s: float
    until_s: float | None = None
    factor: float = DEFAULT_FACTOR

    def active(self, t_s: float, start_s: float) -> bool:
        """Whether the slowdown holds at simulated time ``t_s`` on a clock that started at ``start_s``."""
        since = t_s - start_s
        return since >= self.after_s and (self.until_s is None or since < self.until_s)


def parse_fail_slow_spec(spec: str) -> FailSlowSpec:
    """``gpu=3,kind=thermal,after=5m[,until=20m][,factor=1.6]`` -> FailSlowSpec; ValueError saying what is wrong."""
    values: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in _KEYS:
            raise ValueError(f"{part!r}: expected one of {', '.join(k + '=' for k in _KEYS)}")
        values[key] = value.strip()
    missing = [k for k in ("gpu", "kind") if k not in values]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (e.g. gpu=3,kind=thermal,after=5m)")
    if not values["gpu"].isdigit():
        raise ValueError(f"gpu={values['gpu']}: must be a GPU index (0, 1, ...)")
    if values["kind"] not in KINDS:
        raise ValueError(f"kind={values['kind']}: must be one of {', '.join(KINDS)}")
    after = parse_duration(values.get("after", "0"))
    until = parse_duration(values["until"]) if "until" in values else None
    if until is not None and until <= after:
        raise ValueError(f"until={values['until']} must come after after={values.get('after', '0')}")
    try:
        factor = float(values.get("factor", DEFAULT_FACTOR))
    except ValueError:
        raise ValueError(f"factor={values['factor']}: must be a number > 1") from None
    if not factor > 1:
        raise ValueError(f"factor={values['factor']}: must be a number > 1 (how many times slower)")
    return FailSlowSpec(int(values["gpu"]), values["kind"], after, until, factor)


class FailSlowDriver:
    """Drives one GPU-side fail-slow onto its SimGpu; attach with ``fleet.drive(gpu, FailSlowDriver(...))``.

    Counters grow with the simulated time between calls, so the rates hold however often the agent samples;
    when the window ends the gauges and reasons return to normal (counters, as on a real GPU, stay).
    """

    def __init__(self, spec: FailSlowSpec, start_s: float) -> None:
        self.spec, self.start_s = spec, start_s
        self._last_s: float | None = None
        self._was_active = False
        self._saved: tuple[int, int] | None = None

    def __call__(self, fleet: FaultScripting, now_s: float) -> None:
        dt = 0.0 if self._last_s is None else max(0.0, now_s - self._last_s)
        self._last_s = now_s
        gpu = fleet.gpus[self.spec.gpu]
        active = self.spec.active(now_s, self.start_s)
        kind, factor = self.spec.kind, self.spec.factor
        if active and not self._was_active and kind == "pcie":
            self._saved = (gpu.pcie_gen, gpu.pcie_width)
        if kind in _REASONS:
            reasons = _REASONS[kind]
            gpu.extra_clock_reasons = (gpu.extra_clock_reasons | reasons if active
                                       else gpu.extra_clock_reasons & ~reasons)
            gpu.sm_clock_offset_mhz = -gpu.model.max_sm_mhz * (1 - 1 / factor) if active else 0.0
            if kind == "thermal":
                gpu.temperature_offset_c = 15.0 if active else 0.0
                gpu.throttle_thermal_ns += dt * 1e9 if active else 0.0
            if kind == "power":
                gpu.throttle_power_ns += dt * 1e9 if active else 0.0
        elif kind == "pcie":
            if active:
                gpu.pcie_gen, gpu.pcie_width = 1, 4
                gpu.pcie_replays += round(dt * _PCIE_REPLAYS_PER_S)
            elif self._saved is not None:
                gpu.pcie_gen, gpu.pcie_width = self._saved
                self._saved = None
        elif kind == "nvlink" and active:
            for attr, rate in _NVLINK_PER_S.items():
                setattr(gpu, attr, getattr(gpu, attr) + round(dt * rate))
        elif kind == "memory_errors":
            if active:
                fleet.add_ecc(gpu.index, sbe=round(dt * _ECC_SBE_PER_S))
                gpu.remapped_correctable += round(dt * _REMAPS_PER_S)
            gpu.remap_pending = int(active)
        self._was_active = active


class SlowRanks:
    """What the fail-slow specs do to a synthetic job's timing (SimJob asks it; rank r runs on GPU r)."""

    def __init__(self, specs: Sequence[FailSlowSpec], start_s: float) -> None:
        self.specs, self.start_s = tuple(specs), start_s

    def _factor(self, kinds: frozenset[str], rank: int | None, t_s: float) -> float:
        slow = 1.0
        for s in self.specs:
            if s.kind in kinds and (rank is None or s.gpu == rank) and s.active(t_s, self.start_s):
                slow *= s.factor
        return slow

    def compute_factor(self, rank: int, t_s: float) -> float:
        """How many times longer rank ``rank``'s compute takes at ``t_s``."""
        return self._factor(COMPUTE_KINDS, rank, t_s)

    def stall_s(self, rank: int, t_s: float, compute_s: float) -> float:
        """Host time before each compute chunk of ``rank`` (its data or its CPU is late)."""
        return (self._factor(STALL_KINDS, rank, t_s) - 1.0) * compute_s

    def copy_s(self, rank: int, t_s: float, compute_s: float) -> float:
        """Host-to-device copy time before each compute chunk of ``rank`` (a narrowed PCIe link)."""
        return (self._factor(frozenset({"pcie"}), rank, t_s) - 1.0) * compute_s

    def transfer_extra_s(self, t_s: float, compute_s: float) -> float:
        """Extra time of every collective's transfer for all ranks (a degraded NVLink on the ring)."""
        return (self._factor(frozenset({"nvlink"}), None, t_s) - 1.0) * compute_s

    def host_saturated(self, t_s: float) -> bool:
        """Whether a host_cpu injection holds the node's CPUs at ``t_s``."""
        return any(s.kind == "host_cpu" and s.active(t_s, self.start_s) for s in self.specs)
