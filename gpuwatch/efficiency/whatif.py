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

Two halves, so a job is analysed without holding its ranks' timelines: :func:`rank_graph` reduces one rank's
timeline to its part of the graph (:class:`RankGraph`: nodes, each one op or a chain of ops run back to back
that nothing else waits on inside, with their dependencies and, per node, the durations a replay is made of,
summed per kind of op), where the trace is read; :func:`what_if` joins the ranks' parts through the matched
collectives and p2p pairs and replays them. Every replay is walked in one pass over the nodes, a node's
times a vector with one entry per replay, and a node's times are dropped once the nodes that wait for it have
started, so memory holds the replays' frontier, not the job.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import numpy as np

from gpuwatch.efficiency.arrays import distinct, median
from gpuwatch.efficiency.matching import Collectives, Matching
from gpuwatch.efficiency.result import KindSlowdown, RankSlowdown, WhatIf
from gpuwatch.efficiency.timeline import COLLECTIVE, KIND_NAMES, P2P, UNKNOWN, RankTimeline

DELTA_US = 1000.0


class RankGraph(msgspec.Struct):
    """One rank's part of the what-if graph. Times are microseconds after `origin_us` (the rank's first
    activity start). Per node (local ids, in the actual start order of their first op): its first op's
    start, its last op's end, step, dependencies (`deps[deps_ptr[i]:deps_ptr[i + 1]]`), the host launch
    delay before its first op and those of its other ops summed, and the actual duration of its ops (minus
    nothing: waits for peers are known only across ranks, and only candidate ops have them). Per (node, op
    label, kind) group: how many ops and their summed actual duration (what the ideal and the per-kind
    replays are made of). `comm_*`: every communication op outside a candidate, for the medians. Candidates
    (`c_*`): communication ops that may be part of a cross-rank instance, each a node of its own, with the
    collective it is in the rank's `Collectives` (`c_coll`) or its p2p pairing key (`c_p2p`)."""

    origin_us: float
    ops: int
    start: np.ndarray
    end: np.ndarray
    step: np.ndarray
    deps_ptr: np.ndarray
    deps: np.ndarray
    first_wait: np.ndarray
    inner_delay: np.ndarray
    actual: np.ndarray
    labels: list[tuple[str, Any, Any]]
    g_node: np.ndarray
    g_label: np.ndarray
    g_kind: np.ndarray
    g_count: np.ndarray
    g_sum: np.ndarray
    comm_label: np.ndarray
    comm_transfer: np.ndarray
    c_node: np.ndarray
    c_kind: np.ndarray
    c_type: list[str]
    c_listed: np.ndarray
    c_start: np.ndarray
    c_end: np.ndarray
    c_coll: np.ndarray
    c_p2p: list[str]


class _Graph(msgspec.Struct):
    """The job's graph, joined from its ranks' parts (global node ids, rank by rank)."""

    node_start: np.ndarray      # actual start of each node's first op (us, relative to the job origin)
    node_rank: np.ndarray       # index of each node's rank among the ranks
    node_step: np.ndarray       # step of each node (a node's ops share one)
    actual_steps: np.ndarray    # the measured step times (us)
    order: list[int]            # nodes in the actual start order of their first op
    deps: list[tuple[int, ...]] # nodes each node waits for
    base: list[float]           # the rank's first actual start: a node with no dependency starts there
    instance: list[int]         # cross-rank instance (collective or p2p pair) of each node, else -1
    members: list[list[int]]    # nodes of each instance
    first_wait: np.ndarray      # host launch delay before each node's first op (0 where unknown)
    inner_delay: np.ndarray     # the launch delays of each node's other ops, summed
    actual: np.ndarray          # each node's actual duration (communication: minus its wait for peers)
    typical: np.ndarray         # each node's ideal duration
    per_kind: dict[int, np.ndarray]  # per op kind present: each node with that kind's ops actual, others ideal
    ops: int


def rank_graph(tl: RankTimeline, collectives: Collectives, *, peers: bool) -> RankGraph:
    """`tl`'s part of the what-if graph. With `peers` (other ranks of the job are analysed with it), its
    matchable collectives and paired p2p ops are candidates: whether a peer has them is known only when the
    ranks are joined. Alone, no op has a peer and every op may join a chain."""
    order = np.lexsort((tl.end_us, tl.start_us))
    origin = float(tl.start_us.min())
    n = len(order)
    start, end = tl.start_us[order] - origin, tl.end_us[order] - origin
    kind = tl.kind[order]
    inverse = np.empty(n, np.int64)
    inverse[order] = np.arange(n)
    p2p = _p2p_keys(tl) if peers else []
    c_ops = np.array(([int(inverse[i]) for i in collectives.index] if peers else [])
                     + [int(inverse[idx]) for idx, _ in p2p], dtype=np.int64)
    c_coll = np.array((list(range(len(collectives.index))) if peers else []) + [-1] * len(p2p), dtype=np.int64)
    cand = np.full(n, -1, np.int64)
    cand[c_ops] = np.arange(len(c_ops))
    lane = np.where(tl.stream[order] >= 0, tl.stream[order], 1_000_000 + kind.astype(np.int64))
    op_deps, pred = _dependencies(start, end, lane)
    delay = _launch_delays(start, end, tl.launch_us[order] - origin, op_deps)
    step = tl.step[order]
    node, heads = _chains(op_deps, pred, cand < 0, step)
    m = len(heads)
    rows = op_deps[heads]
    valid = rows >= 0
    transfer = end - start - 0.0  # the same arithmetic as ops with a wait (end - start - wait)
    local = cand < 0
    node_end = np.full(m, -np.inf)
    np.maximum.at(node_end, node, end)
    label, labels, listed = _op_labels(tl, order, kind)
    comm = (kind == COLLECTIVE) | (kind == P2P)
    code = (node[local] * len(labels) + label[local]) * len(KIND_NAMES) + kind[local]
    groups, ginv = np.unique(code, return_inverse=True)
    ginv = ginv.ravel()
    types = list(tl.coll_types) + [""]
    type_id = np.where(tl.coll_type[order] >= 0, tl.coll_type[order], len(types) - 1)
    return RankGraph(
        origin_us=origin, ops=n, start=start[heads], end=node_end, step=step[heads],
        deps_ptr=np.concatenate([[0], np.cumsum(valid.sum(axis=1))]).astype(np.int64),
        deps=node[rows[valid]].astype(np.int32),
        first_wait=delay[heads], inner_delay=np.bincount(node, weights=delay, minlength=m) - delay[heads],
        actual=np.bincount(node, weights=np.where(local, transfer, 0.0), minlength=m),
        labels=labels,
        g_node=(groups // len(KIND_NAMES) // len(labels)).astype(np.int32),
        g_label=(groups // len(KIND_NAMES) % len(labels)).astype(np.int32),
        g_kind=(groups % len(KIND_NAMES)).astype(np.int8),
        g_count=np.bincount(ginv, minlength=len(groups)).astype(np.int32),
        g_sum=np.bincount(ginv, weights=transfer[local], minlength=len(groups)),
        comm_label=label[comm & local].astype(np.int32), comm_transfer=transfer[comm & local],
        c_node=node[c_ops], c_kind=kind[c_ops].astype(np.int64), c_type=[types[t] for t in type_id[c_ops]],
        c_listed=listed[c_ops], c_start=start[c_ops], c_end=end[c_ops], c_coll=c_coll,
        c_p2p=[""] * (len(c_ops) - len(p2p)) + [repr(key) for _, key in p2p],
    )


def _op_labels(tl: RankTimeline, order: np.ndarray, kind: np.ndarray
               ) -> tuple[np.ndarray, list[tuple[str, Any, Any]], np.ndarray]:
    """What counts as "the same op" for the ideal durations, per op (ops in `order`): ("op", kind, kernel
    name) for compute and memory ops, ("comm", collective type, group size) for communication (the size of
    its process group where the trace lists it, else 1: a candidate's own size is known when ranks are
    joined). Made from the timeline's small name tables, so no per-op string is made. Also each op's
    listed group size (0: not listed)."""
    sizes = np.array([len(tl.group_ranks.get(g, ())) for g in tl.process_groups] + [0])
    listed = sizes[tl.process_group[order]]
    size = np.where(listed > 0, listed, 1)
    comm = (kind == COLLECTIVE) | (kind == P2P)
    names = list(tl.names) + [""]            # an unknown id (-1) reads as the last entry, ""
    types = list(tl.coll_types) + [""]
    name_id = np.where(tl.name[order] >= 0, tl.name[order], len(names) - 1).astype(np.int64)
    type_id = np.where(tl.coll_type[order] >= 0, tl.coll_type[order], len(types) - 1).astype(np.int64)
    sizes_n = int(size.max(initial=1)) + 1
    local_code = kind.astype(np.int64) * len(names) + name_id
    comm_code = type_id * sizes_n + size
    label = np.empty(len(order), np.int64)
    labels: list[tuple[str, Any, Any]] = []
    def op_label(c: int) -> tuple[str, Any, Any]:
        return ("op", c // len(names), names[c % len(names)])

    def comm_label(c: int) -> tuple[str, Any, Any]:
        return ("comm", types[c // sizes_n], c % sizes_n)

    makers: list[tuple[np.ndarray, np.ndarray, Callable[[int], tuple[str, Any, Any]]]] = [
        (~comm, local_code, op_label), (comm, comm_code, comm_label)]
    for mask, code, make in makers:
        if not mask.any():
            continue
        uniq, inv = np.unique(code[mask], return_inverse=True)
        label[mask] = inv.ravel() + len(labels)
        labels.extend(make(int(c)) for c in uniq)
    return label, labels, listed


def what_if(graphs: list[RankGraph], ranks: list[int], matching: Matching) -> WhatIf | None:
    """The analysis's what-if from the ranks' parts (in the order `matching` numbers the ranks), None when
    there is nothing to replay."""
    graph = _join(graphs, matching)
    if graph is None:
        return None
    kinds = sorted(graph.per_kind)
    attributed = len(ranks) > 1  # one rank's attribution is its whole slowdown: no replay needed
    steps = _replay(graph, kinds, len(ranks) if attributed else 0)
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
        ops=graph.ops,
        replayed_nodes=len(graph.node_start),
        per_rank=[RankSlowdown(rank=r, slowdown=round(s, 4), share=share(s)) for r, s in per_rank.items()],
        per_op_kind=[KindSlowdown(kind=k, slowdown=round(s, 4), share=share(s)) for k, s in per_kind.items()],
    )


def _join(graphs: list[RankGraph], matching: Matching) -> _Graph | None:
    """The job's graph: the ranks' nodes in one numbering, candidates joined into instances (matched
    collectives, p2p pairs seen on two ranks), each candidate's wait for peers taken off its duration, and
    the ideal durations over all ranks."""
    if not graphs or sum(g.ops for g in graphs) == 0:
        return None
    origin = min(g.origin_us for g in graphs)
    shift = [g.origin_us - origin for g in graphs]
    offset = np.concatenate([[0], np.cumsum([len(g.start) for g in graphs])]).astype(np.int64)
    cat = np.concatenate
    node_start = cat([g.start + s for g, s in zip(graphs, shift)])
    node_end = cat([g.end + s for g, s in zip(graphs, shift)])
    node_step = cat([g.step for g in graphs])
    deps: list[tuple[int, ...]] = []
    for g, first in zip(graphs, offset.tolist()):
        flat = (g.deps + first).tolist()
        ptr = g.deps_ptr.tolist()
        deps.extend(tuple(flat[ptr[i]:ptr[i + 1]]) for i in range(len(g.start)))
    base = [s for g, s in zip(graphs, shift) for _ in range(len(g.start))]

    # Candidates: instance keys, then the instances seen twice or more.
    c_node = cat([g.c_node + first for g, first in zip(graphs, offset.tolist())])
    c_start = cat([g.c_start + s for g, s in zip(graphs, shift)])
    c_end = cat([g.c_end + s for g, s in zip(graphs, shift)])
    keys: dict[tuple[object, ...], int] = {}
    c_key = []
    for pos, g in enumerate(graphs):
        inst = matching.instance_of[pos]
        for coll, p2p in zip(g.c_coll.tolist(), g.c_p2p):
            key: tuple[object, ...] = ("p", p2p) if coll < 0 else ("c", int(inst[coll]))
            c_key.append(-1 if coll >= 0 and inst[coll] < 0 else keys.setdefault(key, len(keys)))
    c_inst = np.array(c_key, dtype=np.int64)
    size = np.bincount(c_inst[c_inst >= 0], minlength=len(keys) + 1)  # one more: indexed by -1 too
    c_inst = np.where((c_inst >= 0) & (size[np.maximum(c_inst, 0)] >= 2), c_inst, -1)
    instance = np.full(len(node_start), -1, np.int64)
    instance[c_node] = c_inst
    members: list[list[int]] = [[] for _ in keys]
    for nd, k in zip(c_node.tolist(), c_inst.tolist()):
        if k >= 0:
            members[k].append(nd)
    members = [sorted(set(m)) for m in members]
    wait = np.zeros(len(c_node))
    inside = c_inst >= 0
    if inside.any():
        latest = np.full(len(keys), -np.inf)
        np.maximum.at(latest, c_inst[inside], c_start[inside])
        wait[inside] = np.clip(latest[c_inst[inside]] - c_start[inside], 0.0, c_end[inside] - c_start[inside])
    c_transfer = c_end - c_start - wait
    listed = cat([g.c_listed for g in graphs])
    c_size = np.where(listed > 0, listed, np.where(inside, size[np.maximum(c_inst, 0)], 1))
    c_kind = cat([g.c_kind for g in graphs])

    # Labels in one numbering; the ideal: means of compute and memory ops, medians of communication.
    ids: dict[tuple[object, ...], int] = {}
    remap = [np.array([ids.setdefault(tuple(lb), len(ids)) for lb in g.labels] + [0], np.int64) for g in graphs]
    c_types = [t for g in graphs for t in g.c_type]
    c_label = np.array([ids.setdefault(("comm", t, int(s)), len(ids)) for t, s in zip(c_types, c_size.tolist())],
                       dtype=np.int64)
    g_node = cat([g.g_node + first for g, first in zip(graphs, offset.tolist())])
    g_label = cat([r[g.g_label] for g, r in zip(graphs, remap)])
    g_kind = cat([g.g_kind for g in graphs])
    g_count = cat([g.g_count for g in graphs]).astype(np.float64)
    g_sum = cat([g.g_sum for g in graphs])
    ideal = np.zeros(len(ids))
    g_comm = (g_kind == COLLECTIVE) | (g_kind == P2P)
    sums = np.bincount(g_label[~g_comm], weights=g_sum[~g_comm], minlength=len(ids))
    counts = np.bincount(g_label[~g_comm], weights=g_count[~g_comm], minlength=len(ids))
    np.divide(sums, counts, out=ideal, where=counts > 0)
    comm_label = cat([r[g.comm_label] for g, r in zip(graphs, remap)] + [c_label])
    comm_transfer = cat([g.comm_transfer for g in graphs] + [c_transfer])
    for c in distinct(comm_label):
        ideal[c] = median(comm_transfer[comm_label == c])

    n = len(node_start)
    actual = cat([g.actual for g in graphs])
    actual[c_node] = c_transfer
    typical = np.bincount(g_node, weights=g_count * ideal[g_label], minlength=n)
    typical[c_node] = ideal[c_label]
    per_kind = {}
    for k in sorted(set(distinct(g_kind).tolist()) | set(distinct(c_kind).tolist())):
        durations = np.bincount(g_node, weights=np.where(g_kind == k, g_sum, g_count * ideal[g_label]), minlength=n)
        durations[c_node] = np.where(c_kind == k, c_transfer, ideal[c_label])
        per_kind[int(k)] = durations
    first_wait = cat([g.first_wait for g in graphs])
    first, last = _bounds(node_step, node_start[:, None], node_end[:, None])
    return _Graph(
        node_start=node_start, node_rank=np.repeat(np.arange(len(graphs)), np.diff(offset)), node_step=node_step,
        actual_steps=_step_times(first, last)[0], order=np.argsort(node_start, kind="stable").tolist(), deps=deps,
        base=base, instance=instance.tolist(), members=members, first_wait=first_wait,
        inner_delay=cat([g.inner_delay for g in graphs]), actual=actual, typical=typical, per_kind=per_kind,
        ops=int(sum(g.ops for g in graphs)),
    )


def _replay(graph: _Graph, kinds: list[int], ranks: int) -> list[np.ndarray]:
    """Step times of every replay the what-if needs, in this order: actual durations with launch delays (the
    check), actual without them, ideal; then one per rank position below `ranks`, with that rank's actual
    durations and all else ideal; then one per op kind in `kinds`, likewise. A node lies on one rank, so a
    rank's replay picks whole nodes' durations; a kind's sums its ops'."""
    replays = 3 + ranks + len(kinds)
    actual, typical, inner, node_rank = graph.actual, graph.typical, graph.inner_delay, graph.node_rank.tolist()
    kind_columns = np.arange(3 + ranks, replays)
    kind_values = np.stack([graph.per_kind[k] for k in kinds], axis=1) if kinds else np.empty((len(actual), 0))

    def durations(i: int) -> np.ndarray:
        d = np.full(replays, typical[i])
        d[0] = actual[i] + inner[i]
        d[1] = actual[i]
        if ranks:
            d[3 + node_rank[i]] = actual[i]
        d[kind_columns] = kind_values[i]
        return d

    first, last = _simulate(graph, durations, replays, graph.first_wait)
    return _step_times(first, last)


def _simulate(graph: _Graph, dur_of: Callable[[int], np.ndarray], replays: int, wait_before: np.ndarray | None
              ) -> tuple[np.ndarray, np.ndarray]:
    """Replay the graph with each node's durations `dur_of(node)` (one per replay: its ops back to back, with
    the launch delays of all but the first) and, in the first replay only, the delay `wait_before` each
    node's first op waits (None: no delays): per step (rows: the known steps in order, or one row for the
    whole window when none is known) and replay (columns), the earliest start and the latest end of its
    nodes. Which node is taken when depends on the graph alone, never on the durations, so the replays are
    walked together, a node's times a vector. A node's end is kept only until every node that waits for it
    has started. Nodes are taken in their actual start order; one whose dependency is not yet known (a
    collective whose last rank comes later in that order) waits for it. If the graph holds a cycle (ranks
    that ran matched collectives in different orders), the instance that began first is closed with the
    ranks that have arrived, and later arrivals end their own transfer after max(that time, their arrival)."""
    n = len(graph.deps)
    wait_of = None if wait_before is None else wait_before.tolist()
    deps, base, instance, members = graph.deps, graph.base, graph.instance, graph.members
    row, rows = _step_rows(graph.node_step)
    first = np.full((rows, replays), np.inf)
    last = np.full((rows, replays), -np.inf)
    refs = Counter(d for ds in deps for d in ds)
    end: dict[int, np.ndarray] = {}
    started, ended = [False] * n, [False] * n
    arrived = [0] * len(members)
    latest: dict[int, np.ndarray] = {}
    closed = [False] * len(members)
    waiters: dict[int, list[int]] = {}
    stack: list[int] = []
    maximum, minimum = np.maximum, np.minimum

    def finish(m: int, t: np.ndarray) -> None:
        e = t + dur_of(m)
        ended[m] = True
        if row[m] >= 0:
            maximum(last[row[m]], e, out=last[row[m]])
        if refs[m] > 0:
            end[m] = e
        if m in waiters:
            stack.extend(waiters.pop(m))

    def run(firsts: Iterable[int]) -> None:
        """Process `firsts` in order, each with everything it unblocks (a stack of ready ops)."""
        for f in firsts:
            stack.append(f)
            while stack:
                i = stack.pop()
                blocked = False
                for d in deps[i]:
                    if not ended[d]:
                        waiters.setdefault(d, []).append(i)
                        blocked = True
                        break
                if blocked:
                    continue
                t = np.full(replays, base[i])
                for d in deps[i]:
                    maximum(t, end[d], out=t)
                    refs[d] -= 1
                    if not refs[d]:
                        del end[d]
                if wait_of is not None:
                    t[0] += wait_of[i]
                started[i] = True
                if row[i] >= 0:
                    minimum(first[row[i]], t, out=first[row[i]])
                k = instance[i]
                if k < 0:
                    finish(i, t)
                    continue
                arrived[k] += 1
                latest[k] = maximum(latest[k], t) if k in latest else t
                if closed[k]:
                    finish(i, latest[k])
                elif arrived[k] == len(members[k]):
                    for m in members[k]:
                        finish(m, latest[k])
                    del latest[k]

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
    return first, last


def _step_rows(step: np.ndarray) -> tuple[list[int], int]:
    """Row of each node among the known steps in order (-1: a node outside the known steps), and how many
    rows; no known steps: every node in one row (the whole window is one step)."""
    known = step >= 0
    if not known.any():
        return [0] * len(step), 1
    ids = distinct(step[known])
    return np.where(known, np.searchsorted(ids, step), -1).tolist(), len(ids)


def _bounds(step: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per step row (as `_step_rows` numbers them) and column of `start` and `end` (nodes x columns): the
    earliest start and the latest end."""
    row, rows = _step_rows(step)
    code = np.array(row, dtype=np.int64)
    inside = code >= 0
    first = np.full((rows, start.shape[1]), np.inf)
    last = np.full((rows, start.shape[1]), -np.inf)
    np.minimum.at(first, code[inside], start[inside])
    np.maximum.at(last, code[inside], end[inside])
    return first, last


def _step_times(first_all: np.ndarray, last_all: np.ndarray) -> list[np.ndarray]:
    """Per analysed step, the job's step time, for each column of the per-step earliest starts and latest
    ends: from the end of the previous step (the first step: its first op's start) to the last end of its
    ops on any rank. One row (no known steps): the whole window is one step."""
    times = []
    for first, last in zip(first_all.T, last_all.T):
        order = np.argsort(first, kind="stable")
        last = np.maximum.accumulate(last[order])
        edges = np.concatenate([[first[order][0]], last])
        gaps = np.diff(edges)
        times.append(gaps[gaps > 0] if (gaps > 0).any() else np.array([edges[-1] - edges[0]]))
    return times


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
