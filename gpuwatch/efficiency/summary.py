"""One rank's timeline reduced to what its job's analysis needs (:class:`RankSummary`), so a job's ranks are
analysed without holding their timelines: each is reduced where it is read, and only the reductions meet.

A summary holds the rank's breakdown made without waits for peers, its exposed collective time and its
collective kernels (to split that time into `comm_wait` and `comm_transfer` once the ranks are matched), the
collectives matching reads, its kernel totals by name, and its part of the what-if graph: per step and per
collective, never per kernel. `engine.analyze_summaries` does the cross-rank part. A summary's size grows
with the rank's steps, collectives and what-if nodes, not with its kernels; it crosses process and network
boundaries as msgpack (:func:`encode`, :func:`decode`).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import numpy as np

from gpuwatch.core.errors import UserError
from gpuwatch.efficiency.arrays import distinct
from gpuwatch.efficiency.load import expand_paths, load_file
from gpuwatch.efficiency.matching import Collectives, collectives_of
from gpuwatch.efficiency.partition import TRANSFER_C, Partition, partition, step_cuts, to_ns
from gpuwatch.efficiency.timeline import COLLECTIVE, RankTimeline
from gpuwatch.efficiency.whatif import RankGraph, rank_graph
from gpuwatch.efficiency.window import select_steps

# One kernel name's totals on a rank: (name, GPU time us, count, count under 10 us, kind of its first).
KernelRow = tuple[str, float, int, int, int]


class RankSummary(msgspec.Struct):
    """What the job's analysis needs of one rank. Nanosecond times are after `partition.origin_us` (the
    floor of `first_us`, the rank's first activity in the analysed window); `span_*` are the whole trace's
    (before `--steps`), for the sanity check of the job's times."""

    rank: int
    source: str
    world_size: int | None
    job_id: str | None
    events_sampled: bool | None
    trace_meta: dict[str, Any]
    span_start_us: float
    span_end_us: float
    first_us: float
    activities: int
    steps: list[int]
    partition: Partition
    cuts: np.ndarray
    exposed_start: np.ndarray
    exposed_end: np.ndarray
    coll_start: np.ndarray      # the matchable collective kernels (`collectives`' rows), then the others
    coll_end: np.ndarray
    collectives: Collectives
    kernels: list[KernelRow]
    graph: RankGraph | None


def summarize(tl: RankTimeline, *, steps: str | None = None, peers: bool = True, what_if: bool = True
              ) -> RankSummary:
    """`tl` reduced to its :class:`RankSummary`, in the window `steps` picks (window.py). `peers`: other ranks
    of the job are analysed with this one (alone, none of its ops can wait for a peer); without `what_if` no
    graph is made."""
    if len(tl) == 0:
        raise UserError(f"{tl.source or f'rank {tl.rank}'}: no GPU activity")
    span_start, span_end = float(tl.start_us.min()), float(np.max(tl.end_us))
    tl = select_steps(tl, steps)
    first = float(tl.start_us.min())
    origin = math.floor(first) if math.isfinite(first) else 0.0
    part = partition(tl, np.zeros(len(tl)), origin, keep_segments=True)
    assert part.segments is not None
    seg_start, seg_end, category = part.segments
    exposed = category == TRANSFER_C
    start, end = to_ns(tl.start_us, origin), to_ns(tl.end_us, origin)
    end = np.maximum(end, start)
    cuts, _ = step_cuts(tl.step, start, part.start_ns, part.start_ns + part.window_ns)
    collectives = collectives_of(tl)
    others = np.setdiff1d(np.flatnonzero(tl.kind == COLLECTIVE), collectives.index)
    kernels = np.concatenate([collectives.index, others]).astype(np.int64)
    part.segments = None
    return RankSummary(
        rank=tl.rank, source=tl.source, world_size=tl.world_size, job_id=tl.job_id,
        events_sampled=tl.events_sampled, trace_meta=tl.trace_meta, span_start_us=span_start,
        span_end_us=span_end, first_us=first, activities=len(tl),
        steps=[int(s) for s in distinct(tl.step) if s >= 0], partition=part, cuts=cuts,
        exposed_start=seg_start[exposed], exposed_end=seg_end[exposed],
        coll_start=start[kernels], coll_end=end[kernels], collectives=collectives, kernels=kernel_rows(tl),
        graph=rank_graph(tl, collectives, peers=peers) if what_if else None,
    )


def kernel_rows(tl: RankTimeline) -> list[KernelRow]:
    """GPU time, count and short count of each kernel name of `tl` (summed over its name ids, in id order)."""
    ids = np.where(tl.name >= 0, tl.name, len(tl.names))
    dur = tl.end_us - tl.start_us
    n = len(tl.names) + 1
    time = np.bincount(ids, weights=dur, minlength=n)
    count = np.bincount(ids, minlength=n)
    short = np.bincount(ids, weights=dur < 10.0, minlength=n)
    kind = np.zeros(n, np.int64)
    kind[ids[::-1]] = tl.kind[::-1]  # the kind of its first activity
    return [(tl.names[i] if i < len(tl.names) else "", float(time[i]), int(count[i]), int(short[i]), int(kind[i]))
            for i in np.flatnonzero(count)]


def summarize_paths(paths: list[str], *, steps: str | None = None, what_if: bool = True, part: bool = False,
                    progress: Callable[[str, int], None] | None = None,
                    map_files: Callable[..., Iterable[list[RankSummary]]] = map) -> list[RankSummary]:
    """The summaries of every rank in `paths` (files or folders, as `load_paths` reads them), one file at a
    time: a file's timelines are dropped once reduced. `part`: these are some of the job's ranks (a node's,
    sent to the collector), so even one rank may have peers; else the paths are the whole job. A caller that
    wants files reduced in parallel passes its executor's `map` as `map_files` (then `progress` must be a
    module-level function)."""
    files = expand_paths(paths)
    job = functools.partial(_summarize_file, alone=len(files) == 1, part=part, steps=steps, what_if=what_if)
    names: dict[str, str] = {}
    return [share_names(s, names)
            for found in map_files(job, [(p, functools.partial(progress, p) if progress else None) for p in files])
            for s in found]


def share_names(summary: RankSummary, names: dict[str, str]) -> RankSummary:
    """`summary` with its kernel names replaced by the equal strings of `names` (added there when new): the
    ranks of a job run the same kernels, and a summary that crossed a process boundary brings its own copy
    of each name, the largest part of it."""
    def shared(name: str) -> str:
        return names.setdefault(name, name)

    summary.kernels = [(shared(k[0]), *k[1:]) for k in summary.kernels]
    if summary.graph is not None:
        summary.graph.labels = [(lb[0], lb[1], shared(lb[2]) if isinstance(lb[2], str) else lb[2])
                                for lb in summary.graph.labels]
    return summary


def _summarize_file(job: tuple[str, Callable[[int], None] | None], *, alone: bool, part: bool, steps: str | None,
                    what_if: bool) -> list[RankSummary]:
    path, report = job
    timelines = load_file(path, progress=report, default_rank=0 if alone else None)
    peers = part or not alone or len(timelines) > 1
    return [summarize(tl, steps=steps, peers=peers, what_if=what_if) for tl in timelines]


#: The first bytes of encoded summaries (and of nothing the trace readers read).
MAGIC = b"GWSUMMARY1\n"
_ENCODER = msgspec.msgpack.Encoder(enc_hook=lambda a: _array_out(a))


def encode(summaries: list[RankSummary]) -> bytes:
    """Summaries as `MAGIC` and msgpack (arrays as dtype, shape and raw bytes; no pickle): what a node sends
    to the collector in place of its ranks' traces, and what the collector keeps per rank."""
    return MAGIC + _ENCODER.encode(summaries)


def decode(data: bytes, name: str = "summary") -> list[RankSummary]:
    """The summaries `encode` wrote; anything else stops with a one-line error naming `name`."""
    if not data.startswith(MAGIC):
        raise UserError(f"{name}: not a gpuwatch trace summary")
    try:
        return msgspec.msgpack.decode(memoryview(data)[len(MAGIC):], type=list[RankSummary], dec_hook=_array_in)
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        raise UserError(f"{name}: a damaged trace summary ({exc})") from None


def _array_out(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return {"dtype": value.dtype.str, "shape": list(value.shape), "data": value.tobytes()}
    if isinstance(value, np.generic):
        return value.item()
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


def _array_in(kind: type, value: Any) -> Any:
    if kind is np.ndarray:
        if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data"}:
            raise ValueError("an array is not (dtype, shape, data)")
        dtype = np.dtype(value["dtype"])
        if dtype.hasobject:
            raise ValueError("object arrays are not accepted")
        return np.frombuffer(value["data"], dtype=dtype).reshape(value["shape"]).copy()
    raise NotImplementedError(f"cannot decode {kind}")
