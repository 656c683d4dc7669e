"""Jobs and alerts as the typed messages of the Query API, and back as the documents ``--json`` prints.

The collector builds its job and alert documents as dicts (the jobs monitor's flags, the alert hub's stored
alerts); the ``Jobs`` and ``Alerts`` RPCs carry them as typed messages (``gpuwatch.v1.Job``,
``gpuwatch.v1.Alert``), and clients turn them back into the same documents, keys in the same order, a value
the collector did not have as null. Both directions are here, so the schema and the printed document cannot
drift apart. A document's message fields share its key names; keys a message does not declare are dropped.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf.message import Message

from gpuwatch.v1 import query_pb2 as q

# the job document's keys before the monitor's, in the order the collector builds them (collector/jobs.py)
_JOB_KEYS = ("ranks", "gpus", "world_size", "steps", "step_rate", "step_time_s", "last_step_us", "last_step",
             "last_step_age_s", "finished", "lost_fraction", "submitted_at", "last_sample", "job_id", "sources",
             "nodes", "stragglers", "delayed", "slow_ranks", "hang")
# keys a document leaves out, rather than null, when unset: a delayed rank has no node and no since
_ABSENT_WHEN_UNSET = {"Straggler": frozenset({"node", "since"})}
_ALERT_KEYS = frozenset({"alertname", "status", "starts_at", "ends_at", "summary"})
_JOB_ALERT_KEYS = _ALERT_KEYS | {"job_id", "details"}


# ------------------------------------------------------------------------------------------- generic
def _message(message_class: type[Message], doc: Mapping[str, Any]) -> Any:
    """``message_class`` with the fields ``doc`` has by name (a None value: the field stays unset)."""
    values: dict[str, Any] = {}
    for field in message_class.DESCRIPTOR.fields:
        value = doc.get(field.name)
        if value is None:
            continue
        if field.message_type is not None:
            nested = getattr(q, field.message_type.name)
            value = [_message(nested, v) for v in value] if field.is_repeated else _message(nested, value)
        values[field.name] = value
    return message_class(**values)


def _document(message: Message) -> dict[str, Any]:
    """The fields of ``message`` by name, in declaration order; an unset optional one None."""
    absent = _ABSENT_WHEN_UNSET.get(message.DESCRIPTOR.name, frozenset())
    doc: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.is_repeated:
            doc[field.name] = [_document(v) for v in value] if field.message_type is not None else list(value)
        elif field.has_presence and not message.HasField(field.name):
            if field.name not in absent:
                doc[field.name] = None
        else:
            doc[field.name] = _document(value) if field.message_type is not None else value
    return doc


# ---------------------------------------------------------------------------------------------- jobs
def job_message(doc: Mapping[str, Any]) -> q.Job:
    """The ``Job`` of a job document (gpuwatch.collector.jobs.list_jobs)."""
    job = _message(q.Job, doc)
    if "breakdown" in doc:  # the jobs monitor analysed it
        job.monitor.CopyFrom(q.JobMonitorFlags(
            breakdown=[q.CategoryFraction(category=c, fraction=f) for c, f in (doc["breakdown"] or {}).items()],
            rank_lost_ratio=[q.RankRatio(rank=int(r), ratio=v) for r, v in (doc.get("rank_lost_ratio") or {}).items()],
            lost_gpu_seconds_total=doc.get("lost_gpu_seconds_total") or 0.0, gone=bool(doc.get("gone"))))
    return job


def job_document(job: q.Job) -> dict[str, Any]:
    """The job document of a ``Job``: what ``gpuwatch jobs --json`` prints for it."""
    fields = _document(job)
    doc = {key: fields[key] for key in _JOB_KEYS}
    if job.HasField("monitor"):
        monitor = job.monitor
        doc.update(breakdown={c.category: c.fraction for c in monitor.breakdown},
                   rank_lost_ratio={r.rank: r.ratio for r in monitor.rank_lost_ratio},
                   lost_gpu_seconds_total=monitor.lost_gpu_seconds_total, gone=monitor.gone)
    return doc


def jobs_response(docs: Sequence[Mapping[str, Any]]) -> q.JobsResponse:
    return q.JobsResponse(jobs=[job_message(doc) for doc in docs])


def job_documents(response: q.JobsResponse) -> list[dict[str, Any]]:
    return [job_document(job) for job in response.jobs]


# -------------------------------------------------------------------------------------------- alerts
def alert_message(doc: Mapping[str, Any]) -> q.Alert:
    """The ``Alert`` of an alert document (a GPU alert's or a job alert's ``to_json``)."""
    alert = _message(q.Alert, doc)
    if "gpu_uuid" in doc:
        alert.gpu.CopyFrom(_message(q.GpuAlert, doc))
        return alert
    job = alert.job
    job.job_id = doc.get("job_id") or ""
    job.labels.extend(q.Label(name=k, value=str(v)) for k, v in doc.items() if k not in _JOB_ALERT_KEYS)
    details = doc.get("details")
    if isinstance(details, Mapping):
        if "stuck" in details:
            job.hang.CopyFrom(_message(q.Hang, details))
        elif "cause" in details:
            job.slow_rank.CopyFrom(_message(q.SlowRank, details))
        else:
            job.straggler.CopyFrom(_message(q.Straggler, details))
    return alert


def alert_document(alert: q.Alert) -> dict[str, Any]:
    """The alert document of an ``Alert``: what ``gpuwatch alerts --json`` prints for it."""
    head = {"alertname": alert.alertname, "status": alert.status}
    times = {"starts_at": alert.starts_at, "ends_at": alert.ends_at if alert.HasField("ends_at") else None}
    if alert.HasField("gpu"):
        return {**head, **_document(alert.gpu), **times, "summary": alert.summary}
    job = alert.job
    kind = job.WhichOneof("details")
    return {**head, "job_id": job.job_id, **{label.name: label.value for label in job.labels},
            "summary": alert.summary, "details": _document(getattr(job, kind)) if kind else None, **times}


def alerts_response(docs: Sequence[Mapping[str, Any]]) -> q.AlertsResponse:
    return q.AlertsResponse(alerts=[alert_message(doc) for doc in docs])


def alert_documents(response: q.AlertsResponse) -> list[dict[str, Any]]:
    return [alert_document(alert) for alert in response.alerts]


# --------------------------------------------------------------------------------------------- usage
def usage_response(rows: Sequence[Mapping[str, Any]], owner_keys: Sequence[str]) -> q.UsageResponse:
    """The ``Usage`` reply of :func:`gpuwatch.collector.owners.usage` rows grouped by ``owner_keys``."""
    replies = []
    for row in rows:
        reply = _message(q.UsageRow, row)
        reply.owner.extend(q.Label(name=k, value=str(row[k])) for k in owner_keys)
        replies.append(reply)
    return q.UsageResponse(rows=replies)


def usage_documents(response: q.UsageResponse) -> list[dict[str, Any]]:
    """The rows ``gpuwatch usage --json`` prints: the owner's columns, then GPU time, loss and energy."""
    docs = []
    for row in response.rows:
        values = _document(row)
        del values["owner"]
        docs.append({**{label.name: label.value for label in row.owner}, **values})
    return docs
