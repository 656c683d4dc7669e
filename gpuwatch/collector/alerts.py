"""Early-failure alerts: per-GPU risk in, fire/resolve transitions out, delivered without blocking the caller.

The engine knows nothing of the collector's internals: it takes :class:`RiskObservation` values (whatever
scores them) and keeps one alert per GPU under the alert policy of models/policy.py (fire at the
threshold, resolve after the risk stayed below half of it for a while), so live alerts behave exactly as
the evaluation counted them. Each alert carries a suggested action from the checkpoint advisor and reads
by its *peak* risk (a risk that fell back is not an all-clear). When the GPU it warned about then fails
(collector/failed.py) the alert turns "failed": it says so, the action becomes the failure's (drain and
reset, not "checkpoint now"), and it stays firing until the GPU is reset, whatever the risk does. Delivery
goes to Prometheus Alertmanager's v2 API and/or a generic JSON webhook through small background senders
with a bounded queue and retries: a slow or dead receiver never stalls scoring.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

# the job the alerts' checkpoint/drain advice assumes unless the collector is told (job_gpus, checkpoint_cost)
from gpuwatch.core.settings import DEFAULT_CHECKPOINT_COST_S, DEFAULT_JOB_GPUS
from gpuwatch.core.times import iso_ms, iso_utc
from gpuwatch.models.advisor import Advice, advise
from gpuwatch.models.policy import AlertPolicy

log = logging.getLogger(__name__)

ALERT_NAME = "GPUFailureRisk"
#: Risk (probability of a fault within the model's horizon) above which draining the node is suggested.
DRAIN_AT = 0.5


@dataclass(frozen=True)
class RiskObservation:
    """One GPU's scored risk at one time, with who runs on it and why the score is what it is."""

    gpu_uuid: str
    gpu_index: int
    node: str
    risk: float
    jobs: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()
    signals: tuple[dict, ...] = ()
    ts_ms: int | None = None
    failed: str | None = None  # the GPU has failed (collector.failed.Failure.reason); None: it runs


@dataclass
class Alert:
    gpu_uuid: str
    gpu_index: int
    node: str
    risk: float
    peak_risk: float
    jobs: tuple[str, ...]
    ranks: tuple[int, ...]
    signals: tuple[dict, ...]
    action: str
    starts_ms: int
    ends_ms: int | None = None
    # policy state: last time the risk was at or above the resolve level
    last_high_ms: int | None = field(default=None, repr=False)
    failed: str | None = None  # set once the GPU has failed: what failed and what to do

    @property
    def firing(self) -> bool:
        return self.ends_ms is None

    @property
    def state(self) -> str:
        return "failed" if self.failed else "at_risk"

    def summary(self) -> str:
        if self.failed:  # "failed: XID 48 (...); <action>": the action is the alert's own field
            what = self.failed.split("; ", 1)[0]
            return f"GPU {self.gpu_index} on {self.node} has {what} (risk had peaked at {self.peak_risk:.2f})"
        return (f"GPU {self.gpu_index} on {self.node} at risk of failing: risk peaked at {self.peak_risk:.2f}"
                f" (now {self.risk:.2f})")

    def to_json(self) -> dict:
        """Webhook and `gpuwatch alerts --json` shape."""
        return {"alertname": ALERT_NAME, "status": "firing" if self.firing else "resolved",
                "node": self.node, "gpu_index": self.gpu_index, "gpu_uuid": self.gpu_uuid,
                "state": self.state, "failed": self.failed,
                "risk": round(self.risk, 4), "peak_risk": round(self.peak_risk, 4), "jobs": list(self.jobs),
                "ranks": list(self.ranks), "signals": list(self.signals), "action": self.action,
                "starts_at": iso_utc(self.starts_ms), "ends_at": iso_utc(self.ends_ms) if self.ends_ms else None,
                "summary": self.summary()}

    @classmethod
    def from_json(cls, doc: dict, last_high_ms: int) -> Alert:
        """A firing alert back from its :meth:`to_json` document (as the alerts table keeps it);
        ``last_high_ms``: when its risk was last at or above the resolve level, as far as is known."""
        return cls(doc["gpu_uuid"], int(doc["gpu_index"]), doc["node"], float(doc["risk"]), float(doc["peak_risk"]),
                   tuple(doc["jobs"]), tuple(doc["ranks"]), tuple(doc["signals"]), doc["action"],
                   iso_ms(doc["starts_at"]), None, last_high_ms, doc.get("failed"))

    def to_alertmanager(self) -> dict:
        """Alertmanager v2 postable alert; a resolved alert carries its endsAt (in the past)."""
        body = {
            "labels": {"alertname": ALERT_NAME, "node": self.node, "gpu": str(self.gpu_index),
                       "uuid": self.gpu_uuid, "severity": "warning"},
            "annotations": {"summary": self.summary(), "action": self.action, "state": self.state,
                            "peak_risk": f"{self.peak_risk:.2f}", "risk": f"{self.risk:.2f}",
                            "jobs": ",".join(self.jobs), "ranks": ",".join(map(str, self.ranks)),
                            "signals": ", ".join(f"{s.get('signal')}={s.get('value')}" for s in self.signals)},
            "startsAt": iso_utc(self.starts_ms),
        }
        if self.ends_ms is not None:
            body["endsAt"] = iso_utc(self.ends_ms)
        return body


@dataclass(frozen=True)
class Transition:
    kind: str  # "fire" or "resolve"
    alert: Alert


def suggest_action(risk: float, node: str, advice: Advice, drain_at: float = DRAIN_AT) -> str:
    """What to do now, by risk and the advisor's break-even precisions (both are probabilities)."""
    steps = []
    if risk >= advice.break_even_precision_checkpoint:
        steps.append("checkpoint now")
    if risk >= max(drain_at, advice.break_even_precision_drain):
        steps.append(f"drain node {node} after the checkpoint")
    return ", then ".join(steps) if steps else "watch: risk below the break-even of any action"


class AlertEngine:
    """One alert per GPU under an :class:`AlertPolicy`; hands every change to the senders."""

    def __init__(self, policy: AlertPolicy, *, senders: Sequence[AlertSender] = (), advice: Advice | None = None,
                 resend_interval_s: float = 60.0, keep_resolved: int = 1000) -> None:
        self.policy = policy
        self.senders = list(senders)
        self.advice = advice or advise(n_gpus=DEFAULT_JOB_GPUS, checkpoint_s=DEFAULT_CHECKPOINT_COST_S)
        self.resend_interval_s = resend_interval_s
        self._active: dict[str, Alert] = {}
        self._resolved: deque[Alert] = deque(maxlen=keep_resolved)
        self._last_sent_ms = 0
        self._lock = threading.Lock()

    def observe(self, observations: Iterable[RiskObservation], now_ms: int | None = None) -> list[Transition]:
        """Apply a round of risk observations; returns fire/resolve transitions (already queued for delivery)."""
        now = int(now_ms if now_ms is not None else time.time() * 1000)
        changes: list[Transition] = []
        turned_failed: list[Alert] = []
        with self._lock:
            for ob in observations:
                t = ob.ts_ms if ob.ts_ms is not None else now
                alert = self._active.get(ob.gpu_uuid)
                was = alert is not None
                last_high = alert.last_high_ms if alert else None
                if ob.failed and not was:
                    continue  # nothing left to predict: the failure itself is the health state's to report
                if alert is not None and (ob.failed or alert.failed):
                    if ob.failed and not alert.failed:
                        turned_failed.append(alert)
                    self._failed(alert, ob, t)  # a failed GPU's alert stays until the GPU is reset
                    if alert.failed:
                        continue
                active, last_high = self.policy.step(was, ob.risk, t, last_high)
                if active and not was:
                    alert = Alert(ob.gpu_uuid, ob.gpu_index, ob.node, ob.risk, ob.risk, ob.jobs, ob.ranks,
                                  ob.signals, suggest_action(ob.risk, ob.node, self.advice), t, None, last_high)
                    self._active[ob.gpu_uuid] = alert
                    changes.append(Transition("fire", alert))
                elif active and alert is not None:
                    alert.risk, alert.last_high_ms = ob.risk, last_high
                    if ob.risk > alert.peak_risk:
                        alert.peak_risk, alert.signals = ob.risk, ob.signals
                        alert.action = suggest_action(ob.risk, ob.node, self.advice)
                    alert.jobs, alert.ranks = ob.jobs or alert.jobs, ob.ranks or alert.ranks
                elif alert is not None:  # was active
                    alert.risk, alert.ends_ms = ob.risk, t
                    del self._active[ob.gpu_uuid]
                    self._resolved.append(alert)
                    changes.append(Transition("resolve", alert))
            resend = now - self._last_sent_ms >= self.resend_interval_s * 1000
            batch = [replace(a) for a in self._active.values()] if resend else [replace(c.alert) for c in changes
                                                                                   if c.kind == "fire"]
            batch += [replace(a) for a in turned_failed if not resend]
            batch += [replace(c.alert) for c in changes if c.kind == "resolve"]
            if resend:
                self._last_sent_ms = now
        if batch:
            for sender in self.senders:
                sender.submit(batch)
        return changes

    @staticmethod
    def _failed(alert: Alert, ob: RiskObservation, t: int) -> None:
        """Turn ``alert`` into (or keep it as, or, after a reset, back out of) a failed-GPU alert."""
        alert.risk = ob.risk
        if ob.failed:
            alert.failed, alert.action = ob.failed, ob.failed.split("; ", 1)[-1]
            alert.last_high_ms = t  # the policy's resolve clock starts only once the GPU runs again
        else:
            alert.failed = None

    def restore(self, alerts: Iterable[Alert], replace: bool = False) -> None:
        """Take back alerts that were firing when the collector stopped: a GPU still at risk keeps its alert
        (same start, no new notification) and one that recovered resolves under the policy as usual. With
        ``replace`` they are the only active ones (another collector held the alerts meanwhile)."""
        with self._lock:
            if replace:
                self._active.clear()
            self._active.update((a.gpu_uuid, a) for a in alerts)

    def active(self) -> list[Alert]:
        with self._lock:
            return list(self._active.values())

    def resolved(self) -> list[Alert]:
        with self._lock:
            return list(self._resolved)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the senders after they deliver what is queued (or the timeout passes)."""
        for sender in self.senders:
            sender.close(timeout_s)


class Sendable(Protocol):
    """What the senders read of an alert: :class:`Alert`, and the job alerts of the alert hub."""

    def to_json(self) -> dict: ...

    def to_alertmanager(self) -> dict: ...


class AlertSender:
    """Posts alert batches from a background thread: bounded queue (oldest dropped), retries with backoff."""

    def __init__(self, url: str, *, queue_size: int = 256, retries: int = 3, timeout_s: float = 5.0,
                 backoff_s: float = 0.5) -> None:
        self.url = url
        self.retries, self.timeout_s, self.backoff_s = retries, timeout_s, backoff_s
        self.sent = self.failed = self.dropped = 0
        self._queue: queue.Queue[Sequence[Sendable] | None] = queue.Queue(maxsize=queue_size)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"alert-sender {url}", daemon=True)
        self._thread.start()

    def submit(self, alerts: Sequence[Sendable]) -> None:
        """Queue a batch; never blocks (drops the oldest queued batch when full)."""
        while True:
            try:
                self._queue.put_nowait(alerts)
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()
                    self.dropped += 1
                except queue.Empty:
                    pass

    def body(self, alerts: Sequence[Sendable]) -> object:
        raise NotImplementedError

    def endpoint(self) -> str:
        return self.url

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            self._deliver(batch)

    def _deliver(self, batch: Sequence[Sendable]) -> None:
        data = json.dumps(self.body(batch)).encode()
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(self.endpoint(), data=data, method="POST",
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    response.read()
                self.sent += 1
                return
            except urllib.error.HTTPError as exc:  # the receiver's reason is in the body: quote it
                reason = exc.read(_REASON_BYTES).decode("utf-8", "replace").strip() or exc.reason
                log.warning("delivery of %s to %s failed (attempt %d): HTTP %d: %r", _names(batch), self.endpoint(),
                            attempt + 1, exc.code, reason)
                if 400 <= exc.code < 500 and exc.code not in (408, 429):
                    break  # the receiver refuses this content: sending it again would be refused again
                if attempt < self.retries and self._stop.wait(self.backoff_s * 2**attempt):
                    break
            except (urllib.error.URLError, OSError) as exc:
                log.warning("delivery of %s to %s failed (attempt %d): %s", _names(batch), self.endpoint(),
                            attempt + 1, exc)
                if attempt < self.retries and self._stop.wait(self.backoff_s * 2**attempt):
                    break
        self.failed += 1

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver what is queued, then stop (gives up waiting after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._queue.put(None, timeout=max(0.01, deadline - time.monotonic()))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    self._stop.set()
                    break
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._stop.set()


_REASON_BYTES = 2000  # of a receiver's error answer, quoted in the log


def _names(alerts: Sequence[Sendable]) -> str:
    """The alerts of a delivery for a log line: "GPUFailureRisk node-7/GPU 3, SlowRank job-1/4"."""
    names = [f"{doc['alertname']} {doc.get('node', doc.get('job_id', '?'))}"
             + (f"/GPU {doc['gpu_index']}" if "gpu_index" in doc else "") for doc in (a.to_json() for a in alerts)]
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


class AlertmanagerSender(AlertSender):
    """Prometheus Alertmanager: POST {url}/api/v2/alerts with a list of postable alerts.

    ``startsAt``/``endsAt`` are on this machine's clock (when this sender first sent the alert firing, and when
    it sent it resolved): alert times are on the data's clock, which for agents on simulated or skewed time
    is hours away, and Alertmanager refuses a start after the end or keeps a resolved alert whose end is in
    its future active. The data's times go along as the ``data_starts_at``/``data_ends_at`` annotations."""

    _KEPT = 100_000  # firing alerts whose wall-clock start is remembered (oldest forgotten first)

    def __init__(self, url: str, **options: Any) -> None:
        self._wall_starts: dict[tuple, int] = {}  # labels -> when first sent firing (ms); the sender thread's
        super().__init__(url, **options)

    def endpoint(self) -> str:
        return self.url.rstrip("/") + "/api/v2/alerts"

    def body(self, alerts: Sequence[Sendable]) -> object:
        now = int(time.time() * 1000)
        out = []
        for alert in alerts:
            doc = alert.to_alertmanager()
            key = tuple(sorted(doc["labels"].items()))
            doc["annotations"]["data_starts_at"] = doc["startsAt"]
            started = self._wall_starts.setdefault(key, now)
            doc["startsAt"] = iso_utc(started)
            if "endsAt" in doc:
                doc["annotations"]["data_ends_at"] = doc["endsAt"]
                doc["endsAt"] = iso_utc(max(now, started))
                del self._wall_starts[key]
            out.append(doc)
        while len(self._wall_starts) > self._KEPT:
            del self._wall_starts[next(iter(self._wall_starts))]
        return out


class WebhookSender(AlertSender):
    """Generic JSON webhook: POST {"version": "1", "source": "gpuwatch", "alerts": [...]}."""

    def body(self, alerts: Sequence[Sendable]) -> object:
        return {"version": "1", "source": "gpuwatch", "alerts": [a.to_json() for a in alerts]}
