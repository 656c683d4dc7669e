"""Which pod, namespace and container hold each GPU: the kubelet's pod-resources API over its unix socket.

The kubelet answers ``v1.PodResourcesLister/List`` with every pod's containers and the device ids the device
plugins gave them. NVIDIA's device plugin hands out GPU UUIDs (``GPU-...``, resource ``nvidia.com/gpu``) or MIG
UUIDs (``MIG-...``, resources ``nvidia.com/mig-<profile>``); with time-slicing it hands out replicas named
``<uuid>::<n>``, and with ``deviceIDStrategy=index`` the GPU's index. This module only reads that answer into a
device id -> owner map; matching ids to the agent's GPUs is :mod:`gpuwatch.agent.owners`' job.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import grpc

from gpuwatch.v1 import podresources_pb2 as pr
from gpuwatch.v1 import podresources_pb2_grpc as pr_grpc

DEFAULT_KUBELET_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
#: Resource names whose devices are NVIDIA GPUs or MIG instances.
GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
#: The device plugin's separator between a device id and its time-slicing replica number.
REPLICA_SEPARATOR = "::"


@dataclass(frozen=True)
class PodOwner:
    """The container a device is allocated to."""

    namespace: str
    pod: str
    container: str


class KubeletUnavailable(Exception):
    """The pod-resources socket is missing or the kubelet did not answer; the message says which and why."""


def is_gpu_resource(resource_name: str) -> bool:
    return resource_name == GPU_RESOURCE or resource_name.startswith(MIG_RESOURCE_PREFIX)


def device_holders(pods: list[pr.PodResources]) -> dict[str, list[PodOwner]]:
    """Device id (replica suffix removed) -> every container holding it (several under time-slicing), by
    namespace and pod name, for the GPU and MIG resources."""
    holders: dict[str, list[PodOwner]] = {}
    for pod in sorted(pods, key=lambda p: (p.namespace, p.name)):
        for container in pod.containers:
            for devices in container.devices:
                if not is_gpu_resource(devices.resource_name):
                    continue
                for device_id in devices.device_ids:
                    base = device_id.split(REPLICA_SEPARATOR, 1)[0]
                    owner = PodOwner(pod.namespace, pod.name, container.name)
                    if owner not in holders.setdefault(base, []):
                        holders[base].append(owner)
    return holders


def device_owners(pods: list[pr.PodResources]) -> dict[str, PodOwner]:
    """Device id (replica suffix removed) -> the first container holding it, for the GPU and MIG resources."""
    return {device: owners[0] for device, owners in device_holders(pods).items()}


class PodResourcesClient:
    """A gRPC client of the kubelet's pod-resources socket (read-only; the DaemonSet mounts it so)."""

    def __init__(self, socket_path: str, timeout_s: float = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None
        self._stub: pr_grpc.PodResourcesListerStub | None = None

    def _lister(self) -> pr_grpc.PodResourcesListerStub:
        if not os.path.exists(self.socket_path):
            self.close()  # a kubelet restart makes a new socket: reconnect when it is back
            raise KubeletUnavailable(f"kubelet pod-resources socket {self.socket_path} does not exist")
        if self._stub is None:
            self._channel = grpc.insecure_channel(f"unix://{os.path.abspath(self.socket_path)}")
            self._stub = pr_grpc.PodResourcesListerStub(self._channel)
        return self._stub

    def list_devices(self) -> dict[str, PodOwner]:
        """Every GPU/MIG device id the kubelet has allocated -> its (first) owner (``List``)."""
        return {device: owners[0] for device, owners in self.list_holders().items()}

    def list_holders(self) -> dict[str, list[PodOwner]]:
        """Every GPU/MIG device id the kubelet has allocated -> all its holders (``List``)."""
        try:
            reply = self._lister().List(pr.ListPodResourcesRequest(), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            self.close()
            raise KubeletUnavailable(f"kubelet pod-resources socket {self.socket_path}: {_rpc_error(exc)}") from None
        return device_holders(list(reply.pod_resources))

    def pod_devices(self, namespace: str, pod: str) -> dict[str, PodOwner]:
        """One pod's GPU/MIG device ids -> owner (``Get``), e.g. to confirm a pod named elsewhere."""
        try:
            reply = self._lister().Get(pr.GetPodResourcesRequest(pod_name=pod, pod_namespace=namespace),
                                       timeout=self.timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return {}
            self.close()
            raise KubeletUnavailable(f"kubelet pod-resources socket {self.socket_path}: {_rpc_error(exc)}") from None
        return device_owners([reply.pod_resources])

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None


def _rpc_error(exc: grpc.RpcError) -> str:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else None
    return f"{code.name if code else 'error'}: {details or exc}"
