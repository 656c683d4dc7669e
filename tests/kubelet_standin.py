"""A stand-in kubelet for the tests: the real pod-resources service (v1.PodResourcesLister) on a unix socket,
answering from a pod list the test edits while it runs."""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from concurrent import futures
from typing import Any

import grpc

from gpuwatch.v1 import podresources_pb2 as pr
from gpuwatch.v1 import podresources_pb2_grpc as pr_grpc


def pod(namespace: str, name: str, *containers: tuple[str, str, list[str]]) -> pr.PodResources:
    """A pod whose containers are (name, resource name, device ids)."""
    return pr.PodResources(namespace=namespace, name=name, containers=[
        pr.ContainerResources(name=c, devices=[pr.ContainerDevices(resource_name=r, device_ids=ids)])
        for c, r, ids in containers])


class StandInKubelet(pr_grpc.PodResourcesListerServicer):
    """Serves ``pods`` on ``<short temp dir>/kubelet.sock``; ``stop()`` removes the socket like a kubelet restart."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kubelet", dir="/tmp")  # unix socket paths are short
        self.socket = os.path.join(self.dir, "kubelet.sock")
        self.pods: list[pr.PodResources] = []
        self.lists = 0
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None

    def List(self, request: pr.ListPodResourcesRequest, context: Any) -> pr.ListPodResourcesResponse:
        with self._lock:
            self.lists += 1
            return pr.ListPodResourcesResponse(pod_resources=list(self.pods))

    def Get(self, request: pr.GetPodResourcesRequest, context: Any) -> pr.GetPodResourcesResponse:
        with self._lock:
            for p in self.pods:
                if p.name == request.pod_name and p.namespace == request.pod_namespace:
                    return pr.GetPodResourcesResponse(pod_resources=p)
        context.abort(grpc.StatusCode.NOT_FOUND, f"pod {request.pod_namespace}/{request.pod_name} not found")
        raise AssertionError("abort returns no value")

    def set_pods(self, *pods: pr.PodResources) -> None:
        with self._lock:
            self.pods = list(pods)

    def start(self) -> StandInKubelet:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pr_grpc.add_PodResourcesListerServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.socket}")
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(None).wait()
            self._server = None
        if os.path.exists(self.socket):
            os.unlink(self.socket)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> StandInKubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
