"""The agent's gRPC uplink: streams spooled batches to the collector in order and deletes them on ack.

One long-lived bidi ``Ingest.Stream`` carries the spooled bytes as they are (no re-encoding) with at most
``window`` batches unacknowledged. When the collector is away the uplink reconnects with capped, jittered
exponential backoff and resends everything not yet acknowledged (the collector deduplicates by agent id and
sequence); given several collectors (``a:7700,b:7700``, sharing one store) it moves on to the next one.
When the collector refuses the stream with INVALID_ARGUMENT or FAILED_PRECONDITION (final: the batch will
never be stored), the batches that were in flight are retried one by one with ``Ingest.Push`` to find the
refused one, which is moved to ``<spool>/rejected/`` and counted so it can never block the rest.

Every call carries this process's instance token. ALREADY_EXISTS means another running agent uses the same
agent id (a copied spool or VM image): nothing is sent or dropped, the spool records the conflict for
``gpuwatch agent --check``, and the uplink keeps retrying slowly in case the other agent goes away.
"""
from __future__ import annotations

import logging
import random
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from gpuwatch.core import security
from gpuwatch.core.settings import ClientSecurity
from gpuwatch.agent.spool import Spool
from gpuwatch.core.batches import INSTANCE_METADATA, MAX_BATCH_BYTES
from gpuwatch.v1 import telemetry_pb2 as pb

log = logging.getLogger(__name__)

_STREAM = "/gpuwatch.v1.Ingest/Stream"
_PUSH = "/gpuwatch.v1.Ingest/Push"
_REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
_MESSAGE_LIMIT = MAX_BATCH_BYTES + 64 * 1024  # a full batch plus the envelope


def make_channel(address: str, *, channel_security: ClientSecurity = ClientSecurity(), reconnect_max_s: float = 10.0,
                 options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """The one place that builds the agent's channel; bad certificate or token files raise UserError."""
    base = [
        ("grpc.max_send_message_length", _MESSAGE_LIMIT),
        ("grpc.max_receive_message_length", _MESSAGE_LIMIT),
        ("grpc.keepalive_time_ms", 60_000),  # collectors must allow pings every >= 60 s
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", int(reconnect_max_s * 1000)),
    ]
    return security.client_channel(address, channel_security, options=base + list(options))


@dataclass
class UplinkStats:
    sent: int = 0
    acked: int = 0
    duplicates: int = 0
    rejected: int = 0
    last_rejected: str = ""  # why the collector refused the latest batch moved to rejected/
    reconnects: int = 0
    last_error: str = ""
    fenced: str = ""  # the collector's ALREADY_EXISTS message while another agent holds this agent id


@dataclass
class _Stream:
    """What one stream attempt has sent and not yet seen acknowledged."""

    in_flight: list[int] = field(default_factory=list)
    last_sent: int = 0
    closed: bool = False


class Uplink:
    """Background sender over a :class:`Spool`; call :meth:`notify` after appending a batch."""

    def __init__(
        self,
        spool: Spool,
        address: str,
        window: int = 32,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 10.0,
        channel_factory: Callable[[str], grpc.Channel] | None = None,
        channel_security: ClientSecurity = ClientSecurity(),
    ) -> None:
        self.spool = spool
        self.addresses = collector_addresses(address)
        for each in self.addresses:  # a bad entry stops the agent now, not the uplink at its first fail-over
            security.check_client_target(each, channel_security)
        self.window = window
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.stats = UplinkStats()
        self._new_channel = channel_factory or (
            lambda a: make_channel(a, channel_security=channel_security, reconnect_max_s=backoff_max_s))
        self._current = 0
        self._open(self.addresses[0])
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._call: Any | None = None  # the stream in flight (grpc's call: iterable, cancel())
        self._attempt = 0
        self._metadata = ((INSTANCE_METADATA, uuid.uuid4().hex),)

    @property
    def address(self) -> str:
        """The collector the uplink sends to now."""
        return self.addresses[self._current]

    def _open(self, address: str) -> None:
        self._channel = self._new_channel(address)
        self._stream_call = self._channel.stream_stream(
            _STREAM, request_serializer=_raw, response_deserializer=pb.BatchAck.FromString)
        self._push_call = self._channel.unary_unary(
            _PUSH, request_serializer=_raw, response_deserializer=pb.BatchAck.FromString)

    def _fail_over(self) -> None:
        """Move on to the next collector of the list (after a failed stream) whose channel opens; the
        unacknowledged batches are resent there, and the collectors' shared store keeps each once."""
        if len(self.addresses) < 2:
            return
        failed = self.address
        self._channel.close()
        for _ in self.addresses:
            self._current = (self._current + 1) % len(self.addresses)
            try:
                self._open(self.address)
            except Exception as exc:  # e.g. a certificate file removed since the start
                log.error("collector %s: cannot open a channel (%s); trying the next one", self.address, exc)
                continue
            log.warning("collector %s unavailable; failing over to %s", failed, self.address)
            return

    # --- public ------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpuwatch-uplink", daemon=True)
        self._thread.start()

    def notify(self) -> None:
        """A new batch is in the spool."""
        with self._cond:
            self._cond.notify_all()

    def wait_drained(self, timeout: float) -> bool:
        """Wait until every spooled batch is acknowledged (or quarantined); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self.spool.pending(), timeout)

    def stop(self) -> None:
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._channel.close()

    # --- the sender thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        """The sender loop; nothing ends it but :meth:`stop` (an unexpected error is logged and retried after
        the backoff, so the agent never samples on with an uplink that has quietly died)."""
        while not self._stopping.is_set():
            try:
                self._attempt_stream()
            except Exception as exc:
                # the traceback once per outage, as _back_off warns once per outage
                log.error("uplink to %s: unexpected error %s: %s; retrying", self.address, type(exc).__name__, exc,
                          exc_info=self._attempt == 0)
                if not self._stopping.is_set():
                    self._back_off(f"{type(exc).__name__}: {exc}")
                    self._fail_over()

    def _attempt_stream(self) -> None:
        """One stream to the current collector; after a failure, the backoff and the next collector."""
        stream = _Stream()
        try:
            self._stream(stream)
            error = "collector ended the stream"
        except grpc.RpcError as exc:
            if self._stopping.is_set():
                return
            error = f"{exc.code().name}: {exc.details()}"
            if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                self._fenced(exc.details())
                self._stopping.wait(self.backoff_max_s)
                return
            if exc.code() in _REFUSED and stream.in_flight:
                try:
                    if self._isolate_refused(stream.in_flight):
                        return
                except grpc.RpcError as push_exc:
                    error = f"{push_exc.code().name}: {push_exc.details()}"
        finally:
            with self._cond:
                stream.closed = True
                self._cond.notify_all()
        if not self._stopping.is_set():
            self._back_off(error)
            self._fail_over()

    def _stream(self, stream: _Stream) -> None:
        self._call = self._stream_call(self._requests(stream), metadata=self._metadata)
        try:
            for ack in self._call:
                self._acknowledged(ack, stream)
        finally:
            self._call = None

    def _requests(self, stream: _Stream):
        """Yields spooled batches in order, at most ``window`` unacknowledged (runs in a gRPC thread)."""
        while True:
            with self._cond:
                seq = None
                while not (stream.closed or self._stopping.is_set()):
                    if len(stream.in_flight) < self.window:
                        seq = self.spool.next_after(stream.last_sent)
                        if seq is not None:
                            break
                    self._cond.wait(0.5)
                if seq is None:
                    return
                stream.in_flight.append(seq)
                stream.last_sent = seq
            self.spool.mark_sent(seq)  # first: a batch that may be stored is never dropped (nor counted as lost)
            data = self.spool.read(seq)
            if data is None:  # dropped by the size bound or a full disk before it was marked
                self._forget(seq, stream)
                continue
            self.stats.sent += 1
            yield data

    def _acknowledged(self, ack: pb.BatchAck, stream: _Stream) -> None:
        # Acks come in the order batches were sent; a spooled batch may carry an older agent id than the
        # spool's (state.json was lost), so the sequence in flight is what identifies it.
        if ack.sequence not in stream.in_flight:
            log.warning("ack for a batch not in flight (%s, sequence %d) ignored", ack.agent_id, ack.sequence)
            return
        if self.stats.fenced:
            self.stats.fenced = ""
            self.spool.record_identity_conflict("")
        self.spool.ack(ack.sequence)
        self.stats.acked += 1
        self.stats.duplicates += int(ack.duplicate)
        self._attempt = 0
        self._forget(ack.sequence, stream)

    def _forget(self, seq: int, stream: _Stream) -> None:
        with self._cond:
            if seq in stream.in_flight:
                stream.in_flight.remove(seq)
            self._cond.notify_all()

    def _isolate_refused(self, in_flight: list[int]) -> bool:
        """Push each in-flight batch alone: acked ones are done, refused ones quarantined. True if any refused."""
        refused = False
        for seq in list(in_flight):
            data = self.spool.read(seq)
            if data is None:
                continue
            try:
                ack = self._push_call(data, timeout=30.0, metadata=self._metadata)
            except grpc.RpcError as exc:
                if exc.code() not in _REFUSED:
                    raise
                reason = f"collector {self.address} refused batch {seq}: {exc.code().name}: {exc.details()}"
                path = self.spool.quarantine(seq, reason)
                log.error("%s; moved to %s", reason, path)
                self.stats.rejected += 1
                self.stats.last_rejected = reason
                refused = True
                continue
            self.spool.ack(ack.sequence)
            self.stats.acked += 1
        with self._cond:
            self._cond.notify_all()
        return refused

    def _fenced(self, details: str) -> None:
        if not self.stats.fenced:
            log.error("collector %s refuses this agent: %s", self.address, details)
        self.stats.fenced = self.stats.last_error = details
        self.spool.record_identity_conflict(details)
        with self._cond:
            self._cond.notify_all()

    def _back_off(self, error: str) -> None:
        delay = min(self.backoff_max_s, self.backoff_initial_s * 2 ** self._attempt)
        self._attempt += 1
        self.stats.reconnects += 1
        self.stats.last_error = error
        level = logging.WARNING if self._attempt == 1 else logging.DEBUG  # once per outage, not per retry
        log.log(level, "collector %s: %s; retrying (backoff up to %.0f s)", self.address, error, self.backoff_max_s)
        self._stopping.wait(random.uniform(delay / 2, delay))


def collector_addresses(value: str) -> list[str]:
    """The collectors of a ``--collector`` value: HOST:PORT, or several separated by commas (tried in turn)."""
    addresses = [a.strip() for a in value.split(",") if a.strip()]
    if not addresses:
        raise ValueError(f"collector {value!r}: expected HOST:PORT[,HOST:PORT...]")
    return addresses


def _raw(data: bytes) -> bytes:
    return data
