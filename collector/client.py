"""Talking to a collector: a query stub with a clear error when it is unreachable, and a batch streamer.

Channels go through gpuwatch.core.security.open_channel, so TLS, mutual TLS and the bearer token work the same
for every read command (``--tls-ca --tls-cert --tls-key --token-file``, or GPUWATCH_TLS_CA, ...).

The streamer keeps a bounded number of batches in flight and yields acknowledgements as the collector
commits them; tools that replay or benchmark (and tests) use it instead of each writing their own loop.
"""
from __future__ import annotations

import argparse
import os
import threading
from collections.abc import Iterable, Iterator

import grpc

from gpuwatch.core import security
from gpuwatch.core.errors import UserError
from gpuwatch.v1 import query_pb2_grpc
from gpuwatch.v1 import telemetry_pb2 as pb

_CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def channel(address: str, timeout: float = 3.0, *, ca: str | None = None, cert: str | None = None,
            key: str | None = None, token: str | None = None, insecure: bool = False) -> grpc.Channel:
    """A connected channel to ``address`` (TLS with ``ca``, mutual with ``cert``/``key``, ``token`` attached),
    or UserError naming the address."""
    ch = security.open_channel(address, ca=ca, cert=cert, key=key, token=token, insecure=insecure,
                               options=_CHANNEL_OPTIONS)
    try:
        grpc.channel_ready_future(ch).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        ch.close()
        raise UserError(f"cannot reach the collector at {address} (no answer within {timeout:g} s); "
                        "is `gpuwatch collector` running there? (--collector or GPUWATCH_COLLECTOR)") from None
    return ch


def connect(address: str, timeout: float = 3.0, **security_options: object) -> query_pb2_grpc.QueryStub:
    """A Query stub for the collector at ``address`` ("host:port"); options as for :func:`channel`."""
    return query_pb2_grpc.QueryStub(channel(address, timeout, **security_options))


def add_connection_arguments(parser: argparse.ArgumentParser, default_collector: str) -> None:
    """``--collector`` and the TLS/token flags of every command that talks to a collector."""
    env = os.environ.get
    parser.add_argument("--collector", default=env("GPUWATCH_COLLECTOR", default_collector),
                        help=f"collector HOST:PORT (default $GPUWATCH_COLLECTOR or {default_collector})")
    parser.add_argument("--tls-ca", default=env("GPUWATCH_TLS_CA"),
                        help="CA certificate (PEM) to verify the collector; enables TLS (env GPUWATCH_TLS_CA)")
    parser.add_argument("--tls-cert", default=env("GPUWATCH_TLS_CERT"),
                        help="client certificate (PEM) for mutual TLS (env GPUWATCH_TLS_CERT)")
    parser.add_argument("--tls-key", default=env("GPUWATCH_TLS_KEY"),
                        help="client private key (PEM) for mutual TLS (env GPUWATCH_TLS_KEY)")
    parser.add_argument("--token-file", default=env("GPUWATCH_TOKEN_FILE"),
                        help="file holding the bearer token (env GPUWATCH_TOKEN_FILE)")
    parser.add_argument("--insecure", action="store_true", default=env("GPUWATCH_INSECURE", "") in ("1", "true"),
                        help="allow sending the token in plaintext to a non-loopback collector")


def channel_args(args: argparse.Namespace, timeout: float = 3.0) -> grpc.Channel:
    """A connected channel from the flags of :func:`add_connection_arguments` (``collector``, ``tls_ca``,
    ``tls_cert``, ``tls_key``, ``token_file``, ``insecure``)."""
    token = security.read_token(args.token_file) if args.token_file else None
    return channel(args.collector, timeout, ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key, token=token,
                   insecure=args.insecure)


def connect_args(args: argparse.Namespace) -> query_pb2_grpc.QueryStub:
    """A Query stub from the flags of :func:`add_connection_arguments`."""
    return query_pb2_grpc.QueryStub(channel_args(args))


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
