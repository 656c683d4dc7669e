"""The collector's gRPC server: Ingest (agents stream batches, acked after commit) and Query (read API).

The server is asynchronous (grpc.aio on one event-loop thread), so an agent's stream costs a coroutine, not
a thread: one process holds thousands of agents, and idle or slow ones cost nothing but memory. Ingest takes
the raw bytes of each batch and decodes them itself (gpuwatch.core.columnar), so a malformed, oversized or
wrong-version batch is answered with a precise status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
FAILED_PRECONDITION) and a log line naming the agent and peer, while every other client keeps being served.
A batch that validated but that the store cannot keep gets a final INVALID_ARGUMENT (the agent sets it aside
instead of resending it forever), a store failure such as a full disk UNAVAILABLE (the agent resends), a
batch of a second agent under the same agent id ALREADY_EXISTS (never UNKNOWN): :func:`store_failure`.
A batch is acknowledged only after the store's writer thread committed it (the event loop awaits the
store's future, never blocks on it); resends are recognised by (agent_id, sequence) in the store. The port
is bound before the store opens (a collector takes connections within a second of starting); calls that
arrive meanwhile wait for the store (:class:`StoreGate`, :meth:`IngestService.attach`).

Bounds, so no client can starve the others: each stream has at most ``stream_window`` batches between
received and acknowledged (beyond that the server stops reading it and HTTP/2 flow control holds the
sender), the whole collector at most ``max_in_flight`` (fair, first come first served), at most
``max_ingest_streams`` streams are open at once (gpuwatch.collector.ingest_admission, which also fences
agent ids: one live agent instance per id), a stream that sends nothing for ``stream_idle_s`` is closed (the
agent reconnects when it has data), keepalive pings find dead peers (and a ping flood is refused), and
connections without calls are closed after ``CONNECTION_IDLE_S``.

Query methods are plain functions ``handler(request, store) -> response`` looked up by method name, run on
their own thread pool (``max_workers``) so they are answered while ingest is saturated; other features
plug theirs in through ``serve(..., query_handlers={"Breakdown": fn})``; a method without a handler
answers UNIMPLEMENTED. Parts that run beside ingest (scoring, the jobs monitor, metrics) are
:class:`Service` objects: they get the store when the server starts, may answer Query methods, and are
stopped before the store closes. Transport security (TLS, mutual TLS, bearer token, the loopback-only
plaintext rule) is gpuwatch.core.security's.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import grpc
from google.protobuf.message import DecodeError, Message

from gpuwatch.core import security
from gpuwatch.core.batches import INSTANCE_METADATA, MAX_BATCH_BYTES, SCHEMA_VERSION, BatchError, TimeWindow
from gpuwatch.collector.failed import failed_gpus
from gpuwatch.collector.ingest_admission import StreamAdmission, StreamRefused, fencing_advice
from gpuwatch.collector.label_budget import LabelBudget
from gpuwatch.collector.store import open_store, redacted
from gpuwatch.collector.store.base import Store, StoreClosed, StoreDamaged, WriteResult
from gpuwatch.core.errors import AgentIdConflict, NotFound, UserError
from gpuwatch.core.settings import (DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_INGEST_STREAMS, DEFAULT_QUERY_WORKERS,
                                     DEFAULT_STREAM_IDLE_S, split_address)
from gpuwatch.v1 import ingest_view_pb2 as view
from gpuwatch.v1 import query_pb2 as q
from gpuwatch.v1 import telemetry_pb2 as pb

if TYPE_CHECKING:
    from gpuwatch.core.columnar import ColumnarBatch

log = logging.getLogger(__name__)

# gRPC refuses messages above this outright (memory guard); batches between MAX_BATCH_BYTES and this
# reach decode_batch, which answers with a message that says what to do.
_HARD_RECEIVE_LIMIT = 4 * MAX_BATCH_BYTES
DEFAULT_STREAM_WINDOW = 64  # batches per stream between received and acked (agents keep 32 in flight)
CONNECTION_IDLE_S = 600.0  # a connection without calls (a query client that went quiet) is closed
STREAMS_PER_CONNECTION = 100  # an agent needs one; a client opening more is refused further streams
STORE_WAIT_S = 60.0  # the longest a query waits for the store to open (a large file replays its log first)
#: Initial metadata of an Ingest stream the collector admitted (a refused one ends with a status instead).
ADMITTED_METADATA = (("gpuwatch-stream", "admitted"),)

QueryHandler = Callable[[Message, Store], Message]


class Service(Protocol):
    """A part of the collector running beside ingest (scorer, jobs monitor, metrics endpoint)."""

    def start(self, store: Store) -> Mapping[str, QueryHandler]:
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


def decode_batch(raw: bytes, window: TimeWindow | None = None) -> ColumnarBatch:
    """Parse and validate one batch's bytes (bounds, and times within ``window`` when given); raise
    :class:`BatchRejected` with the status to answer."""
    from gpuwatch.core.columnar import decode  # numpy: imported with the store, after the port is bound

    if len(raw) > MAX_BATCH_BYTES:
        raise BatchRejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"batch of {len(raw)} bytes is over the {MAX_BATCH_BYTES}-byte limit; send smaller batches")
    try:
        return decode(raw, window)
    except BatchError as exc:
        problem: Exception = exc
    except DecodeError as exc:  # the batch, or only a Column inside it (a name not UTF-8, bad inner bytes)
        problem = DecodeError(f"not a gpuwatch.v1.TelemetryBatch ({exc})")
    except Exception as exc:  # whatever else the bytes provoke is still the batch's fault, never UNKNOWN
        problem = DecodeError(f"cannot be read ({type(exc).__name__}: {exc})")
    try:  # the header, for the message: the Columns stay bytes here, so a bad one cannot fail this parse
        header = view.TelemetryBatchView.FromString(raw)
    except DecodeError:
        raise BatchRejected(grpc.StatusCode.INVALID_ARGUMENT, f"{len(raw)} bytes are {problem}") from None
    code = (grpc.StatusCode.FAILED_PRECONDITION if header.schema_version != SCHEMA_VERSION
            else grpc.StatusCode.INVALID_ARGUMENT)
    raise BatchRejected(code, f"batch {header.sequence} of agent {header.agent_id or '?'}: {problem}",
                        header.agent_id) from None


def store_failure(exc: BaseException, batch: ColumnarBatch, unstorable: tuple[type[BaseException], ...] = ()
                  ) -> BatchRejected:
    """The status for a batch the store did not take: ALREADY_EXISTS for a cloned agent id, INVALID_ARGUMENT
    for a batch that validated but holds something the store cannot keep (``unstorable``, the store's
    ``unstorable_errors``; final: the agent sets it aside instead of resending it forever), UNAVAILABLE for a
    store failure such as a full disk (the agent resends)."""
    where = f"batch {batch.sequence} of agent {batch.agent_id}"
    if isinstance(exc, AgentIdConflict):
        return BatchRejected(grpc.StatusCode.ALREADY_EXISTS, f"{where}: {fencing_advice(batch.agent_id)}",
                             batch.agent_id)
    if isinstance(exc, (ValueError, OverflowError, TypeError, *unstorable)):
        return BatchRejected(grpc.StatusCode.INVALID_ARGUMENT, f"{where} cannot be stored: {exc}", batch.agent_id)
    return BatchRejected(grpc.StatusCode.UNAVAILABLE, f"the collector could not store {where}: {exc}; resend later",
                         batch.agent_id)


class StreamIdle(Exception):
    """A stream sent nothing for the idle limit."""


def _ack(result: WriteResult) -> pb.BatchAck:
    return pb.BatchAck(agent_id=result.agent_id, sequence=result.sequence, duplicate=result.duplicate)


_DONE = object()


class _CommitInbox:
    """Commits resolved on the store's writer thread, handed to the event loop in bunches: the writer wakes the
    loop once per bunch (a write to the loop's self-pipe, then one callback), not once per batch."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Callable[[concurrent.futures.Future], None], concurrent.futures.Future]] = []

    def put(self, settle: Callable[[concurrent.futures.Future], None], done: concurrent.futures.Future) -> None:
        """Call ``settle(done)`` on the loop soon (from any thread)."""
        with self._lock:
            self._items.append((settle, done))
            if len(self._items) > 1:  # a drain is scheduled already
                return
        self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for settle, done in items:
            settle(done)


def _awaitable_commit(stored: concurrent.futures.Future, in_flight: asyncio.Semaphore, inbox: _CommitInbox
                      ) -> asyncio.Future:
    """The store's commit future as an asyncio future of the running loop, releasing ``in_flight`` when the
    commit is done. Unlike asyncio.wrap_future, cancelling the returned future (its stream went away) leaves
    the store's future alone: the batch is committed anyway and the writer resolves what it committed."""
    waiter = asyncio.get_running_loop().create_future()

    def settle(done: concurrent.futures.Future) -> None:
        in_flight.release()
        if waiter.cancelled():
            return
        error = done.exception()
        if error is not None:
            waiter.set_exception(error)
        else:
            waiter.set_result(done.result())

    stored.add_done_callback(functools.partial(inbox.put, settle))
    return waiter


class _IdleWatch:
    """Ends a stream's read that waits longer than ``idle_s`` for the next batch by cancelling the reading
    task (then ``expired`` is true). One timer per stream, re-armed when it fires, instead of a timer made and
    cancelled for every batch as ``asyncio.timeout`` around each read does: a batch costs two assignments.
    Time spent waiting for a full window is not idleness: only the read itself is timed."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.expired = False
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None, "made by the task that reads the stream"
        self._task = task
        self._since: float | None = None  # loop time the current read began; None between reads
        self._timer = self._loop.call_later(idle_s, self._check)

    def reading(self) -> None:
        self._since = self._loop.time()

    def received(self) -> None:
        self._since = None

    def stop(self) -> None:
        self._timer.cancel()

    def _check(self) -> None:
        since, now = self._since, self._loop.time()
        if since is not None and now - since >= self.idle_s:
            self.expired = True
            self._task.cancel()
            return
        self._timer = self._loop.call_at((now if since is None else since) + self.idle_s, self._check)


class IngestService:
    """Stores every well-formed batch once and acknowledges it only after the store committed it.

    Runs on the server's event loop; every wait is an ``await`` (the store's commit future, a full window),
    so one slow agent never holds up another. Streams are admitted by ``admission`` (a bound on open streams,
    the idle limit, one live agent instance per agent id); batch times outside ``window`` are refused.
    """

    def __init__(self, store: Store | None, *, stream_window: int = DEFAULT_STREAM_WINDOW,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, stream_idle_s: float = DEFAULT_STREAM_IDLE_S,
                 max_ingest_streams: int = DEFAULT_MAX_INGEST_STREAMS, window: TimeWindow | None = None) -> None:
        self.store = store
        self.stream_window = stream_window
        self.admission = StreamAdmission(max_ingest_streams, stream_idle_s)
        self.window = window
        self.rejected_by_agent: Counter[str] = Counter()
        self.labels = LabelBudget()
        self._max_in_flight = max_in_flight
        self._in_flight: asyncio.Semaphore | None = None  # made on the event loop, with _inbox
        self._inbox: _CommitInbox | None = None
        self._store_ready: asyncio.Event | None = None  # made on the event loop

    def attach(self, store: Store) -> None:
        """Start storing into ``store`` (on the event loop). Until then every Ingest call waits, so a batch
        that arrives while the store opens is neither acknowledged nor lost: it is stored once it is open."""
        self.store = store
        self._ready_event().set()

    def _ready_event(self) -> asyncio.Event:
        if self._store_ready is None:
            self._store_ready = asyncio.Event()
            if self.store is not None:
                self._store_ready.set()
        return self._store_ready

    async def _wait_for_store(self) -> Store:
        await self._ready_event().wait()
        assert self.store is not None
        return self.store

    @property
    def open_streams(self) -> int:
        """Ingest streams being served now."""
        return self.admission.open_count()

    def handler(self) -> grpc.GenericRpcHandler:
        ack = pb.BatchAck.SerializeToString
        return grpc.method_handlers_generic_handler("gpuwatch.v1.Ingest", {
            # No request deserializer: the handlers get raw bytes and decode them in decode_batch.
            "Stream": grpc.stream_stream_rpc_method_handler(self.stream, response_serializer=ack),
            "Push": grpc.unary_unary_rpc_method_handler(self.push, response_serializer=ack),
        })

    async def push(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.BatchAck:
        try:
            await self._wait_for_store()
            batch = self._decoded(raw)
            self.admission.check_push(batch.agent_id, _instance(context), context.peer())
            commit = await self._submit(batch)
        except (BatchRejected, StoreClosed, StreamRefused) as exc:
            await self._abort(exc, context)
        return await self._acked(batch, commit, context)

    async def stream(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[pb.BatchAck]:
        """Read batches on a task of their own so up to ``stream_window`` are in flight; yield their acks in
        order as they commit. A refused batch ends the stream after the acks of the batches before it."""
        try:
            handle = self.admission.open_stream()
        except StreamRefused as exc:
            await self._abort(exc, context)
        idle = False
        try:
            await self._wait_for_store()
            await context.send_initial_metadata(ADMITTED_METADATA)  # tells the client the stream is served
            window = asyncio.Semaphore(self.stream_window)
            pending: asyncio.Queue = asyncio.Queue()
            sender = (handle, _instance(context), context.peer())
            reader = asyncio.create_task(self._read(requests, window, pending, sender))
            try:
                while (item := await pending.get()) is not _DONE:
                    if isinstance(item, BaseException):  # earlier batches were acked above; now refuse this one
                        idle = isinstance(item, StreamIdle)
                        await self._abort(item, context)
                    else:
                        yield await self._acked(item[0], item[1], context)
                        window.release()
            except asyncio.CancelledError:
                log.debug("ingest stream from %s cancelled (client gone or server stopping)", context.peer())
                raise
            finally:
                reader.cancel()
        finally:
            self.admission.close_stream(handle, idle)

    async def _read(self, requests: AsyncIterator[bytes], window: asyncio.Semaphore, pending: asyncio.Queue,
                    sender: tuple[int, str, str]) -> None:
        incoming = requests.__aiter__()
        idle = _IdleWatch(self.admission.idle_timeout_s)
        try:
            while True:
                await window.acquire()
                idle.reading()
                try:
                    raw = await incoming.__anext__()
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if not idle.expired:
                        raise
                    pending.put_nowait(StreamIdle(f"no batch for {idle.idle_s:g} s; reconnect to send"))
                    return
                idle.received()
                try:
                    batch = self._decoded(raw)
                    self.admission.claim(sender[0], batch.agent_id, sender[1], sender[2])
                    pending.put_nowait((batch, await self._submit(batch)))
                except (BatchRejected, StoreClosed, StreamRefused) as exc:
                    pending.put_nowait(exc)
                    return
        except (grpc.RpcError, grpc.aio.AioRpcError, ConnectionError):  # the client went away
            return
        except Exception as exc:  # never an OK end of a stream whose batch was not stored: the agent resends
            log.exception("ingest stream from %s failed", sender[2])
            pending.put_nowait(BatchRejected(grpc.StatusCode.UNAVAILABLE, f"the collector failed: {exc}"))
        finally:
            idle.stop()
            pending.put_nowait(_DONE)

    def _decoded(self, raw: bytes) -> ColumnarBatch:
        """The checked batch of ``raw``, within its agent's label budget; BatchRejected otherwise."""
        batch = decode_batch(raw, self.window)
        try:
            self.labels.admit(batch)
        except BatchError as exc:
            raise BatchRejected(grpc.StatusCode.INVALID_ARGUMENT, f"batch {batch.sequence}: {exc}",
                                batch.agent_id) from None
        return batch

    async def _submit(self, batch: ColumnarBatch) -> asyncio.Future:
        """Queue ``batch`` for the writer once the collector-wide bound has room; the future is its commit."""
        if self._in_flight is None or self._inbox is None:
            self._in_flight = asyncio.Semaphore(self._max_in_flight)
            self._inbox = _CommitInbox(asyncio.get_running_loop())
        await self._in_flight.acquire()
        assert self.store is not None, "Ingest calls wait for attach()"
        try:
            stored = self.store.submit(batch)
        except BaseException:
            self._in_flight.release()
            raise
        return _awaitable_commit(stored, self._in_flight, self._inbox)

    async def _acked(self, batch: ColumnarBatch, commit: asyncio.Future, context: grpc.aio.ServicerContext
                     ) -> pb.BatchAck:
        try:
            return _ack(await commit)
        except Exception as exc:
            assert self.store is not None, "a batch was submitted to it"
            await self._abort(store_failure(exc, batch, self.store.unstorable_errors), context)

    async def _abort(self, exc: BaseException, context: grpc.aio.ServicerContext) -> NoReturn:
        if isinstance(exc, BatchRejected):
            if exc.code != grpc.StatusCode.UNAVAILABLE:  # refused for good: counted, per agent too
                assert self.store is not None, "Ingest calls wait for attach()"
                self.store.counters.reject()
                agent = exc.agent or "?"
                self.rejected_by_agent[agent] += 1
                exc.message += f" ({self.rejected_by_agent[agent]} refused from this agent so far)"
                log.warning("rejected a batch from agent %s (peer %s): %s", agent, context.peer(), exc.message)
            else:
                log.error("store failed for a batch from %s: %s", context.peer(), exc.message)
            await context.abort(exc.code, exc.message)
        elif isinstance(exc, StreamRefused):
            log.warning("refused an Ingest call from %s: %s", context.peer(), exc.message)
            await context.abort(getattr(grpc.StatusCode, exc.code), exc.message)
        elif isinstance(exc, StreamIdle):
            log.info("closing an idle ingest stream from %s: %s", context.peer(), exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"idle stream closed: {exc}")
        else:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the collector is shutting down; resend to it later")
        raise AssertionError("unreachable: context.abort raises")  # grpc's context is untyped


def _instance(context: grpc.aio.ServicerContext) -> str:
    """The agent process's instance token (empty for clients that send none: they are not fenced)."""
    return dict(context.invocation_metadata() or ()).get(INSTANCE_METADATA, "")


# ------------------------------------------------------------------------------------- query side
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
    identity = {"node", "gpu_index", "ts_ms"}
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


def usage(request: q.UsageRequest, store: Store) -> q.JsonResponse:
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


# ----------------------------------------------------------------------------------------- serving
class _EventLoopThread:
    """An asyncio event loop on a daemon thread of its own (the gRPC server's); the caller stays synchronous."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio", daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        """Run ``coro`` on the loop and return its result (or raise its exception) here."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class CollectorServer:
    """A running collector: its gRPC server, store and services. ``stop`` commits what was received, then closes."""

    def __init__(self, server: grpc.aio.Server, loop: _EventLoopThread, query_pool: ThreadPoolExecutor,
                 store: Store, host: str, port: int, services: Sequence[Service] = (),
                 ingest: IngestService | None = None) -> None:
        self._server = server
        self._loop = loop
        self._query_pool = query_pool
        self.store = store
        self.host = host
        self.port = port
        self.services = list(services)
        self.ingest = ingest
        self._stopped = threading.Event()

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def stop(self, grace: float = 2.0) -> None:
        """Stop taking RPCs (open streams get ``grace`` seconds), stop the services, flush, close the store."""
        if self._stopped.is_set():
            return
        self._loop.run(self._server.stop(grace))
        _stop_all(self.services)
        self.store.close()  # commits what was received; the loop still runs the commits' callbacks
        self._loop.close()
        self._query_pool.shutdown(wait=False, cancel_futures=True)
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


def _server_options() -> list[tuple[str, Any]]:
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", _HARD_RECEIVE_LIMIT),
        ("grpc.max_send_message_length", _HARD_RECEIVE_LIMIT),
        ("grpc.max_concurrent_streams", STREAMS_PER_CONNECTION),
        # find dead peers (a node that lost power leaves a half-open connection) ...
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        # ... and let agents do the same: they ping every 60 s (gpuwatch.agent.uplink)
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 30_000),
        # ... but no more often than that: a client pinging faster (a ping flood) is disconnected
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 30_000),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.max_connection_idle_ms", int(CONNECTION_IDLE_S * 1000)),
        # gRPC core cancels a new call that waits longer than this (its default: 30 s) for the server to take
        # it. The asyncio server takes one new call per turn of its event loop, so when thousands of agents
        # (re)connect while ingest is saturated, streams wait longer than 30 s and were cancelled (CANCELLED
        # at the agent, which reconnected and resent its window: bench/agents.py at 5,000 agents). A waiting
        # stream costs a pending call's memory here; its batches wait in the agent's spool (HTTP/2 flow control).
        ("grpc.server_max_unrequested_time_in_server", int(CONNECTION_IDLE_S)),
    ]


async def _start_grpc(listen: str, handlers: Sequence[grpc.GenericRpcHandler], query_pool: ThreadPoolExecutor,
                      token: str | None, tls: Mapping[str, Any], insecure: bool) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(migration_thread_pool=query_pool, handlers=handlers,
                             interceptors=security.aio_server_interceptors(token), options=_server_options())
    port = security.add_listen_port(server, listen, insecure=insecure, **tls)
    if not port:
        raise UserError(f"cannot listen on {listen}: the address is in use or not local")
    await server.start()
    return server, port


def serve(
    listen: str,
    db_path: str,
    *,
    retention_days: float | None = None,
    max_workers: int = DEFAULT_QUERY_WORKERS,
    stream_window: int = DEFAULT_STREAM_WINDOW,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    stream_idle_s: float = DEFAULT_STREAM_IDLE_S,
    max_ingest_streams: int = DEFAULT_MAX_INGEST_STREAMS,
    time_window: TimeWindow | None = None,
    query_handlers: Mapping[str, QueryHandler] | None = None,
    services: Sequence[Service] | Callable[[], Sequence[Service]] = (),
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_client_ca: str | None = None,
    token: str | None = None,
    insecure: bool = False,
    **store_options: Any,
) -> CollectorServer:
    """Serve on ``listen`` ("host:port", port 0 picks a free one), then open the store and start ``services``.

    The port is bound first, so a starting collector accepts connections at once; calls that arrive before
    the store is open wait for it (ingest acknowledges nothing until its batches are committed, so nothing
    is lost when the store then fails to open: the calls end UNAVAILABLE and agents resend). ``services``
    may be a function that builds them, called once the port is bound (the collector command imports its
    heavy modules there). TLS when ``tls_cert``/``tls_key`` are given (mutual with ``tls_client_ca``); with
    ``token`` every call needs ``authorization: Bearer <token>``. A non-loopback ``listen`` without TLS is
    refused unless ``insecure``. ``max_workers`` threads answer Query calls; ingest runs on the event loop,
    bounded by ``stream_window``, ``max_in_flight``, ``max_ingest_streams`` and ``stream_idle_s`` (see the
    module docstring). Batch times outside ``time_window`` (around the collector's clock; the collector
    command always sets one) are refused.
    Query methods: the defaults, SubmitTrace/Breakdown, the services', then ``query_handlers``.
    Raises UserError when the store is locked by another process or the address cannot be bound.
    """
    handlers: dict[str, QueryHandler] = dict(DEFAULT_QUERY_HANDLERS)
    gate = StoreGate()
    ingest = IngestService(None, stream_window=stream_window, max_in_flight=max_in_flight,
                           stream_idle_s=stream_idle_s, max_ingest_streams=max_ingest_streams, window=time_window)
    query_pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="query")
    loop = _EventLoopThread()
    try:
        server, port = loop.run(_start_grpc(
            listen, (ingest.handler(), query_handler(gate, handlers)), query_pool, token,
            {"cert": tls_cert, "key": tls_key, "client_ca": tls_client_ca}, insecure))
    except BaseException:
        loop.close()
        query_pool.shutdown(wait=False)
        raise
    log.debug("collector bound %s (port %d); opening store %s", listen, port, redacted(db_path))
    started: list[Service] = []
    store: Store | None = None
    try:
        store = open_store(db_path, retention_days=retention_days, **store_options)
        handlers.update(query_handlers or {})
        loop.loop.call_soon_threadsafe(ingest.attach, store)  # ingest and the default queries need only the store
        gate.open(store)
        from gpuwatch.collector.breakdowns import BreakdownService  # pandas and the trace engine: after binding

        service_handlers = BreakdownService().handlers()
        for service in services() if callable(services) else services:
            service_handlers.update(service.start(store))
            started.append(service)
        handlers.update({name: fn for name, fn in service_handlers.items() if name not in (query_handlers or {})})
        gate.services_started()
    except BaseException:  # in the order of CollectorServer.stop: what was committed is acked as it was
        gate.fail()
        loop.run(server.stop(None))
        _stop_all(started)
        if store is not None:
            store.close()
        loop.close()
        query_pool.shutdown(wait=False, cancel_futures=True)
        raise
    host, _ = split_address(listen)  # valid: it was bound
    log.info("collector listening on %s:%d (%s), store %s", host, port,
             "mutual TLS" if tls_client_ca else "TLS" if tls_cert or tls_key else "plaintext", redacted(db_path))
    return CollectorServer(server, loop, query_pool, store, host, port, started, ingest)
