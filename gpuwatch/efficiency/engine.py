"""`analyze()`: timelines of one job's ranks -> their :class:`~gpuwatch.efficiency.result.Analysis`, whose
`to_json()` is the efficiency document (spec efficiency.md v1); `analyze_summaries()`: the same from the
ranks' summaries (summary.py), made where the traces are read, so the job's timelines never meet.

Pure functions of their inputs, so the offline `gpuwatch analyze`, the collector and replay share them.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from gpuwatch.efficiency.matching import Collectives, collectives_of, match_collectives
from gpuwatch.efficiency.partition import (
    CATEGORIES, COMPUTE_C, MEMCPY_C, Partition, StepSlice, partition, to_ns, waits_per_slice, with_waits,
)
from gpuwatch.efficiency.result import (
    Analysis, Coverage, JobBreakdown, KernelStat, RankBreakdown, ShortKernels, StepBreakdown, Straggler,
    TopKernels, Window,
)
from gpuwatch.efficiency.stragglers import find_stragglers
from gpuwatch.efficiency.timeline import KIND_NAMES, RankTimeline
from gpuwatch.efficiency.whatif import what_if
from gpuwatch.efficiency.summary import RankSummary, summarize
from gpuwatch.efficiency.window import select_steps, window_of
from gpuwatch.core.errors import UserError

US_PER_HOUR = 3.6e9
SPEC = "efficiency v1"
# Longest span of one job's activity the engine reads: far beyond any run, far below the int64 nanoseconds
# it partitions in (a broken exporter's timestamps would otherwise overflow them).
MAX_SPAN_US = 365 * 24 * US_PER_HOUR


def analyze(timelines: list[RankTimeline], *, per_step: bool = False, flops_per_step: float | None = None,
            peak_tflops: float | None = None, gpu_hour_price: float | None = None,
            keep_segments: bool = False, steps: str | None = None, with_what_if: bool = True) -> Analysis:
    """The breakdown: per rank, per job, stragglers, matching, coverage, the analysed window and the what-if
    (and per step when asked). `steps` picks the window (see window.py). Each timeline is reduced to its
    summary, and the summaries are analysed (:func:`analyze_summaries`).

    With `keep_segments`, the classified segments and the analysed timelines are kept in the result's
    `partitions` and `timelines` (for rendering timelines; never part of its document)."""
    if not timelines:
        raise UserError("nothing to analyse: no rank timelines")
    summaries = [summarize(tl, steps=steps, peers=len(timelines) > 1, what_if=with_what_if) for tl in timelines]
    analysis = analyze_summaries(summaries, per_step=per_step, flops_per_step=flops_per_step,
                                 peak_tflops=peak_tflops, gpu_hour_price=gpu_hour_price, steps=steps)
    if keep_segments:
        chosen = sorted((select_steps(tl, steps) for tl in timelines), key=lambda tl: tl.rank)
        collectives = [collectives_of(tl) for tl in chosen]
        matching = match_collectives(collectives)
        origin = math.floor(min(float(tl.start_us.min()) for tl in chosen))
        analysis.partitions = [partition(tl, _activity_waits(tl, c, w), origin, keep_segments=True)
                               for tl, c, w in zip(chosen, collectives, matching.waits)]
        analysis.timelines = chosen
    return analysis


def analyze_summaries(summaries: list[RankSummary], *, per_step: bool = False, flops_per_step: float | None = None,
                      peak_tflops: float | None = None, gpu_hour_price: float | None = None,
                      steps: str | None = None) -> Analysis:
    """The analysis of the job whose ranks `summaries` reduced (summary.py): the cross-rank part (matching,
    waits, stragglers, the what-if) and the job's totals. `steps` only names the window the summaries hold."""
    _check_one_job(summaries)
    ordered = sorted(summaries, key=lambda s: s.rank)
    _check_times(ordered)
    window = window_of(steps)
    origin = math.floor(min(s.first_us for s in ordered))
    matching = match_collectives([s.collectives for s in ordered])
    parts = [_job_partition(s, w, origin) for s, w in zip(ordered, matching.waits)]
    mfu_of = _mfu_function(flops_per_step, peak_tflops)
    ranks = [_rank_entry(s, part, matched, per_step, mfu_of)
             for s, part, matched in zip(ordered, parts, matching.matched_per_rank)]
    busy = {entry.rank: entry.busy_per_step_us for entry in ranks}
    stragglers, delayed = find_stragglers(matching, busy)
    coverage = _coverage(ordered, matching.matched)
    graphs = [s.graph for s in ordered]
    return Analysis(
        spec=SPEC,
        categories=list(CATEGORIES),
        ranks=ranks,
        job=_job_entry(ordered, parts, ranks, gpu_hour_price),
        stragglers=stragglers,
        delayed=delayed,
        matched_collectives=matching.matched,
        coverage=coverage,
        straggler_verdict=_verdict(stragglers, coverage),
        window=_window_entry(window, ordered, parts),
        top_kernels=top_kernels(ordered),
        what_if=(what_if([g for g in graphs if g is not None], [s.rank for s in ordered], matching)
                 if all(g is not None for g in graphs) else None),
        trace_meta=next((s.trace_meta for s in ordered if s.trace_meta), {}),
    )


def _job_partition(s: RankSummary, waits_us: np.ndarray, origin: int) -> Partition:
    """The rank's partition with its waits for peers, in the job's time origin."""
    wait_ns = np.zeros(len(s.coll_start), np.int64)
    wait_ns[:len(waits_us)] = to_ns(waits_us, 0.0)
    waits = waits_per_slice((s.exposed_start, s.exposed_end), (s.coll_start, s.coll_end), wait_ns, s.cuts)
    shift_ns = int(round((s.partition.origin_us - origin) * 1000))
    return with_waits(s.partition, waits, s.cuts, float(origin), shift_ns)


def _activity_waits(tl: RankTimeline, collectives: Collectives, waits: np.ndarray) -> np.ndarray:
    """Each activity's wait for peers (0 outside the matched collectives), as `partition` takes them."""
    out = np.zeros(len(tl))
    out[collectives.index] = waits
    return out


def _check_times(summaries: list[RankSummary]) -> None:
    starts = [s.span_start_us for s in summaries]
    ends = [s.span_end_us for s in summaries]
    if not all(map(math.isfinite, starts + ends)):
        raise UserError(f"{summaries[0].source}: activity times are not finite numbers")
    span = max(ends) - min(starts)
    if span > MAX_SPAN_US:
        raise UserError(f"{summaries[0].source}: activity spans {span / US_PER_HOUR / 24:.0f} days; "
                        "the timestamps are not microseconds of one run")


def _coverage(summaries: list[RankSummary], matched: int) -> Coverage:
    """Which ranks of the job are here, and so what can be said about waiting for peers. Without every
    rank, a collective's last arrival may be a rank that is not here: `comm_wait` is then a lower bound
    (the rest of the wait is inside `comm_transfer`) and no rank can be cleared of straggling."""
    present = [s.rank for s in summaries]
    world = next((s.world_size for s in summaries if s.world_size), None)
    complete = len(present) >= world if world else (len(present) >= 2 and matched > 0)
    sampled = [s.events_sampled for s in summaries]
    return Coverage(
        ranks_present=len(present),
        world_size=world,
        ranks=present,
        complete=complete,
        events_sampled=True if any(s is True for s in sampled) else (None if None in sampled else False),
        comm_wait_lower_bound=not complete,
    )


def _verdict(stragglers: list[Straggler], coverage: Coverage) -> str:
    """`undetermined` whenever peers are missing: a rank last among the ranks present may still be early
    among all of them, and a rank that looks fine may be held back by one that is not here."""
    if not coverage.complete:
        return "undetermined"
    return "found" if stragglers else "none"


def _window_entry(window: dict[str, Any], summaries: list[RankSummary], parts: list[Partition]) -> Window:
    return Window(
        **window,
        start_us=min(p.origin_us + _us(p.start_ns) for p in parts),
        end_us=max(p.origin_us + _us(p.start_ns + p.window_ns) for p in parts),
        steps=sorted({step for s in summaries for step in s.steps}),
        activities=int(sum(s.activities for s in summaries)),
    )


def top_kernels(summaries: list[RankSummary], limit: int = 15) -> TopKernels:
    """The kernels that take the most GPU time, and the most frequent ones (with how many ran under
    10 us: the small kernels behind `small_kernel_overhead`), over all ranks: each rank's totals by name
    (summary.kernel_rows), merged."""
    merged: dict[str, list[Any]] = {}  # name -> [time, count, short count, kind]
    for s in summaries:
        for name, time, count, short, kind in s.kernels:
            row = merged.setdefault(name, [0.0, 0, 0, kind])
            row[0] += time
            row[1] += count
            row[2] += short

    def rows(key: Callable[[tuple[str, list[Any]]], tuple[float, str]]) -> list[KernelStat]:
        ordered = sorted(merged.items(), key=key)[:limit]
        return [KernelStat(name=name, kind=KIND_NAMES[k], count=c, time_us=round(t, 3), mean_us=round(t / c, 3),
                           short_count=sh) for name, (t, c, sh, k) in ordered]

    return TopKernels(by_time=rows(lambda item: (-item[1][0], item[0])),
                      by_count=rows(lambda item: (-item[1][1], item[0])))


def _check_one_job(summaries: list[RankSummary]) -> None:
    if not summaries:
        raise UserError("nothing to analyse: no rank timelines")
    seen: dict[int, str] = {}
    for s in summaries:
        if s.rank in seen:
            raise UserError(f"rank {s.rank} given twice: {seen[s.rank]} and {s.source}")
        seen[s.rank] = s.source
    jobs = {s.job_id for s in summaries if s.job_id}
    worlds = {s.world_size for s in summaries if s.world_size}
    if len(jobs) > 1 or len(worlds) > 1:
        sources = ", ".join(f"{s.source or s.rank} (job {s.job_id}, world {s.world_size})" for s in summaries)
        raise UserError(f"inputs come from different jobs: {sources}")


def _us(ns: float) -> float:
    return float(ns) / 1000.0


def _breakdown(totals_ns: np.ndarray) -> dict[str, float]:
    return {name: _us(v) for name, v in zip(CATEGORIES, totals_ns)}


def _fractions(totals_ns: np.ndarray, window_ns: int) -> dict[str, float]:
    return {name: (float(v) / window_ns if window_ns else 0.0) for name, v in zip(CATEGORIES, totals_ns)}


_MfuOf = Callable[[int, int], float | None]  # (steps, window ns) -> model FLOPs utilisation


def _mfu_function(flops_per_step: float | None, peak_tflops: float | None) -> _MfuOf:
    if not flops_per_step or not peak_tflops:
        return lambda steps, window_ns: None
    return lambda steps, window_ns: flops_per_step * steps / (window_ns * 1e-9 * peak_tflops * 1e12)


def _known_steps(part: Partition) -> list[StepSlice]:
    return [s for s in part.steps if s.step is not None]


def _rank_entry(tl: RankSummary, part: Partition, matched: int, per_step: bool, mfu_of: _MfuOf) -> RankBreakdown:
    steps = _known_steps(part)
    busy_ns = int(part.totals_ns[COMPUTE_C] + part.totals_ns[MEMCPY_C])
    return RankBreakdown(
        rank=tl.rank,
        source=tl.source,
        window_start_us=part.origin_us + _us(part.start_ns),
        window_us=_us(part.window_ns),
        breakdown_us=_breakdown(part.totals_ns),
        breakdown_fraction=_fractions(part.totals_ns, part.window_ns),
        lost_us=_us(part.window_ns - part.totals_ns[COMPUTE_C]),
        comm_total_us=_us(part.comm_total_ns),
        comm_overlapped_us=_us(part.comm_overlapped_ns),
        overlap_ratio=part.comm_overlapped_ns / part.comm_total_ns if part.comm_total_ns else None,
        short_kernels=ShortKernels(count=part.short_kernel_count, time_us=_us(part.short_kernel_ns)),
        matched_collectives=matched,
        steps=len(steps),
        busy_per_step_us=_us(busy_ns) / max(len(steps), 1),
        mfu=mfu_of(len(steps), sum(s.window_ns for s in steps)) if steps else None,
        per_step=[
            StepBreakdown(
                step=s.step,
                start_us=part.origin_us + _us(s.start_ns),
                window_us=_us(s.window_ns),
                breakdown_us=_breakdown(s.totals_ns),
                lost_fraction=float(s.window_ns - s.totals_ns[COMPUTE_C]) / s.window_ns,
                mfu=mfu_of(1, s.window_ns) if s.step is not None else None,
            )
            for s in part.steps
        ] if per_step else None,
    )


def _job_entry(timelines: list[RankSummary], parts: list[Partition], ranks: list[RankBreakdown],
               gpu_hour_price: float | None) -> JobBreakdown:
    totals = np.sum([p.totals_ns for p in parts], axis=0)
    window = int(sum(p.window_ns for p in parts))
    comm_total = sum(p.comm_total_ns for p in parts)
    overlapped = sum(p.comm_overlapped_ns for p in parts)
    lost_hours = _us(window - totals[COMPUTE_C]) / US_PER_HOUR
    mfus = [r.mfu for r in ranks if r.mfu is not None]
    return JobBreakdown(
        ranks=len(timelines),
        world_size=next((tl.world_size for tl in timelines if tl.world_size), None),
        job_id=next((tl.job_id for tl in timelines if tl.job_id), None),
        window_us=_us(window),
        breakdown_us=_breakdown(totals),
        breakdown_fraction=_fractions(totals, window),
        lost_us=_us(window - totals[COMPUTE_C]),
        lost_gpu_hours=lost_hours,
        lost_cost=lost_hours * gpu_hour_price if gpu_hour_price is not None else None,
        comm_overlapped_us=_us(overlapped),
        overlap_ratio=overlapped / comm_total if comm_total else None,
        short_kernels=ShortKernels(
            count=sum(p.short_kernel_count for p in parts),
            time_us=_us(sum(p.short_kernel_ns for p in parts)),
        ),
        mfu=float(np.mean(mfus)) if mfus else None,
    )
