"""Real multi-process torch.distributed (gloo, CPU) jobs with the probe on, received by a real ProbeListener."""
from __future__ import annotations

import time
from collections import defaultdict

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import pandas as pd  # noqa: E402

import gpuwatch.probe  # noqa: E402
from gpuwatch.efficiency.engine import analyze  # noqa: E402
from gpuwatch.collector.live import detect_hangs, job_summaries  # noqa: E402
from gpuwatch.efficiency.traces.spans import timelines_from_spans  # noqa: E402
from gloo_jobs import PIPELINE_STEPS, finish_rank, init_rank, pipeline_worker, run_job  # noqa: E402

STEPS = 4
SLOW_RANK = 3
SLOW_S = 0.15


def collectives_worker(rank: int, world: int, port: int, sock: str, out_dir: str) -> None:
    init_rank(rank, world, port)
    pair = dist.new_group([0, 1])
    probe = gpuwatch.probe.start(job="job-coll", endpoint=sock)
    for _ in range(STEPS):
        if rank == SLOW_RANK:
            time.sleep(SLOW_S)  # this rank's compute phase is slow on purpose
        dist.all_reduce(torch.ones(256))                                       # 1024 B
        dist.all_gather([torch.zeros(16) for _ in range(world)], torch.full((16,), float(rank)))  # 64 B
        dist.broadcast(torch.zeros(8, dtype=torch.float64), src=0)             # 64 B
        dist.all_reduce(torch.ones(4), async_op=True).wait()                   # 16 B, future callback
        dist.all_reduce(torch.ones(2), group=pair)                             # ranks 0, 1 only
        probe.step()
    finish_rank(probe, out_dir, rank, {"pair_group": dist.distributed_c10d._get_process_group_name(pair)})


def _by_rank(rows: list[dict], kind: str) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = defaultdict(list)
    for row in rows:
        if row["kind"] == kind and row["dur_us"] >= 0:
            out[row["rank"]].append(row)
    for rank_rows in out.values():
        rank_rows.sort(key=lambda r: (r["process_group"], r["seq"]))
    return out


@pytest.mark.slow
def test_collectives_of_four_ranks_align_and_show_the_slow_rank(tmp_path):
    world = 4
    results, rows = run_job(collectives_worker, world, tmp_path)
    for result in results.values():
        stats = result["stats"]
        assert stats["steps"] == STEPS and stats["dropped"] == 0 and stats["errors"] == 0
        assert stats["sent"] == stats["records"] > 0
    assert {r["job_id"] for r in rows} == {"job-coll"} and {r["world_size"] for r in rows} == {world}

    steps = _by_rank(rows, "step")
    assert ({rank: [r["step"] for r in rs] for rank, rs in steps.items()}
            == {r: list(range(STEPS)) for r in range(world)})

    colls = _by_rank(rows, "collective")
    pair_pg = results[0]["pair_group"]
    expected = ["all_reduce", "all_gather", "broadcast", "all_reduce"] * STEPS
    sizes = {0: 1024, 1: 64, 2: 64, 3: 16}
    by_seq: dict[int, dict[int, dict]] = defaultdict(dict)
    for rank in range(world):
        default = [r for r in colls[rank] if r["process_group"] == "0"]
        assert [r["seq"] for r in default] == list(range(4 * STEPS))
        assert [r["name"] for r in default] == expected
        assert [r["bytes"] for r in default] == [sizes[i % 4] for i in range(4 * STEPS)]
        assert [r["step"] for r in default] == [i // 4 for i in range(4 * STEPS)]
        for r in default:
            by_seq[r["seq"]][rank] = r
        pair = [r for r in colls[rank] if r["process_group"] == pair_pg]
        assert [r["seq"] for r in pair] == (list(range(STEPS)) if rank in (0, 1) else [])

    # the slow rank arrives last at each step's first all_reduce; its peers wait there for it
    for step in range(STEPS):
        instance = by_seq[4 * step]
        starts = {rank: r["start_us"] for rank, r in instance.items()}
        assert max(starts, key=starts.get) == SLOW_RANK
        # Orders, not durations: the slow rank's own collective is the shortest (its peers were already
        # there), each peer waited at least part of the slow rank's sleep (a sleep only gets longer on a loaded
        # machine) and ended after the slow rank arrived.
        slow = instance[SLOW_RANK]["dur_us"]
        for rank, r in instance.items():
            if rank != SLOW_RANK:
                assert slow < r["dur_us"]
                assert r["dur_us"] > SLOW_S * 1e6 / 2
                assert r["start_us"] + r["dur_us"] >= starts[SLOW_RANK]

    # the same rows through the collector's live view and the efficiency engine: the peers' wait is comm_wait
    frame = pd.DataFrame(rows)
    now_us = time.time() * 1e6
    summary = job_summaries(frame, now_us)[0]
    assert summary["steps"] == STEPS and summary["finished"] and summary["ranks"] == world
    assert 0 < summary["lost_fraction"] < 1
    assert detect_hangs(frame, now_us + 3600e6, threshold_s=60) == []
    doc = analyze(timelines_from_spans(frame[frame["kind"] != "end"])).to_json()
    wait = {r["rank"]: r["breakdown_us"]["comm_wait"] for r in doc["ranks"]}
    assert all(wait[rank] > STEPS * SLOW_S * 1e6 / 2 for rank in range(world) if rank != SLOW_RANK)
    assert wait[SLOW_RANK] < min(wait[rank] for rank in range(world) if rank != SLOW_RANK) / 3


@pytest.mark.slow
def test_pipeline_p2p_rows_name_their_peer(tmp_path):
    results, rows = run_job(pipeline_worker, 2, tmp_path)
    for result in results.values():
        assert result["stats"]["steps"] == PIPELINE_STEPS and result["stats"]["dropped"] == 0
    p2p = _by_rank(rows, "p2p")
    for rank in (0, 1):
        other = 1 - rank
        mine = p2p[rank]
        assert {r["peer"] for r in mine} == {other}
        assert sorted({r["seq"] for r in mine}) == list(range(4 * PIPELINE_STEPS))  # 3 ops + 1 batch per step
        batches = [r for r in mine if r["seq"] % 4 == 3]
        assert sorted(r["name"] for r in batches) == ["recv"] * PIPELINE_STEPS + ["send"] * PIPELINE_STEPS
        assert all(r["bytes"] == 32 for r in batches)
    names = {rank: [r["name"] for r in p2p[rank] if r["seq"] % 4 != 3] for rank in (0, 1)}
    assert names[0] == ["send", "recv", "recv"] * PIPELINE_STEPS
    assert names[1] == ["recv", "send", "send"] * PIPELINE_STEPS
    assert all(r["bytes"] == 128 for rank in (0, 1) for r in p2p[rank] if r["seq"] % 4 != 3)
    # rank 0 waited > stall_report_s in the final barrier: reported once while running, then completed
    barrier = [r for r in rows if r["rank"] == 0 and r["name"] == "barrier"]
    assert sorted(r["dur_us"] for r in barrier)[0] == -1.0 and len(barrier) == 2
    assert max(r["dur_us"] for r in barrier) > 0.5e6
