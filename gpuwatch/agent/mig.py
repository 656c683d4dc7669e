"""MIG instances as devices of their own: memory (the instance's MIG handle) and GPM metrics per instance
(``nvmlGpmMigSampleGet``), on the slow cadence, each attributed to the pod holding it like a whole GPU.

A MIG instance's ratios are of its own slice (an instance at full SM activity reads 1.0 however small it is), and
its memory total is its slice of the GPU's; the collector weighs each instance's minute by that slice
(:func:`gpuwatch.collector.owners.usage`). The instances are found again on every slow tick, so a GPU
repartitioned while the agent runs is followed; their GPM buffers are freed when they disappear.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import pynvml as N

from gpuwatch.agent.kubelet import PodOwner
from gpuwatch.agent.nvml import GPM_MIN_SPACING_S, GpuDevice, mig_devices
from gpuwatch.agent.processes import EventPacing
from gpuwatch.core import events as ev
from gpuwatch.core.events import Event

log = logging.getLogger(__name__)

#: The GPM metrics that mean something per instance: activity ratios (PCIe and NVLink are the GPU's).
MIG_GPM_METRICS: tuple[tuple[int, str], ...] = (
    (N.NVML_GPM_METRIC_SM_UTIL, "sm_active"),
    (N.NVML_GPM_METRIC_SM_OCCUPANCY, "sm_occupancy"),
    (N.NVML_GPM_METRIC_ANY_TENSOR_UTIL, "tensor_active"),
    (N.NVML_GPM_METRIC_DRAM_BW_UTIL, "dram_active"),
)


@dataclass
class MigInstance:
    uuid: str
    gpu_index: int
    gpu_instance_id: int
    handle: object
    buffers: list = field(default_factory=list)  # [newer, older] GPM sample buffers
    last_s: float | None = None


class MigSampler:
    """Every MIG instance of the node's GPUs: refreshed, then sampled, on each slow tick."""

    def __init__(self, devices: Sequence[GpuDevice], clock: Callable[[], float]) -> None:
        self.devices = devices
        self.clock = clock
        self.instances: dict[str, MigInstance] = {}

    def refresh(self) -> None:
        found: dict[str, MigInstance] = {}
        for dev, handle, uuid in mig_devices(self.devices):
            known = self.instances.get(uuid)
            if known is not None:
                found[uuid] = known
                continue
            try:
                found[uuid] = MigInstance(uuid, dev.index, N.nvmlDeviceGetGpuInstanceId(handle), handle)
            except N.NVMLError:  # gone between the two calls
                continue
        for uuid, gone in self.instances.items():
            if uuid not in found:
                _free(gone)
        self.instances = found

    def sample(self) -> dict[str, dict[str, float]]:
        """MIG UUID -> its values: memory_used_bytes, memory_total_bytes and, where the GPU has GPM, the
        activity ratios of :data:`MIG_GPM_METRICS` since the previous slow tick."""
        gpm = {dev.index: dev for dev in self.devices if dev.gpm_supported and not dev.lost}
        out: dict[str, dict[str, float]] = {}
        for inst in self.instances.values():
            values: dict[str, float] = {}
            try:
                mem = N.nvmlDeviceGetMemoryInfo(inst.handle, N.nvmlMemory_v2)
                values.update(memory_used_bytes=float(mem.used), memory_total_bytes=float(mem.total))
            except N.NVMLError as exc:
                log.debug("MIG %s: memory: %s", inst.uuid, exc)
            parent = gpm.get(inst.gpu_index)
            if parent is not None:
                values.update(self._gpm(inst, parent))
            out[inst.uuid] = values
        return out

    def _gpm(self, inst: MigInstance, parent: GpuDevice) -> dict[str, float]:
        now = self.clock()
        if inst.last_s is not None and now - inst.last_s < GPM_MIN_SPACING_S:
            return {}
        try:
            if not inst.buffers:
                inst.buffers = [N.nvmlGpmSampleAlloc(), N.nvmlGpmSampleAlloc()]
            newer, older = inst.buffers
            N.nvmlGpmMigSampleGet(parent.handle, inst.gpu_instance_id, older)
        except N.NVMLError as exc:
            log.debug("MIG %s: GPM sample: %s", inst.uuid, exc)
            return {}
        first, inst.last_s = inst.last_s is None, now
        inst.buffers = [older, newer]
        if first:
            return {}
        request = N.c_nvmlGpmMetricsGet_t()
        request.version = N.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(MIG_GPM_METRICS)
        request.sample1, request.sample2 = newer, older
        for slot, (metric_id, _) in zip(request.metrics, MIG_GPM_METRICS):
            slot.metricId = metric_id
        try:
            N.nvmlGpmMetricsGet(request)
        except N.NVMLError as exc:
            log.debug("MIG %s: GPM metrics: %s", inst.uuid, exc)
            return {}
        return {name: min(1.0, max(0.0, slot.value / 100.0))
                for slot, (_, name) in zip(request.metrics, MIG_GPM_METRICS) if slot.nvmlReturn == N.NVML_SUCCESS}

    def close(self) -> None:
        for inst in self.instances.values():
            _free(inst)
        self.instances = {}


def _free(inst: MigInstance) -> None:
    for buf in inst.buffers:
        try:
            N.nvmlGpmSampleFree(buf)
        except N.NVMLError:
            pass
    inst.buffers = []


def mig_events(instances: Mapping[str, MigInstance], values: Mapping[str, Mapping[str, float]],
               holders: Mapping[str, Sequence[PodOwner]], pacing: EventPacing | None = None) -> list[Event]:
    """One ``mig_instances`` event per GPU in MIG mode whose event is due: each instance's values and the pod
    holding it (a MIG GPU counts as shared: the collector divides it among its instances)."""
    by_gpu: dict[int, list[dict[str, object]]] = {}
    for uuid, inst in sorted(instances.items(), key=lambda kv: (kv[1].gpu_index, kv[1].gpu_instance_id)):
        pods = holders.get(uuid, ())
        pod = pods[0] if pods else None
        by_gpu.setdefault(inst.gpu_index, []).append({
            "uuid": uuid, "gpu_instance_id": inst.gpu_instance_id, "namespace": pod.namespace if pod else "",
            "pod": pod.pod if pod else "", "container": pod.container if pod else "",
            **{k: round(v, 4) if k.endswith(("active", "occupancy")) else int(v)
               for k, v in values.get(uuid, {}).items()}})
    return [Event(ev.MIG_INSTANCES, gpu_index=gpu, message=f"GPU {gpu}: {len(listed)} MIG instances",
                  attrs={"instances": json.dumps(listed, separators=(",", ":"))})
            for gpu, listed in sorted(by_gpu.items())
            if pacing is None or pacing.due(gpu, tuple((i["uuid"], i["pod"], "sm_active" in i) for i in listed), True)]
