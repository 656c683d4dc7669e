"""The collector's gRPC server: Ingest (agents stream batches, acked after commit) and Query (read API).

Ingest takes the raw bytes of each batch and decodes them itself, so a malformed, oversized or wrong-version
batch is answered with a precise status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, FAILED_PRECONDITION) and a
log line naming the agent and peer, while every other client keeps being served. Query methods are plain
functions ``handler(request, store) -> response`` looked up by method name, so other features plug theirs in
through ``serve(..., query_handlers={"Breakdown": fn})``; a method without a handler answers UNIMPLEMENTED.
Parts that run beside ingest (scoring, the jobs monitor, metrics) are :class:`Service` objects: they get
the store when the server starts, may answer Query methods, and are stopped before the store closes.
Transport security (TLS, mutual TLS, bearer token, the loopback-only plaintext rule) is gpuwatch.security's.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import duckdb
import grpc
from google.protobuf.message import DecodeError, Message

from gpuwatch import security
from gpuwatch.batches import INSTANCE_METADATA, MAX_BATCH_BYTES, SCHEMA_VERSION, BatchError, TimeWindow, validate
from gpuwatch.collector.breakdowns import BreakdownService
from gpuwatch.collector.failed import failed_gpus
from gpuwatch.collector.ingest_admission import (DEFAULT_MAX_STREAMS_PER_CONNECTION, DEFAULT_STREAM_IDLE_TIMEOUT_S,
                                                 QUERY_RESERVE_WORKERS, StreamAdmission, StreamRefused,
                                                 fencing_advice)
from gpuwatch.collector.store.duckdb import DuckDBStore, StoreClosed, WriteResult
from gpuwatch.errors import AgentIdConflict, NotFound, UserError
from gpuwatch.v1 import query_pb2 as q
from gpuwatch.v1 import telemetry_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_PORT = 7700
# gRPC refuses messages above this outright (memory guard); batches between MAX_BATCH_BYTES and this
# reach decode_batch, which answers with a message that says what to do.
_HARD_RECEIVE_LIMIT = 4 * MAX_BATCH_BYTES
#: Initial metadata of an Ingest stream the collector admitted (a refused one ends with a status instead).
ADMITTED_METADATA = (("gpuwatch-stream", "admitted"),)

QueryHandler = Callable[[Message, DuckDBStore], Message]


class Service(Protocol):
    """A part of the collector running beside ingest (scorer, jobs monitor, metrics endpoint)."""

    def start(self, store: DuckDBStore) -> Mapping[str, QueryHandler]:
        """Begin work on ``store``; return the Query methods it answers (may be empty)."""

    def stop(self) -> None:
        """Stop; called before the store closes."""


class BatchRejected(Exception):
    """A batch the collector will not store: the gRPC status to answer and why."""

    def __init__(self, code: grpc.StatusCode, message: str, agent: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.agent = agent


def decode_batch(raw: bytes, window: TimeWindow | None = None) -> pb.TelemetryBatch:
    """Parse and validate one batch's bytes; raise :class:`BatchRejected` with the status to answer."""
    if len(raw) > MAX_BATCH_BYTES:
        raise BatchRejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"batch of {len(raw)} bytes is over the {MAX_BATCH_BYTES}-byte limit; send smaller batches")
    try:
        batch = pb.TelemetryBatch.FromString(raw)
    except DecodeError as exc:
        raise BatchRejected(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{len(raw)} bytes are not a gpuwatch.v1.TelemetryBatch ({exc})") from None
    try:
        validate(batch, window)
    except BatchError as exc:
        code = (grpc.StatusCode.FAILED_PRECONDITION if batch.schema_version != SCHEMA_VERSION
                else grpc.StatusCode.INVALID_ARGUMENT)
        raise BatchRejected(code, f"batch {batch.sequence} of agent {batch.agent_id or '?'}: {exc}",
                            batch.agent_id) from None
    return batch


def store_failure(exc: BaseException, batch: pb.TelemetryBatch) -> BatchRejected:
    """The status for a batch the store did not take: ALREADY_EXISTS for a cloned agent id, INVALID_ARGUMENT
    for a batch that validated but holds something the store cannot keep (final: the agent sets it aside
    instead of resending it forever), UNAVAILABLE for a store failure such as a full disk (the agent resends)."""
    where = f"batch {batch.sequence} of agent {batch.agent_id}"
    if isinstance(exc, AgentIdConflict):
        return BatchRejected(grpc.StatusCode.ALREADY_EXISTS, f"{where}: {fencing_advice(batch.agent_id)}",
                             batch.agent_id)
    if isinstance(exc, (ValueError, OverflowError, TypeError, duckdb.ConversionException,
                        duckdb.OutOfRangeException, duckdb.InvalidInputException, duckdb.ConstraintException)):
        return BatchRejected(grpc.StatusCode.INVALID_ARGUMENT, f"{where} cannot be stored: {exc}", batch.agent_id)
    return BatchRejected(grpc.StatusCode.UNAVAILABLE, f"the collector could not store {where}: {exc}; resend later",
                         batch.agent_id)


def _ack(result: WriteResult) -> pb.BatchAck:
    return pb.BatchAck(agent_id=result.agent_id, sequence=result.sequence, duplicate=result.duplicate)


class IngestService:
    """Stores every well-formed batch once and acknowledges it only after the store committed it.

    Streams are admitted by ``admission`` (a bound on open streams, an idle timeout, one live agent per id)."""

    def __init__(self, store: DuckDBStore, admission: StreamAdmission | None = None,
                 window: TimeWindow | None = None) -> None:
        self.store = store
        self.admission = admission or StreamAdmission(max_streams=2**31)
        self.window = window
        self.rejected_by_agent: Counter[str] = Counter()

    def handler(self) -> grpc.GenericRpcHandler:
        ack = pb.BatchAck.SerializeToString
        return grpc.method_handlers_generic_handler("gpuwatch.v1.Ingest", {
            # No request deserializer: the handlers get raw bytes and decode them in decode_batch.
            "Stream": grpc.stream_stream_rpc_method_handler(self.stream, response_serializer=ack),
            "Push": grpc.unary_unary_rpc_method_handler(self.push, response_serializer=ack),
        })

    def push(self, raw: bytes, context: grpc.ServicerContext) -> pb.BatchAck:
        batch = self._decode_or_abort(raw, context)
        try:
            self.admission.check_push(batch.agent_id, _instance(context), context.peer())
        except StreamRefused as exc:
            self._abort(exc, context)
        future = self._submit_or_abort(batch, context)
        try:
            return _ack(future.result())
        except Exception as exc:
            self._abort(store_failure(exc, batch), context)

    def stream(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[pb.BatchAck]:
        """Read batches on a helper thread so many are in flight; yield their acks in order as they commit.

        A stream that sends no batch for the admission's idle timeout is ended (the agent reconnects)."""
        try:
            handle = self.admission.open_stream()
        except StreamRefused as exc:
            self._abort(exc, context)
        context.send_initial_metadata(ADMITTED_METADATA)  # tells the client the stream is being served
        pending: queue.Queue = queue.Queue()
        done = object()
        instance, peer = _instance(context), context.peer()

        def read() -> None:
            try:
                for raw in requests:
                    try:
                        batch = decode_batch(raw, self.window)
                        self.admission.claim(handle, batch.agent_id, instance, peer)
                        pending.put((batch, self.store.submit(batch)))
                    except (BatchRejected, StoreClosed, StreamRefused) as exc:
                        pending.put(exc)
                        return
            except grpc.RpcError:  # the client went away; what was submitted is still stored
                pass
            finally:
                pending.put(done)

        threading.Thread(target=read, name="ingest-stream-reader", daemon=True).start()
        idle = False
        try:
            while True:
                try:
                    item = pending.get(timeout=self.admission.idle_timeout_s)
                except queue.Empty:
                    idle = True
                    log.info("closing an idle Ingest stream from %s (no batch for %.0f s)", peer,
                             self.admission.idle_timeout_s)
                    context.abort(grpc.StatusCode.UNAVAILABLE,
                                  f"no batch for {self.admission.idle_timeout_s:g} s; reconnect when there is data")
                if item is done:
                    return
                if isinstance(item, BaseException):  # earlier batches were acked above; now refuse this one
                    self._abort(item, context)
                batch, future = item
                try:
                    result = future.result()
                except Exception as exc:
                    self._abort(store_failure(exc, batch), context)
                yield _ack(result)
        finally:
            self.admission.close_stream(handle, idle)

    def _decode_or_abort(self, raw: bytes, context: grpc.ServicerContext) -> pb.TelemetryBatch:
        try:
            return decode_batch(raw, self.window)
        except BatchRejected as exc:
            self._abort(exc, context)

    def _abort(self, exc: BaseException, context: grpc.ServicerContext) -> None:
        if isinstance(exc, BatchRejected) and exc.code != grpc.StatusCode.UNAVAILABLE:
            self.store.counters.reject()
            self.rejected_by_agent[exc.agent or "?"] += 1
            exc.message += f" ({self.rejected_by_agent[exc.agent or '?']} refused from this agent so far)"
        _abort(exc, context)

    def _submit_or_abort(self, batch: pb.TelemetryBatch, context: grpc.ServicerContext):
        try:
            return self.store.submit(batch)
        except StoreClosed as exc:
            self._abort(exc, context)



def _instance(context: grpc.ServicerContext) -> str:
    return dict(context.invocation_metadata() or ()).get(INSTANCE_METADATA, "")


def _abort(exc: BaseException, context: grpc.ServicerContext) -> None:
    if isinstance(exc, BatchRejected):
        log.warning("rejected a batch from agent %s (peer %s): %s", exc.agent or "?", context.peer(), exc.message)
        context.abort(exc.code, exc.message)
    elif isinstance(exc, StreamRefused):
        log.warning("refused an Ingest call from %s: %s", context.peer(), exc.message)
        context.abort(getattr(grpc.StatusCode, exc.code), exc.message)
    else:
        context.abort(grpc.StatusCode.UNAVAILABLE, "the collector is shutting down; resend to it later")


# ------------------------------------------------------------------------------------- query side
def list_nodes(request: q.ListNodesRequest, store: DuckDBStore) -> q.ListNodesResponse:
    return q.ListNodesResponse(nodes=[
        q.NodeSummary(node=r["node"], gpus=r["gpus"], samples=r["samples"], last_seen_ms=r["last_seen_ms"],
                      agent_id=r["agent_id"], last_sequence=r["last_sequence"])
        for r in store.nodes()])


def list_gpus(request: q.ListGpusRequest, store: DuckDBStore) -> q.ListGpusResponse:
    """The inventory with each GPU's latest job, and ``failed`` for a GPU that failed and was not reset since."""
    info_fields = pb.GpuInfo.DESCRIPTOR.fields_by_name
    failures = failed_gpus(store)
    gpus = []
    for r in store.gpus(request.node or None):
        failure = failures.get((r["node"], r["index"]))
        gpus.append(q.GpuSummary(
            node=r["node"], info=pb.GpuInfo(**{k: v for k, v in r.items() if k in info_fields}),
            samples=r["samples"], last_seen_ms=r["last_sample_ms"] or 0, job_id=r["job_id"] or "",
            rank=-1 if r["rank"] is None else r["rank"], state="failed" if failure else "running",
            failure=failure.reason if failure else ""))
    return q.ListGpusResponse(gpus=gpus)


def latest(request: q.LatestRequest, store: DuckDBStore) -> q.LatestResponse:
    rows = store.latest(request.node or None, None if request.gpu_index < 0 else request.gpu_index)
    identity = {"node", "gpu_index", "ts_ms"}
    return q.LatestResponse(rows=[
        q.LatestRow(node=r["node"], gpu_index=r["gpu_index"], ts_ms=r["ts_ms"],
                    values={k: v for k, v in r.items() if k not in identity and v is not None})
        for r in rows])


def series(request: q.SeriesRequest, store: DuckDBStore) -> q.SeriesResponse:
    if not request.node or not request.field:
        raise UserError("a series needs node and field")
    df = store.series(request.node, request.gpu_index, request.field, since_ms=request.since_ms or None,
                      until_ms=request.until_ms or None, limit=request.limit or None)
    return q.SeriesResponse(ts_ms=df["ts_ms"].tolist(), values=df["value"].tolist())


def events(request: q.EventsRequest, store: DuckDBStore) -> q.EventsResponse:
    rows = store.events(request.node or None, request.kind or None, request.since_ms or None, request.limit or None)
    return q.EventsResponse(events=[
        q.EventsResponse.Row(node=r["node"], event=pb.Event(
            ts_ms=r["ts_ms"], gpu_index=r["gpu_index"], kind=r["kind"], code=r["code"], message=r["message"] or "",
            attrs=r["attrs"]))
        for r in rows])


DEFAULT_QUERY_HANDLERS: dict[str, QueryHandler] = {
    "ListNodes": list_nodes, "ListGpus": list_gpus, "Latest": latest, "Series": series, "Events": events,
}


def query_handler(store: DuckDBStore, handlers: Mapping[str, QueryHandler]) -> grpc.GenericRpcHandler:
    """The Query service over ``handlers``: NotFound answers NOT_FOUND, other UserError INVALID_ARGUMENT, a
    method without a handler UNIMPLEMENTED."""
    service = q.DESCRIPTOR.services_by_name["Query"]

    def method(name: str) -> Callable[[Message, grpc.ServicerContext], Message]:
        def call(request: Message, context: grpc.ServicerContext) -> Message:
            fn = handlers.get(name)
            if fn is None:
                context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not available in this collector yet")
            try:
                return fn(request, store)
            except NotFound as exc:
                context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            except UserError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return call

    return grpc.method_handlers_generic_handler(service.full_name, {
        m.name: grpc.unary_unary_rpc_method_handler(
            method(m.name),
            request_deserializer=getattr(q, m.input_type.name).FromString,
            response_serializer=getattr(q, m.output_type.name).SerializeToString)
        for m in service.methods})


# ----------------------------------------------------------------------------------------- serving
class CollectorServer:
    """A running collector: its gRPC server, store and services. ``stop`` commits what was received, then closes."""

    def __init__(self, server: grpc.Server, store: DuckDBStore, host: str, port: int,
                 services: Sequence[Service] = ()) -> None:
        self._server = server
        self.store = store
        self.host = host
        self.port = port
        self.services = list(services)
        self._stopped = threading.Event()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, grace: float = 2.0) -> None:
        """Stop taking RPCs (open streams get ``grace`` seconds), stop the services, flush, close the store."""
        if self._stopped.is_set():
            return
        self._server.stop(grace).wait()
        _stop_all(self.services)
        self.store.close()
        self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until :meth:`stop` has finished; return whether it has."""
        return self._stopped.wait(timeout)


def _stop_all(services: Sequence[Service]) -> None:
    for service in reversed(services):
        try:
            service.stop()
        except Exception:  # one failing service must not keep the store from being closed
            log.exception("stopping %s failed", type(service).__name__)


def client_limit_options(max_streams_per_connection: int) -> list[tuple[str, int]]:
    """Per-connection limits of the gRPC server: concurrent calls per connection, dropping connections idle
    for 10 minutes, and refusing keepalive pings more often than the agents' 60 s (a ping flood)."""
    return [
        ("grpc.max_concurrent_streams", max_streams_per_connection),
        ("grpc.max_connection_idle_ms", 600_000),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 30_000),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.keepalive_permit_without_calls", 0),
    ]


def serve(
    listen: str,
    db_path: str,
    *,
    retention_days: float | None = None,
    max_workers: int = 256,
    max_ingest_streams: int | None = None,
    max_streams_per_connection: int = DEFAULT_MAX_STREAMS_PER_CONNECTION,
    stream_idle_timeout_s: float = DEFAULT_STREAM_IDLE_TIMEOUT_S,
    time_window: TimeWindow | None = None,
    query_handlers: Mapping[str, QueryHandler] | None = None,
    services: Sequence[Service] = (),
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_client_ca: str | None = None,
    token: str | None = None,
    insecure: bool = False,
    **store_options: Any,
) -> CollectorServer:
    """Open the store, start ``services`` and serve on ``listen`` ("host:port", port 0 picks a free one).

    TLS when ``tls_cert``/``tls_key`` are given (mutual with ``tls_client_ca``); with ``token`` every call
    needs ``authorization: Bearer <token>``. A non-loopback ``listen`` without TLS is refused unless
    ``insecure``. ``max_workers`` bounds concurrent RPCs; every connected agent's stream holds one worker, and
    at most ``max_ingest_streams`` (default: ``max_workers`` less a reserve for queries, 16 or a quarter) are
    served at once, each ended after ``stream_idle_timeout_s`` without a batch; one connection may open at most
    ``max_streams_per_connection`` concurrent calls. Batch times outside ``time_window`` (around the
    collector's clock; the collector command always sets one) are refused.
    Query methods: the defaults, SubmitTrace/Breakdown, the services', then ``query_handlers``.
    Raises UserError when the store is locked by another process or the address cannot be bound.
    """
    host, _, port_text = listen.rpartition(":")
    if not host or not port_text.isdigit():
        raise UserError(f"--listen {listen!r} is not HOST:PORT")
    tls = tls_cert is not None or tls_key is not None
    security.check_listen_policy(listen, tls, insecure)  # before anything is opened
    store = DuckDBStore(db_path, retention_days=retention_days, **store_options)
    started: list[Service] = []
    try:
        handlers: dict[str, QueryHandler] = {**DEFAULT_QUERY_HANDLERS, **BreakdownService().handlers()}
        for service in services:
            handlers.update(service.start(store))
            started.append(service)
        handlers.update(query_handlers or {})
        server = grpc.server(ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                             interceptors=security.server_interceptors(token),
                             options=[("grpc.so_reuseport", 0),
                                      ("grpc.max_receive_message_length", _HARD_RECEIVE_LIMIT),
                                      ("grpc.max_send_message_length", _HARD_RECEIVE_LIMIT),
                                      *client_limit_options(max_streams_per_connection)])
        if max_ingest_streams is None:
            max_ingest_streams = max(1, max_workers - min(QUERY_RESERVE_WORKERS, max_workers // 4))
        admission = StreamAdmission(max_ingest_streams, stream_idle_timeout_s)
        server.add_generic_rpc_handlers((IngestService(store, admission, time_window).handler(),
                                         query_handler(store, handlers)))
        port = security.add_listen_port(server, listen, cert=tls_cert, key=tls_key, client_ca=tls_client_ca,
                                        insecure=insecure)
        if not port:
            raise UserError(f"cannot listen on {listen}: the address is in use or not local")
    except BaseException:
        _stop_all(started)
        store.close()
        raise
    server.start()
    log.info("collector listening on %s:%d (%s), store %s", host, port,
             "mutual TLS" if tls_client_ca else "TLS" if tls else "plaintext", db_path)
    return CollectorServer(server, store, host, port, started)
