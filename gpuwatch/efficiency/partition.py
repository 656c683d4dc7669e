"""Partition one rank's window into the eight categories of the spec, by a vectorised sweep.

All boundaries (activity starts/ends, step cuts) are sorted once; a running count per priority layer
gives, for every elementary segment between two boundaries, the highest-priority thing running. Idle
segments are grouped into gaps and each gap is classified by its length and the launch time of the
activity that ends it. Times are integer nanoseconds relative to a job origin, so the categories sum to
the window exactly.
"""
from __future__ import annotations

import msgspec
import numpy as np

from gpuwatch.core.vocabulary import BREAKDOWN_CATEGORIES
from gpuwatch.efficiency.timeline import COLLECTIVE, MEMCPY, RankTimeline

CATEGORIES = BREAKDOWN_CATEGORIES  # indexed by the *_C constants below
COMPUTE_C, MEMCPY_C, TRANSFER_C, WAIT_C, BUBBLE_C, SMALL_C, HOST_C, OTHER_C = range(8)
SMALL_GAP_NS = 30_000       # idle gaps shorter than this are launch/dispatch overhead
SHORT_KERNEL_NS = 10_000    # kernels shorter than this are reported as short kernels
_N_LAYERS = 5               # busy layers, in priority order: compute, memcpy, transfer, wait, p2p
_IDLE = -1


class StepSlice(msgspec.Struct):
    """One step's slice of the window: from its first activity to the next step's first activity."""

    step: int | None
    start_ns: int
    window_ns: int
    totals_ns: np.ndarray


class Partition(msgspec.Struct):
    """The result for one rank. `segments` (start_ns, end_ns, category) is kept only when asked for."""

    origin_us: float
    start_ns: int
    window_ns: int
    totals_ns: np.ndarray
    comm_total_ns: int
    comm_overlapped_ns: int
    short_kernel_count: int
    short_kernel_ns: int
    steps: list[StepSlice]
    segments: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


def to_ns(us: np.ndarray, origin_us: float) -> np.ndarray:
    """Microseconds (absolute) -> integer nanoseconds after `origin_us`."""
    return np.rint((np.asarray(us, dtype=np.float64) - origin_us) * 1000.0).astype(np.int64)


def partition(tl: RankTimeline, wait_us: np.ndarray, origin_us: float, *, keep_segments: bool = False) -> Partition:
    """Partition `tl`'s window; `wait_us` is each activity's waiting-for-peers time (0 if none)."""
    start, end = to_ns(tl.start_us, origin_us), to_ns(tl.end_us, origin_us)
    end = np.maximum(end, start)
    w_start, w_end = int(start.min()), int(end.max())
    wait = np.clip(to_ns(wait_us, 0.0), 0, end - start)

    starts, ends, layers = _layered_intervals(tl.kind, start, end, wait)
    cuts, cut_steps = step_cuts(tl.step, start, w_start, w_end)
    points = np.concatenate([starts, ends, cuts])
    delta = np.concatenate([np.ones(len(starts), np.int32), -np.ones(len(ends), np.int32),
                            np.zeros(len(cuts), np.int32)])
    layer = np.concatenate([layers, layers, np.zeros(len(cuts), np.int8)])
    order = np.argsort(points, kind="stable")  # starts sort before ends at a tie: touching work merges
    pos, delta, layer = points[order], delta[order], layer[order]

    active = np.empty((_N_LAYERS, max(len(pos) - 1, 0)), dtype=bool)  # no points: all work had zero length
    for k in range(_N_LAYERS):
        active[k] = np.cumsum(np.where(layer == k, delta, 0))[:-1] > 0
    length = np.diff(pos)
    top = np.where(active.any(axis=0), active.argmax(axis=0), _IDLE)

    keep = length > 0
    length, top, seg_start = length[keep], top[keep], pos[:-1][keep]
    comm = active[2:, keep].any(axis=0)
    computing = active[0, keep]
    category = _categorise(top, length, seg_start, start, to_ns_launch(tl.launch_us, origin_us))

    totals = np.bincount(category, weights=length, minlength=8).astype(np.int64)
    is_kernel = tl.kind != MEMCPY
    short = is_kernel & ((end - start) < SHORT_KERNEL_NS)
    return Partition(
        origin_us=origin_us, start_ns=w_start, window_ns=w_end - w_start, totals_ns=totals,
        comm_total_ns=int(length[comm].sum()), comm_overlapped_ns=int(length[comm & computing].sum()),
        short_kernel_count=int(short.sum()), short_kernel_ns=int((end - start)[short].sum()),
        steps=_step_slices(cuts, cut_steps, seg_start, length, category, w_start, w_end),
        segments=_merged_segments(seg_start, length, category) if keep_segments else None,
    )


def to_ns_launch(launch_us: np.ndarray, origin_us: float) -> np.ndarray:
    """Launch times as float nanoseconds after the origin (NaN stays NaN: unknown)."""
    return (np.asarray(launch_us, dtype=np.float64) - origin_us) * 1000.0


def _layered_intervals(kind: np.ndarray, start: np.ndarray, end: np.ndarray, wait: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Busy intervals with their priority layer; a collective splits into its wait and transfer parts."""
    layer_of_kind = np.array([0, 1, 2, 4], dtype=np.int8)  # compute, memcpy, collective(transfer), p2p
    layers = layer_of_kind[kind]
    coll = kind == COLLECTIVE
    waiting = coll & (wait > 0)
    starts = np.concatenate([np.where(coll, start + wait, start), start[waiting]])
    ends = np.concatenate([end, start[waiting] + wait[waiting]])
    layers = np.concatenate([layers, np.full(int(waiting.sum()), 3, dtype=np.int8)])
    nonempty = ends > starts
    return starts[nonempty], ends[nonempty], layers[nonempty]


def _categorise(top: np.ndarray, length: np.ndarray, seg_start: np.ndarray, act_start: np.ndarray,
                act_launch: np.ndarray) -> np.ndarray:
    """Category of each positive-length segment: the busy layer, or its idle gap's class."""
    category = top.astype(np.int64)  # busy layers 0..4 are categories 0..4 in the same order
    idle = top == _IDLE
    if not idle.any():
        return category
    run_start = idle & ~np.concatenate([[False], idle[:-1]])
    run_id = np.cumsum(run_start) - 1
    gap_start = seg_start[run_start]
    gap_len = np.bincount(run_id[idle], weights=length[idle]).astype(np.int64)
    gap_end = gap_start + gap_len
    # The activity that ends a gap: the first starting at its end (earliest launch among ties).
    launch = np.where(np.isnan(act_launch), np.inf, act_launch)
    order = np.lexsort((launch, act_start))
    nxt = np.clip(np.searchsorted(act_start[order], gap_end, side="left"), 0, len(order) - 1)
    next_launch = launch[order][nxt]
    gap_class = np.where(gap_len < SMALL_GAP_NS, SMALL_C,
                         np.where(np.isfinite(next_launch) & (next_launch > gap_start), HOST_C, OTHER_C))
    category[idle] = gap_class[run_id[idle]]
    return category


def step_cuts(step: np.ndarray, start: np.ndarray, w_start: int, w_end: int) -> tuple[np.ndarray, np.ndarray]:
    """Start of each known step (its first activity), sorted; the window is cut there."""
    known = step >= 0
    if not known.any():
        return np.empty(0, np.int64), np.empty(0, np.int64)
    ids, inverse = np.unique(step[known], return_inverse=True)
    first = np.full(len(ids), np.iinfo(np.int64).max)
    np.minimum.at(first, inverse, start[known])
    order = np.argsort(first, kind="stable")
    first, ids = first[order], ids[order]
    inside = (first >= w_start) & (first < w_end)
    return first[inside], ids[inside]


def _step_slices(cuts: np.ndarray, cut_steps: np.ndarray, seg_start: np.ndarray, length: np.ndarray,
                 category: np.ndarray, w_start: int, w_end: int) -> list[StepSlice]:
    if not len(cuts):
        return []
    slice_of = np.searchsorted(cuts, seg_start, side="right")  # 0 = before the first step
    n = len(cuts) + 1
    totals = np.bincount(slice_of * 8 + category, weights=length, minlength=n * 8).astype(np.int64).reshape(n, 8)
    bounds = np.concatenate([[w_start], cuts, [w_end]])
    steps = [None] + [int(s) for s in cut_steps]
    return [
        StepSlice(steps[i], int(bounds[i]), int(bounds[i + 1] - bounds[i]), totals[i])
        for i in range(n) if bounds[i + 1] > bounds[i]
    ]


def _merged_segments(seg_start: np.ndarray, length: np.ndarray, category: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of equal category (for timelines drawn per category)."""
    if not len(seg_start):
        return seg_start, seg_start, category
    change = np.concatenate([[True], category[1:] != category[:-1]])
    starts = seg_start[change]
    ends = np.concatenate([starts[1:], [seg_start[-1] + length[-1]]])
    return starts, ends, category[change]


def waits_per_slice(exposed: tuple[np.ndarray, np.ndarray], collectives: tuple[np.ndarray, np.ndarray],
                    wait_ns: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """How much of a rank's exposed collective time is `comm_wait`, per slice of its window (before its
    first step, then one per step cut, as :class:`Partition` slices it), given each collective kernel's
    `[start, end)` (ns) and wait (ns, the first part of it).

    The rank's partition without waits puts all exposed collective time in `comm_transfer`; with waits, an
    instant of it is `comm_wait` exactly when some kernel is in its wait part there and none in its transfer
    part (transfer outranks wait), and nothing else changes: the union of the two parts is the kernel. So a
    rank's partition is made where its trace is read, and only this split waits for the other ranks."""
    c_start, c_end = collectives
    wait = np.clip(wait_ns, 0, c_end - c_start)
    waiting = wait > 0
    e_start, e_end = exposed
    # Layers: 0 exposed, 1 wait part, 2 transfer part.
    starts = np.concatenate([e_start, c_start[waiting], c_start + wait])
    ends = np.concatenate([e_end, c_start[waiting] + wait[waiting], c_end])
    layer = np.concatenate([np.zeros(len(e_start), np.int8), np.ones(int(waiting.sum()), np.int8),
                            np.full(len(c_start), 2, np.int8)])
    keep = ends > starts
    starts, ends, layer = starts[keep], ends[keep], layer[keep]
    points = np.concatenate([starts, ends, cuts])
    delta = np.concatenate([np.ones(len(starts), np.int32), -np.ones(len(ends), np.int32),
                            np.zeros(len(cuts), np.int32)])
    layers = np.concatenate([layer, layer, np.full(len(cuts), -1, np.int8)])
    order = np.argsort(points, kind="stable")
    pos, delta, layers = points[order], delta[order], layers[order]
    active = [np.cumsum(np.where(layers == k, delta, 0))[:-1] > 0 for k in range(3)]
    length = np.diff(pos)
    counted = active[0] & active[1] & ~active[2] & (length > 0) if len(pos) else np.empty(0, bool)
    slice_of = np.searchsorted(cuts, pos[:-1][counted], side="right")
    return np.bincount(slice_of, weights=length[counted], minlength=len(cuts) + 1).astype(np.int64)


def with_waits(part: Partition, waits: np.ndarray, cuts: np.ndarray, origin_us: float, shift_ns: int) -> Partition:
    """`part` (made without waits) with `waits` (per slice, from :func:`waits_per_slice`) moved from
    `comm_transfer` to `comm_wait`, and its times moved to `origin_us` (`shift_ns` later)."""
    def moved(totals: np.ndarray, wait: int) -> np.ndarray:
        out = totals.copy()
        out[TRANSFER_C] -= wait
        out[WAIT_C] += wait
        return out

    slices = np.searchsorted(cuts, [s.start_ns for s in part.steps], side="right")
    return Partition(
        origin_us=origin_us, start_ns=part.start_ns + shift_ns, window_ns=part.window_ns,
        totals_ns=moved(part.totals_ns, int(waits.sum())), comm_total_ns=part.comm_total_ns,
        comm_overlapped_ns=part.comm_overlapped_ns, short_kernel_count=part.short_kernel_count,
        short_kernel_ns=part.short_kernel_ns,
        steps=[StepSlice(s.step, s.start_ns + shift_ns, s.window_ns, moved(s.totals_ns, int(waits[i])))
               for s, i in zip(part.steps, slices.tolist())],
    )
