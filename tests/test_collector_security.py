"""The collector behind TLS, mutual TLS and a bearer token: only the right client's batches are stored."""
from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from gpuwatch.apps import cli
from gpuwatch.core import security
from gpuwatch.collector import client
from gpuwatch.collector.server import serve
from gpuwatch.core.settings import local_collector
from gpuwatch.core.errors import UserError
from gpuwatch.core.settings import ClientSecurity
from gpuwatch.v1 import query_pb2 as q
from helpers import ROWS_PER_BATCH, TOKEN, make_batch


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def collector(tmp_path, pki, token_file):
    server = serve(local_collector(str(tmp_path / "s.duckdb"), tls_cert=pki["server"], tls_key=pki["server_key"],
                                 tls_client_ca=pki["ca"], token_file=str(token_file)))
    yield server
    server.stop()


def _push(collector, seq: int, **channel_options):
    ch = security.open_channel(collector.address, **channel_options)
    try:
        return client.push(ch, make_batch(seq), timeout=10)
    finally:
        ch.close()


def _stored(collector) -> int:
    collector.store.flush()
    return collector.store.count("gpu_samples")


def test_right_certificate_and_token_are_stored_others_rejected_and_not_stored(collector, pki):
    agent = {"ca": pki["ca"], "cert": pki["client"], "key": pki["client_key"]}
    assert _push(collector, 1, token=TOKEN, **agent).sequence == 1
    assert _stored(collector) == ROWS_PER_BATCH

    with pytest.raises(grpc.RpcError) as wrong_token:
        _push(collector, 2, token="not-the-token", **agent)
    assert wrong_token.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as no_token:
        _push(collector, 3, **agent)
    assert no_token.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as rogue:  # a certificate from another CA: the handshake fails
        _push(collector, 4, token=TOKEN, ca=pki["ca"], cert=pki["rogue_client"], key=pki["rogue_client_key"])
    assert rogue.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as no_cert:
        _push(collector, 5, token=TOKEN, ca=pki["ca"])
    assert no_cert.value.code() == grpc.StatusCode.UNAVAILABLE
    assert _stored(collector) == ROWS_PER_BATCH  # nothing of the refused batches


def test_queries_need_the_token(collector, pki, token_file, capsys):
    agent = {"ca": pki["ca"], "cert": pki["client"], "key": pki["client_key"]}
    stub = client.connect(collector.address, security=ClientSecurity(pki["ca"], pki["client"], pki["client_key"]))
    with pytest.raises(grpc.RpcError) as denied:
        stub.ListNodes(q.ListNodesRequest(), timeout=10)
    assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
    _push(collector, 1, token=TOKEN, **agent)
    flags = ["--collector", collector.address, "--tls-ca", pki["ca"], "--tls-cert", pki["client"],
             "--tls-key", pki["client_key"], "--json"]
    assert cli.main(["nodes", *flags]) == 2
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert cli.main(["nodes", *flags, "--token-file", token_file]) == 0
    assert '"node": "node-1"' in capsys.readouterr().out


def test_plaintext_beyond_loopback_is_refused_unless_insecure(tmp_path):
    db = tmp_path / "open.duckdb"
    with pytest.raises(UserError, match="without TLS"):
        serve(local_collector(str(db), listen="0.0.0.0:0"))
    assert not db.exists()  # refused before the store was opened
    server = serve(local_collector(str(db), listen="0.0.0.0:0", insecure=True))
    server.stop()
    result = subprocess.run([sys.executable, "-m", "gpuwatch", "collector", "--listen", "0.0.0.0:0",
                             "--db", str(tmp_path / "cli.duckdb")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "refusing to listen on 0.0.0.0:0 without TLS" in result.stderr and "--insecure" in result.stderr


def test_a_stream_without_the_token_is_refused_and_the_collector_keeps_serving(collector, pki, tmp_path):
    agent = {"ca": pki["ca"], "cert": pki["client"], "key": pki["client_key"]}
    (tmp_path / "wrong-token").write_text("not-the-token")
    (tmp_path / "wrong-token").chmod(0o600)
    for token_file in (None, str(tmp_path / "wrong-token")):
        ch = client.channel(collector.address,
                            security=ClientSecurity(pki["ca"], pki["client"], pki["client_key"], token_file))
        with pytest.raises(grpc.RpcError) as refused:
            list(client.stream_batches(ch, [make_batch(7)]))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ch.close()
    assert _push(collector, 1, token=TOKEN, **agent).sequence == 1  # the refusals blocked nothing
    assert _stored(collector) == ROWS_PER_BATCH
