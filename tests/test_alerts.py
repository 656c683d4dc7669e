"""Alert engine: policy transitions, suggested actions, delivery to a real Alertmanager and a local webhook."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gpuwatch.collector.alerts import AlertEngine, AlertmanagerSender, RiskObservation, WebhookSender, suggest_action
from gpuwatch.core.times import iso_ms, iso_utc
from gpuwatch.models.advisor import advise
from gpuwatch.models.policy import AlertPolicy
from helpers import T0, alertmanager_alerts, free_port, poll


def obs(risk: float, ts_ms: int, uuid: str = "GPU-a", index: int = 3) -> RiskObservation:
    return RiskObservation(uuid, index, "node-7", risk, jobs=("job-1",), ranks=(11,),
                           signals=({"signal": "sbe_d1h", "value": 420.0},), ts_ms=ts_ms)


def test_fire_once_hysteresis_and_keep_firing():
    engine = AlertEngine(AlertPolicy(0.4, resolve_fraction=0.5, keep_firing_for_s=600))
    minute = 60_000
    assert engine.observe([obs(0.3, T0)]) == []
    fired = engine.observe([obs(0.5, T0 + minute)])
    assert [t.kind for t in fired] == ["fire"] and fired[0].alert.starts_ms == T0 + minute
    # wavering between the resolve level (0.2) and the threshold keeps one alert
    assert engine.observe([obs(0.3, T0 + 2 * minute)]) == []
    assert engine.observe([obs(0.6, T0 + 3 * minute)]) == []
    assert len(engine.active()) == 1 and engine.active()[0].peak_risk == 0.6
    # below the resolve level, but not for keep_firing_for yet
    assert engine.observe([obs(0.1, T0 + 5 * minute)]) == []
    resolved = engine.observe([obs(0.1, T0 + 13 * minute)])
    assert [t.kind for t in resolved] == ["resolve"] and resolved[0].alert.ends_ms == T0 + 13 * minute
    assert engine.active() == [] and len(engine.resolved()) == 1


def test_one_alert_per_gpu_and_independent_gpus():
    engine = AlertEngine(AlertPolicy(0.4, keep_firing_for_s=0))
    first = engine.observe([obs(0.9, T0), obs(0.9, T0, uuid="GPU-b", index=4)])
    assert sorted(t.alert.gpu_uuid for t in first) == ["GPU-a", "GPU-b"]
    assert engine.observe([obs(0.95, T0 + 1000), obs(0.1, T0 + 1000, uuid="GPU-b", index=4)])[0].kind == "resolve"
    assert [a.gpu_uuid for a in engine.active()] == ["GPU-a"]


def test_suggested_action_follows_the_advisor():
    advice = advise(n_gpus=16384, checkpoint_s=300)  # checkpoint break-even ~0.23, drain ~0.14
    assert suggest_action(0.1, "n1", advice).startswith("watch")
    assert suggest_action(0.3, "n1", advice) == "checkpoint now"
    assert suggest_action(0.8, "n1", advice) == "checkpoint now, then drain node n1 after the checkpoint"


def test_fire_and_resolve_through_real_alertmanager(alertmanager):
    sender = AlertmanagerSender(alertmanager, backoff_s=0.1)
    engine = AlertEngine(AlertPolicy(0.4, keep_firing_for_s=0), senders=[sender])
    now = int(time.time() * 1000)
    engine.observe([obs(0.8, now)], now_ms=now)

    got = poll(lambda: alertmanager_alerts(alertmanager, "GPUFailureRisk"), 10, "alert in Alertmanager")
    assert got[0]["labels"]["node"] == "node-7" and got[0]["labels"]["gpu"] == "3"
    assert got[0]["labels"]["uuid"] == "GPU-a" and got[0]["status"]["state"] == "active"
    assert "checkpoint now" in got[0]["annotations"]["action"] and got[0]["annotations"]["jobs"] == "job-1"

    engine.observe([obs(0.05, now + 1000)], now_ms=now + 1000)
    poll(lambda: not alertmanager_alerts(alertmanager, "GPUFailureRisk"), 10, "alert to be resolved in Alertmanager")
    engine.close()
    assert sender.sent == 2 and sender.failed == 0


class _Hook(BaseHTTPRequestHandler):
    received: list = []
    fail_first = 0

    def do_POST(self):  # noqa: N802 (http.server API)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if _Hook.fail_first > 0:
            _Hook.fail_first -= 1
            self.send_response(503)
        else:
            _Hook.received.append(body)
            self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_webhook_delivery_retries_and_never_blocks():
    _Hook.received, _Hook.fail_first = [], 1
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        sender = WebhookSender(f"http://127.0.0.1:{server.server_port}/hook", backoff_s=0.05)
        engine = AlertEngine(AlertPolicy(0.4, keep_firing_for_s=0), senders=[sender])
        engine.observe([obs(0.9, T0)])
        batch = poll(lambda: _Hook.received, 10, "webhook delivery")[0]
        assert batch["source"] == "gpuwatch" and batch["alerts"][0]["status"] == "firing"
        assert batch["alerts"][0]["gpu_uuid"] == "GPU-a" and batch["alerts"][0]["signals"][0]["signal"] == "sbe_d1h"
        engine.close()
        assert sender.sent == 1 and sender.failed == 0
    finally:
        server.shutdown()


def test_dead_receiver_does_not_block_and_queue_is_bounded():
    dead = f"http://127.0.0.1:{free_port()}"
    sender = WebhookSender(dead, queue_size=2, retries=0, timeout_s=0.5)
    engine = AlertEngine(AlertPolicy(0.4, keep_firing_for_s=0), senders=[sender], resend_interval_s=0)
    started = time.monotonic()
    for i in range(50):
        engine.observe([obs(0.9, T0 + i * 1000, uuid=f"GPU-{i}")], now_ms=T0 + i * 1000)
    assert time.monotonic() - started < 1.0  # delivery happens on the sender thread
    engine.close(timeout_s=2)
    assert sender.dropped > 0 and sender.sent == 0


def test_collector_gives_the_alerts_advice_for_its_configured_job(tmp_path):
    from gpuwatch.collector.alert_hub import AlertHub
    from gpuwatch.collector.assembly import start_collector
    from gpuwatch.core.settings import COLLECTOR_OPTIONS, CollectorSettings, load_config

    cfg = load_config(COLLECTOR_OPTIONS, {"listen": "127.0.0.1:0", "db": str(tmp_path / "c.duckdb"),
                                          "job_gpus": 16384, "checkpoint_cost": 60.0}, env={})
    server = start_collector(cfg.build(CollectorSettings))
    try:
        hub = next(s for s in server.services if isinstance(s, AlertHub))
        engine = poll(lambda: hub.engine, 120, "risk alerting once the model has loaded")
        assert engine.advice.young_interval_s / 60 == pytest.approx(19, rel=0.02)  # §5: C = 1 min
    finally:
        server.stop()


def test_alerts_on_a_clock_hours_ahead_reach_alertmanager_and_resolve_there(alertmanager):
    """Before the fix: agents on simulated or skewed time gave startsAt hours ahead; Alertmanager answered 400
    "start time must be before end time", and the resolved alert was later shown active for 13 h."""
    sender = AlertmanagerSender(alertmanager, backoff_s=0.1)
    engine = AlertEngine(AlertPolicy(0.4, keep_firing_for_s=0), senders=[sender])
    ahead = int(time.time() * 1000) + 13 * 3_600_000
    engine.observe([obs(0.8, ahead)], now_ms=ahead)
    (got,) = poll(lambda: alertmanager_alerts(alertmanager, "GPUFailureRisk"), 30, "the alert in Alertmanager")
    assert got["status"]["state"] == "active"
    assert got["annotations"]["data_starts_at"] == iso_utc(ahead)
    assert iso_ms(got["startsAt"]) <= int(time.time() * 1000)  # on the wall clock, not the data's
    engine.observe([obs(0.05, ahead + 60_000)], now_ms=ahead + 60_000)
    poll(lambda: not alertmanager_alerts(alertmanager, "GPUFailureRisk"), 30, "the alert resolved in Alertmanager")
    engine.close()
    assert sender.sent == 2 and sender.failed == 0


class _Refusing(BaseHTTPRequestHandler):
    posts = 0

    def do_POST(self):  # noqa: N802 (http.server API)
        self.rfile.read(int(self.headers["Content-Length"]))
        _Refusing.posts += 1
        message = b'{"code":400,"message":"start time must be before end time"}'
        self.send_response(400)
        self.send_header("Content-Length", str(len(message)))
        self.end_headers()
        self.wfile.write(message)

    def log_message(self, *args):
        pass


def test_a_refused_delivery_quotes_the_receivers_reason_with_the_alert_name_and_is_not_retried(caplog):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        sender = AlertmanagerSender(f"http://127.0.0.1:{server.server_port}", backoff_s=0.05)
        engine = AlertEngine(AlertPolicy(0.4, keep_firing_for_s=0), senders=[sender])
        with caplog.at_level("WARNING", "gpuwatch.collector.alerts"):
            engine.observe([obs(0.9, T0)])
            poll(lambda: sender.failed, 10, "the refused delivery")
        engine.close()
    finally:
        server.shutdown()
    (line,) = [r.getMessage() for r in caplog.records if "HTTP 400" in r.getMessage()]
    assert "start time must be before end time" in line and "GPUFailureRisk node-7/GPU 3" in line
    assert _Refusing.posts == 1  # a 400 would be refused again: not resent 136 times
