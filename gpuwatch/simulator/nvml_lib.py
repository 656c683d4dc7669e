"""The fake NVML library: a pure-Python stand-in for libnvidia-ml.so that pynvml calls as if it were the C one.

:meth:`FakeNvmlLib.install` replaces ``pynvml.nvmlLib`` with this object, whose attributes carry the C symbol
names. Each fake function writes its results through the ctypes ``byref``/pointer arguments pynvml passes and
returns an ``NVML_ERROR_*`` code, so pynvml's real marshalling and error translation run unchanged and the
agent above cannot tell it from a node with GPUs. The library owns what NVML hands out (device handles, event
sets, GPM sample buffers); the values come from the :class:`~gpuwatch.simulator.gpu.SimGpu` state of the
fleet it serves, brought up to the fleet's clock (and its scripted faults driven) on every call.
"""
from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pynvml as N

from gpuwatch.simulator.gpu import SimGpu

if TYPE_CHECKING:
    from gpuwatch.simulator.fleet import SimulatedFleet

_VOID_P = ctypes.c_void_p
_HANDLE_BASE = 0x5A000000
_EVENT_SET_BASE = 0x5B000000
_GPM_SAMPLE_BASE = 0x5C000000
_MIG_HANDLE_BASE = 0x5D000000  # + 0x100 * GPU index + instance
_ALL_LINKS = 0xFFFFFFFF


@dataclass
class _EventSet:
    registered: dict[int, int] = field(default_factory=dict)  # gpu index -> event type mask
    queue: deque = field(default_factory=deque)  # (gpu index, event type, event data)


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


class FakeNvmlLib:
    """Attributes named like NVML's C symbols; each writes through its pointer args and returns a code."""

    def __init__(self, fleet: SimulatedFleet) -> None:
        self._fleet = fleet
        self._initialized = False
        self._lock = threading.Condition()  # guards the handles below; event-set waiters sleep on it
        self._event_sets: dict[int, _EventSet] = {}
        # address -> (GPU index, or (GPU index, MIG instance), sampled at, counters); None until sampled
        self._gpm_samples: dict[int, tuple[int | tuple[int, int], float, dict[str, float]] | None] = {}
        self._next_address = itertools.count(1)  # fake addresses for event sets and GPM buffers
        self._saved: tuple | None = None  # what install() replaced in pynvml

    # --- installing beneath pynvml -----------------------------------------------------------------
    def install(self) -> FakeNvmlLib:
        """Make pynvml call this library instead of libnvidia-ml.so."""
        self._saved = (N.nvmlLib, N._LoadNvmlLibrary)
        N.nvmlLib = self
        N._LoadNvmlLibrary = lambda: None
        N._nvmlGetFunctionPointer_cache.clear()
        return self

    def uninstall(self) -> None:
        """Give pynvml its library back and wake the threads waiting on an event set (they time out)."""
        if self._saved is None:
            return
        N.nvmlLib, N._LoadNvmlLibrary = self._saved
        N._nvmlGetFunctionPointer_cache.clear()
        with self._lock:
            self._saved = None
            self._lock.notify_all()

    def deliver(self, gpu: int, event_type: int, data: int) -> None:
        """Queue an event for every event set registered for it on ``gpu`` (what the driver does)."""
        with self._lock:
            for es in self._event_sets.values():
                if es.registered.get(gpu, 0) & event_type:
                    es.queue.append((gpu, event_type, data))
            self._lock.notify_all()

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
        self._fleet.apply_faults(index)
        if gpu.lost:
            return None, N.NVML_ERROR_GPU_IS_LOST
        if symbol in gpu.unsupported:
            return None, N.NVML_ERROR_NOT_SUPPORTED
        gpu.advance(self._fleet.clock())
        return gpu, N.NVML_SUCCESS

    def _mig(self, handle, symbol: str) -> tuple[SimGpu | None, int, int]:
        """The parent GPU and instance slot behind a MIG handle (its state advanced), or an error code."""
        parent, instance = divmod(_address(handle) - _MIG_HANDLE_BASE, 0x100)
        gpu, rc = self._gpu(_VOID_P(_HANDLE_BASE + 0x100 * parent), symbol)
        if gpu is not None and not 0 <= instance < len(gpu.mig_uuids):
            return None, -1, N.NVML_ERROR_INVALID_ARGUMENT
        return gpu, instance, rc

    def _scalar(self, handle, out, symbol: str, getter: Callable[[SimGpu], float]) -> int:
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
        if _address(handle) >= _MIG_HANDLE_BASE:  # a MIG instance's handle
            mig, instance, rc = self._mig(handle, "nvmlDeviceGetUUID")
            return rc if mig is None else _write_string(buf, length, mig.mig_uuids[instance])
        gpu, rc = self._gpu(handle, "nvmlDeviceGetUUID")
        return rc if gpu is None else _write_string(buf, length, gpu.uuid)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle, out) -> int:
        """MIG-capable models in MIG mode report their instance slots (7 on A100/H100); others NOT_SUPPORTED."""
        gpu, rc = self._gpu(handle, "nvmlDeviceGetMaxMigDeviceCount")
        if gpu is None:
            return rc
        if not gpu.mig_uuids:
            return N.NVML_ERROR_NOT_SUPPORTED
        _out(out).value = max(7, len(gpu.mig_uuids))
        return N.NVML_SUCCESS

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, index, out) -> int:
        gpu, rc = self._gpu(handle, "nvmlDeviceGetMigDeviceHandleByIndex")
        if gpu is None:
            return rc
        i = index.value
        if not 0 <= i < len(gpu.mig_uuids):
            return N.NVML_ERROR_NOT_FOUND  # an empty slot
        _write_pointer(out, _MIG_HANDLE_BASE + 0x100 * gpu.index + i)
        return N.NVML_SUCCESS

    def nvmlDeviceGetGpuInstanceId(self, handle, out) -> int:
        """A MIG handle's GPU instance id (its slot here); a whole GPU's is INVALID_ARGUMENT, as NVML."""
        if _address(handle) < _MIG_HANDLE_BASE:
            return N.NVML_ERROR_INVALID_ARGUMENT
        gpu, instance, rc = self._mig(handle, "nvmlDeviceGetGpuInstanceId")
        if gpu is not None:
            _out(out).value = instance
        return rc

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
        mem = _out(out)
        if _address(handle) >= _MIG_HANDLE_BASE:  # an instance: an even slice of the memory, used by its load
            mig, instance, rc = self._mig(handle, "nvmlDeviceGetMemoryInfo_v2")
            if mig is not None:
                slices = len(mig.mig_uuids)
                mem.total, mem.reserved = mig.model.memory_bytes // slices, 0
                mem.used = min(mem.total, int(mig.memory_used * mig.mig_loads[instance]) // slices)
                mem.free = mem.total - mem.used
            return rc
        gpu, rc = self._gpu(handle, "nvmlDeviceGetMemoryInfo_v2")
        if gpu is not None:
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

    def nvmlDeviceGetProcessUtilization(self, handle, samples, count, last_seen) -> int:
        """One sample per process, newer than ``last_seen`` (µs); NOT_FOUND when there is none, as NVML."""
        gpu, rc = self._gpu(handle, "nvmlDeviceGetProcessUtilization")
        if gpu is None:
            return rc
        now_us = int(self._fleet.clock() * 1e6)
        procs = gpu.processes if now_us > _out(last_seen).value else []
        c_count = _out(count)
        if not procs:
            c_count.value = 0
            return N.NVML_ERROR_NOT_FOUND
        if samples is None or c_count.value < len(procs):
            c_count.value = len(procs)
            return N.NVML_ERROR_INSUFFICIENT_SIZE
        for slot, proc in zip(samples, procs):
            slot.pid, slot.timeStamp = proc.pid, now_us
            slot.smUtil = round(100 * gpu.process_sm_util(proc))
            slot.memUtil = round(100 * 0.48 * gpu.process_sm_util(proc))  # the DRAM share advance() uses
            slot.encUtil = slot.decUtil = 0
        c_count.value = len(procs)
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
        with self._lock:
            address = _GPM_SAMPLE_BASE + 0x100 * next(self._next_address)
            self._gpm_samples[address] = None
        _write_pointer(out, address)
        return N.NVML_SUCCESS

    def nvmlGpmSampleFree(self, sample) -> int:
        with self._lock:
            if _address(sample) not in self._gpm_samples:
                return N.NVML_ERROR_INVALID_ARGUMENT
            del self._gpm_samples[_address(sample)]
        return N.NVML_SUCCESS

    def nvmlGpmSampleGet(self, handle, sample) -> int:
        gpu, rc = self._gpu(handle, "nvmlGpmSampleGet")
        address = _address(sample)
        if gpu is not None:
            if address not in self._gpm_samples:
                return N.NVML_ERROR_INVALID_ARGUMENT
            counters = dict(gpu.busy_integrals, pcie_tx_bytes=gpu.pcie_tx_bytes, pcie_rx_bytes=gpu.pcie_rx_bytes,
                            nvlink_tx_bytes=gpu.nvlink_tx_bytes, nvlink_rx_bytes=gpu.nvlink_rx_bytes)
            self._gpm_samples[address] = (gpu.index, self._fleet.clock(), counters)
        return rc

    def nvmlGpmMigSampleGet(self, handle, gpu_instance_id, sample) -> int:
        """A GPM sample of one MIG instance: the GPU's activity integrals scaled by the instance's load (each
        instance's ratios are of its own slice, as NVML's)."""
        gpu, rc = self._gpu(handle, "nvmlGpmMigSampleGet")
        address, instance = _address(sample), int(getattr(gpu_instance_id, "value", gpu_instance_id))
        if gpu is None:
            return rc
        if address not in self._gpm_samples or not 0 <= instance < len(gpu.mig_uuids):
            return N.NVML_ERROR_INVALID_ARGUMENT
        load = gpu.mig_loads[instance]
        counters = {k: v * load for k, v in gpu.busy_integrals.items()}
        counters.update(pcie_tx_bytes=0.0, pcie_rx_bytes=0.0, nvlink_tx_bytes=0.0, nvlink_rx_bytes=0.0)
        self._gpm_samples[address] = ((gpu.index, instance), self._fleet.clock(), counters)
        return rc

    def nvmlGpmMetricsGet(self, out) -> int:
        request = _out(out)
        if request.version != N.NVML_GPM_METRICS_GET_VERSION:
            return N.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        first = self._gpm_samples.get(_address(request.sample1))
        second = self._gpm_samples.get(_address(request.sample2))
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
        with self._lock:
            address = _EVENT_SET_BASE + 0x100 * next(self._next_address)
            self._event_sets[address] = _EventSet()
        _write_pointer(out, address)
        return N.NVML_SUCCESS

    def nvmlDeviceRegisterEvents(self, handle, event_types, event_set) -> int:
        gpu, rc = self._gpu(handle, "nvmlDeviceRegisterEvents")
        es = self._event_sets.get(_address(event_set))
        if gpu is None or es is None:
            return rc if gpu is None else N.NVML_ERROR_INVALID_ARGUMENT
        if event_types.value & ~_SUPPORTED_EVENTS:
            return N.NVML_ERROR_NOT_SUPPORTED
        es.registered[gpu.index] = es.registered.get(gpu.index, 0) | event_types.value
        return N.NVML_SUCCESS

    def nvmlEventSetWait_v2(self, event_set, out, timeout_ms) -> int:
        deadline = time.monotonic() + timeout_ms.value / 1000.0
        with self._lock:
            es = self._event_sets.get(_address(event_set))
            if es is None:
                return N.NVML_ERROR_INVALID_ARGUMENT
            while not es.queue:
                left = deadline - time.monotonic()
                if left <= 0 or self._saved is None:
                    return N.NVML_ERROR_TIMEOUT
                self._lock.wait(left)
            gpu, event_type, data = es.queue.popleft()
        event = _out(out)
        event.device = ctypes.cast(_HANDLE_BASE + 0x100 * gpu, N.c_nvmlDevice_t)
        event.eventType, event.eventData = event_type, data
        event.gpuInstanceId = event.computeInstanceId = 0xFFFFFFFF
        return N.NVML_SUCCESS

    def nvmlEventSetFree(self, event_set) -> int:
        with self._lock:
            return N.NVML_SUCCESS if self._event_sets.pop(_address(event_set), None) else N.NVML_ERROR_INVALID_ARGUMENT


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

