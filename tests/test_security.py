"""TLS, mutual TLS and bearer tokens against a real gRPC server on loopback, with certificates made here."""
from __future__ import annotations

import socket
from concurrent import futures

import grpc
import pytest

from gpuwatch.core import security
from gpuwatch.core.errors import UserError
from gpuwatch.v1 import query_pb2, query_pb2_grpc
from helpers import TOKEN

class _Nodes(query_pb2_grpc.QueryServicer):
    def ListNodes(self, request, context):
        return query_pb2.ListNodesResponse(nodes=[query_pb2.NodeSummary(node="n1", gpus=8)])


def _serve(token=None, **tls):
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=security.server_interceptors(token))
    query_pb2_grpc.add_QueryServicer_to_server(_Nodes(), server)
    port = security.add_listen_port(server, "127.0.0.1:0", **tls)
    server.start()
    return server, f"127.0.0.1:{port}"


def _call(channel) -> str:
    with channel:
        reply = query_pb2_grpc.QueryStub(channel).ListNodes(query_pb2.ListNodesRequest(), timeout=5)
    return reply.nodes[0].node


def _status(channel) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        _call(channel)
    return info.value.code()


@pytest.fixture
def plain_token_server():
    server, target = _serve(TOKEN)
    yield target
    server.stop(None)


def test_token_on_plaintext_loopback(plain_token_server):
    assert _call(security.open_channel(plain_token_server, token=TOKEN)) == "n1"
    assert _status(security.open_channel(plain_token_server)) == grpc.StatusCode.UNAUTHENTICATED
    assert _status(security.open_channel(plain_token_server, token="wrong")) == grpc.StatusCode.UNAUTHENTICATED


def test_unknown_method_is_still_unimplemented_with_token_check(plain_token_server):
    with security.open_channel(plain_token_server, token=TOKEN) as channel:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/gpuwatch.v1.Query/NoSuchMethod")(b"", timeout=5)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _mtls(pki, token=TOKEN):
    return _serve(token, cert=pki["server"], key=pki["server_key"], client_ca=pki["ca"])


def test_mutual_tls_accepts_good_client_and_rejects_others(pki):
    server, target = _mtls(pki)
    try:
        good = dict(ca=pki["ca"], cert=pki["client"], key=pki["client_key"])
        assert _call(security.open_channel(target, token=TOKEN, **good)) == "n1"
        # valid certificate, no token
        assert _status(security.open_channel(target, **good)) == grpc.StatusCode.UNAUTHENTICATED
        # token but a certificate from another CA, or none: the handshake fails
        rogue = dict(ca=pki["ca"], cert=pki["rogue_client"], key=pki["rogue_client_key"])
        assert _status(security.open_channel(target, token=TOKEN, **rogue)) == grpc.StatusCode.UNAVAILABLE
        assert _status(security.open_channel(target, token=TOKEN, ca=pki["ca"])) == grpc.StatusCode.UNAVAILABLE
        # client that does not trust the server's CA
        untrusting = dict(ca=pki["rogue_ca"], cert=pki["client"], key=pki["client_key"])
        assert _status(security.open_channel(target, token=TOKEN, **untrusting)) == grpc.StatusCode.UNAVAILABLE
        # plaintext client against a TLS server
        assert _status(security.open_channel(target, token=TOKEN)) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)


def test_server_tls_without_client_certificates(pki):
    server, target = _serve(None, cert=pki["server"], key=pki["server_key"])
    try:
        assert _call(security.open_channel(target, ca=pki["ca"])) == "n1"
    finally:
        server.stop(None)


@pytest.mark.parametrize(
    "address, tls, insecure, refused",
    [
        ("127.0.0.1:7700", False, False, False),
        ("[::1]:7700", False, False, False),
        ("localhost:7700", False, False, False),
        ("0.0.0.0:7700", False, False, True),
        ("[::]:7700", False, False, True),
        ("10.1.2.3:7700", False, False, True),
        ("collector.example:7700", False, False, True),
        ("0.0.0.0:7700", True, False, False),
        ("0.0.0.0:7700", False, True, False),
    ],
)
def test_listen_policy(address, tls, insecure, refused):
    if refused:
        with pytest.raises(UserError, match=r"refusing to listen on .*without TLS.*insecure"):
            security.check_listen_policy(address, tls, insecure)
    else:
        security.check_listen_policy(address, tls, insecure)


def test_listen_policy_names_a_bad_address():
    with pytest.raises(UserError, match="not HOST:PORT"):
        security.check_listen_policy("7700", False, False)


def test_plaintext_token_to_remote_collector_needs_insecure():
    with pytest.raises(UserError, match="bearer token to 10.0.0.5:7700 without TLS"):
        security.open_channel("10.0.0.5:7700", token=TOKEN)
    security.open_channel("10.0.0.5:7700", token=TOKEN, insecure=True).close()


def test_bad_credential_files_name_the_file(tmp_path, pki):
    not_pem = tmp_path / "server.crt"
    not_pem.write_text("hello")
    with pytest.raises(UserError, match=r"server certificate .*server.crt: not a PEM file"):
        security.server_credentials(not_pem, pki["server_key"])
    with pytest.raises(UserError, match=r"CA certificate .*missing.pem: not found"):
        security.channel_credentials(tmp_path / "missing.pem")
    with pytest.raises(UserError, match="certificate and key go together"):
        security.channel_credentials(pki["ca"], cert=pki["client"])
    with pytest.raises(UserError, match="needs the server certificate"):
        security.add_listen_port(grpc.server(futures.ThreadPoolExecutor(1)), "127.0.0.1:0", client_ca=pki["ca"])


def test_port_in_use_is_a_clear_error():
    with socket.socket() as taken:  # a plain socket: gRPC servers share ports with SO_REUSEPORT
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(UserError, match=f"cannot listen on {address}: address in use"):
            security.add_listen_port(grpc.server(futures.ThreadPoolExecutor(1)), address)


def test_read_token(tmp_path):
    good = tmp_path / "token"
    good.write_text(f"  {TOKEN}\n")
    good.chmod(0o600)
    assert security.read_token(good) == TOKEN
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(UserError, match="empty: file is empty"):
        security.read_token(empty)
    spaced = tmp_path / "spaced"
    spaced.write_text("two words")
    spaced.chmod(0o600)
    with pytest.raises(UserError, match="one word"):
        security.read_token(spaced)


def test_token_matches():
    assert security.token_matches(f"Bearer {TOKEN}", TOKEN)
    assert not security.token_matches(TOKEN, TOKEN)
    assert not security.token_matches(None, TOKEN)
    assert not security.token_matches(f"Bearer {TOKEN}x", TOKEN)
