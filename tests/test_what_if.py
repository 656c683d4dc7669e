"""The what-if (spec efficiency.md, "What-if") on constructed jobs whose ideal step time is known by
construction: a balanced job (slowdown 1.0), one rank slowed by a known factor, a pipeline with a stage
imbalance (p2p paired by process group and seq), host launch delays; and the replay check (replaying the
actual durations reproduces the actual step times) on all of them and on a real trace."""
from __future__ import annotations

import os

import numpy as np
import pytest

from gpuwatch.efficiency import RankTimeline, analyze, load_paths, whatif
from gpuwatch.efficiency.matching import collectives_of, match_collectives
from gpuwatch.efficiency.timeline import COLLECTIVE, COMPUTE, P2P
from gpuwatch.efficiency.words import ROUGH_REPLAY_ERROR, what_if_lines
from helpers import KINETO_DATA

DATA = KINETO_DATA

# Activity columns of the constructed timelines: (start, dur, kind, stream, name, step, coll_type, group, seq)
STREAM_COMPUTE, STREAM_COMM, STREAM_P2P = 7, 20, 30


def _timeline(rank: int, rows: list[tuple], *, world: int, launch_lead: float = 1.0,
              launch: list[float] | None = None, group_ranks: dict | None = None) -> RankTimeline:
    start = np.array([r[0] for r in rows], dtype=float)
    dur = np.array([r[1] for r in rows], dtype=float)
    names = sorted({r[4] for r in rows})
    types = sorted({r[6] for r in rows if r[6]})
    groups = sorted({r[7] for r in rows if r[7]})
    return RankTimeline.build(
        rank, start, start + dur, np.array([r[2] for r in rows]),
        launch_us=np.array(launch) if launch is not None else start - launch_lead,
        step=np.array([r[5] for r in rows]), stream=np.array([r[3] for r in rows]),
        name=np.array([names.index(r[4]) for r in rows]),
        coll_type=np.array([types.index(r[6]) if r[6] else -1 for r in rows]),
        process_group=np.array([groups.index(r[7]) if r[7] else -1 for r in rows]),
        seq=np.array([r[8] for r in rows]), names=names, coll_types=types, process_groups=groups,
        group_ranks=group_ranks or {}, world_size=world, source=f"constructed rank {rank}",
    )


def _data_parallel(compute_us: list[float], transfer_us: float = 3000.0, steps: int = 6) -> list[RankTimeline]:
    """Each step: one compute kernel per rank, then an all-reduce that ends `transfer_us` after the last
    rank arrives (as NCCL does); the next step starts when it ends."""
    rows: list[list[tuple]] = [[] for _ in compute_us]
    t = 0.0
    for step in range(steps):
        last = t + max(compute_us)
        for r, c in enumerate(compute_us):
            rows[r].append((t, c, COMPUTE, STREAM_COMPUTE, "gemm", step, "", "", -1))
            rows[r].append((t + c, last + transfer_us - (t + c), COLLECTIVE, STREAM_COMM, "ncclAllReduce", step,
                            "all_reduce", "dp", step))
        t = last + transfer_us
    return [_timeline(r, rows[r], world=len(compute_us)) for r in range(len(compute_us))]


def test_balanced_job_has_no_slowdown_and_replays_exactly():
    w = analyze(_data_parallel([10_000.0] * 4)).to_json()["what_if"]
    assert w["slowdown"] == pytest.approx(1.0, abs=1e-4)
    assert w["replay_error"] == pytest.approx(0.0, abs=1e-4)
    assert w["actual_step_us"] == pytest.approx(13_000.0)
    assert w["ideal_step_us"] == pytest.approx(13_000.0)
    assert all(r["share"] is None and r["slowdown"] == pytest.approx(1.0, abs=1e-4) for r in w["per_rank"])


@pytest.mark.parametrize("factor", [1.5, 2.0])
def test_one_rank_slowed_by_a_known_factor(factor):
    c, transfer, ranks = 10_000.0, 3_000.0, 4
    compute = [c] * (ranks - 1) + [c * factor]
    w = analyze(_data_parallel(compute, transfer)).to_json()["what_if"]
    ideal = np.mean(compute) + transfer  # every "gemm" at the job's mean, the all-reduce at its transfer time
    assert w["ideal_step_us"] == pytest.approx(ideal)
    assert w["slowdown"] == pytest.approx((c * factor + transfer) / ideal, abs=1e-4)
    assert w["replay_error"] == pytest.approx(0.0, abs=1e-4)
    by_rank = {r["rank"]: r for r in w["per_rank"]}
    assert by_rank[ranks - 1]["share"] == pytest.approx(1.0, abs=1e-4)  # the slow rank alone explains it all
    assert all(by_rank[r]["share"] == pytest.approx(0.0, abs=1e-4) for r in range(ranks - 1))
    kinds = {k["kind"]: k for k in w["per_op_kind"]}
    assert kinds["compute"]["share"] == pytest.approx(1.0, abs=1e-4)
    assert kinds["collective"]["share"] == pytest.approx(0.0, abs=1e-4)


def _pipeline(stage_us: tuple[float, float], micro: int = 4, transfer: float = 2_000.0, steps: int = 4,
              with_seq: bool = True):
    """Two pipeline stages, forward only: stage 0 computes each micro-batch and sends it (p2p, group
    "pp" = ranks 0 and 1); stage 1 receives it (the receive ends `transfer` after both sides started) and
    computes it; an all-reduce over both ends the step. Returns the timelines and the step time."""
    c0, c1 = stage_us
    rows: list[list[tuple]] = [[], []]
    t, seq = 0.0, 0
    for step in range(steps):
        free0, free1 = t, t
        for _ in range(micro):
            rows[0].append((free0, c0, COMPUTE, STREAM_COMPUTE, "layer", step, "", "", -1))
            send_start = free0 + c0
            recv_start = free1
            done = max(send_start, recv_start) + transfer
            s = seq if with_seq else -1
            rows[0].append((send_start, done - send_start, P2P, STREAM_P2P, "ncclSendRecv", step, "send", "pp", s))
            rows[1].append((recv_start, done - recv_start, P2P, STREAM_P2P, "ncclSendRecv", step, "recv", "pp", s))
            rows[1].append((done, c1, COMPUTE, STREAM_COMPUTE, "layer", step, "", "", -1))
            free0, free1, seq = send_start, done + c1, seq + 1
        arrive0, arrive1 = free0, free1
        end = max(arrive0, arrive1) + transfer
        rows[0].append((arrive0, end - arrive0, COLLECTIVE, STREAM_COMM, "ncclAllReduce", step, "all_reduce", "dp",
                        step))
        rows[1].append((arrive1, end - arrive1, COLLECTIVE, STREAM_COMM, "ncclAllReduce", step, "all_reduce", "dp",
                        step))
        t = end
    groups = {"pp": [0, 1], "dp": [0, 1]}
    return [_timeline(r, rows[r], world=2, group_ranks=groups) for r in range(2)], t / steps


@pytest.mark.parametrize("with_seq", [True, False])
def test_pipeline_stage_imbalance(with_seq):
    timelines, actual = _pipeline((14_000.0, 6_000.0), with_seq=with_seq)
    _, balanced = _pipeline((10_000.0, 10_000.0))  # both stages at the mean "layer" duration
    w = analyze(timelines).to_json()["what_if"]
    assert w["actual_step_us"] == pytest.approx(actual)
    assert w["replay_error"] == pytest.approx(0.0, abs=1e-4)
    assert w["ideal_step_us"] == pytest.approx(balanced)
    assert w["slowdown"] == pytest.approx(actual / balanced, abs=1e-4)
    assert w["slowdown"] > 1.05
    # Attribution: one stage at its measured duration, the other at the mean, also known by construction.
    by_rank = {r["rank"]: r["slowdown"] for r in w["per_rank"]}
    assert by_rank[0] == pytest.approx(_pipeline((14_000.0, 10_000.0))[1] / balanced, abs=1e-4)
    assert by_rank[1] == pytest.approx(_pipeline((10_000.0, 6_000.0))[1] / balanced, abs=1e-4)
    assert by_rank[0] > w["slowdown"] > by_rank[1]


def test_launch_delays_are_replayed_then_removed():
    """A host stall before every step's first kernel: the replay with launch delays reproduces the step
    time, the replay without them is shorter by the stall, and no op is slower than typical (1.0)."""
    stall = 4_000.0
    rows, launch, t = [], [], 0.0
    for step in range(5):
        t += stall
        rows.append((t, 10_000.0, COMPUTE, STREAM_COMPUTE, "gemm", step, "", "", -1))
        launch.append(t)  # launched when it ran: the GPU waited for the host
        t += 10_000.0
    w = analyze([_timeline(0, rows, world=1, launch=launch)]).to_json()["what_if"]
    assert w["replay_error"] == pytest.approx(0.0, abs=1e-4)
    actual = (10_000.0 + 4 * 14_000.0) / 5  # a step runs from the previous step's end (the first: its start)
    assert w["actual_step_us"] == pytest.approx(actual)
    assert w["no_launch_delay_step_us"] == pytest.approx(10_000.0)
    assert w["actual_over_no_launch_delay"] == pytest.approx(actual / 10_000.0, abs=1e-4)
    assert w["slowdown"] == pytest.approx(1.0, abs=1e-4)


def test_a_replay_that_misses_the_steps_is_called_rough():
    """Host stalls the trace cannot explain (no launch records): the replay closes the gaps, misses the
    measured steps, and the report says the what-if is rough; an exact replay draws no such line."""
    rows, t = [], 0.0
    for step in range(5):
        t += 4_000.0  # the GPU idles, and nothing in the trace says why
        rows.append((t, 10_000.0, COMPUTE, STREAM_COMPUTE, "gemm", step, "", "", -1))
        t += 10_000.0
    rough = analyze([_timeline(0, rows, world=1, launch=[float("nan")] * len(rows))])
    assert rough.what_if.replay_error > ROUGH_REPLAY_ERROR
    assert any(line.strip().startswith("caution: replaying") for line in what_if_lines(rough.what_if))
    exact = analyze(_data_parallel([10_000.0, 12_000.0]))
    assert exact.what_if.replay_error < 1e-4
    assert not any("caution" in line for line in what_if_lines(exact.what_if))


def test_real_trace_replay_is_close_and_slowdown_at_least_one():
    doc = analyze(load_paths([os.path.join(DATA, "control_rank3_of8")])).to_json()
    w = doc["what_if"]
    assert w["slowdown"] >= 1.0 and w["ops"] == doc["window"]["activities"]
    assert w["steps"] == 6
    assert w["replay_error"] < 0.05  # the dependency graph of a real trace reproduces its step times


def _crossed_collectives(steps: int = 3) -> list[RankTimeline]:
    """Two ranks that run the all-reduces of process groups "a" and "b" in opposite orders, each on one
    stream: the what-if's graph holds a cycle in every step."""
    rows: list[list[tuple]] = [[], []]
    t = 0.0
    for step in range(steps):
        for r, order in enumerate((("a", "b"), ("b", "a"))):
            rows[r].append((t, 5_000.0 + 1_000.0 * r, COMPUTE, STREAM_COMPUTE, "gemm", step, "", "", -1))
            for i, group in enumerate(order):
                rows[r].append((t + 7_000.0 + 2_000.0 * i, 2_000.0, COLLECTIVE, STREAM_COMM, "ncclAllReduce", step,
                                "all_reduce", group, step))
        t += 12_000.0
    groups = {"a": [0, 1], "b": [0, 1]}
    return [_timeline(r, rows[r], world=2, group_ranks=groups) for r in range(2)]


def test_crossed_collectives_are_replayed():
    """The cycle is broken (the instance that began first closes with the ranks that arrived): a finite
    result with both ranks attributed, not a hang."""
    w = analyze(_crossed_collectives()).to_json()["what_if"]
    assert w["steps"] == 3 and [r["rank"] for r in w["per_rank"]] == [0, 1]
    assert all(np.isfinite([w["slowdown"], w["replay_error"], w["ideal_step_us"]]))


def _graph(timelines: list[RankTimeline]) -> whatif._Graph:
    """The job's what-if graph, joined from its ranks' parts as the engine joins them."""
    ordered = sorted(timelines, key=lambda tl: tl.rank)
    collectives = [collectives_of(tl) for tl in ordered]
    parts = [whatif.rank_graph(tl, c, peers=len(ordered) > 1) for tl, c in zip(ordered, collectives)]
    graph = whatif._join(parts, match_collectives(collectives))
    assert graph is not None
    return graph


@pytest.mark.parametrize("job", ["crossed", "pipeline", "control_rank3_of8"])
def test_replays_walked_together_equal_each_walked_alone(job):
    """The what-if walks all its replays at once, a node's times a vector (attributing R ranks is R
    replays), and drops a node's times once its waiters have started: each column must come out as that
    replay walked alone, cycles included."""
    timelines = {"crossed": _crossed_collectives, "pipeline": lambda: _pipeline((14_000.0, 6_000.0))[0],
                 "control_rank3_of8": lambda: load_paths([os.path.join(DATA, "control_rank3_of8")])}[job]()
    graph = _graph(timelines)
    rng = np.random.default_rng(7)
    dur = rng.uniform(10.0, 5_000.0, (len(graph.node_start), 4))
    wait = rng.uniform(0.0, 300.0, len(graph.node_start))  # the first replay's launch delays
    first, last = whatif._simulate(graph, lambda i: dur[i], 4, wait)
    for c in range(dur.shape[1]):
        alone = whatif._simulate(graph, lambda i, c=c: dur[i, [c]], 1, wait if c == 0 else None)
        np.testing.assert_array_equal(first[:, c], alone[0][:, 0])
        np.testing.assert_array_equal(last[:, c], alone[1][:, 0])
    assert np.isfinite(last).all()


def test_attribution_walks_the_graph_once(monkeypatch):
    """An 8-rank job's 13 replays (the check, without launch delays, ideal, one per rank, one per op kind:
    compute and collective) are one walk."""
    timelines = _data_parallel([10_000.0 + 700.0 * r for r in range(8)])
    walks = []
    simulate = whatif._simulate
    monkeypatch.setattr(whatif, "_simulate", lambda *a: walks.append(a[2]) or simulate(*a))
    together = analyze(timelines).to_json()["what_if"]
    assert walks == [3 + 8 + 2]
    assert [r["slowdown"] for r in together["per_rank"]][-1] > [r["slowdown"] for r in together["per_rank"]][0]
