"""A job's slow ranks from the store, as documents: the queries behind :mod:`gpuwatch.collector.why_slow`.

The same on both engines: span rows the caller already holds, ``gpu_samples`` and ``host_samples`` of the
job's nodes over the same window. Each document has exactly the keys of the `jobs --json` interface:
rank, node, gpu_index, cause, evidence, since (ISO UTC), lost_gpu_seconds (GPU time the job lost to it since
onset: every rank waits), speedup_without (fraction: how much faster the job would run without it).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import pandas as pd

from gpuwatch.collector.slow_evidence import GPU_COLUMNS, DeviceEvidence, device_evidence, rank_intervals
from gpuwatch.collector.store.base import SampleQueries, SpanQueries
from gpuwatch.collector.why_slow import SlowRank, find_slow_ranks
from gpuwatch.core.times import iso_utc

#: GPU samples from this long before the window's start: the reliability tier's counters (every 30 s) need a
#: value from before an onset at the window's start to show a rise
COUNTER_LEAD_MS = 60_000



class SlowRankReads(SampleQueries, SpanQueries, Protocol):
    """A live job's spans and the samples of its nodes around them."""


def job_slow_ranks(store: SampleQueries, job_id: str, rows: pd.DataFrame,
                   delayed: Sequence[int] = ()) -> list[SlowRank]:
    """The slow ranks of ``job_id`` from its span ``rows`` (a window) and its nodes' samples over it."""
    intervals = rank_intervals(rows)
    if intervals.empty:
        return []
    nodes = sorted(str(n) for n in rows["node"].unique())
    start_ms = int(float(rows["start_us"].min()) / 1000)
    gpu = store.gpu_samples(since_ms=start_ms - COUNTER_LEAD_MS, nodes=nodes, columns=GPU_COLUMNS)
    host = store.host_samples(since_ms=start_ms - COUNTER_LEAD_MS, nodes=nodes)
    cache: dict[float, Mapping[int, DeviceEvidence]] = {}

    def devices(since_us: float) -> Mapping[int, DeviceEvidence]:
        if since_us not in cache:
            cache[since_us] = device_evidence(gpu, host, job_id, since_us / 1e6)
        return cache[since_us]

    return find_slow_ranks(intervals, devices, delayed)


def slow_rank_docs(found: Sequence[SlowRank], rows: pd.DataFrame,
                   onsets: Mapping[tuple[int | None, str], float] | None = None) -> list[dict[str, Any]]:
    """The documents of ``found``; ``onsets`` (rank, cause) -> the onset first seen (a monitor's memory,
    for a slowdown that began before the window) overrides the window's own."""
    if not found:
        return []
    ranks = int(rows["rank"].nunique())
    newest_us = float((rows["start_us"] + rows["dur_us"].clip(lower=0)).max())
    docs = []
    for s in found:
        since = min(s.since_us, (onsets or {}).get((s.rank, s.cause), s.since_us))
        share = s.speedup_without / (1 + s.speedup_without)  # of the job's time, lost to it
        docs.append({"rank": s.rank, "node": s.node, "gpu_index": s.gpu_index, "cause": s.cause,
                     "evidence": s.evidence, "since": iso_utc(int(since / 1000)),
                     "lost_gpu_seconds": round(max(0.0, newest_us - since) / 1e6 * ranks * share, 3),
                     "speedup_without": round(s.speedup_without, 4)})
    return docs


def live_slow_ranks(store: SlowRankReads, job_id: str, window_s: float,
                    delayed: Sequence[int] = ()) -> list[dict[str, Any]]:
    """The documents of the job's slow ranks over its last ``window_s`` of spans (a live breakdown's)."""
    rows = store.recent_spans(window_s, job_id)
    return slow_rank_docs(job_slow_ranks(store, job_id, rows, delayed), rows) if len(rows) else []
