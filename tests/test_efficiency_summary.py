"""Ranks reduced to summaries where they are read (efficiency/summary.py) give the analysis of their
timelines: on the shared real traces and on constructed multi-rank jobs (waits overlapping compute, several
streams, p2p pairs, ranks summarised on different "nodes" and sent as bytes), the breakdown equals the
partition made with every timeline at hand, and the what-if's single walk equals each replay walked alone.
End to end: `submit-trace --summarize` from two nodes to a real collector on loopback, on both stores."""
from __future__ import annotations

import os

import numpy as np
import orjson
import pytest

from gpuwatch.apps import cli
from gpuwatch.apps.breakdown_cli import fetch_breakdown, submit_traces
from gpuwatch.collector.breakdowns import BreakdownService
from gpuwatch.collector.client import connect
from gpuwatch.collector.server import serve
from gpuwatch.core.errors import UserError
from gpuwatch.core.settings import local_collector
from gpuwatch.efficiency import RankTimeline, analyze, load_paths, whatif
from gpuwatch.efficiency.engine import analyze_summaries
from gpuwatch.efficiency.matching import collectives_of, match_collectives
from gpuwatch.efficiency.partition import CATEGORIES
from gpuwatch.efficiency.summary import decode, encode, summarize, summarize_paths
from gpuwatch.efficiency.timeline import COLLECTIVE, COMPUTE, MEMCPY, P2P
from helpers import KINETO_DATA, STORE_KINDS, store_url

SHARED = sorted(d for d in os.listdir(KINETO_DATA) if os.path.isdir(os.path.join(KINETO_DATA, d)))


def _assert_partitions_match(doc: dict, full) -> None:
    """The document's rank breakdowns (from summaries) equal the partitions made from whole timelines with
    their waits (`keep_segments`), in every category, per rank and per step."""
    assert full.partitions is not None
    for rank, part in zip(doc["ranks"], full.partitions):
        assert rank["breakdown_us"] == {c: float(v) / 1000.0 for c, v in zip(CATEGORIES, part.totals_ns)}
        steps = [(s.step, {c: float(v) / 1000.0 for c, v in zip(CATEGORIES, s.totals_ns)}) for s in part.steps]
        assert [(s["step"], s["breakdown_us"]) for s in rank["per_step"]] == steps


@pytest.mark.parametrize("folder", SHARED)
def test_summaries_give_the_full_analysis_on_shared_traces(folder):
    path = os.path.join(KINETO_DATA, folder)
    doc = analyze_summaries(decode(encode(summarize_paths([path]))), per_step=True).to_json()
    full = analyze(load_paths([path]), per_step=True, keep_segments=True)
    assert doc == full.to_json()
    _assert_partitions_match(doc, full)


def _job(ranks: int, steps: int, seed: int, *, pipeline: bool = False) -> list[RankTimeline]:
    """A constructed job: per rank and step, compute kernels on two streams, a memcpy, and an all-reduce per
    step that starts while the rank's last kernels still run (so a rank's wait overlaps its own compute) and
    ends a common transfer after the last rank arrives; a slow rank; with `pipeline`, p2p sends and receives
    between neighbouring ranks paired by group and seq."""
    rng = np.random.default_rng(seed)
    rows: list[list[tuple]] = [[] for _ in range(ranks)]
    t = 0.0
    for step in range(steps):
        arrive = []
        for r in range(ranks):
            at = t + rng.uniform(0, 40)
            for k in range(int(rng.integers(3, 7))):
                d = rng.uniform(20, 400) * (1.6 if r == ranks - 1 else 1.0)
                rows[r].append((at, d, COMPUTE, 7 + k % 2, f"k{k % 3}", step, "", "", -1))
                at += d * rng.uniform(0.5, 1.05)
            rows[r].append((at, rng.uniform(5, 30), MEMCPY, 9, "copy", step, "", "", -1))
            if pipeline and r + 1 < ranks:
                rows[r].append((at, rng.uniform(20, 60), P2P, 30, "sendrecv", step, "send", f"pp{r}", step))
            if pipeline and r > 0:
                rows[r].append((at - 30, rng.uniform(40, 90), P2P, 30, "sendrecv", step, "recv", f"pp{r - 1}", step))
            arrive.append(at - rng.uniform(0, 60))
        end = max(arrive) + rng.uniform(80, 120)
        for r in range(ranks):
            rows[r].append((arrive[r], end - arrive[r], COLLECTIVE, 20, "ncclAllReduce", step, "all_reduce", "dp",
                            step))
        t = end + rng.uniform(5, 50)
    groups = {"dp": list(range(ranks)), **{f"pp{r}": [r, r + 1] for r in range(ranks - 1)}}
    out = []
    for r in range(ranks):
        rr = rows[r]
        names = sorted({x[4] for x in rr})
        types = sorted({x[6] for x in rr if x[6]})
        pgs = sorted({x[7] for x in rr if x[7]})
        start = np.array([x[0] for x in rr])
        out.append(RankTimeline.build(
            r, start, start + np.array([x[1] for x in rr]), np.array([x[2] for x in rr]),
            launch_us=start - rng.uniform(-20, 5, len(rr)), step=np.array([x[5] for x in rr]),
            stream=np.array([x[3] for x in rr]), name=np.array([names.index(x[4]) for x in rr]),
            coll_type=np.array([types.index(x[6]) if x[6] else -1 for x in rr]),
            process_group=np.array([pgs.index(x[7]) if x[7] else -1 for x in rr]),
            seq=np.array([x[8] for x in rr]), names=names, coll_types=types, process_groups=pgs,
            group_ranks={g: groups[g] for g in pgs}, world_size=ranks, source=f"constructed rank {r}"))
    return out


JOBS = [(2, 3, 1, False), (4, 5, 2, False), (5, 4, 3, True), (8, 3, 4, True)]


@pytest.mark.parametrize("ranks,steps,seed,pipeline", JOBS)
def test_summaries_from_separate_nodes_give_the_full_analysis(ranks, steps, seed, pipeline):
    timelines = _job(ranks, steps, seed, pipeline=pipeline)
    full = analyze(timelines, per_step=True, keep_segments=True)
    doc = full.to_json()
    assert doc["matched_collectives"] == steps and doc["job"]["breakdown_us"]["comm_wait"] > 0
    _assert_partitions_match(doc, full)
    # Each "node" reduces its own ranks and sends bytes; the ranks meet only as summaries.
    half = ranks // 2
    nodes = [encode([summarize(tl) for tl in part]) for part in (timelines[half:], timelines[:half])]
    joined = analyze_summaries([s for blob in nodes for s in decode(blob)], per_step=True).to_json()
    assert joined == doc


@pytest.mark.parametrize("ranks,steps,seed,pipeline", JOBS)
def test_one_walk_attributes_as_one_replay_per_rank(ranks, steps, seed, pipeline):
    """The spec's attribution replays the job once per rank (that rank actual, all else ideal); the
    what-if walks them together: each rank's slowdown equals its own replay walked alone."""
    timelines = _job(ranks, steps, seed, pipeline=pipeline)
    w = analyze(timelines).to_json()["what_if"]
    collectives = [collectives_of(tl) for tl in timelines]
    graph = whatif._join([whatif.rank_graph(tl, c, peers=True) for tl, c in zip(timelines, collectives)],
                         match_collectives(collectives))
    assert graph is not None

    def mean_step(durations: np.ndarray) -> float:
        first, last = whatif._simulate(graph, lambda i: durations[[i]], 1, None)
        return float(whatif._step_times(first, last)[0].mean())

    ideal = mean_step(graph.typical)
    assert w["ideal_step_us"] == round(ideal, 3)
    for pos, entry in enumerate(w["per_rank"]):
        alone = np.where(graph.node_rank == pos, graph.actual, graph.typical)
        assert entry["slowdown"] == round(mean_step(alone) / ideal, 4)
    assert max(w["per_rank"], key=lambda e: e["slowdown"])["rank"] == ranks - 1  # the slow rank


def test_damaged_summary_is_refused_in_one_line():
    blob = encode([summarize(_job(2, 2, 5)[0])])
    for bad in (b"not a summary", blob[:len(blob) // 2]):
        with pytest.raises(UserError) as err:
            decode(bad, "node7.summary")
        assert "node7.summary" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_nodes_submit_summaries_and_the_collector_joins_them(kind, tmp_path, capsys):
    """Two nodes each reduce their own rank of a real two-rank trace and send only the summary; the
    collector's breakdown is `analyze` of both traces; a whole trace submitted later for one rank replaces
    that rank's summary and the result is the same."""
    server = serve(local_collector(store_url(kind, tmp_path), max_workers=8),
                   query_handlers=BreakdownService().handlers())
    try:
        stub = connect(server.address)
        folder = os.path.join(KINETO_DATA, "sampled_2ranks_of128")
        ranks = [os.path.join(folder, f"rank{r}.json.gz") for r in (0, 1)]
        expected = orjson.loads(orjson.dumps(analyze(load_paths(ranks), per_step=True).to_json()))
        first = submit_traces(stub, "S", [ranks[0]], summarize=True)
        assert [r["rank"] for r in first["ranks"]] == [0]
        assert cli.main(["submit-trace", "--summarize", "--job", "S", ranks[1], "--collector", server.address]) == 0
        assert "2 rank(s) analysed" in capsys.readouterr().err
        doc = fetch_breakdown(stub, "S", per_step=True)
        assert doc.pop("source") == "traces"
        assert doc == expected
        submit_traces(stub, "S", [ranks[1]])  # the whole trace of rank 1 replaces its summary
        again = fetch_breakdown(stub, "S", per_step=True)
        again.pop("source")
        assert again == expected
        assert server.store.traced_jobs()[0]["ranks"] == 2
    finally:
        server.stop()
