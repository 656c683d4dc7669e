"""A minimal in-memory Ingest server: a real gRPC endpoint for agent tests, benchmarks and dry runs.

It validates each batch like the collector (:func:`gpuwatch.core.batches.validate`), refuses bad ones with
INVALID_ARGUMENT, deduplicates by (agent id, sequence) and acknowledges. It stores nothing on disk; the real
collector lives in gpuwatch.collector.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from gpuwatch.core import security
from gpuwatch.core.batches import BatchError, validate
from gpuwatch.v1 import telemetry_pb2 as pb
from gpuwatch.v1 import telemetry_pb2_grpc as pb_grpc


@dataclass
class SinkStore:
    """What a sink received; shared between sink instances to model a collector restart."""

    batches: dict[tuple[str, int], pb.TelemetryBatch] = field(default_factory=dict)
    received: int = 0  # including duplicates
    cond: threading.Condition = field(default_factory=threading.Condition)

    def wait_for(self, predicate: Callable[[SinkStore], bool], timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: predicate(self), timeout)

    def sequences(self, agent_id: str | None = None) -> list[int]:
        with self.cond:
            return sorted(seq for (a, seq) in self.batches if agent_id is None or a == agent_id)


class IngestSink(pb_grpc.IngestServicer):
    """Serve Ingest on ``address`` ("127.0.0.1:0" picks a free port). ``refuse`` may reject a batch."""

    def __init__(self, store: SinkStore | None = None,
                 refuse: Callable[[pb.TelemetryBatch], str | None] | None = None) -> None:
        self.store = store or SinkStore()
        self.refuse = refuse
        self._server: grpc.Server | None = None

    def start(self, address: str = "127.0.0.1:0", *, cert: str | None = None, key: str | None = None,
              client_ca: str | None = None, token: str | None = None) -> int:
        """Serve (TLS with ``cert``/``key``, mutual with ``client_ca``, bearer ``token``); returns the port."""
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                                   interceptors=security.server_interceptors(token))
        pb_grpc.add_IngestServicer_to_server(self, self._server)
        port = security.add_listen_port(self._server, address, cert=cert, key=key, client_ca=client_ca)
        self._server.start()
        return port

    def stop(self, grace: float | None = None) -> None:
        if self._server is not None:
            self._server.stop(grace).wait()

    def Stream(self, request_iterator, context):
        for batch in request_iterator:
            yield self._accept(batch, context)

    def Push(self, request, context):
        return self._accept(request, context)

    def _accept(self, batch: pb.TelemetryBatch, context) -> pb.BatchAck:
        try:
            validate(batch)
            problem = self.refuse(batch) if self.refuse else None
        except BatchError as exc:
            problem = str(exc)
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"batch {batch.sequence}: {problem}")
        key = (batch.agent_id, batch.sequence)
        with self.store.cond:
            duplicate = key in self.store.batches
            self.store.batches.setdefault(key, batch)
            self.store.received += 1
            self.store.cond.notify_all()
        return pb.BatchAck(agent_id=batch.agent_id, sequence=batch.sequence, duplicate=duplicate)
