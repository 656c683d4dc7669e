"""Talking to a collector: a query stub with a clear error when it is unreachable, and a batch streamer.

Channels go through gpuwatch.core.security.client_channel with the client's
:class:`~gpuwatch.core.settings.ClientSecurity`, so TLS, mutual TLS and the bearer token work the same for the
agent and every command (``--tls-ca --tls-cert --tls-key --token-file``, or GPUWATCH_TLS_CA, ...).

The streamer keeps a bounded number of batches in flight and yields acknowledgements as the collector
commits them; tools that replay or benchmark (and tests) use it instead of each writing their own loop.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

import grpc

from gpuwatch.core.security import client_channel
from gpuwatch.core.settings import ClientSecurity
from gpuwatch.core.errors import UserError
from gpuwatch.v1 import query_pb2_grpc
from gpuwatch.v1 import telemetry_pb2 as pb

_CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def channel(address: str, timeout: float = 3.0, *, security: ClientSecurity = ClientSecurity()) -> grpc.Channel:
    """A connected channel to ``address`` with the client's TLS and token settings, or UserError naming the
    address."""
    ch = client_channel(address, security, options=_CHANNEL_OPTIONS)
    try:
        grpc.channel_ready_future(ch).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        ch.close()
        raise UserError(f"cannot reach the collector at {address} (no answer within {timeout:g} s); "
                        "is `gpuwatch collector` running there? (--collector or GPUWATCH_COLLECTOR)") from None
    return ch


def connect(address: str, timeout: float = 3.0, *, security: ClientSecurity = ClientSecurity()
            ) -> query_pb2_grpc.QueryStub:
    """A Query stub for the collector at ``address`` ("host:port"); options as for :func:`channel`."""
    return query_pb2_grpc.QueryStub(channel(address, timeout, security=security))


def _serialize(batch: bytes | pb.TelemetryBatch) -> bytes:
    return batch if isinstance(batch, bytes) else batch.SerializeToString()


def stream_batches(
    ch: grpc.Channel, batches: Iterable[bytes | pb.TelemetryBatch], window: int = 64
) -> Iterator[pb.BatchAck]:
    """Send batches (messages or pre-serialized bytes) on one Ingest stream, at most ``window`` unacked.

    Yields each BatchAck in order; a rejected batch ends the stream with its grpc.RpcError.
    """
    in_flight = threading.Semaphore(window)

    def requests() -> Iterator[bytes]:
        for batch in batches:
            in_flight.acquire()
            yield batch

    call = ch.stream_stream("/gpuwatch.v1.Ingest/Stream", request_serializer=_serialize,
                            response_deserializer=pb.BatchAck.FromString)
    for ack in call(requests()):
        in_flight.release()
        yield ack


def push(ch: grpc.Channel, batch: bytes | pb.TelemetryBatch, timeout: float = 30.0) -> pb.BatchAck:
    """Send one batch with the unary Push and return its ack."""
    call = ch.unary_unary("/gpuwatch.v1.Ingest/Push", request_serializer=_serialize,
                          response_deserializer=pb.BatchAck.FromString)
    return call(batch, timeout=timeout)
