"""Simulated GPU physics: what a GPU of a given model reports while a training job runs on it.

:class:`SimGpu` holds one GPU's state: the product's static properties (:data:`MODELS`), the job's duty cycle
(:class:`Workload`), the processes on it, and the values that follow from the work over simulated time
(utilisation, power, temperature, clocks, energy, throttle time, PCIe/NVLink bytes, GPM activity integrals),
plus the reliability counters and offsets that fault scripting (:mod:`gpuwatch.simulator.faults`,
:mod:`gpuwatch.simulator.degrade`) changes. It knows nothing of NVML's calling convention: the fake library
(:mod:`gpuwatch.simulator.nvml_lib`) reads these attributes and writes them through pynvml's pointers.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pynvml as N

@dataclass(frozen=True)
class GpuModel:
    """Static properties of a GPU product, from NVIDIA data sheets (SXM parts)."""

    name: str
    architecture: int
    memory_bytes: int
    power_limit_w: float
    idle_power_w: float
    max_sm_mhz: int
    idle_sm_mhz: int
    mem_mhz: int
    pcie_gen: int
    nvlink_links: int
    nvlink_bytes_per_s: float
    gpm: bool
    unsupported: frozenset = frozenset()  # C symbols and field ids the product does not support


_AMPERE_PLUS_UNSUPPORTED = frozenset(
    {N.NVML_FI_DEV_RETIRED_SBE, N.NVML_FI_DEV_RETIRED_DBE, N.NVML_FI_DEV_RETIRED_PENDING}
)

MODELS: dict[str, GpuModel] = {
    "H100": GpuModel("NVIDIA H100 80GB HBM3", N.NVML_DEVICE_ARCH_HOPPER, 80 * 2**30, 700.0, 70.0,
                     1980, 345, 2619, 5, 18, 450e9, True, _AMPERE_PLUS_UNSUPPORTED),
    "A100": GpuModel("NVIDIA A100-SXM4-80GB", N.NVML_DEVICE_ARCH_AMPERE, 80 * 2**30, 400.0, 55.0,
                     1410, 210, 1593, 4, 12, 300e9, False,
                     _AMPERE_PLUS_UNSUPPORTED | {"nvmlGpmSampleGet", "nvmlGpmMetricsGet"}),
}


@dataclass
class Workload:
    """A training job's duty cycle as NVML's 1 s utilisation window sees it."""

    busy_fraction: float = 0.88  # share of a step spent in kernels (the rest: exposed comm, data loading)
    wobble: float = 0.04  # slow swing of the busy share (period 97 s)
    noise: float = 0.03  # sample-to-sample jitter of the busy share
    checkpoint_every_s: float = 600.0  # a checkpoint pauses the GPUs this often ...
    checkpoint_s: float = 20.0  # ... for this long
    memory_fraction: float = 0.75  # framebuffer share the job holds

    def busy(self, t: float, rng: random.Random, phase: float) -> float:
        if self.busy_fraction <= 0:
            return 0.0
        if self.checkpoint_every_s > 0 and (t + phase) % self.checkpoint_every_s < self.checkpoint_s:
            return min(1.0, max(0.0, 0.04 + rng.gauss(0, 0.01)))
        level = self.busy_fraction + self.wobble * math.sin(2 * math.pi * (t + phase) / 97.0)
        return min(1.0, max(0.0, level + rng.gauss(0, self.noise)))


WORKLOADS: dict[str, Workload] = {"training": Workload(), "idle": Workload(busy_fraction=0.0, memory_fraction=0.0)}


@dataclass
class SimProcess:
    pid: int
    environ: dict[str, str]
    used_memory: int
    weight: float = 1.0  # its share of the GPU's busy time against the other processes' (time-slicing)


@dataclass
class SimGpu:
    """One simulated GPU. Every public attribute may be set between ticks to script a scenario."""

    index: int
    model: GpuModel
    workload: Workload
    seed: int
    node: str
    # reliability counters and link state (the fault helpers of SimulatedFleet change these)
    ecc_sbe_volatile: int = 0
    ecc_dbe_volatile: int = 0
    ecc_sbe_aggregate: int = 0
    ecc_dbe_aggregate: int = 0
    remapped_correctable: int = 0
    remapped_uncorrectable: int = 0
    remap_pending: int = 0
    remap_failure: int = 0
    pcie_replays: int = 0
    pcie_gen: int = 0
    pcie_width: int = 16
    nvlink_crc_flit: int = 0
    nvlink_crc_data: int = 0
    nvlink_replay: int = 0
    nvlink_recovery: int = 0
    extra_clock_reasons: int = 0  # OR-ed into the clock-event reasons (e.g. HW slowdown)
    temperature_offset_c: float = 0.0  # added to the GPU temperature (a failing fan or cold plate)
    memory_temperature_offset_c: float = 0.0  # added to the memory temperature (field 82)
    sm_clock_offset_mhz: float = 0.0  # added to the SM clock while busy (thermal slowdown)
    lost: bool = False
    failed_xid: int = 0  # a fatal XID stopped the GPU's work: it idles until reset() (0: not failed)
    unsupported: set = field(default_factory=set)  # C symbol names or field ids returning NOT_SUPPORTED
    processes: list[SimProcess] = field(default_factory=list)
    # workload-driven state, advanced by advance()
    utilization: float = 0.0
    power_w: float = 0.0
    temperature_c: float = 32.0
    energy_mj: float = 0.0
    throttle_power_ns: float = 0.0
    throttle_thermal_ns: float = 0.0
    pcie_tx_bytes: float = 0.0
    pcie_rx_bytes: float = 0.0
    nvlink_tx_bytes: float = 0.0
    nvlink_rx_bytes: float = 0.0
    power_capped: bool = False
    # integrals behind GPM: seconds of activity (x share) since start
    busy_integrals: dict[str, float] = field(default_factory=dict)
    _t: float | None = None

    def __post_init__(self) -> None:
        # Seeded by node name, seed and index, so the nodes of a demo fleet do not show identical numbers; the
        # phase is shared by a node's GPUs (one job checkpoints together) plus a few seconds per GPU.
        self.rng = random.Random(f"{self.node}/{self.seed}/{self.index}/workload")
        node_phase = random.Random(f"{self.node}/{self.seed}/phase").uniform(0, self.workload.checkpoint_every_s)
        self.phase = node_phase + self.rng.uniform(0, 5)
        self.pcie_gen = self.pcie_gen or self.model.pcie_gen
        self.unsupported |= set(self.model.unsupported)
        self.busy_integrals = {k: 0.0 for k in ("sm_active", "sm_occupancy", "tensor", "dram", "graphics")}
        ident = random.Random(f"{self.node}/{self.index}/{self.seed}")
        self.uuid = "GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}".format(
            *(ident.getrandbits(b) for b in (32, 16, 16, 16, 48)))
        self.pci_bus = 0x18 + 0x10 * self.index
        self.mig_uuids: list[str] = []  # MIG instances (SimulatedFleet.partition_mig); empty: MIG off
        self.mig_loads: list[float] = []  # each instance's activity against the GPU's workload (1.0: the same)
        self.serial = f"{1650000000000 + self.seed * 1000 + self.index}"

    @property
    def has_job(self) -> bool:
        return bool(self.processes)

    def advance(self, now: float) -> None:
        """Bring the workload-driven state up to ``now`` (at most 10 updates per simulated second)."""
        if self._t is None:
            self._t = now
            self.utilization = self._busy(now)
            self._set_power_and_temp(dt=0.0)
            return
        dt = now - self._t
        if dt < 0.1:
            return
        self._t = now
        u = self.utilization = self._busy(now)
        self._set_power_and_temp(dt)
        self.energy_mj += self.power_w * dt * 1000.0
        if self.power_capped:
            self.throttle_power_ns += dt * 1e9 * 0.3
        self.pcie_tx_bytes += dt * (2e7 + 0.4e9 * u)
        self.pcie_rx_bytes += dt * (2e7 + 1.6e9 * u)
        nvlink = dt * self.model.nvlink_bytes_per_s * 0.25 * u
        self.nvlink_tx_bytes += nvlink
        self.nvlink_rx_bytes += nvlink
        shares = {"graphics": u, "sm_active": 0.95 * u, "sm_occupancy": 0.42 * u, "tensor": 0.62 * u, "dram": 0.48 * u}
        for key, share in shares.items():
            self.busy_integrals[key] += share * dt

    def _busy(self, now: float) -> float:
        if self.failed_xid:
            return 0.0  # a fatal XID killed every context on the GPU; nothing runs until it is reset
        return self.workload.busy(now, self.rng, self.phase) if self.has_job else 0.0

    def _set_power_and_temp(self, dt: float) -> None:
        m = self.model
        u = self.utilization
        demand = m.idle_power_w + (m.power_limit_w * 1.02 - m.idle_power_w) * u**1.2 + self.rng.gauss(0, 3)
        self.power_capped = demand > m.power_limit_w
        self.power_w = max(m.idle_power_w * 0.9, min(demand, m.power_limit_w))
        target = 30.0 + 45.0 * self.power_w / m.power_limit_w
        alpha = 1.0 if dt == 0 else 1.0 - math.exp(-dt / 60.0)
        self.temperature_c += (target - self.temperature_c) * alpha

    @property
    def sm_clock_mhz(self) -> int:
        if self.utilization < 0.02:
            return self.model.idle_sm_mhz
        return max(self.model.idle_sm_mhz,
                   int(self.model.max_sm_mhz * (0.94 if self.power_capped else 1.0) + self.sm_clock_offset_mhz))

    @property
    def clock_reasons(self) -> int:
        reasons = self.extra_clock_reasons
        if self.utilization < 0.02:
            reasons |= N.nvmlClocksEventReasonGpuIdle
        if self.power_capped:
            reasons |= N.nvmlClocksEventReasonSwPowerCap
        return reasons

    def process_sm_util(self, process: SimProcess) -> float:
        """The process's share of the SM time (0..1): the GPU's utilisation split by the processes' weights."""
        total = sum(p.weight for p in self.processes)
        return self.utilization * process.weight / total if total > 0 else 0.0

    @property
    def memory_used(self) -> int:
        return int(512 * 2**20 + sum(p.used_memory for p in self.processes))
