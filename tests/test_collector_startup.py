"""The collector answers before its failure model has loaded; scoring and risk alerts begin once it has."""
from __future__ import annotations

import threading

from gpuwatch.collector import client
from gpuwatch.collector.alert_hub import AlertHub
from gpuwatch.collector.scoring import Scorer
from gpuwatch.collector.server import serve
from gpuwatch.models.model import load_model
from gpuwatch.v1 import query_pb2 as q
from helpers import make_batch, poll


def test_queries_and_ingest_are_served_while_the_model_loads_and_scoring_follows(tmp_path):
    release = threading.Event()
    loads = []

    def slow_load():  # stands for seconds of unpickling; the test decides when it finishes
        release.wait(120)
        loads.append(1)
        return load_model(None)

    hub = AlertHub(None)
    scorer = Scorer(None, hub, interval_s=0.1, load_model=slow_load)
    server = serve("127.0.0.1:0", str(tmp_path / "s.duckdb"), services=[hub, scorer])
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
    server = serve("127.0.0.1:0", str(tmp_path / "s.duckdb"), services=[scorer])
    try:
        poll(lambda: scorer.ready.is_set() and scorer.rounds >= 1, 120, "health-only scoring")
        assert scorer.model is None and scorer.hub.engine is None
    finally:
        server.stop()
