"""Live job summaries and hang detection over constructed span frames."""
from __future__ import annotations

import pandas as pd
import pytest

from gpuwatch.collector.live import detect_hangs, job_summaries
from gpuwatch.core.errors import UserError

T0 = 1.7e15  # epoch µs
STEP_US = 100_000.0


def _row(rank, step, kind, name, start, dur, seq=-1, pg="0", job="j", peer=-1):
    return {"job_id": job, "rank": rank, "step": step, "kind": kind, "name": name, "start_us": start,
            "dur_us": dur, "process_group": pg, "seq": seq, "bytes": 1024, "world_size": 4,
            "node": f"node{rank // 2}", "peer": peer}


def _healthy(steps: int, ranks: int = 4, job: str = "j", slow_rank: int | None = None) -> list[dict]:
    """Each step: compute, then one all_reduce whose start waits for the slowest rank."""
    rows = []
    for s in range(steps):
        t = T0 + s * STEP_US
        arrive = {r: t + (60_000 if r == slow_rank else 40_000) for r in range(ranks)}
        last = max(arrive.values())
        for r in range(ranks):
            rows.append(_row(r, s, "step", "step", t, STEP_US, s, "", job))
            rows.append(_row(r, s, "collective", "all_reduce", arrive[r], last + 20_000 - arrive[r], s, "0", job))
    return rows


def test_summaries_give_steps_rate_and_lost_fraction_per_job():
    frame = pd.DataFrame(_healthy(20) + _healthy(5, ranks=2, job="k"))
    now = T0 + 20 * STEP_US
    summaries = {s["job_id"]: s for s in job_summaries(frame, now)}
    j = summaries["j"]
    assert (j["ranks"], j["nodes"], j["world_size"], j["steps"]) == (4, ["node0", "node1"], 4, 20)
    assert j["step_rate"] == pytest.approx(10.0) and j["step_time_s"] == pytest.approx(0.1)
    assert j["last_step_age_s"] == pytest.approx(0.0) and not j["finished"]
    # the probe has no compute rows: compute = step minus communication; 20 ms all-reduce per 100 ms step
    assert j["lost_fraction"] == pytest.approx(0.2, abs=0.01)
    assert summaries["k"]["steps"] == 5 and summaries["k"]["ranks"] == 2


def test_no_hang_while_ranks_progress_or_after_they_finished():
    rows = _healthy(10)
    now = T0 + 10 * STEP_US
    assert detect_hangs(pd.DataFrame(rows), now + 1e6, threshold_s=5) == []
    ended = rows + [_row(r, 10, "end", "close", now, 0.0) for r in range(4)]
    assert detect_hangs(pd.DataFrame(ended), now + 60e6, threshold_s=5) == []


def test_ranks_behind_their_peers_are_the_stuck_ones():
    rows = _healthy(10)
    # ranks 0, 1, 3 complete one more all_reduce (seq 10); rank 2 never reports it
    t = T0 + 10 * STEP_US
    rows += [_row(r, 10, "collective", "all_reduce", t + 40_000, 30_000, 10) for r in (0, 1, 3)]
    hangs = detect_hangs(pd.DataFrame(rows), t + 120e6, threshold_s=60)
    assert len(hangs) == 1
    hang = hangs[0]
    assert hang["culprits"] == [2] and hang["stalled_ranks"] == [0, 1, 2, 3]
    stuck = {e["rank"]: e for e in hang["stuck"]}
    assert (stuck[2]["state"], stuck[2]["op"], stuck[2]["seq"], stuck[2]["node"]) == ("behind", "all_reduce", 10,
                                                                                      "node1")
    assert "rank(s) 2" in hang["summary"] and "all_reduce" in hang["summary"]
    assert detect_hangs(pd.DataFrame(rows), t + 30e6, threshold_s=60) == []


def test_when_all_are_level_the_rank_that_never_arrived_is_named():
    rows = _healthy(10)
    t = T0 + 10 * STEP_US
    # ranks 0, 1, 2 are inside all_gather seq 10 (reported running); rank 3 never started it
    rows += [_row(r, 10, "collective", "all_gather", t + 40_000, -1.0, 10) for r in (0, 1, 2)]
    # a running row that later completed must not count
    rows += [_row(3, 9, "collective", "all_reduce", T0 + 9 * STEP_US + 40_000, -1.0, 9)]
    hang = detect_hangs(pd.DataFrame(rows), t + 600e6, threshold_s=300)[0]
    assert hang["culprits"] == [3]
    states = {e["rank"]: (e["state"], e["op"], e["seq"]) for e in hang["stuck"]}
    assert states == {0: ("waiting", "all_gather", 10), 1: ("waiting", "all_gather", 10),
                      2: ("waiting", "all_gather", 10), 3: ("absent", "all_gather", 10)}
    assert hang["stalled_s"] == pytest.approx(600, abs=1)


def test_pipeline_rank_waiting_on_a_silent_peer_points_at_the_peer():
    rows = [_row(r, 0, "step", "step", T0, STEP_US, 0, "") for r in (0, 1)]
    rows.append(_row(1, 1, "p2p", "recv", T0 + STEP_US, -1.0, 5, peer=0))
    hang = detect_hangs(pd.DataFrame(rows), T0 + 100e6, threshold_s=10)[0]
    assert hang["culprits"] == [0]
    states = {e["rank"]: e["state"] for e in hang["stuck"]}
    assert states == {0: "silent", 1: "waiting"}


def test_missing_columns_are_named():
    with pytest.raises(UserError, match="missing column.*process_group"):
        detect_hangs(pd.DataFrame([{"job_id": "j", "rank": 0}]).assign(step=0, kind="step", name="", start_us=0.0,
                                                                      dur_us=1.0, seq=0, node=""), 0, 1)
