"""A simulated GPU fleet that sits beneath pynvml: a pure-Python stand-in for the NVML C library.

``SimulatedFleet.install()`` replaces ``pynvml.nvmlLib`` with an object whose attributes carry the C symbol
names. Each fake function writes its results through the ctypes ``byref``/pointer arguments pynvml passes
and returns an ``NVML_ERROR_*`` code, so pynvml's real marshalling and error translation run unchanged and
the agent above cannot tell it from a node with GPUs. Values follow a training-like workload (see
docs/simfleet.md); faults are scripted with ``inject_xid``, ``add_ecc``, ``lose_gpu``, ...
"""
from __future__ import annotations

import ctypes
import itertools
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pynvml as N

from gpuwatch.core.xids import FATAL as FATAL_XIDS

_VOID_P = ctypes.c_void_p
_HANDLE_BASE = 0x5A000000
_EVENT_SET_BASE = 0x5B000000
_GPM_SAMPLE_BASE = 0x5C000000
_ALL_LINKS = 0xFFFFFFFF
_PID_BASE = 100_000


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
        self.uuid = "GPU-%08x-%04x-%04x-%04x-%012x" % tuple(ident.getrandbits(b) for b in (32, 16, 16, 16, 48))
        self.pci_bus = 0x18 + 0x10 * self.index
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

    @property
    def memory_used(self) -> int:
        return int(512 * 2**20 + sum(p.used_memory for p in self.processes))


class SimClock:
    """Simulated time that runs ``speed`` times faster than the wall clock.

    Reads ``start`` (epoch seconds) at the wall-clock instant ``origin`` and advances ``speed`` simulated
    seconds per real second from there, so agents given the same ``start`` and ``origin`` share one clock
    however far apart they were started. Defaults: both are the wall time when the clock is made.
    """

    def __init__(self, speed: float = 1.0, start: float | None = None, origin: float | None = None) -> None:
        if not speed > 0:
            raise ValueError(f"simulated speed {speed}: must be > 0")
        self.speed = speed
        self.origin = time.time() if origin is None else origin
        self.start = self.origin if start is None else start

    def __call__(self) -> float:
        return self.from_wall(time.time())

    def from_wall(self, wall_s: float) -> float:
        """The simulated time at wall-clock time ``wall_s`` (e.g. when a thread stamped an event)."""
        return self.start + (wall_s - self.origin) * self.speed


@dataclass
class _EventSet:
    registered: dict[int, int] = field(default_factory=dict)  # gpu index -> event type mask
    queue: deque = field(default_factory=deque)  # (gpu index, event type, event data)


class SimulatedFleet:
    """N simulated GPUs of one model on one node, installable beneath pynvml.

    ``launcher`` picks the environment the fake training processes carry: "slurm" (SLURM_JOB_ID,
    SLURM_PROCID, SLURM_LOCALID) or "torchelastic" (TORCHELASTIC_RUN_ID, RANK, LOCAL_RANK);
    ``job_id`` names their job (default ``sim-<node>``), so a synthetic job's spans can join the GPU rows.
    """

    def __init__(
        self,
        n_gpus: int,
        model: str = "H100",
        seed: int = 0,
        workload: str | Workload = "training",
        node: str = "sim",
        launcher: str = "slurm",
        clock: Callable[[], float] = time.time,
        driver_loaded: bool = True,
        job_id: str | None = None,
    ) -> None:
        if model not in MODELS:
            raise ValueError(f"unknown GPU model {model!r}; simulated models: {', '.join(MODELS)}")
        if isinstance(workload, str):
            if workload not in WORKLOADS:
                raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
            workload = WORKLOADS[workload]
        self.node = node
        self.clock = clock
        self.driver_loaded = driver_loaded
        self.driver_version = "570.133.20"
        self.cuda_version = 12080
        self.kernel_log: list[str] = []  # the NVRM lines a real node would print to /dev/kmsg
        self.gpus = [SimGpu(i, MODELS[model], workload, seed, node) for i in range(n_gpus)]
        if workload.busy_fraction > 0:
            for gpu in self.gpus:
                self.start_job(gpu.index, job_id or f"sim-{node}", rank=gpu.index, local_rank=gpu.index, launcher=launcher)
        self._lock = threading.Condition()
        self._event_sets: dict[int, _EventSet] = {}
        self._gpm_samples: dict[int, tuple[int, float, dict[str, float]] | None] = {}
        self._saved: tuple | None = None
        self._next_address = itertools.count(1)  # fake addresses for event sets and GPM buffers
        self._drivers: dict[int, list[Callable[[SimulatedFleet, float], None]]] = {}

    # --- installing beneath pynvml -------------------------------------------------------------
    def install(self) -> SimulatedFleet:
        """Make pynvml talk to this fleet instead of libnvidia-ml.so."""
        if self._saved is not None:
            return self
        self._saved = (N.nvmlLib, N._LoadNvmlLibrary)
        N.nvmlLib = _FakeNvmlLib(self)
        N._LoadNvmlLibrary = lambda: None
        N._nvmlGetFunctionPointer_cache.clear()
        return self

    def uninstall(self) -> None:
        if self._saved is None:
            return
        N.nvmlLib, N._LoadNvmlLibrary = self._saved
        N._nvmlGetFunctionPointer_cache.clear()
        self._saved = None
        with self._lock:
            self._lock.notify_all()

    def __enter__(self) -> SimulatedFleet:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    # --- jobs --------------------------------------------------------------------------------------
    def start_job(self, gpu: int, job_id: str, rank: int, local_rank: int, launcher: str = "slurm") -> int:
        """Put one training process of ``job_id`` on ``gpu``; returns its fake PID."""
        if launcher == "slurm":
            env = {"SLURM_JOB_ID": job_id, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local_rank)}
        elif launcher == "torchelastic":
            env = {"TORCHELASTIC_RUN_ID": job_id, "RANK": str(rank), "LOCAL_RANK": str(local_rank)}
        else:
            raise ValueError(f"unknown launcher {launcher!r}; use 'slurm' or 'torchelastic'")
        g = self.gpus[gpu]
        pid = _PID_BASE + gpu * 100 + len(g.processes)
        g.processes.append(SimProcess(pid, env, int(g.model.memory_bytes * g.workload.memory_fraction)))
        return pid

    def stop_job(self, gpu: int) -> None:
        self.gpus[gpu].processes.clear()

    def environ(self, pid: int) -> dict[str, str] | None:
        """The environment of a simulated process (what /proc/<pid>/environ holds on a real node)."""
        for g in self.gpus:
            for p in g.processes:
                if p.pid == pid:
                    return dict(p.environ)
        return None

    # --- scripted faults ---------------------------------------------------------------------------
    def inject_xid(self, gpu: int, code: int, message: str = "") -> None:
        """Deliver an XID through the NVML event sets and print it to the simulated kernel log."""
        g = self.gpus[gpu]
        self.kernel_log.append(
            f"NVRM: Xid (PCI:0000:{g.pci_bus:02x}:00): {code}, pid=<unknown>, name=<unknown>, {message or 'simulated'}"
        )
        if code in FATAL_XIDS:
            g.failed_xid = code
        self._deliver(gpu, N.nvmlEventTypeXidCriticalError, code)

    def reset_gpu(self, gpu: int) -> None:
        """What `nvidia-smi -r` does to a failed simulated GPU: it runs its work again."""
        self.gpus[gpu].failed_xid = 0

    def add_ecc(self, gpu: int, sbe: int = 0, dbe: int = 0) -> None:
        g = self.gpus[gpu]
        g.ecc_sbe_volatile += sbe
        g.ecc_sbe_aggregate += sbe
        g.ecc_dbe_volatile += dbe
        g.ecc_dbe_aggregate += dbe
        if dbe:
            self._deliver(gpu, N.nvmlEventTypeDoubleBitEccError, 0)

    def set_remap(self, gpu: int, correctable: int | None = None, uncorrectable: int | None = None,
                  pending: bool | None = None, failure: bool | None = None) -> None:
        g = self.gpus[gpu]
        if correctable is not None:
            g.remapped_correctable = correctable
        if uncorrectable is not None:
            g.remapped_uncorrectable = uncorrectable
        if pending is not None:
            g.remap_pending = int(pending)
        if failure is not None:
            g.remap_failure = int(failure)

    def add_pcie_replays(self, gpu: int, n: int) -> None:
        self.gpus[gpu].pcie_replays += n

    def set_pcie_link(self, gpu: int, gen: int, width: int) -> None:
        """Downtrain (or restore) the PCIe link: a precursor of bus failures."""
        self.gpus[gpu].pcie_gen, self.gpus[gpu].pcie_width = gen, width

    def add_nvlink_errors(self, gpu: int, crc_flit: int = 0, crc_data: int = 0, replay: int = 0,
                          recovery: int = 0) -> None:
        g = self.gpus[gpu]
        g.nvlink_crc_flit += crc_flit
        g.nvlink_crc_data += crc_data
        g.nvlink_replay += replay
        g.nvlink_recovery += recovery

    def lose_gpu(self, gpu: int) -> None:
        """The GPU falls off the bus: XID 79, then every call on its handle returns GPU_IS_LOST."""
        self.inject_xid(gpu, 79, "GPU has fallen off the bus.")
        self.gpus[gpu].lost = True

    def drive(self, gpu: int, driver: Callable[[SimulatedFleet, float], None]) -> None:
        """Call ``driver(fleet, now)`` before each NVML call on ``gpu`` (a failure process ticking its counters)."""
        if not 0 <= gpu < len(self.gpus):
            raise ValueError(f"GPU {gpu}: this simulated node has GPUs 0-{len(self.gpus) - 1}")
        self._drivers.setdefault(gpu, []).append(driver)

    def _deliver(self, gpu: int, event_type: int, data: int) -> None:
        with self._lock:
            for es in self._event_sets.values():
                if es.registered.get(gpu, 0) & event_type:
                    es.queue.append((gpu, event_type, data))
            self._lock.notify_all()


def _out(arg):
    """The ctypes object behind a ``byref(...)`` argument (or the object itself when passed directly)."""
    return getattr(arg, "_obj", arg)


def _address(ptr) -> int:
    return ctypes.cast(ptr, _VOID_P).value or 0


def _write_pointer(arg, address: int) -> None:
    _VOID_P.from_address(ctypes.addressof(_out(arg))).value = address


def _write_string(buf, length, text: str) -> int:
    data = text.encode()
    if len(data) + 1 > _out(length).value:
        return N.NVML_ERROR_INSUFFICIENT_SIZE
    buf.value = data
    return N.NVML_SUCCESS


_GPM_METRICS = {  # GPM metric id -> (integral key | byte counter, scale to NVML units)
    N.NVML_GPM_METRIC_GRAPHICS_UTIL: ("graphics", 100.0),
    N.NVML_GPM_METRIC_SM_UTIL: ("sm_active", 100.0),
    N.NVML_GPM_METRIC_SM_OCCUPANCY: ("sm_occupancy", 100.0),
    N.NVML_GPM_METRIC_ANY_TENSOR_UTIL: ("tensor", 100.0),
    N.NVML_GPM_METRIC_DRAM_BW_UTIL: ("dram", 100.0),
    N.NVML_GPM_METRIC_PCIE_TX_PER_SEC: ("pcie_tx_bytes", 1 / 2**20),
    N.NVML_GPM_METRIC_PCIE_RX_PER_SEC: ("pcie_rx_bytes", 1 / 2**20),
    N.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: ("nvlink_tx_bytes", 1 / 2**20),
    N.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: ("nvlink_rx_bytes", 1 / 2**20),
}


class _FakeNvmlLib:
    """Attributes named like NVML's C symbols; each writes through its pointer args and returns a code."""

    def __init__(self, fleet: SimulatedFleet) -> None:
        self._fleet = fleet
        self._initialized = False

    # --- plumbing ----------------------------------------------------------------------------------
    def _gpu(self, handle, symbol: str) -> tuple[SimGpu | None, int]:
        """The GPU behind ``handle`` with its state advanced, or an error code for this call."""
        if not self._initialized:
            return None, N.NVML_ERROR_UNINITIALIZED
        index = (_address(handle) - _HANDLE_BASE) // 0x100
        gpus = self._fleet.gpus
        if not 0 <= index < len(gpus):
            return None, N.NVML_ERROR_INVALID_ARGUMENT
        gpu = gpus[index]
        for driver in self._fleet._drivers.get(index, ()):
            driver(self._fleet, self._fleet.clock())
        if gpu.lost:
            return None, N.NVML_ERROR_GPU_IS_LOST
        if symbol in gpu.unsupported:
            return None, N.NVML_ERROR_NOT_SUPPORTED
        gpu.advance(self._fleet.clock())
        return gpu, N.NVML_SUCCESS

    def _scalar(self, handle, out, symbol: str, getter: Callable[[SimGpu], int]) -> int:
        gpu, rc = self._gpu(handle, symbol)
        if gpu is not None:
            _out(out).value = int(getter(gpu))
        return rc

    # --- system ------------------------------------------------------------------------------------
    def nvmlInitWithFlags(self, flags) -> int:
        if not self._fleet.driver_loaded:
            return N.NVML_ERROR_DRIVER_NOT_LOADED
        self._initialized = True
        return N.NVML_SUCCESS

    def nvmlShutdown(self) -> int:
        self._initialized = False
        return N.NVML_SUCCESS

    def nvmlSystemGetDriverVersion(self, buf, length) -> int:
        return _write_string(buf, length, self._fleet.driver_version)

    def nvmlSystemGetCudaDriverVersion(self, out) -> int:
        _out(out).value = self._fleet.cuda_version
        return N.NVML_SUCCESS

    nvmlSystemGetCudaDriverVersion_v2 = nvmlSystemGetCudaDriverVersion

    def nvmlDeviceGetCount_v2(self, out) -> int:
        if not self._initialized:
            return N.NVML_ERROR_UNINITIALIZED
        _out(out).value = len(self._fleet.gpus)
        return N.NVML_SUCCESS

    def nvmlDeviceGetHandleByIndex_v2(self, index, out) -> int:
        if not self._initialized:
            return N.NVML_ERROR_UNINITIALIZED
        i = index.value
        if not 0 <= i < len(self._fleet.gpus):
            return N.NVML_ERROR_INVALID_ARGUMENT
        _write_pointer(out, _HANDLE_BASE + 0x100 * i)
        return N.NVML_SUCCESS

    # --- inventory ---------------------------------------------------------------------------------
    def nvmlDeviceGetName(self, handle, buf, length) -> int:
        gpu, rc = self._gpu(handle, "nvmlDeviceGetName")
        return rc if gpu is None else _write_string(buf, length, gpu.model.name)

    def nvmlDeviceGetUUID(self, handle, buf, length) -> int:
        gpu, rc = self._gpu(handle, "nvmlDeviceGetUUID")
        return rc if gpu is None else _write_string(buf, length, gpu.uuid)

    def nvmlDeviceGetSerial(self, handle, buf, length) -> int:
        gpu, rc = self._gpu(handle, "nvmlDeviceGetSerial")
        return rc if gpu is None else _write_string(buf, length, gpu.serial)

    def nvmlDeviceGetPciInfo_v3(self, handle, out) -> int:
        gpu, rc = self._gpu(handle, "nvmlDeviceGetPciInfo_v3")
        if gpu is not None:
            info = _out(out)
            info.domain, info.bus, info.device = 0, gpu.pci_bus, 0
            info.pciDeviceId = 0x233010DE if gpu.model.gpm else 0x20B510DE
            info.busId = f"00000000:{gpu.pci_bus:02X}:00.0".encode()
            info.busIdLegacy = f"0000:{gpu.pci_bus:02X}:00.0".encode()
        return rc

    def nvmlDeviceGetArchitecture(self, handle, out) -> int:
        return self._scalar(handle, out, "nvmlDeviceGetArchitecture", lambda g: g.model.architecture)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle, out) -> int:
        return self._scalar(handle, out, "nvmlDeviceGetMaxPcieLinkGeneration", lambda g: g.model.pcie_gen)

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle, out) -> int:
        return self._scalar(handle, out, "nvmlDeviceGetMaxPcieLinkWidth", lambda g: 16)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle, out) -> int:
        return self._scalar(handle, out, "nvmlDeviceGetCurrPcieLinkGeneration", lambda g: g.pcie_gen)

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle, out) -> int:
        return self._scalar(handle, out, "nvmlDeviceGetCurrPcieLinkWidth", lambda g: g.pcie_width)

    # --- fast tier ---------------------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle, out) -> int:
        gpu, rc = self._gpu(handle, "nvmlDeviceGetUtilizationRates")
        if gpu is not None:
            util = _out(out)
            util.gpu = round(100 * gpu.utilization)
            util.memory = round(100 * gpu.utilization * 0.55)
        return rc

    def nvmlDeviceGetMemoryInfo_v2(self, handle, out) -> int:
        gpu, rc = self._gpu(handle, "nvmlDeviceGetMemoryInfo_v2")
        if gpu is not None:
            mem = _out(out)
            if mem.version != N.nvmlMemory_v2:
                return N.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
            reserved = 455 * 2**20
            mem.total, mem.reserved, mem.used = gpu.model.memory_bytes, reserved, gpu.memory_used
            mem.free = mem.total - reserved - mem.used
        return rc

    def nvmlDeviceGetTemperatureV(self, handle, out) -> int:
        gpu, rc = self._gpu(handle, "nvmlDeviceGetTemperatureV")
        if gpu is not None:
            temp = _out(out)
            if temp.sensorType != N.NVML_TEMPERATURE_GPU:
                return N.NVML_ERROR_INVALID_ARGUMENT
            temp.temperature = round(gpu.temperature_c + gpu.temperature_offset_c)
        return rc

    def nvmlDeviceGetPowerUsage(self, handle, out) -> int:
        return self._scalar(handle, out, "nvmlDeviceGetPowerUsage", lambda g: g.power_w * 1000)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle, out) -> int:
        return self._scalar(handle, out, "nvmlDeviceGetEnforcedPowerLimit", lambda g: g.model.power_limit_w * 1000)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle, out) -> int:
        return self._scalar(handle, out, "nvmlDeviceGetTotalEnergyConsumption", lambda g: g.energy_mj)

    def nvmlDeviceGetClockInfo(self, handle, clock_type, out) -> int:
        def clock(g: SimGpu) -> int:
            return g.sm_clock_mhz if clock_type.value == N.NVML_CLOCK_SM else g.model.mem_mhz
        return self._scalar(handle, out, "nvmlDeviceGetClockInfo", clock)

    def nvmlDeviceGetMaxClockInfo(self, handle, clock_type, out) -> int:
        def clock(g: SimGpu) -> int:
            return g.model.max_sm_mhz if clock_type.value == N.NVML_CLOCK_SM else g.model.mem_mhz
        return self._scalar(handle, out, "nvmlDeviceGetMaxClockInfo", clock)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle, out) -> int:
        return self._scalar(handle, out, "nvmlDeviceGetCurrentClocksEventReasons", lambda g: g.clock_reasons)

    def nvmlDeviceGetFieldValues(self, handle, count, values) -> int:
        gpu, rc = self._gpu(handle, "nvmlDeviceGetFieldValues")
        if gpu is None:
            return rc
        now_us = int(self._fleet.clock() * 1e6)
        filled = 0
        for entry in _out(values)[: count.value]:
            entry.timestamp, entry.latencyUsec = now_us, 3
            getter = _FIELD_GETTERS.get(entry.fieldId)
            if getter is None or entry.fieldId in gpu.unsupported:
                entry.nvmlReturn = N.NVML_ERROR_NOT_SUPPORTED
                continue
            if entry.fieldId in _LINK_SCOPED_FIELDS and entry.scopeId != _ALL_LINKS:
                entry.nvmlReturn = N.NVML_ERROR_INVALID_ARGUMENT
                continue
            entry.nvmlReturn = N.NVML_SUCCESS
            entry.valueType = N.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            entry.value.ullVal = int(getter(gpu))
            filled += 1
        return N.NVML_SUCCESS if filled or not count.value else N.NVML_ERROR_NOT_SUPPORTED

    # --- slow tier ---------------------------------------------------------------------------------
    def nvmlDeviceGetRemappedRows(self, handle, corr, unc, pending, failure) -> int:
        gpu, rc = self._gpu(handle, "nvmlDeviceGetRemappedRows")
        if gpu is not None:
            _out(corr).value, _out(unc).value = gpu.remapped_correctable, gpu.remapped_uncorrectable
            _out(pending).value, _out(failure).value = gpu.remap_pending, gpu.remap_failure
        return rc

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle, count, infos) -> int:
        gpu, rc = self._gpu(handle, "nvmlDeviceGetComputeRunningProcesses_v3")
        if gpu is None:
            return rc
        c_count = _out(count)
        if infos is None:
            c_count.value = len(gpu.processes)
            return N.NVML_ERROR_INSUFFICIENT_SIZE if gpu.processes else N.NVML_SUCCESS
        if c_count.value < len(gpu.processes):
            c_count.value = len(gpu.processes)
            return N.NVML_ERROR_INSUFFICIENT_SIZE
        for slot, proc in zip(infos, gpu.processes):
            slot.pid, slot.usedGpuMemory = proc.pid, proc.used_memory
            slot.gpuInstanceId = slot.computeInstanceId = 0xFFFFFFFF
        c_count.value = len(gpu.processes)
        return N.NVML_SUCCESS

    # --- GPM (Hopper+) -----------------------------------------------------------------------------
    def nvmlGpmQueryDeviceSupport(self, handle, out) -> int:
        gpu, rc = self._gpu(handle, "nvmlGpmQueryDeviceSupport")
        if gpu is not None:
            support = _out(out)
            if support.version != N.NVML_GPM_SUPPORT_VERSION:
                return N.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
            support.isSupportedDevice = int(gpu.model.gpm)
        return rc

    def nvmlGpmSampleAlloc(self, out) -> int:
        with self._fleet._lock:
            address = _GPM_SAMPLE_BASE + 0x100 * next(self._fleet._next_address)
            self._fleet._gpm_samples[address] = None
        _write_pointer(out, address)
        return N.NVML_SUCCESS

    def nvmlGpmSampleFree(self, sample) -> int:
        with self._fleet._lock:
            if _address(sample) not in self._fleet._gpm_samples:
                return N.NVML_ERROR_INVALID_ARGUMENT
            del self._fleet._gpm_samples[_address(sample)]
        return N.NVML_SUCCESS

    def nvmlGpmSampleGet(self, handle, sample) -> int:
        gpu, rc = self._gpu(handle, "nvmlGpmSampleGet")
        address = _address(sample)
        if gpu is not None:
            if address not in self._fleet._gpm_samples:
                return N.NVML_ERROR_INVALID_ARGUMENT
            counters = dict(gpu.busy_integrals, pcie_tx_bytes=gpu.pcie_tx_bytes, pcie_rx_bytes=gpu.pcie_rx_bytes,
                            nvlink_tx_bytes=gpu.nvlink_tx_bytes, nvlink_rx_bytes=gpu.nvlink_rx_bytes)
            self._fleet._gpm_samples[address] = (gpu.index, self._fleet.clock(), counters)
        return rc

    def nvmlGpmMetricsGet(self, out) -> int:
        request = _out(out)
        if request.version != N.NVML_GPM_METRICS_GET_VERSION:
            return N.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        first = self._fleet._gpm_samples.get(_address(request.sample1))
        second = self._fleet._gpm_samples.get(_address(request.sample2))
        if first is None or second is None or first[0] != second[0]:
            return N.NVML_ERROR_INVALID_ARGUMENT
        dt = second[1] - first[1]
        for i in range(request.numMetrics):
            metric = request.metrics[i]
            spec = _GPM_METRICS.get(metric.metricId)
            if spec is None or dt <= 0:
                metric.nvmlReturn = N.NVML_ERROR_NOT_SUPPORTED if spec is None else N.NVML_ERROR_INVALID_ARGUMENT
                continue
            key, scale = spec
            metric.nvmlReturn = N.NVML_SUCCESS
            metric.value = (second[2][key] - first[2][key]) / dt * scale
        return N.NVML_SUCCESS

    # --- events ------------------------------------------------------------------------------------
    def nvmlDeviceGetSupportedEventTypes(self, handle, out) -> int:
        return self._scalar(handle, out, "nvmlDeviceGetSupportedEventTypes", lambda g: _SUPPORTED_EVENTS)

    def nvmlEventSetCreate(self, out) -> int:
        with self._fleet._lock:
            address = _EVENT_SET_BASE + 0x100 * next(self._fleet._next_address)
            self._fleet._event_sets[address] = _EventSet()
        _write_pointer(out, address)
        return N.NVML_SUCCESS

    def nvmlDeviceRegisterEvents(self, handle, event_types, event_set) -> int:
        gpu, rc = self._gpu(handle, "nvmlDeviceRegisterEvents")
        es = self._fleet._event_sets.get(_address(event_set))
        if gpu is None or es is None:
            return rc if gpu is None else N.NVML_ERROR_INVALID_ARGUMENT
        if event_types.value & ~_SUPPORTED_EVENTS:
            return N.NVML_ERROR_NOT_SUPPORTED
        es.registered[gpu.index] = es.registered.get(gpu.index, 0) | event_types.value
        return N.NVML_SUCCESS

    def nvmlEventSetWait_v2(self, event_set, out, timeout_ms) -> int:
        fleet = self._fleet
        deadline = time.monotonic() + timeout_ms.value / 1000.0
        with fleet._lock:
            es = fleet._event_sets.get(_address(event_set))
            if es is None:
                return N.NVML_ERROR_INVALID_ARGUMENT
            while not es.queue:
                left = deadline - time.monotonic()
                if left <= 0 or fleet._saved is None:
                    return N.NVML_ERROR_TIMEOUT
                fleet._lock.wait(left)
            gpu, event_type, data = es.queue.popleft()
        event = _out(out)
        event.device = ctypes.cast(_HANDLE_BASE + 0x100 * gpu, N.c_nvmlDevice_t)
        event.eventType, event.eventData = event_type, data
        event.gpuInstanceId = event.computeInstanceId = 0xFFFFFFFF
        return N.NVML_SUCCESS

    def nvmlEventSetFree(self, event_set) -> int:
        with self._fleet._lock:
            return N.NVML_SUCCESS if self._fleet._event_sets.pop(_address(event_set), None) else N.NVML_ERROR_INVALID_ARGUMENT


_SUPPORTED_EVENTS = (
    N.nvmlEventTypeXidCriticalError | N.nvmlEventTypeDoubleBitEccError | N.nvmlEventTypeSingleBitEccError
    | N.nvmlEventTypePState | N.nvmlEventTypeClock
)

_LINK_SCOPED_FIELDS = {N.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, N.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX}

_FIELD_GETTERS: dict[int, Callable[[SimGpu], float]] = {
    N.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: lambda g: g.ecc_sbe_volatile,
    N.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: lambda g: g.ecc_dbe_volatile,
    N.NVML_FI_DEV_ECC_SBE_AGG_TOTAL: lambda g: g.ecc_sbe_aggregate,
    N.NVML_FI_DEV_ECC_DBE_AGG_TOTAL: lambda g: g.ecc_dbe_aggregate,
    N.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: lambda g: g.nvlink_crc_flit,
    N.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL: lambda g: g.nvlink_crc_data,
    N.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: lambda g: g.nvlink_replay,
    N.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL: lambda g: g.nvlink_recovery,
    N.NVML_FI_DEV_PERF_POLICY_POWER: lambda g: g.throttle_power_ns,
    N.NVML_FI_DEV_PERF_POLICY_THERMAL: lambda g: g.throttle_thermal_ns,
    N.NVML_FI_DEV_MEMORY_TEMP: lambda g: round(g.temperature_c + 6 + g.memory_temperature_offset_c),
    N.NVML_FI_DEV_PCIE_REPLAY_COUNTER: lambda g: g.pcie_replays,
    N.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: lambda g: g.nvlink_tx_bytes // 1024,
    N.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: lambda g: g.nvlink_rx_bytes // 1024,
    N.NVML_FI_DEV_POWER_CURRENT_LIMIT: lambda g: g.model.power_limit_w * 1000,
    N.NVML_FI_DEV_ENERGY: lambda g: g.energy_mj,
    N.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: lambda g: g.pcie_tx_bytes,
    N.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: lambda g: g.pcie_rx_bytes,
}
