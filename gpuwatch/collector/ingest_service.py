"""The collector's Ingest service: agents push or stream batches, each acknowledged after its commit.

It runs on the server's asyncio event loop, so an agent's stream costs a coroutine, not a thread: one process
holds thousands of agents, and idle or slow ones cost nothing but memory. Ingest takes the raw bytes of each
batch and decodes them itself (gpuwatch.core.columnar), so a malformed, oversized or wrong-version batch is
answered with a precise status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, FAILED_PRECONDITION) and a log line
naming the agent and peer, while every other client keeps being served. A batch that validated but that the
store cannot keep gets a final INVALID_ARGUMENT (the agent sets it aside instead of resending it forever), a
store failure such as a full disk UNAVAILABLE (the agent resends), a batch of a second agent under the same
agent id ALREADY_EXISTS (never UNKNOWN): :func:`store_failure`. A batch is acknowledged only after the
store's writer thread committed it (the event loop awaits the store's future, never blocks on it); resends
are recognised by (agent_id, sequence) in the store. Calls that arrive before the store is open wait for it
(:meth:`IngestService.attach`).

Bounds, so no client can starve the others: each stream has at most ``stream_window`` batches between
received and acknowledged (beyond that the server stops reading it and HTTP/2 flow control holds the
sender), the whole collector at most ``max_in_flight`` (fair, first come first served), at most
``max_ingest_streams`` streams are open at once (gpuwatch.collector.ingest_admission, which also fences
agent ids: one live agent instance per id), and a stream that sends nothing for ``stream_idle_s`` is closed
(the agent reconnects when it has data). The connection-level bounds are the server's
(gpuwatch.collector.server).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, NoReturn

import grpc
from google.protobuf.message import DecodeError

from gpuwatch.collector.ingest_admission import StreamAdmission, StreamRefused, fencing_advice
from gpuwatch.collector.label_budget import LabelBudget
from gpuwatch.collector.store.base import Store, StoreClosed, WriteResult
from gpuwatch.core.batches import INSTANCE_METADATA, MAX_BATCH_BYTES, SCHEMA_VERSION, BatchError, TimeWindow
from gpuwatch.core.errors import AgentIdConflict
from gpuwatch.core.settings import DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_INGEST_STREAMS, DEFAULT_STREAM_IDLE_S
from gpuwatch.v1 import ingest_view_pb2 as view
from gpuwatch.v1 import telemetry_pb2 as pb

if TYPE_CHECKING:
    from gpuwatch.core.columnar import ColumnarBatch

log = logging.getLogger(__name__)

DEFAULT_STREAM_WINDOW = 64  # batches per stream between received and acked (agents keep 32 in flight)
#: Initial metadata of an Ingest stream the collector admitted (a refused one ends with a status instead).
ADMITTED_METADATA = (("gpuwatch-stream", "admitted"),)


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
