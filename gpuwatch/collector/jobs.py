"""Live jobs in the collector: the `Jobs` RPC, and a monitor that flags slow ranks and hangs as alerts.

The list comes from :func:`gpuwatch.collector.live.job_summaries` over the recent probe spans in the store
(rates, lost share), the step marks kept over each job's life (steps, last step, finished), plus the jobs
known only from submitted traces or GPU samples. Every
``interval_s`` the :class:`JobsMonitor` analyses each running job's recent spans (``window_s``) with the
efficiency engine (the same one as `gpuwatch analyze`): breakdown fractions, lost time per rank, and
stragglers as docs/efficiency.md defines them (last to arrive far more often than chance *and*
busier than the peers; ranks late only because they waited are `delayed`, not flagged). A straggler keeps
the time the monitor first flagged it (``since``) while it stays flagged. Hangs come from
:func:`~gpuwatch.collector.live.detect_hangs`. Each job's ``slow_ranks`` say why a rank is slow, with the
evidence, onset and cost (:mod:`gpuwatch.collector.slow_ranks`, docs/why-slow.md); the monitor keeps a cause's
onset while it holds. Stragglers, slow ranks and hangs become alerts (``SlowRank``, ``JobHang``) through the
:class:`~gpuwatch.collector.alert_hub.AlertHub` and resolve when they clear. The per-step efficiency of
the spans analysed each round is kept in the store, where it outlives the raw spans' window.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

import msgspec
import pandas as pd

from gpuwatch.collector.alert_hub import JOB_HANG, SLOW_RANK, AlertHub, JobFinding
from gpuwatch.collector.breakdowns import breakdown_rows
from gpuwatch.efficiency.engine import analyze
from gpuwatch.efficiency.result import Analysis
from gpuwatch.collector.live import detect_hangs, job_summaries, probe_timelines
from gpuwatch.collector.periodic import PeriodicService
from gpuwatch.collector.query_documents import jobs_response
from gpuwatch.collector.slow_ranks import job_slow_ranks, slow_rank_docs
from gpuwatch.core.times import iso_utc
from gpuwatch.collector.store.base import (STEP_MARK_KINDS, BreakdownRecords, EventQueries, SampleQueries,
                                           SpanQueries)
from gpuwatch.core.errors import UserError
from gpuwatch.core.settings import DEFAULT_HANG_S
from gpuwatch.core.settings import DEFAULT_JOBS_INTERVAL_S as DEFAULT_INTERVAL_S
from gpuwatch.core.settings import DEFAULT_JOBS_WINDOW_S as DEFAULT_WINDOW_S
from gpuwatch.v1 import query_pb2 as q

log = logging.getLogger(__name__)



class JobListReads(SpanQueries, BreakdownRecords, Protocol):
    """What the jobs list reads: spans, step progress, the jobs seen in samples and in submitted traces."""


class JobsStore(JobListReads, SampleQueries, EventQueries, Protocol):
    """What the jobs monitor reads and writes: the list's reads, stopped agents, slow-rank samples, step rows."""


def list_jobs(store: JobListReads, now_us: float | None = None, window_s: float = DEFAULT_WINDOW_S,
              flags: Mapping[str, Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Every job the collector knows, with ``sources`` saying from where: probe ``spans`` (ranks, nodes, steps,
    step rate, lost fraction over the last ``window_s``), submitted ``traces`` (ranks) and ``gpu_samples``
    (nodes, GPUs); plus the monitor's ``flags`` per job (stragglers, delayed, hang) where given. A job submitted
    with `submit-trace` or only seen on GPUs is a job too, so it is listed rather than hidden."""
    jobs: dict[str, dict[str, Any]] = {}

    def known(job_id: str, source: str) -> dict[str, Any]:
        job = jobs.setdefault(job_id, {**_UNKNOWN, "job_id": job_id, "sources": [], "nodes": []})
        job["sources"].append(source)
        return job

    now = time.time() * 1e6 if now_us is None else now_us
    # with the monitor's flags (which carry each job's lost fraction) the step marks are enough
    spans = store.recent_spans(window_s, kinds=None if flags is None else STEP_MARK_KINDS)
    summaries = ({s["job_id"]: s for s in job_summaries(spans, now, window_s, lost=flags is None)}
                 if not spans.empty else {})
    for progress in store.job_progress().to_dict("records"):
        summaries[progress["job_id"]] = _whole_life(summaries.get(progress["job_id"]), progress, now)
    for job_id in sorted(summaries):
        summary = summaries[job_id]
        job = known(job_id, "spans")
        job.update(summary, last_step=iso_utc(int(summary["last_step_us"] / 1000)) if summary["last_step_us"]
                   else None)
    for row in _traced_jobs(store):
        job = known(row["job_id"], "traces")
        job["ranks"] = job["ranks"] or int(row["ranks"])
        job["submitted_at"] = row["submitted_at"]
    for row in store.sample_jobs():
        job = known(row["job_id"], "gpu_samples")
        job["nodes"] = sorted(set(job["nodes"]) | set(row["nodes"]))
        job["gpus"] = int(row["gpus"])
        job["ranks"] = job["ranks"] or int(row["ranks"]) or None
        job["last_sample"] = iso_utc(int(row["last_seen_ms"]))
    for job in jobs.values():
        job.update({"stragglers": [], "delayed": [], "slow_ranks": [], "hang": None,
                    **(flags or {}).get(job["job_id"], {})})
    return [jobs[j] for j in sorted(jobs)]


# the keys of a job that a source it is not known from cannot fill
_UNKNOWN: dict[str, Any] = {
    "ranks": None, "gpus": None, "world_size": None, "steps": None, "step_rate": None, "step_time_s": None,
    "last_step_us": None, "last_step": None, "last_step_age_s": None, "finished": None, "lost_fraction": None,
    "submitted_at": None, "last_sample": None,
}


def _whole_life(recent: dict[str, Any] | None, progress: Mapping[str, Any], now_us: float) -> dict[str, Any]:
    """A job's summary with what its step marks say over its whole life (raw spans cover a window only):
    ranks, nodes, world size, steps, last step and finished; rates and lost share stay the recent window's."""
    last = progress["last_step_us"]
    last = None if last is None or pd.isna(last) else float(last)
    world = progress["world_size"]
    return {
        "step_rate": None, "step_time_s": None, "lost_fraction": None, **(recent or {}),
        "job_id": progress["job_id"],
        "ranks": max(int(progress["ranks"]), (recent or {}).get("ranks") or 0),
        "nodes": sorted(set(progress["nodes"]) | set((recent or {}).get("nodes", []))),
        "world_size": int(world) if world is not None and pd.notna(world) and world > 0 else
        (recent or {}).get("world_size"),
        "steps": int(progress["steps"]),
        "last_step_us": last,
        "last_step_age_s": (now_us - last) / 1e6 if last is not None else None,
        "finished": bool(progress["finished"]),
    }


def _traced_jobs(store: BreakdownRecords) -> list[dict[str, Any]]:
    """Jobs with submitted traces: ranks and the last submission time (ISO UTC)."""
    return [{"job_id": r["job_id"], "ranks": r["ranks"], "submitted_at": iso_utc(int(r["submitted_ms"]))}
            for r in store.traced_jobs()]


def list_jobs_rpc(request: q.JobsRequest, store: JobListReads) -> q.JobsResponse:
    """The ``Jobs`` RPC of a collector without a monitor: the list without flags."""
    return jobs_response(list_jobs(store))


def analyse_spans(rows: pd.DataFrame, job_id: str, per_step: bool = False) -> Analysis | None:
    """The engine's analysis of some of a job's span rows; None when they hold nothing it can analyse."""
    try:
        timelines = probe_timelines(rows, source=f"job {job_id} probe spans")
        return analyze(timelines, per_step=per_step) if timelines is not None else None
    except UserError as exc:
        log.warning("job %s: cannot analyse its recent spans: %s", job_id, exc)
        return None


def whole_steps_since(rows: pd.DataFrame, since_us: float) -> pd.DataFrame:
    """A job's ``rows`` of the whole steps that began at or after ``since_us``, every rank's spans of each
    (and the rows of no step that began then). Whole: where the job marks its steps' ends, a step no rank has
    marked yet (the one running now) waits for the next round. Cut span by span instead, a rank could count a
    step with only part of its work in the window, a collective begun after the cut or a chunk still running,
    and its busy time per step, which decides a straggler, would drop by up to a step's share."""
    known = rows["step"] >= 0
    began = rows["start_us"].where(known).groupby(rows["step"].where(known)).transform("min")
    marked = rows.loc[rows["kind"] == "step", "step"]
    ended = rows["step"].isin(marked) if len(marked) else known
    return rows[(known & ended & (began >= since_us)) | (~known & (rows["start_us"] >= since_us))]


class JobsMonitor(PeriodicService["JobsStore"]):
    """Collector service: every ``interval_s``, breakdown, stragglers and hangs of every running job."""

    name = "jobs-monitor"

    def __init__(self, hub: AlertHub | None = None, *, interval_s: float = DEFAULT_INTERVAL_S,
                 window_s: float = DEFAULT_WINDOW_S, hang_threshold_s: float = DEFAULT_HANG_S) -> None:
        super().__init__(interval_s)
        self.hub = hub
        self.window_s = window_s
        self.hang_threshold_s = hang_threshold_s
        self._flags: dict[str, dict[str, Any]] = {}
        self._since: dict[tuple[str, int], int] = {}
        self._onsets: dict[tuple[str, int | None, str], float] = {}  # (job, rank, cause) -> first onset (us)
        self._lost_s: dict[str, float] = {}
        self._ingested_upto: pd.Timestamp | None = None  # spans ingested up to here count in _lost_s
        self._lock = threading.Lock()

    def handlers(self) -> Mapping[str, Any]:
        return {"Jobs": self.jobs_rpc}

    def run_round(self) -> object:
        return self.check_once()

    def jobs_rpc(self, request: q.JobsRequest, store: JobListReads) -> q.JobsResponse:
        return jobs_response(self.jobs())

    def jobs(self, now_us: float | None = None) -> list[dict[str, Any]]:
        """:func:`list_jobs` with this monitor's latest flags."""
        with self._lock:
            flags = {job: dict(f) for job, f in self._flags.items()}
        return list_jobs(self.bound_store, now_us, self.window_s, flags)

    def snapshot(self) -> list[dict[str, Any]]:
        """Per monitored job: breakdown fractions, lost GPU seconds so far, lost ratio per rank, stragglers."""
        with self._lock:
            return [{"job_id": job, **f} for job, f in self._flags.items()]

    def check_once(self, now_us: float | None = None) -> dict[str, dict[str, Any]]:
        """One round over every job with spans in the window (or hung); returns the flags per job (also served
        by ``Jobs`` and metrics). Alerts are raised for running jobs only: the alerts of a job that finished, or
        whose every node's agent stopped after its last span (the job is gone), resolve."""
        now = time.time() * 1e6 if now_us is None else now_us
        spans = self.bound_store.recent_spans(max(self.window_s, self.hang_threshold_s))
        hangs = {h["job_id"]: h for h in detect_hangs(spans, now, self.hang_threshold_s)}
        finished = {s["job_id"] for s in job_summaries(spans, now, self.window_s, lost=False) if s["finished"]}
        recent = spans[spans["start_us"] >= now - self.window_s * 1e6]
        fresh = spans["ts"] > self._ingested_upto if self._ingested_upto is not None else spans["ts"].notna()
        flags: dict[str, dict[str, Any]] = {}
        for job_id in sorted(set(recent["job_id"]) | set(hangs)):
            if self.stopping:  # the collector is shutting down: the round's remaining jobs wait for a restart
                return flags
            if job_id:
                mine = spans["job_id"] == job_id
                flags[job_id] = {**self._job_flags(job_id, spans[mine], spans[mine & fresh], now, hangs.get(job_id)),
                                 "finished": job_id in finished}
        gone = _gone_jobs(spans, self._stopped_nodes())
        for job_id, f in flags.items():
            f["gone"] = job_id in gone
        self._raise_alerts({job: f for job, f in flags.items() if not f["finished"] and not f["gone"]}, now)
        if len(spans):
            self._ingested_upto = spans["ts"].max()
        with self._lock:
            self._flags = flags
        return flags

    def _stopped_nodes(self) -> dict[str, float]:
        """Nodes whose agent's last lifecycle event is ``agent_stop`` -> when it stopped (epoch us)."""
        stopped = self.bound_store.stopped_agents()
        return dict(zip(stopped["node"], stopped["stopped_us"].astype(float)))

    def _job_flags(self, job_id: str, rows: pd.DataFrame, new_rows: pd.DataFrame, now_us: float,
                   hang: dict | None) -> dict[str, Any]:
        """Flags from the window's rows; lost GPU seconds grow by the rows ingested since the last round."""
        window = whole_steps_since(rows, now_us - self.window_s * 1e6)
        doc = analyse_spans(window, job_id)
        fresh = analyse_spans(new_rows, job_id, per_step=True) if len(new_rows) else None
        if fresh:  # the per-step aggregates that outlive the raw spans
            steps = breakdown_rows(fresh)
            self.bound_store.add_step_breakdowns(steps[steps["step"].notna() & (steps["us"] > 0)].assign(job_id=job_id))
        lost = self._lost_s.get(job_id, 0.0) + (fresh.job.lost_us / 1e6 if fresh else 0.0)
        self._lost_s[job_id] = lost
        stragglers = []
        for s in doc.stragglers if doc else []:
            first = self._since.setdefault((job_id, s.rank), int(now_us / 1000))
            stragglers.append({**msgspec.structs.asdict(s), "node": _node_of(rows, s.rank), "since": iso_utc(first)})
        flagged = {(job_id, s["rank"]) for s in stragglers}
        for key in [k for k in self._since if k[0] == job_id and k not in flagged]:
            del self._since[key]
        return {
            "slow_ranks": self._slow_ranks(job_id, window, [d.rank for d in doc.delayed] if doc else []),
            "breakdown": doc.job.breakdown_fraction if doc else {},
            "lost_fraction": doc.job.lost_us / doc.job.window_us if doc and doc.job.window_us else None,
            "rank_lost_ratio": {r.rank: r.lost_us / r.window_us for r in doc.ranks if r.window_us} if doc else {},
            "lost_gpu_seconds_total": lost,
            "stragglers": stragglers,
            "delayed": [msgspec.structs.asdict(d) for d in doc.delayed] if doc else [],
            "hang": hang,
        }

    def _slow_ranks(self, job_id: str, window: pd.DataFrame, delayed: list[int]) -> list[dict[str, Any]]:
        """The job's slow ranks with their causes; an onset is remembered while the same cause holds, so a
        slowdown older than the window keeps its start and its cost since."""
        try:
            found = job_slow_ranks(self.bound_store, job_id, window, delayed)
        except UserError as exc:
            log.warning("job %s: cannot tell why it is slow: %s", job_id, exc)
            return []
        keys = {(job_id, s.rank, s.cause): s.since_us for s in found}
        for key in [k for k in self._onsets if k[0] == job_id and k not in keys]:
            del self._onsets[key]
        for key, since in keys.items():
            self._onsets[key] = min(since, self._onsets.get(key, since))
        return slow_rank_docs(found, window, {k[1:]: v for k, v in self._onsets.items() if k[0] == job_id})

    def _raise_alerts(self, flags: Mapping[str, Mapping[str, Any]], now_us: float) -> None:
        if self.hub is None:
            return
        slow = [JobFinding(job_id, f"{job_id}/{s['rank']}", _straggler_summary(job_id, s, f.get("slow_ranks", [])), s,
                           {"rank": str(s["rank"]), "node": s["node"]})
                for job_id, f in flags.items() for s in f["stragglers"]]
        slow += [JobFinding(job_id, f"{job_id}/{r['rank'] if r['rank'] is not None else r['cause']}",
                            _slow_rank_summary(job_id, r), r,
                            {"rank": str(r["rank"] if r["rank"] is not None else ""), "node": r["node"] or "",
                             "cause": r["cause"]})
                 for job_id, f in flags.items() for r in f.get("slow_ranks", [])
                 if r["cause"] != "peer" and r["rank"] not in {s["rank"] for s in f["stragglers"]}]
        hung = [JobFinding(job_id, job_id, f["hang"]["summary"], f["hang"]) for job_id, f in flags.items() if f["hang"]]
        now_ms = int(now_us / 1000)
        self.hub.set_job_alerts(SLOW_RANK, slow, now_ms)
        self.hub.set_job_alerts(JOB_HANG, hung, now_ms)


def _gone_jobs(spans: pd.DataFrame, stopped: dict[str, float]) -> set[str]:
    """Jobs every node of which has a stopped agent, stopped after the job's last span there."""
    if not stopped or spans.empty:
        return set()
    last = spans[spans["job_id"] != ""].groupby(["job_id", "node"])["start_us"].max().reset_index()
    last["stopped_us"] = last["node"].map(stopped)
    after = last["stopped_us"].notna() & (last["stopped_us"] >= last["start_us"])
    every_node = after.groupby(last["job_id"]).all()
    return set(every_node.index[every_node])


def _node_of(rows: pd.DataFrame, rank: int) -> str:
    nodes = rows.loc[rows["rank"] == rank, "node"]
    return str(nodes.iloc[-1]) if len(nodes) else ""


def _straggler_summary(job_id: str, s: Mapping[str, Any], slow_ranks: list[dict[str, Any]]) -> str:
    busy = f", busy {s['busy_ratio']:.2f}x its peers" if s.get("busy_ratio") else ""
    why = next((f"; cause {r['cause']}: {r['evidence']}; the job would run {r['speedup_without']:.0%} faster "
                f"without it" for r in slow_ranks if r["rank"] == s["rank"]), "")
    return (f"rank {s['rank']} of job {job_id} is a straggler: last at {s['last_share']:.0%} of "
            f"{s['collectives']} collectives (chance {s['chance_share']:.0%}), "
            f"{s['mean_lateness_us'] / 1e3:.1f} ms late on average{busy}, since {s['since']}{why}")


def _slow_rank_summary(job_id: str, r: Mapping[str, Any]) -> str:
    who = f"rank {r['rank']} of job {job_id} is slow" if r["rank"] is not None else f"job {job_id} is slow"
    return (f"{who} since {r['since']}: cause {r['cause']}: {r['evidence']}; the job would run "
            f"{r['speedup_without']:.0%} faster without it ({r['lost_gpu_seconds']:,.0f} GPU seconds lost)")
