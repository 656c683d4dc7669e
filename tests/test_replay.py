"""`gpuwatch replay`: recordings back into batches, streamed to a real collector (process or in-process)."""
import json
import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from gpuwatch.apps import cli
from gpuwatch.core.batches import validate
from gpuwatch.efficiency.engine import analyze
from gpuwatch.collector.scoring import Scorer
from gpuwatch.collector.server import serve
from gpuwatch.core.settings import local_collector
from gpuwatch.collector.store.duckdb import DuckDBStore
from gpuwatch.efficiency.traces.spans import timelines_from_spans
from gpuwatch.core.errors import UserError
from gpuwatch.models.model import load_model
from gpuwatch.core.recording import RecordingWriter, open_recording
from gpuwatch.apps.recording_cli import format_result
from gpuwatch.apps.replay import node_batches, recording_batches, recording_id, replay_agent_id
from gpuwatch.apps.replay_offline import replay_offline
from helpers import (T0, CollectorProcess, degrading_node, sim_batches, sorted_samples, two_rank_spans,
                     write_small_recording)


def _gpuwatch(*argv, timeout=120):
    return subprocess.run([sys.executable, "-m", "gpuwatch", *argv], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def agent_recording(tmp_path_factory):
    """Two simulated nodes recorded by the real agent (record-only) into one recording."""
    rec = tmp_path_factory.mktemp("agent") / "R"
    for node, gpus in (("rep-a", 2), ("rep-b", 3)):
        run = _gpuwatch("agent", "--simulate", str(gpus), "--ticks", "4", "--interval", "0.05", "--record", str(rec),
                        "--node", node, "--no-probe-socket")
        assert run.returncode == 0, run.stderr
    return rec


def _recorded_counts(rec) -> dict:
    df = open_recording(rec).table("gpu_samples")
    return {node: {"gpus": int(g["gpu_index"].nunique()), "samples": len(g)} for node, g in df.groupby("node")}


def test_fast_replay_into_a_collector_process_stores_the_recorded_samples_once(agent_recording, tmp_path):
    db = str(tmp_path / "c.duckdb")
    collector = CollectorProcess(db).start()
    address = collector.address
    try:
        first = _gpuwatch("replay", str(agent_recording), "--fast", "--collector", address, "--ticks-per-batch", "2",
                          "--json")
        assert first.returncode == 0, first.stderr
        sent = json.loads(first.stdout)
        nodes = json.loads(_gpuwatch("nodes", "--collector", address, "--json").stdout)
        assert {n["node"]: {"gpus": n["gpus"], "samples": n["samples"]} for n in nodes} == \
            _recorded_counts(agent_recording)
        assert sent["batches"] >= 4 and sent["duplicates"] == 0

        again = json.loads(_gpuwatch("replay", str(agent_recording), "--collector", address, "--ticks-per-batch", "2",
                                     "--json").stdout)
        assert again["duplicates"] == again["batches"] == sent["batches"] and again["stored"] == 0
        assert json.loads(_gpuwatch("nodes", "--collector", address, "--json").stdout) == nodes
    finally:
        collector.stop()
    store = DuckDBStore(db)
    try:
        stored = sorted_samples(store.gpu_samples())
        events = store.count("events")
    finally:
        store.close()
    rec = open_recording(agent_recording)
    pd.testing.assert_frame_equal(stored, sorted_samples(rec.table("gpu_samples")), check_dtype=False)
    assert events == len(rec.table("events"))


def test_offline_replay_gives_the_same_counts(agent_recording):
    result = replay_offline(agent_recording, quiet=True)
    recorded = _recorded_counts(agent_recording)
    events = open_recording(agent_recording).table("events").groupby("node").size()
    assert {n["node"]: {"gpus": n["gpus"], "samples": n["samples"]} for n in result["store"]["nodes"]} == recorded
    assert {n["node"]: n["events"] for n in result["store"]["nodes"]} == events.to_dict()
    assert {node: c["gpu_samples"] for node, c in result["nodes"].items()} == \
        {node: c["samples"] for node, c in recorded.items()}


def test_a_simulated_fleet_recording_replays(tmp_path):
    sim = tmp_path / "S"
    run = _gpuwatch("simulate", "--nodes", "1", "--gpus", "2", "--days", "0.1", "--seed", "3", "--out", str(sim),
                    "--json")
    assert run.returncode == 0, run.stderr
    db = tmp_path / "s.duckdb"
    replayed = _gpuwatch("replay", str(sim), "--offline", "--db", str(db), "--score-interval", "3600", "--json")
    assert replayed.returncode == 0, replayed.stderr
    (node,) = json.loads(replayed.stdout)["store"]["nodes"]
    rec = open_recording(sim)
    assert (node["node"], node["gpus"], node["samples"]) == ("node-0000", 2, len(rec.table("gpu_samples")))
    assert node["events"] == len(rec.table("events"))
    # --db keeps the store; replaying into it again stores nothing twice
    again = json.loads(_gpuwatch("replay", str(sim), "--db", str(db), "--score-interval", "3600", "--json").stdout)
    assert again["stored"] == 0 and again["store"]["nodes"][0]["samples"] == node["samples"]
    # scoring over the replayed range matches the collector's scorer on the same rows ingested directly
    scoring = json.loads(replayed.stdout)["scoring"]
    assert scoring["model"] and scoring["rounds"] == 3
    live = DuckDBStore(str(tmp_path / "live.duckdb"))
    try:
        for batch in sim_batches(rec.table("gpu_samples"), rec.table("events")):
            live.write(batch)
        scorer = Scorer(load_model(None))
        scorer.bind(live)
        expected = scorer.score_once(int(rec.manifest["end_ms"]))
    finally:
        live.close()
    def by_gpu(rows, key):
        return {(g["node"], g["gpu_index"]): g[key] for g in rows}

    assert by_gpu(scoring["gpus"], "health") == by_gpu(expected, "health")
    assert by_gpu(scoring["gpus"], "risk") == pytest.approx(by_gpu(expected, "risk"))


def test_batches_keep_missing_values_missing_and_events_in_the_batch_of_their_time(tmp_path):
    write_small_recording(tmp_path / "R")
    rec = open_recording(tmp_path / "R")
    timed = list(node_batches(rec, "n1", agent_id="a", ticks_per_batch=2))
    batches = [tb.batch for tb in timed]
    for b in batches:
        validate(b)
    assert [b.sequence for b in batches] == [1, 2, 3]
    assert [tb.ts_ms for tb in timed] == [T0 + 1000, T0 + 3000, T0 + 4000]
    assert [len(b.events) for b in batches] == [0, 1, 0]
    assert batches[1].events[0].code == 79 and dict(batches[1].events[0].attrs) == {"pid": "42"}
    names = {c.field for b in batches for s in b.samples for c in s.columns}
    assert names == {"gpu_utilization_ratio", "gpu_temperature_celsius"}  # never-sampled fields stay out
    temps = [v for s in batches[0].samples for c in s.columns if c.field == "gpu_temperature_celsius" for v in c.values]
    assert temps[0] == 40.0 and math.isnan(temps[1])
    assert list(batches[0].samples[0].job_id) == ["j1", "j1"] and list(batches[0].samples[1].rank) == [-1, -1]
    assert [g.uuid for g in batches[0].gpus] == ["GPU-0", "GPU-1"]


def test_agent_ids_are_stable_per_recording_and_node(tmp_path, agent_recording):
    write_small_recording(tmp_path / "R")
    rec = open_recording(tmp_path / "R")
    ids = {tb.batch.agent_id for tb in recording_batches(rec)}
    assert ids == {replay_agent_id("n1", recording_id(rec))} == {
        f"replay-n1-{recording_id(open_recording(tmp_path / 'R'))}"}
    assert recording_id(rec) != recording_id(open_recording(agent_recording))


def test_offline_replay_computes_the_job_breakdown_from_replayed_spans(tmp_path):
    spans = two_rank_spans()
    write_small_recording(tmp_path / "R", spans)
    result = replay_offline(tmp_path / "R", quiet=True)
    assert result["nodes"]["n1"]["spans"] == len(spans)  # spans without a node travel with n1
    expected = analyze(timelines_from_spans(spans.assign(world_size=2.0), source="spans")).to_json()["job"]
    got = result["store"]["breakdowns"]["J"]
    assert got["ranks"] == 2 and got["breakdown_fraction"] == pytest.approx(expected["breakdown_fraction"])


def test_speed_paces_batches_by_recorded_time(tmp_path, monkeypatch):
    """Paced: the last batch leaves no sooner than recorded time / speed (a floor that holds on any machine);
    unpaced: the replay never waits. No upper bound on time: a loaded machine may be slow."""
    import gpuwatch.apps.replay as replay_module
    waits: list[float] = []
    real_sleep = replay_module.time.sleep
    monkeypatch.setattr(replay_module.time, "sleep", lambda s: (waits.append(s), real_sleep(s)))
    write_small_recording(tmp_path / "R")  # 4 s of recorded time
    result = replay_offline(tmp_path / "R", speed=8.0, ticks_per_batch=1, quiet=True)
    assert result["batches"] == 5 and result["seconds"] >= 0.5 and waits
    waits.clear()
    fast = replay_offline(tmp_path / "R", ticks_per_batch=1, quiet=True)
    assert fast["batches"] == 5 and waits == []


@pytest.mark.parametrize("argv, message", [
    (["replay", "{tmp}/missing"], "not a gpuwatch recording"),
    (["replay", "{tmp}"], "no manifest.json"),
    (["replay", "{rec}", "--collector", "127.0.0.1:1", "--db", "{tmp}/x.duckdb"], "--db and --model are for --offline"),
    (["replay", "{rec}", "--speed", "0"], "--speed 0: must be > 0"),
    (["replay", "{rec}", "--ticks-per-batch", "0"], "--ticks-per-batch 0"),
    (["replay", "{rec}", "--collector", "127.0.0.1:1"], "cannot reach the collector at 127.0.0.1:1"),
])
def test_bad_input_is_one_clear_line(tmp_path, agent_recording, argv, message):
    run = _gpuwatch(*[a.format(tmp=tmp_path, rec=agent_recording) for a in argv])
    assert run.returncode == 2 and message in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr


def test_a_refused_batch_ends_the_replay_with_an_error_and_keeps_what_was_acked(tmp_path):
    rows = pd.DataFrame({"node": "n1", "gpu_index": 0, "ts": T0 + np.arange(4) * 1000, "gpu_power_watts": 1.0})
    with RecordingWriter(tmp_path / "R", source="test") as w:
        w.append("gpu_samples", rows)
        # an event with an empty kind is refused by the collector (batches.validate)
        w.append("events", pd.DataFrame([{"node": "n1", "gpu_index": 0, "ts": T0 + 3000, "kind": "",
                                          "code": 0}]))
    db = tmp_path / "c.duckdb"
    with pytest.raises(UserError, match="refused the replay after 1 acknowledged batches.*run the replay again"):
        replay_offline(tmp_path / "R", db=db, ticks_per_batch=2, quiet=True)
    store = DuckDBStore(str(db))
    try:
        assert store.count("gpu_samples") == 2
    finally:
        store.close()


def test_replay_into_a_token_collector(agent_recording, tmp_path, capsys):
    token_file = tmp_path / "token"
    token_file.write_text("replay-token\n")
    token_file.chmod(0o600)
    server = serve(local_collector(str(tmp_path / "t.duckdb"), token_file=str(token_file)))
    try:
        argv = ["replay", str(agent_recording), "--collector", server.address, "--quiet", "--json"]
        assert cli.main(argv) == 2
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert cli.main([*argv, "--token-file", str(token_file)]) == 0
        assert json.loads(capsys.readouterr().out)["duplicates"] == 0
        server.store.flush()
        assert server.store.count("gpu_samples") == sum(c["samples"]
                                                        for c in _recorded_counts(agent_recording).values())
    finally:
        server.stop()


def test_text_output_names_nested_signals_instead_of_yes():
    gpu = {"node": "n1", "gpu_index": 0, "risk": 0.25,
           "signals": [{"signal": "xid_rate", "value": 1.0}, {"signal": "temp_max", "value": 90.0}]}
    text = format_result({"scoring": {"gpus": [gpu]}})
    assert "xid_rate,temp_max" in text and "yes" not in text


def test_text_output_says_yes_no_for_flags_and_rounds_floats():
    text = format_result({"scoring": {"model": True, "peak_risk": 0.123456789, "rounds": 3}})
    assert "model: yes" in text and "peak_risk: 0.1235" in text and "rounds: 3" in text and "True" not in text


def test_offline_scoring_reports_the_gpu_that_failed_as_failed(tmp_path):
    """XID 48 at 29 h of a 31 h recording, no reset after it: the scorer's last round, the failed list and the
    risk alert raised before the failure all say "failed"; the healthy GPUs stay ok."""
    gpu, events = degrading_node(T0, hours=31, fault_after_h=29, failing_gpu=1)
    with RecordingWriter(tmp_path / "R", source="test", resolution_s=60.0) as w:
        w.append("gpu_samples", gpu)
        w.append("events", events)
    scoring = replay_offline(tmp_path / "R", quiet=True)["scoring"]
    (failed,) = scoring["failed"]
    assert (failed["node"], failed["gpu_index"]) == ("node-0000", 1) and "XID 48" in failed["reason"]
    health = {g["gpu_index"]: g["health"] for g in scoring["gpus"]}
    assert health[1] == "fail" and all(h == "ok" for i, h in health.items() if i != 1)
    (alert,) = [a for a in scoring["alerts"] if a["alertname"] == "GPUFailureRisk"]
    assert alert["gpu_index"] == 1 and alert["state"] == "failed" and alert["status"] == "firing"
    assert _ms(alert["starts_at"]) < failed["since_ms"] and "has failed: XID 48" in alert["summary"]
    assert scoring["peak_risk"]["node-0000/1"] >= 0.5 and scoring["seconds"] > 0


def _ms(iso: str) -> int:
    return int(pd.Timestamp(iso).value // 1_000_000)
