"""The collector's alert path: GPU failure risk, slow ranks and hung jobs, one set of senders, one table.

GPU risk goes through :class:`~gpuwatch.collector.alerts.AlertEngine` (threshold, hysteresis, dedup and the
suggested action). Job alerts (``SlowRank`` per straggler rank, ``JobHang`` per job) are set by the jobs
monitor as "what is true now": new ones fire, missing ones resolve. Both reach the same Alertmanager and
webhook senders, and every alert is kept in the store's ``alerts`` table, so `gpuwatch alerts` answers
from it; on start the hub takes back the alerts left firing, so a restart neither resolves nor re-fires them.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from gpuwatch.collector.alerts import ALERT_NAME as GPU_FAILURE_RISK
from gpuwatch.collector.alerts import Alert, AlertEngine, AlertSender, RiskObservation, Transition
from gpuwatch.collector.query_documents import alerts_response
from gpuwatch.collector.store.base import AlertRecords
from gpuwatch.core.times import iso_ms, iso_utc
from gpuwatch.collector.store.dialect import ms_to_datetime
from gpuwatch.models.policy import AlertPolicy
from gpuwatch.v1 import query_pb2 as q

SLOW_RANK = "SlowRank"
JOB_HANG = "JobHang"
ALERT_NAMES = (GPU_FAILURE_RISK, SLOW_RANK, JOB_HANG)


@dataclass
class JobAlert:
    """A slow-rank or hang alert of one job; shaped like :class:`Alert` for the senders."""

    alertname: str
    job_id: str
    subject: str                       # what the alert is about: "job/rank" for SlowRank, the job for JobHang
    summary: str
    details: dict[str, Any]            # the evidence, as JSON-ready values
    labels: dict[str, str] = field(default_factory=dict)
    starts_ms: int = 0
    ends_ms: int | None = None

    @property
    def firing(self) -> bool:
        return self.ends_ms is None

    def to_json(self) -> dict:
        """Webhook and `gpuwatch alerts --json` shape."""
        return {"alertname": self.alertname, "status": "firing" if self.firing else "resolved",
                "job_id": self.job_id, **self.labels, "summary": self.summary, "details": self.details,
                "starts_at": iso_utc(self.starts_ms), "ends_at": iso_utc(self.ends_ms) if self.ends_ms else None}

    @classmethod
    def from_json(cls, doc: dict, subject: str) -> JobAlert:
        """A firing job alert back from its :meth:`to_json` document and its ``subject``."""
        labels = {k: v for k, v in doc.items() if k not in _JOB_ALERT_KEYS}
        return cls(doc["alertname"], doc["job_id"], subject, doc["summary"], doc["details"], labels,
                   iso_ms(doc["starts_at"]))

    def to_alertmanager(self) -> dict:
        body = {"labels": {"alertname": self.alertname, "job_id": self.job_id, **self.labels, "severity": "warning"},
                "annotations": {"summary": self.summary, "details": json.dumps(self.details, sort_keys=True)},
                "startsAt": iso_utc(self.starts_ms)}
        if self.ends_ms is not None:
            body["endsAt"] = iso_utc(self.ends_ms)
        return body


_JOB_ALERT_KEYS = {"alertname", "status", "job_id", "summary", "details", "starts_at", "ends_at"}


@dataclass(frozen=True)
class JobFinding:
    """One thing the jobs monitor sees now (a straggler rank, a hang) that should be an alert."""

    job_id: str
    subject: str
    summary: str
    details: dict[str, Any]
    labels: dict[str, str] = field(default_factory=dict)


class AlertHub:
    """Fires, resolves, delivers and persists every alert of the collector; answers the ``Alerts`` RPC."""

    def __init__(self, policy: AlertPolicy | None = None, senders: Sequence[AlertSender] = (),
                 **engine_options: Any) -> None:
        self.senders = list(senders)
        self._engine_options = engine_options
        self._firing_gpu_alerts: list[Alert] = []  # for an engine made later (use_policy)
        self.engine = AlertEngine(policy, senders=self.senders, **engine_options) if policy else None
        self._jobs: dict[tuple[str, str], JobAlert] = {}
        self._lock = threading.Lock()
        self._store: AlertRecords | None = None

    # ---- service -----------------------------------------------------------------------------------
    def start(self, store: AlertRecords) -> Mapping[str, Any]:
        """Use ``store`` and take back the alerts that were firing when the collector last stopped, so a
        restart neither resolves nor re-fires what is still true."""
        self._store = store
        self._restore(store)
        return {"Alerts": list_alerts}

    def reload(self) -> None:
        """Replace the alerts held here by those the store says are firing (another collector raised them
        while it held the cluster lease), so taking the work over neither re-fires nor resolves twice."""
        with self._lock:
            self._jobs.clear()
        assert self._store is not None, "reloaded once started"
        self._restore(self._store, replace=True)

    def use_policy(self, policy: AlertPolicy) -> None:
        """Start risk alerting with ``policy``: the collector calls this once its failure model has loaded in
        the background; the GPU alerts that were firing when the store was opened are taken back then."""
        engine = AlertEngine(policy, senders=self.senders, **self._engine_options)
        engine.restore(self._firing_gpu_alerts)
        self.engine = engine

    def _restore(self, store: AlertRecords, replace: bool = False) -> None:
        firing = store.firing_alerts()
        gpu_alerts = []
        with self._lock:
            for row in firing.itertuples(index=False):
                doc = json.loads(row.doc)
                if row.alertname == GPU_FAILURE_RISK:
                    # last persisted while firing: the risk was high then, or within keep_firing_for of it
                    gpu_alerts.append(Alert.from_json(doc, last_high_ms=int(row.updated_ms)))
                else:
                    self._jobs[(row.alertname, row.subject)] = JobAlert.from_json(doc, row.subject)
        if self.engine is not None:
            self.engine.restore(gpu_alerts, replace=replace)
        else:
            self._firing_gpu_alerts = gpu_alerts

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.close()
        else:
            for sender in self.senders:
                sender.close()

    # ---- GPU risk ----------------------------------------------------------------------------------
    def observe_risk(self, observations: Iterable[RiskObservation], now_ms: int | None = None) -> list[Transition]:
        """One scoring round: fire/resolve through the engine, then persist what changed and what is active."""
        if self.engine is None:
            return []
        now = _now_ms(now_ms)
        changes = self.engine.observe(observations, now_ms=now)
        rows = [_gpu_row(a) for a in self.engine.active()] + [_gpu_row(c.alert) for c in changes
                                                             if c.kind == "resolve"]
        self._persist(rows)
        return changes

    def observe_risk_rounds(self, rounds: Iterable[tuple[int, Sequence[RiskObservation]]]) -> list[Transition]:
        """Many scoring rounds in time order (a replay): the engine sees each round as it would live, and the
        alerts table is written once at the end instead of once per round."""
        if self.engine is None:
            return []
        changes = [c for now, observations in rounds for c in self.engine.observe(observations, now_ms=now)]
        touched = {id(a): a for a in [c.alert for c in changes] + self.engine.active()}
        self._persist([_gpu_row(a) for a in touched.values()])
        return changes

    # ---- jobs --------------------------------------------------------------------------------------
    def set_job_alerts(self, alertname: str, findings: Iterable[JobFinding], now_ms: int | None = None,
                       jobs: Iterable[str] | None = None) -> list[JobAlert]:
        """Make the active ``alertname`` alerts equal ``findings``: new ones fire, missing ones resolve.

        With ``jobs``, only alerts of those jobs are considered (the others were not looked at this round).
        Returns the alerts that fired or resolved now; all active ones are (re)sent so receivers keep them.
        """
        now = _now_ms(now_ms)
        scope = None if jobs is None else set(jobs)
        changed: list[JobAlert] = []
        with self._lock:
            wanted = {(alertname, f.subject): f for f in findings}
            for key, finding in wanted.items():
                alert = self._jobs.get(key)
                if alert is None:
                    alert = self._jobs[key] = JobAlert(alertname, finding.job_id, finding.subject, finding.summary,
                                                       finding.details, finding.labels, now)
                    changed.append(alert)
                else:
                    alert.summary, alert.details = finding.summary, finding.details
            for key, alert in list(self._jobs.items()):
                if key[0] == alertname and key not in wanted and (scope is None or alert.job_id in scope):
                    alert.ends_ms = now
                    del self._jobs[key]
                    changed.append(alert)
            active = [a for k, a in self._jobs.items() if k[0] == alertname]
        outgoing = active + [a for a in changed if not a.firing]
        for sender in self.senders:
            if outgoing:
                sender.submit(outgoing)
        self._persist([_job_row(a) for a in outgoing])
        return changed

    def active_job_alerts(self) -> list[JobAlert]:
        with self._lock:
            return list(self._jobs.values())

    # ---- persistence -------------------------------------------------------------------------------
    def _persist(self, rows: list[dict]) -> None:
        if self._store is None or not rows:
            return
        table = pd.DataFrame(rows, columns=["id", "alertname", "subject", "status", "starts_at", "ends_at",
                                            "updated_at", "doc"])

        self._store.upsert_alerts(table)


def list_alerts(request: q.AlertsRequest, store: AlertRecords) -> q.AlertsResponse:
    """The ``Alerts`` RPC: firing alerts (and resolved ones with include_resolved), newest first."""
    return alerts_response([json.loads(doc) for doc in store.alert_docs(bool(request.include_resolved))])


def _gpu_row(alert: Alert) -> dict:
    subject = f"{alert.node}/{alert.gpu_index}"
    return _row(GPU_FAILURE_RISK, subject, alert.starts_ms, alert.ends_ms, alert.to_json())


def _job_row(alert: JobAlert) -> dict:
    return _row(alert.alertname, alert.subject, alert.starts_ms, alert.ends_ms, alert.to_json())


def _row(alertname: str, subject: str, starts_ms: int, ends_ms: int | None, doc: dict) -> dict:
    return {"id": f"{alertname}:{subject}:{starts_ms}", "alertname": alertname, "subject": subject,
            "status": doc["status"], "starts_at": ms_to_datetime(starts_ms),
            "ends_at": ms_to_datetime(ends_ms) if ends_ms else None,
            "updated_at": ms_to_datetime(int(time.time() * 1000)), "doc": json.dumps(doc)}


def _now_ms(now_ms: int | None) -> int:
    return int(time.time() * 1000) if now_ms is None else int(now_ms)
