"""The collector binds its port before it opens the store and answers before its failure model has loaded;
batches that arrive before the store is open are stored once, never acknowledged early."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from gpuwatch.collector import client
from gpuwatch.collector.alert_hub import AlertHub
from gpuwatch.collector.scoring import Scorer
from gpuwatch.collector import server as server_module
from gpuwatch.collector.server import serve
from gpuwatch.core.settings import local_collector
from gpuwatch.collector.store import open_store
from gpuwatch.core.errors import UserError
from gpuwatch.models.model import load_model
from gpuwatch.v1 import query_pb2 as q
from gpuwatch.v1 import telemetry_pb2 as pb
from helpers import free_port, make_batch, poll


def _serve_in_background(pool: ThreadPoolExecutor, db: str, **options):
    """serve() on a known port in a thread (it returns once the store is open); the port accepts before."""
    address = f"127.0.0.1:{free_port()}"
    started = pool.submit(serve, local_collector(db, listen=address), **options)
    ch = poll(lambda: _connected(address), 120, "the port to accept before the collector finished starting")
    return address, started, ch


def _connected(address: str) -> grpc.Channel | None:
    ch = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(ch).result(timeout=0.5)
        return ch
    except grpc.FutureTimeoutError:
        ch.close()
        return None


def _push_later(ch: grpc.Channel, batch: pb.TelemetryBatch) -> grpc.Future:
    return ch.unary_unary("/gpuwatch.v1.Ingest/Push", request_serializer=lambda b: b.SerializeToString(),
                          response_deserializer=pb.BatchAck.FromString).future(batch, timeout=120)


@pytest.fixture
def store_opens_when_released(monkeypatch):
    """The store opens (or fails to) only once the test sets the returned event: it stands for a large store
    replaying its log; ``outcome`` holds an exception to raise instead of opening."""
    release = threading.Event()
    outcome: list[BaseException] = []

    def slow_open(*args, **kwargs):
        release.wait(120)
        if outcome:
            raise outcome[0]
        return open_store(*args, **kwargs)

    monkeypatch.setattr(server_module, "open_store", slow_open)
    return release, outcome


def test_batches_and_queries_that_arrive_before_the_store_is_open_wait_for_it(tmp_path, store_opens_when_released):
    release, _ = store_opens_when_released
    with ThreadPoolExecutor(2) as pool:
        address, started, ch = _serve_in_background(pool, str(tmp_path / "s.duckdb"))
        push = _push_later(ch, make_batch(1))
        nodes = client.connect(address).ListNodes.future(q.ListNodesRequest(), timeout=120)
        alerts = client.connect(address).Alerts.future(q.AlertsRequest(), timeout=120)  # no service answers it
        assert not push.done() and not nodes.done()  # nothing is acknowledged before the store can commit it
        release.set()
        server = started.result(120)
        try:
            assert not push.result().duplicate
            assert [n.node for n in nodes.result().nodes] in (["node-1"], [])  # answered, before or after the push
            with pytest.raises(grpc.RpcError) as unanswered:
                alerts.result()
            assert unanswered.value.code() == grpc.StatusCode.UNIMPLEMENTED  # after the services, not before
            rows = sum(len(s.ts_ms) for s in make_batch(1).samples)
            assert server.store.count("ingested") == 1 and server.store.count("gpu_samples") == rows
            assert client.push(ch, make_batch(1)).duplicate  # the resend of an acked batch is recognised
        finally:
            ch.close()
            server.stop()


def test_a_batch_sent_while_the_store_fails_to_open_is_not_acknowledged_and_its_resend_is_stored_once(
        tmp_path, store_opens_when_released):
    release, outcome = store_opens_when_released
    outcome.append(UserError("cannot open store: it is locked by another process"))
    db = str(tmp_path / "s.duckdb")
    with ThreadPoolExecutor(2) as pool:
        _, started, ch = _serve_in_background(pool, db)
        push = _push_later(ch, make_batch(1))
        release.set()
        with pytest.raises(UserError, match="locked"):
            started.result(120)
        with pytest.raises(grpc.RpcError) as refused:
            push.result()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        ch.close()
    outcome.clear()
    server = serve(local_collector(db))
    try:
        assert server.store.count("ingested") == 0  # nothing of it was stored, so nothing was acknowledged
        resend = client.channel(server.address)
        assert not client.push(resend, make_batch(1)).duplicate
        assert server.store.count("ingested") == 1
        resend.close()
    finally:
        server.stop()


def test_queries_and_ingest_are_served_while_the_model_loads_and_scoring_follows(tmp_path):
    release = threading.Event()
    loads = []

    def slow_load():  # stands for seconds of unpickling; the test decides when it finishes
        release.wait(120)
        loads.append(1)
        return load_model(None)

    hub = AlertHub(None)
    scorer = Scorer(None, hub, interval_s=0.1, load_model=slow_load)
    server = serve(local_collector(str(tmp_path / "s.duckdb")), services=[hub, scorer])
    try:
        ch = client.channel(server.address)
        assert not client.push(ch, make_batch(1)).duplicate
        (node,) = client.connect(server.address).ListNodes(q.ListNodesRequest()).nodes
        assert node.node == "node-1"
        # answered while the model is still loading: nothing scored, no risk alerting yet
        assert not scorer.ready.is_set() and not loads and scorer.rounds == 0 and hub.engine is None
        release.set()
        poll(lambda: scorer.ready.is_set() and scorer.rounds >= 1, 120, "scoring after the model loaded")
        assert loads == [1] and scorer.model is not None and hub.engine is not None
        ch.close()
    finally:
        release.set()
        server.stop()


def test_a_model_that_fails_to_load_leaves_health_scoring_running(tmp_path):
    def broken():
        raise ValueError("truncated model file")

    scorer = Scorer(None, AlertHub(None), interval_s=0.1, load_model=broken)
    server = serve(local_collector(str(tmp_path / "s.duckdb")), services=[scorer])
    try:
        poll(lambda: scorer.ready.is_set() and scorer.rounds >= 1, 120, "health-only scoring")
        assert scorer.model is None and scorer.hub.engine is None
    finally:
        server.stop()


@pytest.mark.parametrize("flags, message", [
    (["--listen", "{busy}"], "--listen {busy}: cannot listen there (Address already in use)"),
    (["--listen", "127.0.0.1:0", "--metrics-listen", "{busy}"],
     "--metrics-listen {busy}: cannot listen there (Address already in use)"),
    (["--listen", "127.0.0.1:0", "--memory-limit", "lots"],
     "memory_limit (from flag --memory-limit): 'lots' is not a size such as 1GB or 512MB"),
])
def test_bad_start_up_settings_are_one_line_before_the_store_is_opened(tmp_path, flags, message):
    """Our line alone (not gRPC's C-core line first), naming the flag, not the store; no store file left."""
    with socket.create_server(("127.0.0.1", 0)) as holder:
        busy = f"127.0.0.1:{holder.getsockname()[1]}"
        db = tmp_path / "never.duckdb"
        result = subprocess.run(
            [sys.executable, "-m", "gpuwatch", "collector", "--db", str(db), *[f.format(busy=busy) for f in flags]],
            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"gpuwatch collector: error: {message.format(busy=busy)}"]
    assert not list(tmp_path.iterdir())
