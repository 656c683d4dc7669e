"""TLS, mutual TLS and bearer tokens between agents, the collector and its clients.

Telemetry and the query API are only as trustworthy as the channel: a cluster network is shared, so the
collector refuses to listen beyond loopback in plaintext unless told ``insecure``, checks a bearer token on
every call (constant-time compare), and can demand client certificates from agents. The functions take file
paths, as configs name them, and fail with one line naming the file and the problem.
"""
from __future__ import annotations

import collections
import hmac
import ipaddress
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from gpuwatch.core.settings import ClientSecurity, split_address
from gpuwatch.core.errors import UserError

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
AUTH_HEADER = "authorization"
UNAUTHENTICATED_DETAILS = "missing or invalid bearer token"


# ---- files --------------------------------------------------------------------------------------------

def _read(path: PathLike, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise UserError(f"{what} {path}: not found") from None
    except OSError as exc:
        raise UserError(f"{what} {path}: cannot read: {exc.strerror}") from None
    if not data.strip():
        raise UserError(f"{what} {path}: file is empty")
    return data


def _read_pem(path: PathLike, what: str) -> bytes:
    data = _read(path, what)
    if b"-----BEGIN " not in data:
        raise UserError(f"{what} {path}: not a PEM file (no '-----BEGIN' line)")
    return data


def read_token(path: PathLike) -> str:
    """The bearer token in a file (surrounding whitespace stripped); one line, no spaces; refused, as ssh
    refuses a private key, when others may read it (see :func:`check_private`)."""
    token = _read(path, "token file").decode("utf-8", "replace").strip()
    check_private(path, "token file")
    if any(c.isspace() for c in token):
        raise UserError(f"token file {path}: the token must be one word without spaces or line breaks")
    return token


def check_private(path: PathLike, what: str) -> None:
    """UserError when a secret file is readable by others: world-readable whoever owns it, or open to its
    group or others while owned by this user (ssh's rule for keys; a file owned by root and shared with
    this user's group, as Kubernetes mounts a secret with fsGroup, is accepted)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise UserError(f"{what} {path}: cannot read: {exc.strerror}") from None
    mode = st.st_mode & 0o777
    if mode & 0o004 or (st.st_uid == os.geteuid() and mode & 0o077):
        raise UserError(f"{what} {path}: permissions {mode:04o} are too open (others can read the secret); "
                        f"run chmod 600 {path}")


def _pair(cert: PathLike | None, key: PathLike | None, role: str) -> tuple[bytes, bytes] | None:
    if (cert is None) != (key is None):
        raise UserError(f"{role} certificate and key go together: got only the {'certificate' if cert else 'key'}")
    if cert is None or key is None:
        return None
    return _read_pem(key, f"{role} key"), _read_pem(cert, f"{role} certificate")


# ---- credentials --------------------------------------------------------------------------------------

def server_credentials(cert: PathLike, key: PathLike, client_ca: PathLike | None = None) -> grpc.ServerCredentials:
    """TLS for a gRPC server; with ``client_ca`` clients must present a certificate that chains to it."""
    pair = _pair(cert, key, "server")
    ca = _read_pem(client_ca, "client CA") if client_ca is not None else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(ca: PathLike, cert: PathLike | None = None,
                        key: PathLike | None = None) -> grpc.ChannelCredentials:
    """TLS for a gRPC client, verifying the server against ``ca``; ``cert``/``key`` add a client certificate."""
    pair = _pair(cert, key, "client")
    private_key, chain = pair if pair else (None, None)
    return grpc.ssl_channel_credentials(_read_pem(ca, "CA certificate"), private_key, chain)


# ---- token checking (server side) ---------------------------------------------------------------------

def token_matches(header: str | None, token: str) -> bool:
    """True when an ``Authorization`` value is ``Bearer <token>``; constant time in the token."""
    expected = f"Bearer {token}".encode()
    return header is not None and hmac.compare_digest(header.encode(), expected)


def _refusal_reason(header: str | None) -> str:
    return "no bearer token" if header is None else "wrong bearer token"


def _denied(handler: grpc.RpcMethodHandler, method: str, why: str, asynchronous: bool = False
            ) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED without running it (and logs who
    was turned away, so a misconfigured agent shows in the collector's log, not only in its own). On an
    asyncio server the refusal runs on the event loop and must be a coroutine (a plain function's abort would
    wait on the loop it blocks)."""

    def abort(_request: Any, context: grpc.ServicerContext) -> None:
        log.warning("refused %s from %s: %s", method, context.peer(), why)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)

    async def abort_async(_request: Any, context: grpc.aio.ServicerContext) -> None:
        log.warning("refused %s from %s: %s", method, context.peer(), why)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)

    if asynchronous:
        abort = abort_async  # type: ignore[assignment]
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Rejects every call whose ``authorization`` metadata is not ``Bearer <token>`` (UNAUTHENTICATED)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("empty bearer token")
        self._token = token

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        header = dict(details.invocation_metadata or ()).get(AUTH_HEADER)
        if handler is None or token_matches(header, self._token):
            return handler
        return _denied(handler, details.method, _refusal_reason(header))


class AsyncBearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """:class:`BearerTokenInterceptor` for an asyncio server (grpc.aio); refused calls get UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("empty bearer token")
        self._token = token

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        header = dict(details.invocation_metadata or ()).get(AUTH_HEADER)
        if handler is None or token_matches(header, self._token):
            return handler
        return _denied(handler, details.method, _refusal_reason(header), asynchronous=True)


# ---- attaching the token (client side) ----------------------------------------------------------------

class _CallDetails(
    collections.namedtuple("_CallDetails", "method timeout metadata credentials wait_for_ready compression"),
    grpc.ClientCallDetails,
):
    pass


class _BearerMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` on plaintext channels, where gRPC refuses call credentials."""

    def __init__(self, token: str) -> None:
        self._header = (AUTH_HEADER, f"Bearer {token}")

    def _with_token(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = list(details.metadata or ()) + [self._header]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(details), request_iterator)


def open_channel(
    target: str,
    *,
    ca: PathLike | None = None,
    cert: PathLike | None = None,
    key: PathLike | None = None,
    token: str | None = None,
    insecure: bool = False,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A client channel: TLS when ``ca`` is given (mutual with ``cert``/``key``), with the token attached.

    A token over plaintext to a non-loopback target would travel readable by anyone on the path, so that
    needs ``insecure=True``.
    """
    if ca is not None:
        creds = channel_credentials(ca, cert, key)
        if token:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
        return grpc.secure_channel(target, creds, options=list(options))
    if cert is not None or key is not None:
        raise UserError("a client certificate needs TLS: give the CA certificate (tls_ca) too")
    if token:
        _check_token_exposure(target, insecure)
    channel = grpc.insecure_channel(target, options=list(options))
    return grpc.intercept_channel(channel, _BearerMetadata(token)) if token else channel


def _check_token_exposure(target: str, insecure: bool) -> None:
    check_exposure(target, protected=False, insecure=insecure, what="to send a bearer token to",
                   needs="TLS (tls_ca)")


def check_client_target(target: str, client: ClientSecurity) -> None:
    """What :func:`client_channel` would refuse for ``target``, checked without opening it: a client given
    several targets checks all of them at start, not each when it first fails over to it."""
    if client.token_file and client.tls_ca is None:
        _check_token_exposure(target, client.insecure)


def client_channel(target: str, client: ClientSecurity, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """:func:`open_channel` with a client's security settings (the agent's, a query command's, replay's): the
    token is read from ``token_file`` here, so a bad file stops the client with one line naming it."""
    token = read_token(client.token_file) if client.token_file else None
    return open_channel(target, ca=client.tls_ca, cert=client.tls_cert, key=client.tls_key, token=token,
                        insecure=client.insecure, options=options)


# ---- listening ----------------------------------------------------------------------------------------

def is_loopback(host: str) -> bool:
    """True for localhost and loopback IPs; any other name may resolve to a routable address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(address: str, *, protected: bool, insecure: bool, what: str, needs: str) -> None:
    """Raise UserError when ``address`` is reachable beyond this host, unprotected and not allowed insecure."""
    try:
        host, _ = split_address(address)
    except ValueError as exc:
        raise UserError(f"address {exc}") from None
    if protected or insecure or is_loopback(host):
        return
    raise UserError(
        f"refusing {what} {address} without {needs}: other machines could read and forge the traffic; "
        "configure it, or set insecure (--insecure) if this network is trusted"
    )


def check_listen_policy(address: str, tls: bool, insecure: bool) -> None:
    """Listening on a non-loopback address needs TLS unless ``insecure`` is set."""
    check_exposure(address, protected=tls, insecure=insecure, what="to listen on",
                   needs="TLS (tls_cert and tls_key)")


def add_listen_port(
    server: grpc.Server,
    address: str,
    *,
    cert: PathLike | None = None,
    key: PathLike | None = None,
    client_ca: PathLike | None = None,
    insecure: bool = False,
) -> int:
    """Bind ``server`` to ``address`` (TLS when cert/key are given) after the listen policy; returns the port."""
    tls = cert is not None or key is not None
    if client_ca is not None and not tls:
        raise UserError("tls_client_ca (mutual TLS) needs the server certificate and key (tls_cert, tls_key)")
    check_listen_policy(address, tls, insecure)
    credentials = server_credentials(cert, key, client_ca) if tls else None  # type: ignore[arg-type]
    try:
        if credentials is not None:
            return int(server.add_secure_port(address, credentials))
        return int(server.add_insecure_port(address))
    except RuntimeError:
        raise UserError(f"cannot listen on {address}: address in use or not available") from None


def server_interceptors(token: str | None) -> list[grpc.ServerInterceptor]:
    """Interceptors for ``grpc.server(..., interceptors=...)``: the token check when a token is configured."""
    return [BearerTokenInterceptor(token)] if token else []


def aio_server_interceptors(token: str | None) -> list[grpc.aio.ServerInterceptor]:
    """Interceptors for ``grpc.aio.server(..., interceptors=...)``: the token check when a token is configured."""
    return [AsyncBearerTokenInterceptor(token)] if token else []
