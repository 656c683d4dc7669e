"""Efficiency breakdowns inside the collector: the `SubmitTrace` and `Breakdown` Query handlers.

A job's breakdown comes from the same engine as `gpuwatch analyze` and has the same JSON shape, plus a
`source` key: "traces" when trace files (Kineto JSON or span tables) were submitted for the job, else
"live", computed from the probe span rows the agents streamed in. Ranks of a job are often submitted one
file at a time, so the collector keeps each rank's compact timeline (`job_timelines`) and re-analyses all
of the job's ranks when another one arrives (cross-rank waits and stragglers need every rank). A node can
send its ranks' summaries instead (`submit-trace --summarize`, efficiency/summary.py: reduced where the traces
are, a small fraction of their size); they are kept per rank the same way and the collector does only the
cross-rank part. Each
result is kept as the JSON document (`breakdown_docs`) and as rows per job, rank and step
(`breakdowns`; step NULL is the rank's whole window, -1 the slice before its first known step), for SQL
and dashboards. A live breakdown analyses the job's last ``live_window_s`` of spans (raw spans are kept for
a bounded window only) and adds the per-step totals the jobs monitor aggregated over the job's life, and the
job's slow ranks with their causes (:mod:`gpuwatch.collector.slow_ranks`).
"""
from __future__ import annotations

import threading
from typing import Protocol
from collections.abc import Callable

import orjson
import pandas as pd

from gpuwatch.efficiency.engine import analyze, analyze_summaries
from gpuwatch.efficiency.load import SPAN_ENDINGS, TRACE_ENDINGS, load_file
from gpuwatch.efficiency.result import Analysis
from gpuwatch.efficiency.summary import MAGIC, RankSummary, decode, encode, summarize
from gpuwatch.efficiency.timeline import RankTimeline
from gpuwatch.collector.live import probe_timelines
from gpuwatch.collector.slow_ranks import live_slow_ranks
from gpuwatch.collector.store.base import BreakdownRecords, SampleQueries, SpanQueries
from gpuwatch.core.errors import NotFound, UserError
from gpuwatch.v1 import query_pb2 as q

TRACES, LIVE = "traces", "live"
UNKNOWN_STEP = -1

#: Seconds of a job's newest probe spans (its own clock) that a live breakdown analyses; older steps count
#: through the per-step aggregates the jobs monitor keeps (the document's "history").
DEFAULT_LIVE_WINDOW_S = 300.0



class BreakdownStore(BreakdownRecords, SpanQueries, SampleQueries, Protocol):
    """What breakdowns read and write: stored timelines and documents, live spans, slow-rank samples."""


class UnknownJob(NotFound):
    """The collector has neither submitted traces nor probe spans for the job (answered NOT_FOUND)."""


class BreakdownService:
    """Query handlers `submit_trace` and `breakdown`, in the server's `handler(request, store)` form."""

    def __init__(self, live_window_s: float = DEFAULT_LIVE_WINDOW_S) -> None:
        self.live_window_s = live_window_s
        self._submitting = threading.Lock()  # read, re-analyse and write one submission at a time

    def handlers(self) -> dict[str, Callable]:
        """For `serve(..., query_handlers=BreakdownService().handlers())`."""
        return {"SubmitTrace": self.submit_trace, "Breakdown": self.breakdown}

    def submit_trace(self, request: q.SubmitTraceRequest, store: BreakdownStore) -> q.SubmitTraceResponse:
        """Load one submitted file, re-analyse the job with all its ranks, store the result."""
        job_id = _job_id(request.job_id)
        if not request.filename:
            raise UserError("a submitted trace needs its filename (for the format and for messages)")
        if not request.content:
            raise UserError(f"{request.filename}: the file is empty")
        new = load_submitted(request.filename, request.content)
        for rank in new:
            if rank.job_id and rank.job_id != job_id:
                raise UserError(f"{request.filename}: rows of job {rank.job_id!r}, submitted as job {job_id!r}")
        with self._submitting:
            return self._store_submission(store, job_id, request.filename, new)

    def _store_submission(self, store: BreakdownStore, job_id: str, filename: str,
                          new: list[Submitted]) -> q.SubmitTraceResponse:
        kept = [r for r in stored_ranks(store, job_id) if r.rank not in {n.rank for n in new}]
        analysis = _analyze_ranks(job_id, kept + new)
        doc = _document(analysis, TRACES)
        timelines = pd.DataFrame({"job_id": job_id, "rank": pd.array([r.rank for r in new], "int32"),
                                  "filename": filename, "timeline": [_blob(r) for r in new]})
        store.save_submission(job_id, timelines, breakdown_rows(analysis), _dumps(doc), TRACES)
        return q.SubmitTraceResponse(job_id=job_id, ranks=len(analysis.ranks), json=_dumps(without_steps(doc)))

    def breakdown(self, request: q.BreakdownRequest, store: BreakdownStore) -> q.JsonResponse:
        """The job's breakdown from its submitted traces, else live from its recent probe spans (and stored)."""
        job_id = _job_id(request.job_id)
        doc = stored_doc(store, job_id, TRACES)
        if doc is None:
            analysis = _analyze(job_id, live_timelines(store, job_id, self.live_window_s))
            doc = {**_document(analysis, LIVE), "history": step_history(store, job_id),
                   "slow_ranks": live_slow_ranks(store, job_id, self.live_window_s, [d.rank for d in analysis.delayed])}
            store.save_breakdown(job_id, LIVE, breakdown_rows(analysis), _dumps(doc))
        return q.JsonResponse(json=_dumps(doc if request.per_step else without_steps(doc)))


# ------------------------------------------------------------------------------------------ inputs
Submitted = RankTimeline | RankSummary  # a rank as submitted: its timeline, or its summary


def load_submitted(filename: str, content: bytes) -> list[Submitted]:
    """The ranks of one submitted file: summaries (by their first bytes), else rank timelines parsed from
    memory by the same loaders as `gpuwatch analyze`; errors and sources name `filename`."""
    if content.startswith(MAGIC):
        return list(decode(content, filename))
    if not filename.endswith(TRACE_ENDINGS + SPAN_ENDINGS):
        raise UserError(f"{filename}: unknown format (expected {', '.join(TRACE_ENDINGS + SPAN_ENDINGS)})")
    return list(load_file(filename, default_rank=0, content=content))


def stored_ranks(store: BreakdownRecords, job_id: str) -> list[Submitted]:
    """The job's submitted ranks (timelines or summaries), by rank."""
    return [decode(blob)[0] if blob.startswith(MAGIC) else RankTimeline.from_bytes(blob)
            for blob in store.job_timelines(job_id)]


def _blob(rank: Submitted) -> bytes:
    return rank.to_bytes() if isinstance(rank, RankTimeline) else encode([rank])


def live_timelines(store: SpanQueries, job_id: str, window_s: float = DEFAULT_LIVE_WINDOW_S) -> list[RankTimeline]:
    """Rank timelines from the job's probe span rows of its last ``window_s`` (finished spans of the kinds
    the engine reads)."""
    spans = store.recent_spans(window_s, job_id)
    if spans.empty:
        raise UnknownJob(f"job {job_id!r}: unknown to this collector (no submitted traces and no probe spans)")
    timelines = probe_timelines(spans, source=f"job {job_id} probe spans")
    if timelines is None:
        raise UserError(f"job {job_id} probe spans: no activity rows yet (only step marks)")
    return timelines


def stored_doc(store: BreakdownRecords, job_id: str, source: str) -> dict | None:
    """The last breakdown document stored for the job from `source`, or None."""
    doc = store.breakdown_doc(job_id, source)
    return orjson.loads(doc) if doc is not None else None


def step_history(store: SpanQueries, job_id: str) -> dict:
    """The job's per-step efficiency over every step the jobs monitor aggregated (beyond the live window):
    steps and ranks counted, and the time per category summed (µs)."""
    totals = store.step_breakdown_totals(job_id)
    return {"steps": int(totals["steps"].max()) if len(totals) else 0,
            "ranks": int(totals["ranks"].max()) if len(totals) else 0,
            "breakdown_us": {str(r.category): float(r.us) for r in totals.itertuples()}}


# ------------------------------------------------------------------------------------------ results
def without_steps(doc: dict) -> dict:
    """A breakdown document without the per-step slices (what `analyze --json` prints without --per-step)."""
    return {**doc, "ranks": [{k: v for k, v in r.items() if k != "per_step"} for r in doc["ranks"]]}


def breakdown_rows(analysis: Analysis) -> pd.DataFrame:
    """One row per rank, step (NA: the rank's window, -1 the slice before its first known step) and
    category, in µs: columns rank, step, category, us."""
    rows = []
    for rank in analysis.ranks:
        slices: list[tuple[int | None, dict[str, float]]] = [(None, rank.breakdown_us)]
        slices += [(UNKNOWN_STEP if s.step is None else s.step, s.breakdown_us) for s in rank.per_step or []]
        rows += [(rank.rank, step, category, us) for step, values in slices for category, us in values.items()]
    return pd.DataFrame(rows, columns=["rank", "step", "category", "us"]).astype({"step": "Int64"})


def _analyze(job_id: str, timelines: list[RankTimeline]) -> Analysis:
    try:
        return analyze(timelines, per_step=True)
    except UserError as exc:
        raise type(exc)(f"job {job_id!r}: {exc}") from None  # keeps NotFound a NOT_FOUND


def _analyze_ranks(job_id: str, ranks: list[Submitted]) -> Analysis:
    """The job from its submitted ranks: timelines are reduced here, summaries came reduced."""
    try:
        peers = len(ranks) > 1
        return analyze_summaries([summarize(r, peers=peers) if isinstance(r, RankTimeline) else r for r in ranks],
                                 per_step=True)
    except UserError as exc:
        raise type(exc)(f"job {job_id!r}: {exc}") from None


def _document(analysis: Analysis, source: str) -> dict:
    """The stored and answered document: the engine's, and where its input came from."""
    return {**analysis.to_json(), "source": source}


def _job_id(job_id: str) -> str:
    if not job_id.strip():
        raise UserError("a job id is required")
    return job_id


def _dumps(doc: dict) -> str:
    return orjson.dumps(doc).decode()
