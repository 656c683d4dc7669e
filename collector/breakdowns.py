"""Efficiency breakdowns inside the collector: the `SubmitTrace` and `Breakdown` Query handlers.

A job's breakdown comes from the same engine as `gpuwatch analyze` and has the same JSON shape, plus a
`source` key: "traces" when trace files (Kineto JSON or span tables) were submitted for the job, else
"live", computed from the probe span rows the agents streamed in. Ranks of a job are often submitted one
file at a time, so the collector keeps each rank's compact timeline (`job_timelines`) and re-analyses all
of the job's ranks when another one arrives (cross-rank waits and stragglers need every rank). Each
result is kept as the JSON document (`breakdown_docs`) and as rows per job, rank and step
(`breakdowns`; step NULL is the rank's whole window, -1 the slice before its first known step), for SQL
and dashboards. Every write runs on the store's writer thread.
"""
from __future__ import annotations

import datetime as dt
import os
import tempfile
import threading
import weakref
from collections.abc import Callable

import orjson
import pandas as pd
import pyarrow as pa

from gpuwatch.collector.efficiency.engine import analyze
from gpuwatch.collector.efficiency.load import SPAN_ENDINGS, TRACE_ENDINGS, load_file
from gpuwatch.collector.efficiency.timeline import RankTimeline
from gpuwatch.collector.live import probe_timelines
from gpuwatch.collector.store.duckdb import DuckDBStore
from gpuwatch.errors import NotFound, UserError
from gpuwatch.v1 import query_pb2 as q

TRACES, LIVE = "traces", "live"
UNKNOWN_STEP = -1

TABLES = (
    """CREATE TABLE IF NOT EXISTS job_timelines (
    job_id VARCHAR NOT NULL, rank INTEGER NOT NULL, filename VARCHAR, timeline BLOB NOT NULL,
    submitted_at TIMESTAMP NOT NULL, PRIMARY KEY (job_id, rank))""",
    """CREATE TABLE IF NOT EXISTS breakdowns (
    job_id VARCHAR NOT NULL, source VARCHAR NOT NULL, rank INTEGER NOT NULL, step BIGINT, category VARCHAR NOT NULL,
    us DOUBLE NOT NULL, computed_at TIMESTAMP NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS breakdown_docs (
    job_id VARCHAR NOT NULL, source VARCHAR NOT NULL, doc JSON NOT NULL, computed_at TIMESTAMP NOT NULL,
    PRIMARY KEY (job_id, source))""",
)


class UnknownJob(NotFound):
    """The collector has neither submitted traces nor probe spans for the job (answered NOT_FOUND)."""


class BreakdownService:
    """Query handlers `submit_trace` and `breakdown`, in the server's `handler(request, store)` form.

    The server opens the store and passes it to every call; the tables are created on a store's first use."""

    def __init__(self) -> None:
        self._ready: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()
        self._submitting = threading.Lock()  # read, re-analyse and write one submission at a time

    def handlers(self) -> dict[str, Callable]:
        """For `serve(..., query_handlers=BreakdownService().handlers())`."""
        return {"SubmitTrace": self.submit_trace, "Breakdown": self.breakdown}

    def submit_trace(self, request: q.SubmitTraceRequest, store: DuckDBStore) -> q.SubmitTraceResponse:
        """Load one submitted file, re-analyse the job with all its ranks, store the result."""
        job_id = _job_id(request.job_id)
        if not request.filename:
            raise UserError("a submitted trace needs its filename (for the format and for messages)")
        if not request.content:
            raise UserError(f"{request.filename}: the file is empty")
        new = load_submitted(request.filename, request.content)
        for tl in new:
            if tl.job_id and tl.job_id != job_id:
                raise UserError(f"{request.filename}: rows of job {tl.job_id!r}, submitted as job {job_id!r}")
        self._ensure_tables(store)
        with self._submitting:
            return self._store_submission(store, job_id, request.filename, new)

    def _store_submission(self, store: DuckDBStore, job_id: str, filename: str,
                          new: list[RankTimeline]) -> q.SubmitTraceResponse:
        kept = [tl for tl in stored_timelines(store, job_id) if tl.rank not in {n.rank for n in new}]
        doc = _analyze(job_id, kept + new, TRACES)
        now = _now()
        rows = pa.table({
            "job_id": [job_id] * len(new), "rank": pa.array([tl.rank for tl in new], pa.int32()),
            "filename": [filename] * len(new), "timeline": pa.array([tl.to_bytes() for tl in new], pa.binary()),
            "submitted_at": pa.array([now] * len(new), pa.timestamp("ms")),
        })

        def write(con) -> None:
            con.begin()
            try:
                con.register("_new_timelines", rows)
                con.execute("INSERT OR REPLACE INTO job_timelines BY NAME SELECT * FROM _new_timelines")
                con.unregister("_new_timelines")
                _replace_breakdown(con, job_id, TRACES, doc, now)
                con.commit()
            except BaseException:
                con.rollback()
                raise

        store.run_write(write)
        return q.SubmitTraceResponse(job_id=job_id, ranks=len(doc["ranks"]), json=_dumps(without_steps(doc)))

    def breakdown(self, request: q.BreakdownRequest, store: DuckDBStore) -> q.JsonResponse:
        """The job's breakdown from its submitted traces, else live from its probe spans (and stored)."""
        job_id = _job_id(request.job_id)
        self._ensure_tables(store)
        doc = stored_doc(store, job_id, TRACES)
        if doc is None:
            doc = _analyze(job_id, live_timelines(store, job_id), LIVE)
            now = _now()
            store.run_write(lambda con: _replace_breakdown(con, job_id, LIVE, doc, now))
        return q.JsonResponse(json=_dumps(doc if request.per_step else without_steps(doc)))

    def _ensure_tables(self, store: DuckDBStore) -> None:
        with self._lock:
            if store in self._ready:
                return
            store.run_write(lambda con: [con.execute(statement) for statement in TABLES])
            self._ready.add(store)


# ------------------------------------------------------------------------------------------ inputs
def load_submitted(filename: str, content: bytes) -> list[RankTimeline]:
    """Rank timelines of one submitted file, parsed by the same loaders as `gpuwatch analyze`; errors name
    `filename` (the loaders read a temporary copy)."""
    base = os.path.basename(filename)
    if not base.endswith(TRACE_ENDINGS + SPAN_ENDINGS):
        raise UserError(f"{filename}: unknown format (expected {', '.join(TRACE_ENDINGS + SPAN_ENDINGS)})")
    with tempfile.TemporaryDirectory(prefix="gpuwatch-trace-") as folder:
        path = os.path.join(folder, base)
        with open(path, "wb") as f:
            f.write(content)
        try:
            timelines = load_file(path, default_rank=0)
        except UserError as exc:
            raise UserError(str(exc).replace(path, filename)) from None
    for tl in timelines:
        tl.source = tl.source.replace(path, filename)
    return timelines


def stored_timelines(store: DuckDBStore, job_id: str) -> list[RankTimeline]:
    """The job's submitted rank timelines, by rank."""
    df = store.query_df("SELECT timeline FROM job_timelines WHERE job_id = ? ORDER BY rank", [job_id])
    return [RankTimeline.from_bytes(bytes(blob)) for blob in df["timeline"]]


def live_timelines(store: DuckDBStore, job_id: str) -> list[RankTimeline]:
    """Rank timelines from the job's probe span rows (finished spans of the kinds the engine reads)."""
    spans = store.spans(job_id)
    if spans.empty:
        raise UnknownJob(f"job {job_id!r}: unknown to this collector (no submitted traces and no probe spans)")
    timelines = probe_timelines(spans, source=f"job {job_id} probe spans")
    if timelines is None:
        raise UserError(f"job {job_id} probe spans: no activity rows yet (only step marks)")
    return timelines


def stored_doc(store: DuckDBStore, job_id: str, source: str) -> dict | None:
    """The last breakdown document stored for the job from `source`, or None."""
    df = store.query_df("SELECT doc FROM breakdown_docs WHERE job_id = ? AND source = ?", [job_id, source])
    return orjson.loads(df["doc"].iloc[0]) if len(df) else None


# ------------------------------------------------------------------------------------------ results
def without_steps(doc: dict) -> dict:
    """The document without the per-step slices (what `analyze --json` prints without --per-step)."""
    return {**doc, "ranks": [{k: v for k, v in r.items() if k != "per_step"} for r in doc["ranks"]]}


def breakdown_rows(job_id: str, source: str, doc: dict, computed_at: dt.datetime) -> pd.DataFrame:
    """One row per job, rank, step (NULL: the rank's window) and category, in µs."""
    rows = []
    for rank in doc["ranks"]:
        slices = [(None, rank["breakdown_us"])]
        slices += [(UNKNOWN_STEP if s["step"] is None else s["step"], s["breakdown_us"]) for s in rank.get("per_step", [])]
        rows += [(rank["rank"], step, category, us) for step, values in slices for category, us in values.items()]
    df = pd.DataFrame(rows, columns=["rank", "step", "category", "us"]).astype({"step": "Int64"})
    return df.assign(job_id=job_id, source=source, computed_at=computed_at)


def _replace_breakdown(con, job_id: str, source: str, doc: dict, now: dt.datetime) -> None:
    rows = breakdown_rows(job_id, source, doc, now)
    con.execute("DELETE FROM breakdowns WHERE job_id = ? AND source = ?", [job_id, source])
    con.register("_breakdown_rows", rows)
    try:
        con.execute("INSERT INTO breakdowns BY NAME SELECT * FROM _breakdown_rows")
    finally:
        con.unregister("_breakdown_rows")
    con.execute("INSERT OR REPLACE INTO breakdown_docs VALUES (?, ?, ?, ?)", [job_id, source, _dumps(doc), now])


def _analyze(job_id: str, timelines: list[RankTimeline], source: str) -> dict:
    try:
        doc = analyze(timelines, per_step=True)
    except UserError as exc:
        raise type(exc)(f"job {job_id!r}: {exc}") from None  # keeps NotFound a NOT_FOUND
    return {**doc, "source": source}


def _job_id(job_id: str) -> str:
    if not job_id.strip():
        raise UserError("a job id is required")
    return job_id


def _dumps(doc: dict) -> str:
    return orjson.dumps(doc).decode()


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
