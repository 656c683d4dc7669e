"""The collector's gRPC server put together: Ingest and Query on one port, the store, and the services.

The server is asynchronous (grpc.aio on one event-loop thread): Ingest
(gpuwatch.collector.ingest_service) runs on the loop, Query (gpuwatch.collector.query_service) on its own
thread pool (``max_workers``). The port is bound before the store opens (a collector takes connections within
a second of starting); calls that arrive meanwhile wait for the store. Parts that run beside ingest (scoring,
the jobs monitor, metrics) are :class:`Service` objects: they get the store when the server starts, may answer
Query methods, and are stopped before the store closes. Connection bounds: keepalive pings find dead peers (and
a ping flood is refused), a connection opens at most ``STREAMS_PER_CONNECTION`` streams, and connections
without calls are closed after ``CONNECTION_IDLE_S``. Transport security (TLS, mutual TLS, bearer token, the
loopback-only plaintext rule) is gpuwatch.core.security's.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import grpc

from gpuwatch.collector.ingest_service import IngestService
from gpuwatch.collector.query_service import DEFAULT_QUERY_HANDLERS, QueryHandler, StoreGate, query_handler
from gpuwatch.collector.store import open_store, redacted
from gpuwatch.collector.store.base import Store
from gpuwatch.core import security
from gpuwatch.core.batches import MAX_BATCH_BYTES, TimeWindow
from gpuwatch.core.errors import UserError
from gpuwatch.core.security import read_token
from gpuwatch.core.settings import CollectorSettings, split_address
from gpuwatch.core.times import parse_duration

log = logging.getLogger(__name__)

# gRPC refuses messages above this outright (memory guard); batches between MAX_BATCH_BYTES and this
# reach decode_batch, which answers with a message that says what to do.
_HARD_RECEIVE_LIMIT = 4 * MAX_BATCH_BYTES
CONNECTION_IDLE_S = 600.0  # a connection without calls (a query client that went quiet) is closed
STREAMS_PER_CONNECTION = 100  # an agent needs one; a client opening more is refused further streams


class Service(Protocol):
    """A part of the collector running beside ingest (scorer, jobs monitor, metrics endpoint)."""

    def start(self, store: Store) -> Mapping[str, QueryHandler]:
        """Begin work on ``store``; return the Query methods it answers (may be empty)."""

    def stop(self) -> None:
        """Stop; called before the store closes."""


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


def serve(settings: CollectorSettings, *, services: Sequence[Service] | Callable[[], Sequence[Service]] = (),
          query_handlers: Mapping[str, QueryHandler] | None = None) -> CollectorServer:
    """Serve on ``settings.listen`` ("host:port", port 0 picks a free one), then open the store and start
    ``services``.

    The port is bound first, so a starting collector accepts connections at once; calls that arrive before
    the store is open wait for it (ingest acknowledges nothing until its batches are committed, so nothing
    is lost when the store then fails to open: the calls end UNAVAILABLE and agents resend). ``services``
    may be a function that builds them, called once the port is bound (the collector command imports its
    heavy modules there). Transport security, the store and its retention, the query threads, the ingest
    bounds and the accepted time window are the settings' (their help says what each does; see the module
    docstrings of gpuwatch.collector.ingest_service for the bounds).
    Query methods: the defaults, SubmitTrace/Breakdown, the services', then ``query_handlers``.
    Raises UserError when the store is locked by another process or the address cannot be bound.
    """
    listen, store_url = settings.listen, settings.store or settings.db
    token = read_token(settings.token_file) if settings.token_file else None
    handlers: dict[str, QueryHandler] = dict(DEFAULT_QUERY_HANDLERS)
    gate = StoreGate()
    ingest = IngestService(None, max_in_flight=settings.max_in_flight, stream_idle_s=settings.stream_idle_timeout,
                           max_ingest_streams=settings.max_ingest_streams,
                           window=TimeWindow(settings.max_sample_age_days, settings.max_sample_ahead_days))
    query_pool = ThreadPoolExecutor(max_workers=settings.max_workers, thread_name_prefix="query")
    loop = _EventLoopThread()
    try:
        server, port = loop.run(_start_grpc(
            listen, (ingest.handler(), query_handler(gate, handlers)), query_pool, token,
            {"cert": settings.tls_cert, "key": settings.tls_key, "client_ca": settings.tls_client_ca},
            settings.insecure))
    except BaseException:
        loop.close()
        query_pool.shutdown(wait=False)
        raise
    log.debug("collector bound %s (port %d); opening store %s", listen, port, redacted(store_url))
    started: list[Service] = []
    store: Store | None = None
    try:
        store = open_store(store_url, **store_options(settings))
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
    security_kind = ("mutual TLS" if settings.tls_client_ca else "TLS" if settings.tls_cert or settings.tls_key
                     else "plaintext")
    log.info("collector listening on %s:%d (%s), store %s", host, port, security_kind, redacted(store_url))
    return CollectorServer(server, loop, query_pool, store, host, port, started, ingest)


def store_options(settings: CollectorSettings) -> dict[str, Any]:
    """The store's options from the collector's settings (a duration of 0 turns its tier off)."""
    return {"retention_days": settings.retention_days, "memory_limit": settings.memory_limit,
            "span_retention_s": settings.span_retention or None,
            "raw_retention_s": parse_duration(settings.raw_retention) or None,
            "rollup_retention_s": parse_duration(settings.rollup_retention) or None,
            "clickhouse_cluster": settings.clickhouse_cluster}
