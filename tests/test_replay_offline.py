"""`gpuwatch replay --offline` stores and scores exactly what streaming the recording to a collector does."""
import json

import numpy as np
import pandas as pd
import pytest

from gpuwatch.apps.replay import recording_id, replay
from gpuwatch.apps.replay_offline import replay_offline, score_replayed
from gpuwatch.collector import client
from gpuwatch.collector.assembly import failure_model
from gpuwatch.collector.server import serve
from gpuwatch.core.settings import local_collector
from gpuwatch.collector.store.duckdb import DuckDBStore
from gpuwatch.core.errors import UserError
from gpuwatch.core.fields import GPU_FIELD_NAMES, HOST_FIELD_NAMES
from gpuwatch.core.recording import RecordingWriter, open_recording
from helpers import T0, degrading_node, two_rank_spans, write_small_recording

_PER_GPU = ", ".join(f"count({name}) AS {name}" for name in GPU_FIELD_NAMES)
_PER_NODE = ", ".join(f"count({name}) AS {name}" for name in HOST_FIELD_NAMES)


@pytest.fixture(scope="module")
def failing_fleet(tmp_path_factory):
    """Two nodes, 31 h of minutes: node-0000 GPU 1 degrades and dies with XID 48 at 29 h (never reset),
    node-0001 stays healthy; host samples with a field that is sometimes missing."""
    path = tmp_path_factory.mktemp("fleet") / "R"
    with RecordingWriter(path, source="test", resolution_s=60.0) as w:
        for node in (0, 1):
            gpu, events = degrading_node(T0, hours=31, fault_after_h=29 if node == 0 else 60, node=node)
            w.append("gpu_samples", gpu)
            w.append("events", events)
            ts = np.sort(gpu["ts"].unique())
            host = pd.DataFrame({"node": f"node-000{node}", "ts": ts, "host_load1": np.linspace(0, 4, len(ts)),
                                 "host_cpu_utilization_ratio": np.where(np.arange(len(ts)) % 7, 0.5, np.nan)})
            w.append("host_samples", host)
    return path


def _stored(store) -> dict:
    """What a store holds, as counts: per GPU and field, per node and host field, events, spans, agents."""
    def rows(sql: str) -> list[dict]:
        return store.query_df(sql).to_dict("records")

    return {"gpu": rows(f"SELECT node, gpu_index, count(*) AS n, {_PER_GPU} FROM gpu_samples "
                        "GROUP BY ALL ORDER BY ALL"),
            "host": rows(f"SELECT node, count(*) AS n, {_PER_NODE} FROM host_samples GROUP BY ALL ORDER BY ALL"),
            "events": rows("SELECT node, gpu_index, epoch_ms(ts) AS ts, kind, code FROM events ORDER BY ALL"),
            "spans": store.count("spans"),
            "agents": rows("SELECT agent_id, node, last_sequence FROM agents ORDER BY ALL")}


def _alerts(scoring: dict) -> list[dict]:
    return sorted(({k: a[k] for k in ("alertname", "node", "gpu_index", "state", "status", "starts_at", "summary")
                    if k in a} for a in scoring["alerts"]), key=lambda a: json.dumps(a, sort_keys=True))


def _streamed(path, db) -> tuple[dict, dict, dict]:
    """Stream the recording at ``path`` to a collector on loopback: (replay result, stored counts, scoring)."""
    rec = open_recording(path)
    server = serve(local_collector(str(db)))
    try:
        ch = client.channel(server.address)
        try:
            streamed = replay(rec, ch, quiet=True).as_dict()
        finally:
            ch.close()
        server.store.flush()
        scoring = score_replayed(server.store, int(rec.manifest["start_ms"]), int(rec.manifest["end_ms"]),
                                 model=failure_model(None), quiet=True)
        return streamed, _stored(server.store), scoring
    finally:
        server.stop()


def _offline(path, db) -> tuple[dict, dict]:
    """Replay the recording at ``path`` offline into ``db``: (result, stored counts)."""
    result = replay_offline(path, db=db, quiet=True)
    store = DuckDBStore(str(db))
    try:
        return result, _stored(store)
    finally:
        store.close()


def test_offline_replay_stores_and_alerts_as_streaming_to_a_collector_does(failing_fleet, tmp_path):
    streamed, online, online_scoring = _streamed(failing_fleet, tmp_path / "online.duckdb")
    offline, stored = _offline(failing_fleet, tmp_path / "offline.duckdb")
    assert stored == online
    assert {k: offline[k] for k in ("batches", "stored", "duplicates", "nodes")} == \
        {k: streamed[k] for k in ("batches", "stored", "duplicates", "nodes")}
    assert sum(g["n"] for g in online["gpu"]) == len(open_recording(failing_fleet).table("gpu_samples"))
    assert len(online["host"]) == 2 and online["events"]
    assert _alerts(offline["scoring"]) == _alerts(online_scoring) and offline["scoring"]["alerts"]
    assert offline["scoring"]["failed"] == online_scoring["failed"]
    (failed,) = offline["scoring"]["failed"]
    assert (failed["node"], failed["gpu_index"]) == ("node-0000", 1)
    assert [a["state"] for a in _alerts(offline["scoring"]) if a["alertname"] == "GPUFailureRisk"] == ["failed"]
    assert _by_gpu(offline["scoring"], "health") == _by_gpu(online_scoring, "health")
    assert _by_gpu(offline["scoring"], "health")[("node-0000", 1)] == "fail"
    assert _by_gpu(offline["scoring"], "risk") == pytest.approx(_by_gpu(online_scoring, "risk"))
    assert offline["scoring"]["peak_risk"] == pytest.approx(online_scoring["peak_risk"])


def _by_gpu(scoring: dict, key: str) -> dict:
    return {(g["node"], g["gpu_index"]): g[key] for g in scoring["gpus"]}


def test_offline_replay_stores_spans_as_streaming_does(tmp_path):
    write_small_recording(tmp_path / "R", two_rank_spans())
    streamed, online, _ = _streamed(tmp_path / "R", tmp_path / "online.duckdb")
    offline, stored = _offline(tmp_path / "R", tmp_path / "offline.duckdb")
    assert stored == online and online["spans"] == len(two_rank_spans())
    assert offline["nodes"] == streamed["nodes"]


def test_a_batch_the_store_refuses_ends_the_offline_replay_with_one_clear_error(tmp_path):
    """The same recording id with other rows (a recording rewritten in place): its first batch is the same (a
    duplicate), the second is not what is stored under its sequence, so the writer refuses it as another
    agent's batch and the replay stops there, as the collector's Ingest answers a stream."""
    rows = pd.DataFrame({"node": "n1", "gpu_index": 0, "ts": T0 + np.arange(4) * 1000, "gpu_power_watts": 1.0})
    for path, frame in ((tmp_path / "A", rows), (tmp_path / "B", rows.iloc[:3])):
        with RecordingWriter(path, source="test", resolution_s=1.0) as w:
            w.append("gpu_samples", frame)
    assert recording_id(open_recording(tmp_path / "A")) == recording_id(open_recording(tmp_path / "B"))
    db = tmp_path / "c.duckdb"
    assert replay_offline(tmp_path / "A", db=db, ticks_per_batch=2, quiet=True)["stored"] == 2
    with pytest.raises(UserError, match=r"refused the replay after 1 acknowledged batches: batch 2 of agent "
                                        r"replay-n1-.*used by two agents.*\(ALREADY_EXISTS\)"):
        replay_offline(tmp_path / "B", db=db, ticks_per_batch=2, quiet=True)
