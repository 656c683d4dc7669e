"""What-if: how much faster the job would run if no rank and no step were slower than the job's typical op.

The method of "Understanding Stragglers in Large Model Training Using What-if Analysis" (OSDI'25), as the
spec (efficiency.md, "What-if") defines it. The analysed ops of every rank become a dependency graph:
- on a rank, op B depends, per stream, on the latest op A that started before B and ended no later than
  `DELTA_US` after B started (the rest of "every such op" is implied through that stream's order);
- a matched collective instance ends, on every rank, its transfer time after the last rank arrives;
- a point-to-point pair (send/recv matched by process group and seq, else by order between the two ranks
  of a two-rank group) ends its transfer time after both sides have started;
- with launch delays kept, an op also waits the host stall the trace shows before it (the part of its
  idle gap before which its launch call had not begun).

The graph is replayed with chosen durations: "actual" (the check: it must reproduce the measured step
times), "actual without launch delays", and "ideal" (compute and memory ops at the mean duration of their
kernel name over all ranks and steps, communication transfers at the median of their collective type and
group size). `slowdown` = actual-without-launch-delays ÷ ideal mean step time; attribution replays with
one rank's (or one op kind's) actual durations and all else ideal.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, TypedDict

import msgspec
import numpy as np

from gpuwatch.efficiency.arrays import distinct, median
from gpuwatch.efficiency.matching import Matching
from gpuwatch.efficiency.result import KindSlowdown, RankSlowdown, WhatIf
from gpuwatch.efficiency.timeline import COLLECTIVE, KIND_NAMES, P2P, UNKNOWN, RankTimeline

DELTA_US = 1000.0
_NO_INSTANCE = -1


class _Graph(msgspec.Struct):
    """All ranks' ops (global op ids, each rank's ops in actual start order), and the graph the replay
    walks: nodes, each one op or a chain of ops run back to back that nothing else waits on inside (a
    stream's kernels between two cross-stream dependencies), which replays exactly as one op of their
    summed duration and a fraction of the work. Per op, only what a replay's durations are made of is kept
    (the job's ops are many; its nodes a twentieth of them on real traces)."""

    node: np.ndarray            # node of each op
    head: np.ndarray            # first op of each node
    node_start: np.ndarray      # actual start of each node's first op (us, relative to the job origin)
    node_rank: np.ndarray       # index of each node's rank among the timelines
    node_step: np.ndarray       # step of each node (a node's ops share one)
    actual_steps: np.ndarray    # the measured step times (us)
    order: list[int]            # nodes in the actual start order of their first op
    deps: list[tuple[int, ...]] # nodes each node waits for
    base: list[float]           # the rank's first actual start: a node with no dependency starts there
    instance: list[int]         # cross-rank instance (collective or p2p pair) of each node, else -1
    members: list[list[int]]    # nodes of each instance
    transfer: np.ndarray        # actual duration, minus the wait for peers for communication ops
    first_wait: np.ndarray      # host launch delay before each node's first op (0 where unknown)
    inner_delay: np.ndarray     # the launch delays of each node's other ops, summed
    kind: np.ndarray
    key: np.ndarray             # what "the same op" is for the ideal: kernel name, or type and group size
    comm: np.ndarray            # True for communication ops (their ideal is a median, not a mean)


class _Part(TypedDict):
    """One rank's ops in actual start order, and where they sit among all ranks' ops."""

    order: np.ndarray   # the rank's activity rows in actual start order
    offset: int         # global id of the rank's first op
    pos: int            # index of the rank among the timelines


def what_if(timelines: list[RankTimeline], matching: Matching) -> WhatIf | None:
    """The analysis's what-if (None when there is nothing to replay)."""
    graph = _build(timelines, matching)
    if graph is None:
        return None
    ranks = [tl.rank for tl in timelines]
    kinds = [k for k in range(len(KIND_NAMES)) if (graph.kind == k).any()]
    attributed = len(ranks) > 1  # one rank's attribution is its whole slowdown: no replay needed
    steps = _replay(graph, _ideal_durations(graph), kinds, len(ranks) if attributed else 0)
    actual_steps = graph.actual_steps
    replay, no_delay, ideal_steps = steps[:3]
    t_actual, t_ideal = float(no_delay.mean()), float(ideal_steps.mean())
    if not (t_ideal > 0 and t_actual > 0 and (actual_steps > 0).all()):
        return None  # steps of zero length (a trace of zero-length work): no time to compare against
    if replay.shape != actual_steps.shape:
        return None  # a live window cut a step to nothing in the trace or in the replay: no step-by-step check
    attribution = [float(s.mean()) / t_ideal for s in steps[3:]]
    per_rank = dict(zip(ranks, attribution[:len(ranks)] if attributed else [t_actual / t_ideal]))
    per_kind = {KIND_NAMES[k]: s for k, s in zip(kinds, attribution[len(ranks) if attributed else 0:])}
    slowdown = t_actual / t_ideal
    excess = slowdown - 1.0

    def share(s: float) -> float | None:
        return round((s - 1.0) / excess, 4) if excess > 1e-9 else None

    return WhatIf(
        slowdown=round(max(1.0, slowdown), 4),
        slowdown_unclamped=round(slowdown, 4),
        actual_step_us=round(float(actual_steps.mean()), 3),
        replayed_step_us=round(float(replay.mean()), 3),
        replay_error=round(float(np.max(np.abs(replay - actual_steps) / actual_steps)), 4),
        no_launch_delay_step_us=round(t_actual, 3),
        actual_over_no_launch_delay=round(float(actual_steps.mean()) / t_actual, 4),
        ideal_step_us=round(t_ideal, 3),
        steps=len(actual_steps),
        ops=len(graph.node),
        replayed_nodes=len(graph.head),
        per_rank=[RankSlowdown(rank=r, slowdown=round(s, 4), share=share(s)) for r, s in per_rank.items()],
        per_op_kind=[KindSlowdown(kind=k, slowdown=round(s, 4), share=share(s)) for k, s in per_kind.items()],
    )


def _build(timelines: list[RankTimeline], matching: Matching) -> _Graph | None:
    origin = min(float(tl.start_us.min()) for tl in timelines if len(tl))
    parts: list[_Part] = []
    offset = 0
    for pos, tl in enumerate(timelines):
        order = np.lexsort((tl.end_us, tl.start_us))
        parts.append({"order": order, "offset": offset, "pos": pos})
        offset += len(order)
    n = offset
    if n == 0:
        return None
    start = np.concatenate([tl.start_us[p["order"]] - origin for tl, p in zip(timelines, parts)])
    end = np.concatenate([tl.end_us[p["order"]] - origin for tl, p in zip(timelines, parts)])
    kind = np.concatenate([tl.kind[p["order"]] for tl, p in zip(timelines, parts)])
    instance, members, group_size = _instances(timelines, parts, matching, n)
    transfer = end - start - _waits(instance, start, end)
    key = _op_keys(timelines, parts, kind, group_size)
    step = np.concatenate([tl.step[p["order"]] for tl, p in zip(timelines, parts)])
    node = np.empty(n, np.int64)
    delay = np.empty(n)
    heads: list[int] = []
    deps: list[tuple[int, ...]] = []
    base: list[float] = []
    # One rank at a time: its op-level dependencies (a column per stream) are reduced to its nodes' and
    # dropped before the next rank's are made, so they never exist for the whole job at once.
    for tl, p in zip(timelines, parts):
        span = slice(p["offset"], p["offset"] + len(p["order"]))
        lane = np.where(tl.stream[p["order"]] >= 0, tl.stream[p["order"]],
                        1_000_000 + tl.kind[p["order"]].astype(np.int64))
        op_deps, pred = _dependencies(start[span], end[span], lane)
        delay[span] = _launch_delays(start[span], end[span], tl.launch_us[p["order"]] - origin, op_deps)
        local_node, local_heads = _chains(op_deps, pred, instance[span] < 0, step[span])
        first = len(heads)
        node[span] = local_node + first
        heads.extend((local_heads + p["offset"]).tolist())
        for row in op_deps[local_heads].tolist():
            deps.append(tuple(int(local_node[d]) + first for d in row if d >= 0))
        base.extend([float(start[span][0])] * len(local_heads))
    head = np.array(heads, dtype=np.int64)
    rank_pos = np.concatenate([np.full(len(p["order"]), p["pos"]) for p in parts])
    # The measured step times from the nodes (a node's ops share a step, its first op starts first): the
    # same minima and maxima as from every op, without a sort of the job's ops.
    node_end = np.full(len(head), -np.inf)
    np.maximum.at(node_end, node, end)
    return _Graph(
        node=node, head=head, node_start=start[head], node_rank=rank_pos[head], node_step=step[head],
        actual_steps=_step_times(step[head], start[head][:, None], node_end[:, None])[0],
        order=np.argsort(start[head], kind="stable").tolist(), deps=deps, base=base,
        instance=instance[head].tolist(), members=[sorted(set(node[m].tolist())) for m in members],
        first_wait=delay[head], inner_delay=np.bincount(node, weights=delay, minlength=len(head)) - delay[head],
        transfer=transfer, kind=kind, key=key, comm=(kind == COLLECTIVE) | (kind == P2P),
    )


def _chains(deps: np.ndarray, pred: np.ndarray, local: np.ndarray, step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(node of each op, first op of each node) of one rank: an op joins its stream predecessor's node
    when it waits for that op alone, neither is communication, they share a step, and nothing else
    waits for the predecessor."""
    n = len(deps)
    has = deps >= 0
    other = has & (deps != pred[:, None])
    needed = np.zeros(n, dtype=bool)
    needed[deps[other]] = True
    single = (has.sum(axis=1) == 1) & (has & (deps == pred[:, None])).any(axis=1)
    merge = single & local & (pred >= 0)
    p = pred[merge]
    merge[merge] = local[p] & (step[p] == step[merge]) & ~needed[p]
    root = np.where(merge, pred, np.arange(n))
    while True:
        jumped = root[root]
        if np.array_equal(jumped, root):
            break
        root = jumped
    heads = np.flatnonzero(~merge)
    return np.searchsorted(heads, root), heads


def _waits(instance: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Each op's wait for its peers (the spec's clamp(max(s) - s_r, 0, d_r)), for matched collectives and
    paired p2p alike; 0 for ops that are not part of a cross-rank instance."""
    inside = instance >= 0
    wait = np.zeros(len(start))
    if inside.any():
        latest = np.full(int(instance.max()) + 1, -np.inf)
        np.maximum.at(latest, instance[inside], start[inside])
        wait[inside] = np.clip(latest[instance[inside]] - start[inside], 0.0, end[inside] - start[inside])
    return wait


def _dependencies(start: np.ndarray, end: np.ndarray, lane: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per op (ops in start order), the ops it depends on, one column per lane (stream; -1: none): the
    latest op of that lane that started before it and ended no later than DELTA_US after it started. A
    dependency its predecessor on its own lane already has (or a later one on that lane) is implied, and
    left out. Also each op's predecessor on its lane (-1 for the first)."""
    n = len(start)
    found = []
    for ln in distinct(lane):
        on = np.flatnonzero(lane == ln)
        p = np.searchsorted(start[on], start, side="left") - 1
        ok = p >= 0
        cand = np.where(ok, on[np.maximum(p, 0)], -1)
        running = ok & (end[np.maximum(cand, 0)] > start + DELTA_US)
        prev = np.where(p >= 1, on[np.maximum(p - 1, 0)], -1)
        found.append(np.where(running, prev, cand))
    dep = np.stack(found, axis=1) if found else np.empty((n, 0), np.int64)
    # The same-lane predecessor of each op (already implies what it depends on).
    pred = np.full(n, -1)
    for ln in distinct(lane):
        on = np.flatnonzero(lane == ln)
        pred[on[1:]] = on[:-1]
    implied = np.zeros_like(dep, dtype=bool)
    has_pred = pred >= 0
    implied[has_pred] = (dep[pred[has_pred]] >= dep[has_pred]) & (dep[has_pred] != pred[has_pred, None])
    return np.where(implied | (dep < 0), -1, dep), pred


def _launch_delays(start: np.ndarray, end: np.ndarray, launch: np.ndarray, deps: np.ndarray) -> np.ndarray:
    """The host stall before each op: from when its dependencies were done to when its launch call began
    (never past its start); 0 where the launch time is unknown."""
    ready = np.where(deps >= 0, end[np.maximum(deps, 0)], start[0]).max(axis=1, initial=start[0])
    stall = np.minimum(launch, start) - ready
    return np.where(np.isnan(stall), 0.0, np.maximum(stall, 0.0))


def _instances(timelines: list[RankTimeline], parts: list[_Part], matching: Matching, n: int
               ) -> tuple[np.ndarray, list[list[int]], np.ndarray]:
    """Cross-rank instance of each op (matched collectives, paired p2p), the ops of each, and each op's
    group size (ranks in its instance, or the size of its process group where the trace lists it)."""
    instance = np.full(n, _NO_INSTANCE, dtype=np.int64)
    group_size = np.ones(n, dtype=np.int64)
    rows: list[tuple[int, tuple[object, ...]]] = []  # (global op, instance key) for collectives and p2p
    keys: dict[tuple[object, ...], int] = {}
    for tl, p in zip(timelines, parts):
        inverse = np.empty(len(p["order"]), np.int64)
        inverse[p["order"]] = np.arange(len(p["order"]))
        coll = matching.instance_of[p["pos"]]
        for idx in np.flatnonzero(coll >= 0):
            rows.append((p["offset"] + int(inverse[idx]), ("c", int(coll[idx]))))
        for idx, key in _p2p_keys(tl):
            rows.append((p["offset"] + int(inverse[idx]), key))
    members: list[list[int]] = []
    for op, key in rows:
        k = keys.get(key)
        if k is None:
            k = keys[key] = len(members)
            members.append([])
        members[k].append(op)
    for k, ops in enumerate(members):
        if len(ops) >= 2:
            instance[ops] = k
            group_size[ops] = len(ops)
    members = [ops if len(ops) >= 2 else [] for ops in members]
    for tl, p in zip(timelines, parts):  # the group's own size where the trace lists its members
        sizes = np.array([len(tl.group_ranks.get(g, ())) for g in tl.process_groups] + [0])
        listed = sizes[tl.process_group[p["order"]]]
        span = slice(p["offset"], p["offset"] + len(p["order"]))
        group_size[span] = np.where(listed > 0, listed, group_size[span])
    return instance, members, group_size


def _p2p_keys(tl: RankTimeline) -> list[tuple[np.intp, tuple[object, ...]]]:
    """(activity index, pairing key) of each p2p op whose peer is known: the two ranks of its process
    group; paired by (group, seq) when the trace has seq, else by order between the two ranks."""
    out: list[tuple[np.intp, tuple[object, ...]]] = []
    p2p = np.flatnonzero(tl.kind == P2P)
    p2p = p2p[np.argsort(tl.start_us[p2p], kind="stable")]
    counts: dict[tuple[int, ...], int] = {}
    for idx in p2p:
        g = int(tl.process_group[idx])
        if g == UNKNOWN:
            continue
        name = tl.process_groups[g]
        ranks = tl.group_ranks.get(name, [])
        if len(ranks) != 2 or tl.rank not in ranks:
            continue
        pair = tuple(sorted(ranks))
        seq = int(tl.seq[idx])
        if seq == UNKNOWN:
            seq = counts.get(pair, 0)
            counts[pair] = seq + 1
            out.append((idx, ("p", pair, "order", seq)))
        else:
            out.append((idx, ("p", pair, name, seq)))
    return out


def _op_keys(timelines: list[RankTimeline], parts: list[_Part], kind: np.ndarray, group_size: np.ndarray
             ) -> np.ndarray:
    """What counts as "the same op" for the ideal durations, as a dense integer per op: the kernel name
    (and kind) for compute and memory ops, (collective type, group size) for communication. Built from
    each timeline's small name tables, so no per-op string is made."""
    ids: dict[tuple[object, ...], int] = {}
    keys: list[np.ndarray] = []
    for tl, p in zip(timelines, parts):
        o = p["order"]
        kinds = tl.kind[o].astype(np.int64)
        comm = (kinds == COLLECTIVE) | (kinds == P2P)
        size = group_size[p["offset"]: p["offset"] + len(o)]
        names = list(tl.names) + [""]            # an unknown id (-1) reads as the last entry, ""
        types = list(tl.coll_types) + [""]
        name_id = np.where(tl.name[o] >= 0, tl.name[o], len(names) - 1).astype(np.int64)
        type_id = np.where(tl.coll_type[o] >= 0, tl.coll_type[o], len(types) - 1).astype(np.int64)
        sizes = int(size.max()) + 1
        local = kinds * len(names) + name_id     # (kind, name) as one local code
        comm_code = type_id * sizes + size       # (type, group size) as one local code
        key = np.empty(len(o), np.int64)
        op_label = functools.partial(_op_label, names)
        comm_label = functools.partial(_comm_label, types, sizes)
        for mask, code, label in ((~comm, local, op_label), (comm, comm_code, comm_label)):
            if not mask.any():
                continue
            uniq, inverse = np.unique(code[mask], return_inverse=True)
            table = np.array([ids.setdefault(label(int(c)), len(ids)) for c in uniq], dtype=np.int64)
            key[mask] = table[inverse.ravel()]
        keys.append(key)
    return np.concatenate(keys)


def _op_label(names: list[str], code: int) -> tuple[Any, ...]:
    return ("op", code // len(names), names[code % len(names)])


def _comm_label(types: list[str], sizes: int, code: int) -> tuple[Any, ...]:
    return ("comm", types[code // sizes], code % sizes)


def _ideal_durations(graph: _Graph) -> np.ndarray:
    """Compute and memory ops: mean duration per kernel name; communication: median transfer per
    (collective type, group size); over all ranks and steps."""
    code = graph.key
    ideal = np.empty(len(code))
    local = ~graph.comm
    if local.any():
        sums = np.bincount(code[local], weights=graph.transfer[local], minlength=code.max() + 1)
        counts = np.bincount(code[local], minlength=code.max() + 1)
        ideal[local] = sums[code[local]] / counts[code[local]]
    for c in distinct(code[graph.comm]):
        mine = graph.comm & (code == c)
        ideal[mine] = median(graph.transfer[mine])
    return ideal


# Replays walked together are held as (nodes x replays) float arrays; past this many elements (32 MB each) a
# job's replays are walked in groups (a 512-rank job: 250k nodes, 518 replays, 1 GB a matrix all at once).
_WALK_ELEMENTS = 1 << 22


def _replay(graph: _Graph, ideal: np.ndarray, kinds: list[int], ranks: int) -> list[np.ndarray]:
    """Step times of every replay the what-if needs, in this order: actual durations with launch delays (the
    check), actual without them, ideal; then one per rank position below `ranks`, with that rank's actual
    durations and all else ideal; then one per op kind in `kinds`, likewise. A node lies on one rank, so a
    rank's replay picks whole nodes' durations; a kind's sums its ops'."""
    n = len(graph.head)
    per_node = functools.partial(np.bincount, graph.node, minlength=n)
    actual, typical = per_node(weights=graph.transfer), per_node(weights=ideal)
    inner = graph.inner_delay
    node_rank = graph.node_rank

    def durations(replay: int) -> np.ndarray:  # made as each group is walked: a 512-rank job has 518
        if replay == 0:
            with_delays: np.ndarray = actual + inner
            return with_delays
        if replay < 3:
            return actual if replay == 1 else typical
        if replay < 3 + ranks:
            return np.where(node_rank == replay - 3, actual, typical)
        return per_node(weights=np.where(graph.kind == kinds[replay - 3 - ranks], graph.transfer, ideal))

    first_wait = graph.first_wait
    node_step = graph.node_step
    group = max(1, _WALK_ELEMENTS // max(n, 1))
    steps: list[np.ndarray] = []
    replays = 3 + ranks + len(kinds)
    for first in range(0, replays, group):
        chosen = range(first, min(first + group, replays))
        dur = np.stack([durations(i) for i in chosen], axis=1)
        starts, ends = _simulate(graph, dur, first_wait if first == 0 else None)
        del dur  # before the step times' copies: the walk's matrices bound this function's memory
        steps.extend(_step_times(node_step, starts, ends))
        del starts, ends
    return steps


def _simulate(graph: _Graph, dur: np.ndarray, wait_before: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Replay the graph with each node's duration `dur` (its ops back to back, with the launch delays of
    all but the first) and, in the first replay (column) only, the delay `wait_before` each node's first op
    waits (None: no delays): (start, end) of
    every node, as nodes x replays, a column per column of `dur`. Which node is taken when depends on the
    graph alone, never on the durations, so the replays are walked together, a node's times a vector (one
    by one, a job of R ranks walked a graph that grows with R, R times, to attribute its slowdown).
    Nodes are taken in their actual start order; one whose dependency is not yet known (a collective whose
    last rank comes later in that order) waits for it. If the graph holds a cycle (ranks that ran matched
    collectives in different orders), the instance that began first is closed with the ranks that have
    arrived, and later arrivals end their own transfer after max(that time, their arrival)."""
    n, replays = dur.shape
    dur_of = list(dur)
    wait_of = None if wait_before is None else wait_before.tolist()
    starts, ends = np.full((n, replays), np.nan), np.full((n, replays), np.nan)  # NaN: never started / ended
    start, end = list(starts), list(ends)  # each node's row, written in place
    deps, base, instance, members = graph.deps, graph.base, graph.instance, graph.members
    started, ended = [False] * n, [False] * n
    arrived = [0] * len(members)
    latest: list[np.ndarray | float] = [float("-inf")] * len(members)
    closed = [False] * len(members)
    waiters: dict[int, list[int]] = {}
    stack: list[int] = []
    maximum, add = np.maximum, np.add

    def finish(m: int, t: np.ndarray | float) -> None:
        add(t, dur_of[m], end[m])
        ended[m] = True
        if m in waiters:
            stack.extend(waiters.pop(m))

    def run(firsts: Iterable[int]) -> None:
        """Process `firsts` in order, each with everything it unblocks (a stack of ready ops)."""
        for first in firsts:
            stack.append(first)
            while stack:
                i = stack.pop()
                t = base[i]
                blocked = False
                for d in deps[i]:
                    if not ended[d]:
                        waiters.setdefault(d, []).append(i)
                        blocked = True
                        break
                    t = maximum(t, end[d])
                if blocked:
                    continue
                start[i][...] = t
                if wait_of is not None:
                    start[i][0] += wait_of[i]
                started[i] = True
                k = instance[i]
                if k < 0:
                    finish(i, start[i])
                    continue
                arrived[k] += 1
                latest[k] = maximum(latest[k], start[i])
                if closed[k]:
                    finish(i, latest[k])
                elif arrived[k] == len(members[k]):
                    for m in members[k]:
                        finish(m, latest[k])

    run(graph.order)
    while True:  # break cycles, if any
        pending = [k for k in range(len(members)) if 0 < arrived[k] < len(members[k]) and not closed[k]]
        if not pending:
            break
        k = min(pending, key=lambda j: min(graph.node_start[m] for m in members[j]))
        closed[k] = True
        for m in members[k]:
            if started[m] and not ended[m]:
                finish(m, latest[k])  # what waited for it goes on the stack
        woken = stack[:]
        stack.clear()
        run(woken)
    return starts, ends


def _step_times(step: np.ndarray, start: np.ndarray, end: np.ndarray) -> list[np.ndarray]:
    """Per analysed step, the job's step time, for each column of `start` and `end` (ops or nodes x replays):
    from the end of the previous step (the first step: its first op's start) to the last end of its ops on
    any rank. No known steps: the whole window is one."""
    known = step >= 0
    if not known.any():
        return [np.array([np.nanmax(e) - np.nanmin(s)]) for s, e in zip(start.T, end.T)]
    code = np.unique(step[known], return_inverse=True)[1]
    by_step = np.argsort(code, kind="stable")
    bounds = np.flatnonzero(np.r_[True, np.diff(code[by_step]) != 0])
    rows = np.flatnonzero(known)[by_step]
    last_all = np.maximum.reduceat(np.nan_to_num(end[rows], copy=False, nan=-np.inf), bounds, axis=0)
    first_all = np.minimum.reduceat(np.nan_to_num(start[rows], copy=False, nan=np.inf), bounds, axis=0)
    times = []
    for first, last in zip(first_all.T, last_all.T):
        order = np.argsort(first, kind="stable")
        last = np.maximum.accumulate(last[order])
        edges = np.concatenate([[first[order][0]], last])
        gaps = np.diff(edges)
        times.append(gaps[gaps > 0] if (gaps > 0).any() else np.array([edges[-1] - edges[0]]))
    return times
