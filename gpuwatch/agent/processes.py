"""Per-process GPU use rolled up per owner: the cure for time-slicing's "every pod shows the same number".

Several pods sharing one GPU (time-slicing, MPS) all see the GPU's utilisation and power. NVML knows better per
process: ``nvmlDeviceGetProcessUtilization`` gives each process's SM and memory utilisation, and the running
compute processes their memory. On the slow cadence the daemon reads both (:meth:`NvmlSampler.running_processes
<gpuwatch.agent.nvml.NvmlSampler.running_processes>`), finds each process's owner (its pod among the pods the
kubelet says hold the GPU, its job from its environment or cgroup) and sends one ``gpu_processes`` event per GPU
with the processes summed per owner. PIDs stay on the node: no per-PID series, no PID in the event.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gpuwatch.agent.jobs import EnvironReader, JobInfo
from gpuwatch.agent.kubelet import PodOwner
from gpuwatch.agent.nvml import GpuProcess
from gpuwatch.core import events as ev
from gpuwatch.core.events import Event

#: Owners listed per GPU and event at most (the busiest); the event's attribute stays under the batch's text cap.
MAX_OWNERS = 16
#: Seconds between the events of a GPU several owners share, and of any other GPU (whose owners did not change).
SHARED_EVERY_S = 60.0
SINGLE_EVERY_S = 240.0
#: Kubernetes sets a container's hostname, and so this variable, to its pod's name.
POD_NAME_VARIABLE = "HOSTNAME"


@dataclass
class OwnerUse:
    """The processes of one owner on one GPU, summed: SM and memory utilisation ratios of the whole GPU
    (None: NVML gave no sample for any of them), memory in bytes."""

    namespace: str = ""
    pod: str = ""
    container: str = ""
    job_id: str = ""
    user: str = ""
    sm_util: float | None = None
    mem_util: float | None = None
    memory_bytes: int = 0
    processes: int = 0

    def key(self) -> tuple[str, str, str, str, str]:
        return self.namespace, self.pod, self.container, self.job_id, self.user

    def add(self, proc: GpuProcess) -> None:
        self.processes += 1
        self.memory_bytes += proc.used_memory
        if proc.sm_util is not None:
            self.sm_util = (self.sm_util or 0.0) + proc.sm_util
        if proc.mem_util is not None:
            self.mem_util = (self.mem_util or 0.0) + proc.mem_util

    def as_dict(self) -> dict[str, object]:
        rounded = {k: None if v is None else round(min(1.0, v), 4)
                   for k, v in (("sm_util", self.sm_util), ("mem_util", self.mem_util))}
        return {"namespace": self.namespace, "pod": self.pod, "container": self.container, "job_id": self.job_id,
                "user": self.user, **rounded, "memory_bytes": self.memory_bytes, "processes": self.processes}


def pod_of(environ: Mapping[str, str] | None, holders: Sequence[PodOwner]) -> PodOwner | None:
    """The pod a process runs in, among the pods holding its GPU: the only one, or the one its hostname names
    (None: no pod holds the GPU, or the process cannot be told apart, e.g. its environment is unreadable)."""
    if len(holders) == 1:
        return holders[0]
    name = (environ or {}).get(POD_NAME_VARIABLE, "")
    matches = [h for h in holders if h.pod == name] if name else []
    return matches[0] if matches else None


def rollup(processes: Sequence[GpuProcess], holders: Sequence[PodOwner], job_of: Mapping[int, JobInfo],
           environ_reader: EnvironReader) -> list[OwnerUse]:
    """One GPU's processes summed per owner, busiest first."""
    owners: dict[tuple[str, str, str, str, str], OwnerUse] = {}
    for proc in processes:
        job = job_of.get(proc.pid)
        pod = pod_of(environ_reader(proc.pid) if len(holders) > 1 else None, holders)
        use = OwnerUse(pod.namespace if pod else "", pod.pod if pod else "", pod.container if pod else "",
                       job.job_id if job else "", job.user if job else "")
        owners.setdefault(use.key(), use).add(proc)
    return sorted(owners.values(), key=lambda u: (-(u.sm_util or 0.0), -u.memory_bytes, u.key()))


class EventPacing:
    """When a GPU's next per-tick event (``gpu_processes``, ``mig_instances``) is due, so they cost a few rows
    per GPU and hour, not one per slow tick: a GPU shared by several owners (whose split needs its numbers) every
    ``shared_s``, any other every ``single_s`` (under the collector's PROCESS_STALE_S), and whenever its owners
    (or which of their values are known) change.
    """

    def __init__(self, clock: Callable[[], float], shared_s: float = SHARED_EVERY_S,
                 single_s: float = SINGLE_EVERY_S) -> None:
        self.clock, self.shared_s, self.single_s = clock, shared_s, single_s
        self._last: dict[int, tuple[float, tuple]] = {}

    def due(self, gpu: int, owners: tuple, shared: bool) -> bool:
        now = self.clock()
        last = self._last.get(gpu)
        every = self.shared_s if shared else self.single_s
        if last is not None and last[1] == owners and now - last[0] < every:
            return False
        self._last[gpu] = (now, owners)
        return True


def process_events(by_gpu: Mapping[int, Sequence[OwnerUse]], pacing: EventPacing | None = None) -> list[Event]:
    """One ``gpu_processes`` event per GPU with processes whose event is due (at most MAX_OWNERS owners, the
    busiest)."""
    out = []
    for gpu, uses in sorted(by_gpu.items()):
        if not uses:
            continue
        owners = tuple(sorted((*u.key(), u.sm_util is None) for u in uses))  # a first sample is news too
        if pacing is not None and not pacing.due(gpu, owners, len(uses) > 1):
            continue
        listed = [u.as_dict() for u in uses[:MAX_OWNERS]]
        attrs = {"owners": json.dumps(listed, separators=(",", ":"))}
        if len(uses) > MAX_OWNERS:
            attrs["more_owners"] = str(len(uses) - MAX_OWNERS)
        out.append(Event(ev.GPU_PROCESSES, gpu_index=gpu, attrs=attrs,
                         message=f"GPU {gpu}: {sum(u.processes for u in uses)} processes of {len(uses)} owners"))
    return out
