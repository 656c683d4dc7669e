"""Who holds each GPU: the kubelet's pod (when the agent runs in Kubernetes) together with the job and rank
from the processes' environment (:mod:`gpuwatch.agent.jobs`).

Ownership changes rarely, so it travels as data, not as a label on every sample: the daemon refreshes it on the
slow cadence and emits one ``gpu_owner`` event per GPU whose owner changed (every GPU on the first refresh, so
the collector closes what an earlier run left open, and again every ``reannounce_s``, so an owner holding a GPU
longer than the store keeps events is not forgotten). The collector turns those change points into intervals
(GPU, owner, from, to) and joins them at query time. Without the kubelet socket the pod fields stay empty and
the job comes from the process environments alone.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpuwatch.agent.jobs import NO_JOB, JobInfo
from gpuwatch.agent.kubelet import KubeletUnavailable, PodOwner, PodResourcesClient
from gpuwatch.core import events as ev
from gpuwatch.core.events import Event

log = logging.getLogger(__name__)

REANNOUNCE_S = ev.GPU_OWNER_REANNOUNCE_S


@dataclass(frozen=True)
class GpuOwner:
    """A GPU's holder: its pod (Kubernetes) and its job and rank (launcher environment); empty when unknown.
    ``mig`` is the MIG instance's UUID when the pod holds an instance rather than the whole GPU."""

    namespace: str = ""
    pod: str = ""
    container: str = ""
    job_id: str = ""
    rank: int = -1
    mig: str = ""
    user: str = ""

    def attrs(self) -> dict[str, str]:
        return {"namespace": self.namespace, "pod": self.pod, "container": self.container,
                "job_id": self.job_id, "rank": str(self.rank), "mig": self.mig, "user": self.user}


NO_OWNER = GpuOwner()


class OwnerTracker:
    """GPU index -> :class:`GpuOwner`, from the kubelet (if given) and the jobs found in process environments.

    ``uuids`` maps each GPU's index to its UUID; ``mig_parents`` each MIG instance's UUID to its GPU's index.
    Device ids the kubelet gives as plain indices (the device plugin's ``deviceIDStrategy=index``) match too.
    While the kubelet cannot be reached the pods are unknown (never the last answer: a pod may have ended), so
    the owners fall back to the process environments; ``kubelet_error`` says why.
    """

    def __init__(self, uuids: Mapping[int, str], kubelet: PodResourcesClient | None = None,
                 mig_parents: Mapping[str, int] | None = None, *, reannounce_s: float = REANNOUNCE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kubelet = kubelet
        self.reannounce_s = reannounce_s
        self._clock = clock
        self._announced: float | None = None
        self._index_of: dict[str, int] = {uuid: index for index, uuid in uuids.items() if uuid}
        self._index_of.update({str(index): index for index in uuids})
        self.mig_parents = dict(mig_parents or {})  # MIG UUID -> its GPU's index
        self._uuids = dict(uuids)
        self.by_gpu: dict[int, GpuOwner] = {}
        #: GPU index -> every pod holding it (several with time-slicing), from the last refresh
        self.holders: dict[int, list[PodOwner]] = {}
        #: device id (GPU or MIG UUID) -> the pods holding it, from the last refresh
        self.device_holders: dict[str, list[PodOwner]] = {}
        self.kubelet_error: str | None = None

    def owner(self, gpu_index: int) -> GpuOwner:
        return self.by_gpu.get(gpu_index, NO_OWNER)

    def pods(self) -> dict[int, tuple[PodOwner, str]]:
        """GPU index -> (its pod, the MIG UUID or "") from the kubelet; empty without one or when unreachable."""
        self.holders, self.device_holders = {}, {}
        if self.kubelet is None:
            return {}
        try:
            holders = self.kubelet.list_holders()
        except KubeletUnavailable as exc:
            if self.kubelet_error != str(exc):
                log.warning("%s; GPU owners fall back to process environments", exc)
            self.kubelet_error = str(exc)
            return {}
        self.device_holders = holders
        devices = {device: owners[0] for device, owners in holders.items()}
        for device_id, owners in holders.items():
            index = self._index_of.get(device_id, self.mig_parents.get(device_id))
            if index is not None:
                self.holders.setdefault(index, []).extend(o for o in owners if o not in self.holders.get(index, []))
        if self.kubelet_error is not None:
            log.info("kubelet pod-resources socket %s answers again", self.kubelet.socket_path)
        self.kubelet_error = None
        by_gpu: dict[int, tuple[PodOwner, str]] = {}
        for device_id, pod in devices.items():
            if device_id in self._index_of:  # the whole GPU wins over any MIG instance of it
                by_gpu[self._index_of[device_id]] = (pod, "")
        for device_id, pod in devices.items():
            parent = self.mig_parents.get(device_id)
            if parent is not None and parent not in by_gpu:  # several pods on one GPU's instances: the first
                by_gpu[parent] = (pod, device_id)
        return by_gpu

    def refresh(self, jobs: Mapping[int, JobInfo]) -> list[Event]:
        """Recompute every GPU's owner; one ``gpu_owner`` event per GPU whose owner changed."""
        pods = self.pods()
        now = self._clock()
        everything = self._announced is None or now - self._announced >= self.reannounce_s
        if everything:
            self._announced = now
        changed: list[Event] = []
        new: dict[int, GpuOwner] = {}
        for index in sorted(self._uuids):
            job = jobs.get(index, NO_JOB)
            pod, mig = pods.get(index, (None, ""))
            owner = GpuOwner(pod.namespace if pod else "", pod.pod if pod else "", pod.container if pod else "",
                             job.job_id, job.rank, mig, job.user)
            new[index] = owner
            if everything or owner != self.by_gpu.get(index, NO_OWNER):
                who = f"{owner.namespace}/{owner.pod}/{owner.container}" if owner.pod else "no pod"
                changed.append(Event(ev.GPU_OWNER, gpu_index=index,
                                     message=f"GPU {index}: {who}, job {owner.job_id or 'none'} rank {owner.rank}",
                                     attrs={**owner.attrs(), "uuid": self._uuids[index]}))
        self.by_gpu = new
        return changed
