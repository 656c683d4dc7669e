"""Scripted degradation of a simulated GPU: ``--sim-fault gpu=3,kind=ecc,after=5m,fail=50m``.

A :class:`FaultSpec` becomes a :class:`gpuwatch.simulator.failing_fleet.FaultPlan` on the fleet's clock, and a
:class:`Degradation` drives it onto one :class:`~gpuwatch.simulator.gpu.SimGpu` tick by tick with
:func:`~gpuwatch.simulator.failing_fleet.plan_effects`, the same failure process the training fleet is simulated
with: precursors show up in the NVML counters, gauges and XID events the agent reads through its normal
code path, and at the fault the GPU emits its fault XID and/or falls off the bus.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuwatch.core.times import parse_duration

if TYPE_CHECKING:  # failsim pulls in numpy and pandas: imported only when a fault is scripted
    from gpuwatch.simulator.faults import FaultScripting
    from gpuwatch.simulator.gpu import SimGpu
    from gpuwatch.simulator.failing_fleet import FaultPlan

#: --sim-fault kind -> failsim mechanism
KINDS: dict[str, str] = {"ecc": "memory", "remap": "memory", "memory": "memory", "thermal": "thermal",
                         "pcie": "pcie", "pcie_width": "pcie_width", "nvlink": "nvlink", "sudden": "sudden"}
_KEYS = ("gpu", "kind", "after", "fail", "xid", "seed")
#: Recovery after the fault lies beyond any run: a failed simulated GPU stays failed.
_NEVER_S = 10 * 365 * 86400

#: Counter field -> (SimGpu attribute, scale from the field's unit to the attribute's)
_COUNTERS: dict[str, tuple[str, float]] = {
    "gpu_ecc_sbe_volatile_total": ("ecc_sbe_volatile", 1),
    "gpu_ecc_sbe_aggregate_total": ("ecc_sbe_aggregate", 1),
    "gpu_ecc_dbe_volatile_total": ("ecc_dbe_volatile", 1),
    "gpu_ecc_dbe_aggregate_total": ("ecc_dbe_aggregate", 1),
    "gpu_remapped_rows_correctable": ("remapped_correctable", 1),
    "gpu_pcie_replay_total": ("pcie_replays", 1),
    "gpu_nvlink_crc_flit_errors_total": ("nvlink_crc_flit", 1),
    "gpu_nvlink_crc_data_errors_total": ("nvlink_crc_data", 1),
    "gpu_nvlink_replay_errors_total": ("nvlink_replay", 1),
    "gpu_throttle_thermal_seconds_total": ("throttle_thermal_ns", 1e9),
}
#: Gauge field -> (SimGpu offset attribute, scale); set, not accumulated
_OFFSETS: dict[str, tuple[str, float]] = {
    "gpu_temperature_celsius": ("temperature_offset_c", 1),
    "gpu_memory_temperature_celsius": ("memory_temperature_offset_c", 1),
    "gpu_sm_clock_hertz": ("sm_clock_offset_mhz", 1e-6),
}
_FLAGS: dict[str, str] = {"gpu_remapped_rows_pending": "remap_pending", "gpu_remapped_rows_failure": "remap_failure"}
_FULL_PCIE_WIDTH = 16


@dataclass(frozen=True)
class FaultSpec:
    """One scripted fault: GPU ``gpu`` starts degrading ``after_s`` and fails ``fail_s`` after the clock starts."""

    gpu: int
    kind: str
    after_s: float
    fail_s: float
    xid: int | None = None  # the fault's XID; default: the mechanism's first
    seed: int = 0

    @property
    def mechanism(self) -> str:
        return KINDS[self.kind]


def parse_fault_spec(spec: str) -> FaultSpec:
    """``gpu=3,kind=ecc,after=5m,fail=50m[,xid=48][,seed=1]`` -> FaultSpec; ValueError saying what is wrong."""
    from gpuwatch.simulator.failing_fleet import MECHANISMS

    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in _KEYS:
            raise ValueError(f"{part!r}: expected one of {', '.join(k + '=' for k in _KEYS)}")
        fields[key] = value.strip()
    missing = [k for k in ("gpu", "kind", "fail") if k not in fields]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (e.g. gpu=3,kind=ecc,after=5m,fail=50m)")
    if not fields["gpu"].isdigit():
        raise ValueError(f"gpu={fields['gpu']}: must be a GPU index (0, 1, ...)")
    kind = fields["kind"]
    if kind not in KINDS:
        raise ValueError(f"kind={kind}: must be one of {', '.join(KINDS)}")
    after, fail = parse_duration(fields.get("after", "0")), parse_duration(fields["fail"])
    if fail <= after:
        raise ValueError(f"fail={fields['fail']} must come after after={fields.get('after', '0')}")
    mechanism = MECHANISMS[KINDS[kind]]
    xid = None
    if "xid" in fields:
        if not mechanism.final_xids:
            raise ValueError(f"xid={fields['xid']}: a {kind} fault raises no XID (it shows in the link width)")
        if not fields["xid"].isdigit() or int(fields["xid"]) not in mechanism.final_xids:
            raise ValueError(f"xid={fields['xid']}: a {kind} fault ends in XID "
                             + " or ".join(map(str, mechanism.final_xids)))
        xid = int(fields["xid"])
    if not fields.get("seed", "0").isdigit():
        raise ValueError(f"seed={fields['seed']}: must be a non-negative integer")
    return FaultSpec(int(fields["gpu"]), kind, after, fail, xid, int(fields.get("seed", "0")))


class Degradation:
    """Drives one FaultPlan onto its simulated GPU; attach with ``fleet.drive(gpu, Degradation(...))``.

    Each call covers the simulated time since the previous one (at least ``min_step_s``), so the counts
    drawn per step add up to the same rates however often the agent samples.
    """

    def __init__(self, plan: FaultPlan, *, min_step_s: float = 1.0) -> None:
        self.plan = plan
        self.min_step_s = min_step_s
        self._last_s: float | None = None

    @classmethod
    def from_spec(cls, spec: FaultSpec, node: str, clock_start_s: float) -> Degradation:
        from gpuwatch.simulator.failing_fleet import MECHANISMS, FaultPlan

        start_ms = int(clock_start_s * 1000)
        fault_ms = start_ms + int(spec.fail_s * 1000)
        xid = spec.xid if spec.xid is not None else (MECHANISMS[spec.mechanism].final_xids or (0,))[0]
        return cls(FaultPlan(node, spec.gpu, spec.mechanism, start_ms + int(spec.after_s * 1000), fault_ms,
                             fault_ms + _NEVER_S * 1000, xid, seed=spec.seed))

    def __call__(self, fleet: FaultScripting, now_s: float) -> None:
        if self._last_s is None:
            self._last_s = now_s
            return
        dt = now_s - self._last_s
        if dt < self.min_step_s:
            return
        self._last_s = now_s
        from gpuwatch.simulator.failing_fleet import plan_effects

        effects = plan_effects(self.plan, [int(now_s * 1000)], dt)
        gpu = fleet.gpus[self.plan.gpu_index]
        _apply(gpu, effects)
        for _, kind, code, message in sorted(effects.events):
            if kind == "xid":
                fleet.inject_xid(gpu.index, code, message)
            elif kind == "gpu_lost":
                gpu.lost = True  # the agent finds out as a real one does: GPU_IS_LOST on its next call


def _apply(gpu: SimGpu, effects) -> None:
    for name, inc in effects.increments.items():
        attr, scale = _COUNTERS[name]
        setattr(gpu, attr, type(getattr(gpu, attr))(getattr(gpu, attr) + float(inc[0]) * scale))
    for name, offset in effects.offsets.items():
        if name == "gpu_pcie_link_width":
            gpu.pcie_width = int(_FULL_PCIE_WIDTH + offset[0])
        else:
            attr, scale = _OFFSETS[name]
            setattr(gpu, attr, float(offset[0]) * scale)
    for name, flag in effects.flags.items():
        setattr(gpu, _FLAGS[name], int(bool(flag[0])))
