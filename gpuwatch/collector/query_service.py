"""The collector's Query service: the read API over the store.

Query methods are plain functions ``handler(request, store) -> response`` looked up by method name
(:data:`QueryHandler`); the server runs them on their own thread pool so they are answered while ingest is
saturated. The defaults here read the store directly; other features (breakdowns, jobs, alerts) plug theirs
in as services or through ``serve(..., query_handlers=...)``; a method without a handler answers
UNIMPLEMENTED. The collector binds its port before it opens its store, so a call that arrives meanwhile
waits for what it needs (:class:`StoreGate`).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import grpc
from google.protobuf.message import Message

from gpuwatch.collector.failed import failed_gpus
from gpuwatch.collector.store.base import Store, StoreDamaged
from gpuwatch.core.errors import NotFound, UserError
from gpuwatch.v1 import query_pb2 as q
from gpuwatch.v1 import telemetry_pb2 as pb

STORE_WAIT_S = 60.0  # the longest a query waits for the store to open (a large file replays its log first)

QueryHandler = Callable[[Message, Store], Message]


def list_nodes(request: q.ListNodesRequest, store: Store) -> q.ListNodesResponse:
    return q.ListNodesResponse(nodes=[
        q.NodeSummary(node=r["node"], gpus=r["gpus"], samples=r["samples"], last_seen_ms=r["last_seen_ms"],
                      agent_id=r["agent_id"], last_sequence=r["last_sequence"])
        for r in store.nodes()])


def list_gpus(request: q.ListGpusRequest, store: Store) -> q.ListGpusResponse:
    """The inventory with each GPU's latest job, and ``failed`` for a GPU that failed and was not reset since."""
    from gpuwatch.collector.owners import current_owners, owner_columns  # pandas: after the port is bound

    info_fields = pb.GpuInfo.DESCRIPTOR.fields_by_name
    failures = failed_gpus(store)
    owners = current_owners(store)
    gpus = []
    for r in store.gpus(request.node or None):
        failure = failures.get((r["node"], r["index"]))
        gpus.append(q.GpuSummary(
            node=r["node"], info=pb.GpuInfo(**{k: v for k, v in r.items() if k in info_fields}),
            samples=r["samples"], last_seen_ms=r["last_sample_ms"] or 0, job_id=r["job_id"] or "",
            rank=-1 if r["rank"] is None else r["rank"], state="failed" if failure else "running",
            failure=failure.reason if failure else "", **owner_columns(owners.get((r["node"], r["index"])))))
    return q.ListGpusResponse(gpus=gpus)


def latest(request: q.LatestRequest, store: Store) -> q.LatestResponse:
    rows = store.latest(request.node or None, None if request.gpu_index < 0 else request.gpu_index)
    identity = {"node", "gpu_index", "ts_ms", "job_id", "rank"}
    return q.LatestResponse(rows=[
        q.LatestRow(node=r["node"], gpu_index=r["gpu_index"], ts_ms=r["ts_ms"],
                    values={k: v for k, v in r.items() if k not in identity and v is not None})
        for r in rows])


def series(request: q.SeriesRequest, store: Store) -> q.SeriesResponse:
    if not request.node or not request.field:
        raise UserError("a series needs node and field")
    df = store.series(request.node, request.gpu_index, request.field, since_ms=request.since_ms or None,
                      until_ms=request.until_ms or None, limit=request.limit or None)
    return q.SeriesResponse(ts_ms=df["ts_ms"].tolist(), values=df["value"].tolist(),
                            resolution_s=df["resolution_s"].tolist() if "resolution_s" in df else [])


def events(request: q.EventsRequest, store: Store) -> q.EventsResponse:
    rows = store.events(request.node or None, request.kind or None, request.since_ms or None, request.limit or None)
    return q.EventsResponse(events=[
        q.EventsResponse.Row(node=r["node"], event=pb.Event(
            ts_ms=r["ts_ms"], gpu_index=r["gpu_index"], kind=r["kind"], code=r["code"], message=r["message"] or "",
            attrs=r["attrs"]))
        for r in rows])


def usage(request: q.UsageRequest, store: Store) -> q.UsageResponse:
    from gpuwatch.collector.owners import usage_rpc  # pandas: after the port is bound

    return usage_rpc(request, store)


DEFAULT_QUERY_HANDLERS: dict[str, QueryHandler] = {
    "ListNodes": list_nodes, "ListGpus": list_gpus, "Latest": latest, "Series": series, "Events": events,
    "Usage": usage,
}


class StoreGate:
    """The store queries read, once it is open, and whether the services have started. The collector binds
    its port before it opens the store (so it answers connections within a second of starting) and opens the
    store before it starts its services; a query that arrives meanwhile waits for what it needs."""

    def __init__(self) -> None:
        self._store: Store | None = None
        self._store_settled = threading.Event()
        self._services_settled = threading.Event()

    def open(self, store: Store) -> None:
        self._store = store
        self._store_settled.set()

    def services_started(self) -> None:
        self._services_settled.set()

    def fail(self) -> None:
        """The collector did not start (it is stopping): waiting calls get no store."""
        self._store = None
        self._store_settled.set()
        self._services_settled.set()

    def wait(self, timeout: float | None) -> Store | None:
        """The store, or None when it did not open within ``timeout`` seconds (or at all)."""
        self._store_settled.wait(timeout)
        return self._store

    def wait_for_services(self, timeout: float | None) -> bool:
        """Whether the services started (so every Query method they answer is registered) within ``timeout``."""
        return self._services_settled.wait(timeout) and self._store is not None


def query_handler(gate: StoreGate, handlers: Mapping[str, QueryHandler]) -> grpc.GenericRpcHandler:
    """The Query service over ``handlers`` and the store ``gate`` opens: NotFound answers NOT_FOUND, other
    UserError INVALID_ARGUMENT, a method without a handler UNIMPLEMENTED, a call whose deadline passes before
    the store is open UNAVAILABLE."""
    service = q.DESCRIPTOR.services_by_name["Query"]

    def method(name: str) -> Callable[[Message, grpc.ServicerContext], Message]:
        def call(request: Message, context: grpc.ServicerContext) -> Message:
            store = gate.wait(min(context.time_remaining() or STORE_WAIT_S, STORE_WAIT_S))
            fn = handlers.get(name)
            if fn is None and store is not None:  # a service's method: registered once the services started
                gate.wait_for_services(min(context.time_remaining() or STORE_WAIT_S, STORE_WAIT_S))
                fn = handlers.get(name)
            if store is None:  # (context.abort raises)
                return context.abort(grpc.StatusCode.UNAVAILABLE, "the collector is opening its store; retry shortly")
            if fn is None:
                return context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not available in this collector yet")
            try:
                return fn(request, store)
            except NotFound as exc:
                context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            except StoreDamaged as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            except UserError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return call

    return grpc.method_handlers_generic_handler(service.full_name, {
        m.name: grpc.unary_unary_rpc_method_handler(
            method(m.name),
            request_deserializer=getattr(q, m.input_type.name).FromString,
            response_serializer=getattr(q, m.output_type.name).SerializeToString)
        for m in service.methods})
