"""The NVML sampler: what the agent reads from the GPUs of a node, at which cadence, in gpuwatch units.

Fast tier every tick (utilisation, memory, temperature, power, clocks, clock-event reasons and one
``nvmlDeviceGetFieldValues`` for the batchable fields), GPM on Hopper and newer, slow tier every
``slow_interval`` (ECC, retired pages, remapped rows, PCIe replays and link, NVLink errors). A call or field
that a GPU does not support is recorded once, reported once as a ``field_unsupported`` event and never
polled again; a GPU that falls off the bus is reported once (``gpu_lost``) and dropped while the others go
on. Values use the names and units of :mod:`gpuwatch.core.fields`.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import pynvml as N

from gpuwatch.core import events as ev
from gpuwatch.core.events import Event
from gpuwatch.core.errors import UserError
from gpuwatch.v1 import telemetry_pb2 as pb

log = logging.getLogger(__name__)

ALL_LINKS = 0xFFFFFFFF
GPM_MIN_SPACING_S = 0.1  # Hopper refuses GPM samples closer than 100 ms (NVIDIA/DCGM#310)
MIB = 2**20

# (field id, scope or None, gpuwatch field, scale to gpuwatch units)
FieldSpec = tuple[int, "int | None", str, float]
FAST_FIELD_VALUES: tuple[FieldSpec, ...] = (
    (N.NVML_FI_DEV_MEMORY_TEMP, None, "gpu_memory_temperature_celsius", 1.0),
    (N.NVML_FI_DEV_POWER_CURRENT_LIMIT, None, "gpu_power_limit_watts", 1e-3),
    (N.NVML_FI_DEV_ENERGY, None, "gpu_energy_joules_total", 1e-3),
    (N.NVML_FI_DEV_PERF_POLICY_POWER, None, "gpu_throttle_power_seconds_total", 1e-9),
    (N.NVML_FI_DEV_PERF_POLICY_THERMAL, None, "gpu_throttle_thermal_seconds_total", 1e-9),
    (N.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, None, "gpu_pcie_tx_bytes_total", 1.0),
    (N.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, None, "gpu_pcie_rx_bytes_total", 1.0),
    (N.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS, "gpu_nvlink_tx_bytes_total", 1024.0),
    (N.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS, "gpu_nvlink_rx_bytes_total", 1024.0),
)
SLOW_FIELD_VALUES: tuple[FieldSpec, ...] = (
    (N.NVML_FI_DEV_ECC_SBE_VOL_TOTAL, None, "gpu_ecc_sbe_volatile_total", 1.0),
    (N.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, None, "gpu_ecc_dbe_volatile_total", 1.0),
    (N.NVML_FI_DEV_ECC_SBE_AGG_TOTAL, None, "gpu_ecc_sbe_aggregate_total", 1.0),
    (N.NVML_FI_DEV_ECC_DBE_AGG_TOTAL, None, "gpu_ecc_dbe_aggregate_total", 1.0),
    (N.NVML_FI_DEV_RETIRED_SBE, None, "gpu_retired_pages_sbe", 1.0),
    (N.NVML_FI_DEV_RETIRED_DBE, None, "gpu_retired_pages_dbe", 1.0),
    (N.NVML_FI_DEV_RETIRED_PENDING, None, "gpu_retired_pages_pending", 1.0),
    (N.NVML_FI_DEV_PCIE_REPLAY_COUNTER, None, "gpu_pcie_replay_total", 1.0),
    (N.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL, None, "gpu_nvlink_crc_flit_errors_total", 1.0),
    (N.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL, None, "gpu_nvlink_crc_data_errors_total", 1.0),
    (N.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL, None, "gpu_nvlink_replay_errors_total", 1.0),
    (N.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL, None, "gpu_nvlink_recovery_errors_total", 1.0),
)
GPM_METRICS: tuple[tuple[int, str, float], ...] = (  # (GPM metric id, gpuwatch field, scale)
    (N.NVML_GPM_METRIC_SM_UTIL, "gpu_sm_active_ratio", 0.01),
    (N.NVML_GPM_METRIC_SM_OCCUPANCY, "gpu_sm_occupancy_ratio", 0.01),
    (N.NVML_GPM_METRIC_ANY_TENSOR_UTIL, "gpu_tensor_active_ratio", 0.01),
    (N.NVML_GPM_METRIC_DRAM_BW_UTIL, "gpu_dram_bandwidth_utilization_ratio", 0.01),
    (N.NVML_GPM_METRIC_PCIE_TX_PER_SEC, "gpu_pcie_tx_bytes_per_second", MIB),
    (N.NVML_GPM_METRIC_PCIE_RX_PER_SEC, "gpu_pcie_rx_bytes_per_second", MIB),
    (N.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC, "gpu_nvlink_tx_bytes_per_second", MIB),
    (N.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, "gpu_nvlink_rx_bytes_per_second", MIB),
)
_VALUE_MEMBER = {  # nvmlValueType_t -> member of the c_nvmlValue_t union
    N.NVML_VALUE_TYPE_DOUBLE: "dVal",
    N.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    N.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    N.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    N.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    N.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    N.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}
_ARCHITECTURES = {
    N.NVML_DEVICE_ARCH_KEPLER: "kepler", N.NVML_DEVICE_ARCH_MAXWELL: "maxwell", N.NVML_DEVICE_ARCH_PASCAL: "pascal",
    N.NVML_DEVICE_ARCH_VOLTA: "volta", N.NVML_DEVICE_ARCH_TURING: "turing", N.NVML_DEVICE_ARCH_AMPERE: "ampere",
    N.NVML_DEVICE_ARCH_ADA: "ada", N.NVML_DEVICE_ARCH_HOPPER: "hopper", N.NVML_DEVICE_ARCH_BLACKWELL: "blackwell",
}
# Errors that mean "this GPU cannot give this value": record once, never ask again.
_UNSUPPORTED = (N.NVMLError_NotSupported, N.NVMLError_NoPermission, N.NVMLError_FunctionNotFound)


class NoGpuDriverError(UserError):
    """No NVIDIA driver or NVML library on this node."""


@dataclass
class Tick:
    """What one sampling tick produced: values per GPU index, events, and whether the slow tier ran."""

    rows: dict[int, dict[str, float]]
    events: list[Event]
    slow: bool


@dataclass
class GpuDevice:
    """One GPU's inventory and sampling state (capability cache, GPM buffers)."""

    index: int
    handle: object
    uuid: str = ""
    name: str = ""
    pci_bus_id: str = ""
    serial: str = ""
    memory_total: int = 0
    architecture: str = "unknown"
    gpm_supported: bool = False
    pcie_gen_max: float | None = None
    pcie_width_max: float | None = None
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)
    fast_fields: list[FieldSpec] = field(default_factory=lambda: list(FAST_FIELD_VALUES))
    slow_fields: list[FieldSpec] = field(default_factory=lambda: list(SLOW_FIELD_VALUES))
    gpm_metrics: list[tuple[int, str, float]] = field(default_factory=lambda: list(GPM_METRICS))
    gpm_buffers: list = field(default_factory=list)
    gpm_last_s: float | None = None
    process_seen_us: int = 0  # newest per-process utilisation sample read (NVML's lastSeenTimeStamp)

    def info(self) -> pb.GpuInfo:
        return pb.GpuInfo(index=self.index, uuid=self.uuid, name=self.name, pci_bus_id=self.pci_bus_id,
                          serial=self.serial, memory_total_bytes=self.memory_total,
                          architecture=self.architecture, gpm_supported=self.gpm_supported)


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on a GPU: its memory (bytes) and utilisation ratios (None: no sample)."""

    pid: int
    used_memory: int
    sm_util: float | None = None
    mem_util: float | None = None


class _GpuLost(Exception):
    """Internal: the GPU being sampled returned GPU_IS_LOST."""


class NvmlSampler:
    """Samples every GPU of the node through pynvml (real driver or the simulated fleet beneath it)."""

    def __init__(self, slow_interval: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.slow_interval = slow_interval
        self.clock = clock
        self.devices: list[GpuDevice] = []
        self.driver_version = ""
        self.cuda_version = ""
        self._next_slow: float | None = None
        self._pending_events: list[Event] = []

    # --- lifecycle ---------------------------------------------------------------------------------
    def open(self) -> list[GpuDevice]:
        """Initialise NVML and take the inventory; raises NoGpuDriverError without a driver."""
        try:
            N.nvmlInit()
        except (N.NVMLError_LibraryNotFound, N.NVMLError_DriverNotLoaded) as exc:
            raise NoGpuDriverError(
                f"no NVIDIA driver on this node (NVML: {exc}); use --simulate N to run on simulated GPUs"
            ) from exc
        self.driver_version = _text(N.nvmlSystemGetDriverVersion())
        try:
            cuda = N.nvmlSystemGetCudaDriverVersion()
            self.cuda_version = f"{cuda // 1000}.{cuda % 1000 // 10}"
        except N.NVMLError:
            self.cuda_version = ""
        self.devices = [self._inventory(i) for i in range(N.nvmlDeviceGetCount())]
        return self.devices

    def close(self) -> None:
        for dev in self.devices:
            for buf in dev.gpm_buffers:
                _quietly(N.nvmlGpmSampleFree, buf)
            dev.gpm_buffers = []
        _quietly(N.nvmlShutdown)

    def _inventory(self, index: int) -> GpuDevice:
        dev = GpuDevice(index, N.nvmlDeviceGetHandleByIndex(index))
        try:
            dev.uuid = _text(self._call(dev, "nvmlDeviceGetUUID", N.nvmlDeviceGetUUID) or "")
            dev.name = _text(self._call(dev, "nvmlDeviceGetName", N.nvmlDeviceGetName) or "")
            dev.serial = _text(self._call(dev, "nvmlDeviceGetSerial", N.nvmlDeviceGetSerial) or "")
            pci = self._call(dev, "nvmlDeviceGetPciInfo_v3", N.nvmlDeviceGetPciInfo_v3)
            dev.pci_bus_id = _text(pci.busId) if pci is not None else ""
            mem = self._call(dev, "nvmlDeviceGetMemoryInfo_v2", _memory_info)
            dev.memory_total = int(mem.total) if mem is not None else 0
            arch = self._call(dev, "nvmlDeviceGetArchitecture", N.nvmlDeviceGetArchitecture)
            dev.architecture = _ARCHITECTURES.get(arch, "unknown")
            gen = self._call(dev, "nvmlDeviceGetMaxPcieLinkGeneration", N.nvmlDeviceGetMaxPcieLinkGeneration)
            width = self._call(dev, "nvmlDeviceGetMaxPcieLinkWidth", N.nvmlDeviceGetMaxPcieLinkWidth)
            dev.pcie_gen_max, dev.pcie_width_max = gen, width
            support = self._call(dev, "nvmlGpmQueryDeviceSupport", N.nvmlGpmQueryDeviceSupport)
            dev.gpm_supported = bool(support is not None and support.isSupportedDevice)
            if dev.gpm_supported:
                dev.gpm_buffers = [N.nvmlGpmSampleAlloc(), N.nvmlGpmSampleAlloc()]
        except _GpuLost:
            self._mark_lost(dev)
        return dev

    # --- sampling ----------------------------------------------------------------------------------
    def sample(self) -> Tick:
        """One tick: the fast tier and GPM for every live GPU, plus the slow tier when it is due."""
        now = self.clock()
        slow = self._next_slow is None or now >= self._next_slow
        if slow:
            self._next_slow = now + self.slow_interval
        rows: dict[int, dict[str, float]] = {}
        for dev in self.devices:
            if dev.lost:
                continue
            values: dict[str, float] = {}
            try:
                self._fast(dev, values)
                if dev.gpm_supported:
                    self._gpm(dev, now, values)
                if slow:
                    self._slow(dev, values)
            except _GpuLost:
                self._mark_lost(dev)
                continue
            rows[dev.index] = values
        events, self._pending_events = self._pending_events, []
        return Tick(rows, events, slow)

    def running_pids(self) -> dict[int, list[int]]:
        """PIDs of the compute processes on each live GPU (for job discovery, on the slow cadence)."""
        return {gpu: [p.pid for p in procs] for gpu, procs in self.running_processes(utilization=False).items()}

    def running_processes(self, utilization: bool = True) -> dict[int, list[GpuProcess]]:
        """The compute processes on each live GPU with their memory and, with ``utilization``, their SM and
        memory utilisation since the previous call (``nvmlDeviceGetProcessUtilization``: the mean of the
        samples NVML kept since then; None where it has none or does not support it)."""
        out: dict[int, list[GpuProcess]] = {}
        for dev in self.devices:
            if dev.lost:
                continue
            try:
                procs = self._call(dev, "nvmlDeviceGetComputeRunningProcesses", N.nvmlDeviceGetComputeRunningProcesses)
                samples = self._process_samples(dev) if utilization and procs else {}
            except _GpuLost:
                self._mark_lost(dev)
                continue
            out[dev.index] = [GpuProcess(p.pid, int(p.usedGpuMemory or 0), *samples.get(p.pid, (None, None)))
                              for p in procs or ()]
        return out

    def _process_samples(self, dev: GpuDevice) -> dict[int, tuple[float, float]]:
        """PID -> (SM, memory) utilisation as ratios, averaged over NVML's samples newer than the last read."""
        samples = self._call(dev, "nvmlDeviceGetProcessUtilization", N.nvmlDeviceGetProcessUtilization,
                             dev.process_seen_us)
        sums: dict[int, list[float]] = {}
        for sample in samples or ():
            acc = sums.setdefault(int(sample.pid), [0.0, 0.0, 0.0])
            acc[0] += sample.smUtil
            acc[1] += sample.memUtil
            acc[2] += 1
            dev.process_seen_us = max(dev.process_seen_us, int(sample.timeStamp))
        return {pid: (sm / n / 100.0, mem / n / 100.0) for pid, (sm, mem, n) in sums.items()}

    def mig_parents(self) -> dict[str, int]:
        """MIG instance UUID -> its GPU's index, so a pod holding a MIG instance is matched to the GPU."""
        return {uuid: dev.index for dev, _, uuid in mig_devices(self.devices)}

    def _fast(self, dev: GpuDevice, out: dict[str, float]) -> None:
        util = self._call(dev, "nvmlDeviceGetUtilizationRates", N.nvmlDeviceGetUtilizationRates)
        if util is not None:
            out["gpu_utilization_ratio"] = util.gpu / 100.0
            out["gpu_memory_utilization_ratio"] = util.memory / 100.0
        mem = self._call(dev, "nvmlDeviceGetMemoryInfo_v2", _memory_info)
        if mem is not None:
            out["gpu_memory_used_bytes"] = float(mem.used)
            out["gpu_memory_total_bytes"] = float(mem.total)
        self._put(out, "gpu_temperature_celsius", 1.0,
                  self._call(dev, "nvmlDeviceGetTemperatureV", N.nvmlDeviceGetTemperatureV, N.NVML_TEMPERATURE_GPU))
        self._put(out, "gpu_power_watts", 1e-3, self._call(dev, "nvmlDeviceGetPowerUsage", N.nvmlDeviceGetPowerUsage))
        self._put(out, "gpu_sm_clock_hertz", 1e6,
                  self._call(dev, "nvmlDeviceGetClockInfo(SM)", N.nvmlDeviceGetClockInfo, N.NVML_CLOCK_SM))
        self._put(out, "gpu_memory_clock_hertz", 1e6,
                  self._call(dev, "nvmlDeviceGetClockInfo(MEM)", N.nvmlDeviceGetClockInfo, N.NVML_CLOCK_MEM))
        self._put(out, "gpu_clock_event_reasons", 1.0,
                  self._call(dev, "nvmlDeviceGetCurrentClocksEventReasons", N.nvmlDeviceGetCurrentClocksEventReasons))
        dev.fast_fields = self._field_values(dev, dev.fast_fields, out)

    def _slow(self, dev: GpuDevice, out: dict[str, float]) -> None:
        dev.slow_fields = self._field_values(dev, dev.slow_fields, out)
        remap = self._call(dev, "nvmlDeviceGetRemappedRows", N.nvmlDeviceGetRemappedRows)
        if remap is not None:
            names = ("gpu_remapped_rows_correctable", "gpu_remapped_rows_uncorrectable",
                     "gpu_remapped_rows_pending", "gpu_remapped_rows_failure")
            out.update(zip(names, map(float, remap)))
        self._put(out, "gpu_pcie_link_gen", 1.0,
                  self._call(dev, "nvmlDeviceGetCurrPcieLinkGeneration", N.nvmlDeviceGetCurrPcieLinkGeneration))
        self._put(out, "gpu_pcie_link_width", 1.0,
                  self._call(dev, "nvmlDeviceGetCurrPcieLinkWidth", N.nvmlDeviceGetCurrPcieLinkWidth))
        self._put(out, "gpu_pcie_link_gen_max", 1.0, dev.pcie_gen_max)
        self._put(out, "gpu_pcie_link_width_max", 1.0, dev.pcie_width_max)

    def _gpm(self, dev: GpuDevice, now: float, out: dict[str, float]) -> None:
        """Take a GPM sample into the older buffer and turn the last two samples into metrics."""
        if dev.gpm_last_s is not None and now - dev.gpm_last_s < GPM_MIN_SPACING_S:
            return
        newer, older = dev.gpm_buffers
        if self._call(dev, "nvmlGpmSampleGet", N.nvmlGpmSampleGet, older) is None:
            return
        first = dev.gpm_last_s is None
        dev.gpm_last_s = now
        dev.gpm_buffers = [older, newer]  # the buffer just filled is now the newer one
        if first or not dev.gpm_metrics:
            return
        request = N.c_nvmlGpmMetricsGet_t()
        request.version = N.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(dev.gpm_metrics)
        request.sample1, request.sample2 = newer, older
        for slot, (metric_id, _, _) in zip(request.metrics, dev.gpm_metrics):
            slot.metricId = metric_id
        if self._call(dev, "nvmlGpmMetricsGet", lambda _h: N.nvmlGpmMetricsGet(request)) is None:
            return
        keep = []
        for slot, spec in zip(request.metrics, dev.gpm_metrics):
            metric_id, name, scale = spec
            if slot.nvmlReturn == N.NVML_SUCCESS:
                out[name] = max(0.0, slot.value) * scale
                keep.append(spec)
            elif slot.nvmlReturn in (N.NVML_ERROR_NOT_SUPPORTED, N.NVML_ERROR_NO_PERMISSION):
                self._mark_unsupported(dev, f"GPM metric {metric_id}", name, N.NVMLError(slot.nvmlReturn))
            else:
                keep.append(spec)
        dev.gpm_metrics = keep

    def _field_values(self, dev: GpuDevice, specs: list[FieldSpec], out: dict[str, float]) -> list[FieldSpec]:
        """Read ``specs`` in one nvmlDeviceGetFieldValues; returns the specs still worth asking for."""
        if not specs:
            return specs
        ids = [fid if scope is None else (fid, scope) for fid, scope, _, _ in specs]
        values = self._call(dev, "nvmlDeviceGetFieldValues", N.nvmlDeviceGetFieldValues, ids)
        if values is None:
            return specs if "nvmlDeviceGetFieldValues" not in dev.unsupported else []
        keep = []
        for spec, value in zip(specs, values):
            fid, _, name, scale = spec
            rc = value.nvmlReturn
            if rc == N.NVML_SUCCESS:
                member = _VALUE_MEMBER.get(value.valueType)
                if member is not None:
                    out[name] = float(getattr(value.value, member)) * scale
                keep.append(spec)
            elif rc == N.NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost()
            elif rc in (N.NVML_ERROR_NOT_SUPPORTED, N.NVML_ERROR_NO_PERMISSION):
                self._mark_unsupported(dev, f"field {fid}", name, N.NVMLError(rc))
            else:
                keep.append(spec)
        return keep

    # --- capability cache and faults ---------------------------------------------------------------
    def _call(self, dev: GpuDevice, key: str, fn: Callable, *args):
        """``fn(handle, *args)``, or None when unsupported (recorded once) or failing this time."""
        if key in dev.unsupported:
            return None
        try:
            return fn(dev.handle, *args)
        except N.NVMLError_GpuIsLost as exc:
            raise _GpuLost() from exc
        except _UNSUPPORTED as exc:
            self._mark_unsupported(dev, key, key, exc)
        except N.NVMLError as exc:
            log.debug("GPU %d: %s failed this tick: %s", dev.index, key, exc)
        return None

    def _mark_unsupported(self, dev: GpuDevice, key: str, what: str, exc: Exception) -> None:
        dev.unsupported.add(key)
        self._pending_events.append(Event(
            ev.FIELD_UNSUPPORTED, gpu_index=dev.index, code=getattr(exc, "value", 0),
            message=f"GPU {dev.index}: {key} ({what}): {exc}; not polled again",
            attrs={"nvml": key, "field": what},
        ))

    def _mark_lost(self, dev: GpuDevice) -> None:
        dev.lost = True
        self._pending_events.append(Event(ev.GPU_LOST, gpu_index=dev.index, code=N.NVML_ERROR_GPU_IS_LOST,
                                          message=f"GPU {dev.index} ({dev.uuid or 'unknown uuid'}) is lost "
                                                  "(off the bus); no longer sampled",
                                          attrs={"uuid": dev.uuid, "pci_bus_id": dev.pci_bus_id}))

    @staticmethod
    def _put(out: dict[str, float], name: str, scale: float, value: float | None) -> None:
        if value is not None:
            out[name] = float(value) * scale


def _memory_info(handle):
    return N.nvmlDeviceGetMemoryInfo(handle, version=N.nvmlMemory_v2)


def mig_devices(devices: Iterable[GpuDevice]) -> Iterator[tuple[GpuDevice, object, str]]:
    """Every MIG instance of ``devices`` that still answer: (its GPU, its NVML handle, its UUID)."""
    for dev in devices:
        if dev.lost:
            continue
        try:
            count = N.nvmlDeviceGetMaxMigDeviceCount(dev.handle)
        except N.NVMLError:  # no MIG on this GPU or driver
            continue
        for i in range(count):
            try:
                handle = N.nvmlDeviceGetMigDeviceHandleByIndex(dev.handle, i)
                uuid = _text(N.nvmlDeviceGetUUID(handle))
            except N.NVMLError:  # an empty slot
                continue
            yield dev, handle, uuid


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _quietly(fn: Callable, *args) -> None:
    try:
        fn(*args)
    except N.NVMLError as exc:
        log.debug("%s: %s", getattr(fn, "__name__", fn), exc)

