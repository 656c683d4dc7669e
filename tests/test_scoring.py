"""Online failure scoring over both real stores (DuckDB, ClickHouse through chdb): the shipped model, the
training feature function, alerts."""
from __future__ import annotations

import json
import time

import pytest

from gpuwatch.apps import cli
from gpuwatch.collector.alert_hub import AlertHub, list_alerts
from gpuwatch.collector.query_documents import alert_documents
from gpuwatch.collector.alerts import ALERT_NAME
from gpuwatch.collector.assembly import start_collector
from gpuwatch.collector.scoring import MinuteHistory, Scorer, observation, score_gpus
from gpuwatch.collector.store import open_store
from gpuwatch.core.settings import COLLECTOR_OPTIONS, CollectorSettings, load_config
from gpuwatch.simulator.failing_fleet import HOUR_MS
from gpuwatch.models.model import load_model
from gpuwatch.v1 import query_pb2 as q
from helpers import STORE_KINDS, T0, alertmanager_alerts, degrading_node, poll, sim_batches, store_url

FAILING = 1


@pytest.fixture(scope="module")
def model():
    return load_model(None)


@pytest.fixture(params=STORE_KINDS)
def kind(request):
    return request.param


@pytest.fixture
def store(tmp_path, kind):
    store = open_store(store_url(kind, tmp_path, "scoring"))
    gpu, events = degrading_node(T0, hours=38, fault_after_h=29, failing_gpu=FAILING)
    for batch in sim_batches(gpu, events):
        store.write(batch)
    yield store
    store.close()


def _alerts(store, include_resolved=False) -> list[dict]:
    return alert_documents(list_alerts(q.AlertsRequest(include_resolved=include_resolved), store))


def test_degrading_gpu_alerts_with_signals_and_action_then_resolves(store, model):
    hub = AlertHub(model.alert_policy())
    hub.start(store)
    scorer = Scorer(model, hub)
    scorer.bind(store)

    early = scorer.score_once(T0 + 20 * HOUR_MS)  # 9 h before the fault: before the precursor shows
    assert len(early) == 4 and max(g["risk"] for g in early) < model.threshold and not hub.engine.active()

    scored = {g["gpu_index"]: g for g in scorer.score_once(T0 + 28 * HOUR_MS)}  # 1 h before the fault
    assert scored[FAILING]["risk"] >= model.threshold and scored[FAILING]["health"] in ("warn", "fail")
    assert all(g["risk"] < model.threshold / 2 and g["health"] == "ok" for i, g in scored.items() if i != FAILING)
    (alert,) = _alerts(store)
    assert alert["alertname"] == ALERT_NAME and alert["status"] == "firing"
    assert (alert["node"], alert["gpu_index"], alert["gpu_uuid"]) == ("node-0000", FAILING, f"GPU-node-0000-{FAILING}")
    assert alert["jobs"] == ["job-5"] and alert["ranks"] == [FAILING]
    assert alert["signals"] and {"signal", "value", "contribution"} <= set(alert["signals"][0])
    assert "checkpoint" in alert["action"]

    scorer.score_once(T0 + 36 * HOUR_MS)  # repaired: risk fell
    assert not hub.engine.active() and _alerts(store) == []
    (resolved,) = _alerts(store, include_resolved=True)
    assert resolved["status"] == "resolved" and resolved["ends_at"] and resolved["gpu_index"] == FAILING


def test_a_restarted_hub_keeps_the_firing_alert_without_a_duplicate_then_resolves_it(store, model):
    scorer = Scorer(model)  # scores only; each round goes to the hub of the collector run below
    scorer.bind(store)

    def round_(hub, hours):
        now = T0 + int(hours * HOUR_MS)
        return hub.observe_risk([observation(g, now) for g in scorer.score_once(now)], now_ms=now)

    def started_hub():
        hub = AlertHub(model.alert_policy())
        hub.start(store)
        return hub

    hub = started_hub()
    assert [c.kind for c in round_(hub, 28)] == ["fire"]
    (before,) = _alerts(store)
    hub.stop()

    hub = started_hub()  # the collector restarted on the same store
    assert [a.gpu_index for a in hub.engine.active()] == [FAILING]
    assert round_(hub, 28.5) == []  # still at risk: neither resolved nor fired again
    (after,) = _alerts(store, include_resolved=True)
    assert after["status"] == "firing" and after["starts_at"] == before["starts_at"]
    assert [c.kind for c in round_(hub, 36)] == ["resolve"]  # repaired: the restored alert resolves as usual
    (resolved,) = _alerts(store, include_resolved=True)
    assert resolved["status"] == "resolved" and resolved["starts_at"] == before["starts_at"]
    hub.stop()


def test_the_data_clock_scores_nothing_on_an_empty_store(model, tmp_path, kind):
    scorer = Scorer(model, clock="data")
    empty = open_store(store_url(kind, tmp_path, "empty"))  # one chdb engine per process: no other store
    try:
        scorer.bind(empty)
        assert scorer.score_once() == [] and scorer.scored_at_ms is None  # nothing stored yet
    finally:
        empty.close()


def test_the_data_clock_scores_at_the_newest_sample(store, model):
    scorer = Scorer(model, clock="data")
    scorer.bind(store)
    newest = store.newest_sample_ms()
    scored = scorer.score_once()
    assert scorer.scored_at_ms == newest and len(scored) == 4
    assert [g["risk"] for g in scored] == [g["risk"] for g in score_gpus(store, model, int(newest))]
    with pytest.raises(ValueError, match="clock 'sim'"):
        Scorer(model, clock="sim")


def test_auto_clock_follows_agents_on_simulated_time_and_the_budget_sets_the_alert_threshold(store, model, caplog):
    """A collector started on its own (the default auto clock) scores a --sim-speed fleet at its data time."""
    hub = AlertHub(model.alert_policy())
    hub.start(store)
    scorer = Scorer(model, hub, clock="auto", false_alarm_budget=1.0)
    scorer.bind(store)
    newest = store.newest_sample_ms()
    with caplog.at_level("WARNING"):
        scored = scorer.score_once()
    assert scorer.scored_at_ms == newest and len(scored) == 4 and "data clock" in caplog.text
    assert hub.engine.policy.threshold == scorer.threshold == scorer.calibrator.threshold(newest)
    hub.stop()


def test_without_a_model_health_is_still_scored_and_no_risk_alerts(store):
    hub = AlertHub()
    hub.start(store)
    scorer = Scorer(None, hub)
    scorer.bind(store)
    scored = {g["gpu_index"]: g for g in scorer.score_once(T0 + 28 * HOUR_MS)}
    assert scored[FAILING]["risk"] is None and scored[FAILING]["health"] == "warn" and scored[FAILING]["reasons"]
    assert _alerts(store) == []


def test_running_collector_delivers_the_alert_to_alertmanager_and_alerts_cli(tmp_path, alertmanager, capsys, kind):
    now = int(time.time() * 1000)
    gpu, events = degrading_node(now - 28 * HOUR_MS, hours=28, fault_after_h=29, failing_gpu=FAILING)
    cfg = load_config(COLLECTOR_OPTIONS, {"listen": "127.0.0.1:0", "db": store_url(kind, tmp_path, "c"),
                                            "alertmanager_url": alertmanager, "score_interval": 0.5}, env={})
    server = start_collector(cfg.build(CollectorSettings))
    try:
        for batch in sim_batches(gpu, events):
            server.store.write(batch)

        (got,) = poll(lambda: alertmanager_alerts(alertmanager, ALERT_NAME), 60, "the GPU alert in Alertmanager",
                      every=0.2)
        assert got["labels"]["node"] == "node-0000" and got["labels"]["gpu"] == str(FAILING)
        assert "checkpoint" in got["annotations"]["action"]
        assert cli.main(["alerts", "--collector", server.address, "--json"]) == 0
        (listed,) = json.loads(capsys.readouterr().out)
        assert listed["gpu_index"] == FAILING and listed["status"] == "firing"
    finally:
        server.stop()
    reopened = open_store(store_url(kind, tmp_path, "c"))  # alerts survive a restart of the collector
    try:
        assert [a["gpu_index"] for a in _alerts(reopened)] == [FAILING]
    finally:
        reopened.close()


def test_rounds_that_reuse_aggregated_minutes_score_like_a_fresh_read(store, model):
    history = MinuteHistory()
    for hours in (26, 27.5, 27.9):  # the later rounds re-read only the recent minutes
        kept = score_gpus(store, model, T0 + int(hours * HOUR_MS), history)
    fresh = score_gpus(store, model, T0 + int(27.9 * HOUR_MS))
    assert [g["risk"] for g in kept] == [g["risk"] for g in fresh] and [g["health"] for g in kept] == [
        g["health"] for g in fresh]
    assert kept[FAILING]["signals"] == fresh[FAILING]["signals"]


def test_samples_arriving_late_are_read_again(tmp_path, model, kind):
    store = open_store(store_url(kind, tmp_path, "late"))
    try:
        gpu, events = degrading_node(T0, hours=28, fault_after_h=29, failing_gpu=FAILING)
        cut = gpu["ts"] < gpu["ts"].min() + (gpu["ts"].max() - gpu["ts"].min()) / 2
        for batch in sim_batches(gpu[cut], events.iloc[:0]):
            store.write(batch)
        history, now = MinuteHistory(), T0 + 28 * HOUR_MS
        before = score_gpus(store, model, now, history)
        for batch in sim_batches(gpu[~cut], events, agent="agent-replaying-its-spool"):
            store.write(batch)
        after = score_gpus(store, model, now + 60_000, history)
        assert after[FAILING]["risk"] > before[FAILING]["risk"]
        fresh = score_gpus(store, model, now + 60_000)
        assert [g["risk"] for g in after] == [g["risk"] for g in fresh]
    finally:
        store.close()


def test_an_alert_on_a_gpu_that_then_fails_says_failed_until_the_gpu_is_reset(store, model):
    """XID 48 at 29 h: the risk alert of 28 h turns "failed" (peak risk, the failure's action) and stays, though
    the model's risk falls once the GPU is down; the driver reload at 33 h (energy counter restarts) clears it."""
    hub = AlertHub(model.alert_policy())
    hub.start(store)
    scorer = Scorer(model, hub)
    scorer.bind(store)
    scorer.score_once(T0 + 28 * HOUR_MS)
    (flagged,) = _alerts(store)
    assert flagged["state"] == "at_risk" and "peaked at" in flagged["summary"]

    down = {g["gpu_index"]: g for g in scorer.score_once(T0 + 31 * HOUR_MS)}
    assert down[FAILING]["health"] == "fail" and down[FAILING]["failed"]["code"] == 48
    assert down[FAILING]["reasons"][0].startswith("failed: XID 48 (Double bit ECC error")
    assert all(g["failed"] is None for i, g in down.items() if i != FAILING)
    (alert,) = _alerts(store)
    assert alert["state"] == "failed" and alert["status"] == "firing"
    assert "has failed: XID 48" in alert["summary"] and f"peaked at {flagged['peak_risk']:.2f}" in alert["summary"]
    assert "checkpoint" not in alert["action"] and "reset" in alert["action"]

    repaired = {g["gpu_index"]: g for g in scorer.score_once(T0 + 36 * HOUR_MS)}
    assert repaired[FAILING]["failed"] is None and _alerts(store) == []


@pytest.mark.parametrize("clock", ["data", "wall"])
def test_data_that_arrives_faster_than_rounds_is_scored_at_every_step_like_an_offline_replay(
        tmp_path, model, kind, clock):
    """Before the fix: a recording streamed into a live collector raised no GPUFailureRisk for the GPU that failed
    (its rounds, on the data clock, jumped from before the risk rose to after the failure), where
    `replay --offline`, scoring every step, raised "GPUFailureRisk ... has failed". On the wall clock the same
    happens to a backlog (an agent's spool drained after an outage, a recording of the last hours): the data
    here ends now, and rounds on the wall clock scored only "now", when the GPU had already failed."""
    store = open_store(store_url(kind, tmp_path, "fast"))
    hub = AlertHub(model.alert_policy())
    start = T0 if clock == "data" else (int(time.time() * 1000) // 60_000 - 31 * 60) * 60_000  # ends now
    try:
        hub.start(store)
        gpu, events = degrading_node(start, hours=31, fault_after_h=29, failing_gpu=FAILING)
        early = gpu["ts"] < gpu["ts"].min() + (gpu["ts"].max() - gpu["ts"].min()) * 20 / 31  # the first 20 h
        for batch in sim_batches(gpu[early], events.iloc[:0]):
            store.write(batch)
        scorer = Scorer(model, hub, clock=clock)
        scorer.bind(store)
        scorer.score_once()
        assert _alerts(store) == []  # at 20 h nothing is wrong yet
        for batch in sim_batches(gpu[~early], events, agent="agent-sim-2"):
            store.write(batch)
        scorer.score_once()  # one round, 11 h of data later: the GPU failed at 29 h
        (alert,) = _alerts(store)
        assert alert["gpu_index"] == FAILING and alert["state"] == "failed" and "has failed" in alert["summary"]
    finally:
        hub.stop()
        store.close()


def test_a_node_whose_data_arrives_after_the_data_clock_passed_its_times_is_still_scored_step_by_step(
        tmp_path, model, kind):
    """The live-stream case: node 1's whole recording is stored first and scored, carrying the data
    clock to its end; node 0's recording of the same hours (its GPU failed at 29 h) arrives after that round.
    A catch-up keyed by the newest time in the store scored nothing new and raised no alert."""
    store = open_store(store_url(kind, tmp_path, "late"))
    hub = AlertHub(model.alert_policy())
    try:
        hub.start(store)
        healthy, _ = degrading_node(T0, hours=31, fault_after_h=40, node=1)  # its fault lies past the data
        for batch in sim_batches(healthy, _.iloc[:0], agent="agent-sim-1"):
            store.write(batch)
        scorer = Scorer(model, hub, clock="data")
        scorer.bind(store)
        scorer.score_once()
        assert _alerts(store) == []
        failing, events = degrading_node(T0, hours=31, fault_after_h=29, failing_gpu=FAILING, node=0)
        for batch in sim_batches(failing, events, agent="agent-sim-0"):
            store.write(batch)
        scorer.score_once()  # the data clock has not moved: the newest sample is node 1's, as before
        (alert,) = _alerts(store)
        assert (alert["node"], alert["gpu_index"]) == (str(failing["node"].iloc[0]), FAILING)
        assert alert["state"] == "failed" and "has failed" in alert["summary"]
    finally:
        hub.stop()
        store.close()


def test_a_restarted_scorer_catches_up_only_data_that_arrives_after_it_started(store, model, monkeypatch):
    """What the store held when the scorer was bound was scored by the collector before (or never will be live):
    re-scoring up to two days of it step by step at every restart would cost a fleet's history per restart.
    And to find new data a round reads only the samples after the newest it saw of the nodes whose agents sent
    batches since its last look; it read the inventory with every GPU's sample count, newest sample and owner,
    a scan of the whole raw tier (two days of the fleet's samples), twice a round."""
    import gpuwatch.collector.scoring as scoring

    histories, reads = [], []
    real_history, newest_samples = scoring.score_history, store.newest_samples
    monkeypatch.setattr(scoring, "score_history", lambda *a, **k: histories.append(a[2:4]) or real_history(*a, **k))
    monkeypatch.setattr(store, "newest_samples",
                        lambda after=None, nodes=None: reads.append((after, nodes)) or newest_samples(after, nodes))
    monkeypatch.setattr(store, "gpus", lambda *a, **k: pytest.fail("a scoring round read every stored sample"))
    hub = AlertHub(model.alert_policy())
    hub.start(store)
    try:
        scorer = Scorer(model, hub, clock="data")
        scorer.bind(store)
        newest = store.newest_sample_ms()
        scorer.score_once()
        assert histories == [] and scorer.scored_at_ms == newest  # the stored 38 h: scored at "now" only
        later, _ = degrading_node(newest, hours=3, fault_after_h=40, failing_gpu=FAILING)
        for batch in sim_batches(later, _.iloc[:0], agent="agent-sim-later"):
            store.write(batch)
        scorer.score_once()
        assert histories == [(newest, store.newest_sample_ms() - 1)]  # the 3 h that came at once, step by step
        node = str(later["node"].iloc[0])
        assert reads == [(None, None), (newest, [node]), (newest, [node])]  # bound: all, once; rounds: the new
    finally:
        hub.stop()

