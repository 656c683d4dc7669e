"""The eight-category partition, matching and stragglers on timelines whose answer is known by construction."""
from __future__ import annotations

import numpy as np
import pytest

from gpuwatch.efficiency import CATEGORIES, RankTimeline, analyze
from gpuwatch.efficiency.timeline import COLLECTIVE, COMPUTE, MEMCPY, P2P
from gpuwatch.core.errors import UserError

T0 = 1_700_000_000_000_000.0  # an epoch-microsecond origin, as real traces have


def timeline(rank: int, rows: list[tuple], **meta) -> RankTimeline:
    """rows: (kind, start, end[, launch[, type[, step]]]) with times relative to T0."""
    types = sorted({r[4] for r in rows if len(r) > 4 and r[4]})
    col = lambda i, fill: [r[i] if len(r) > i and r[i] is not None else fill for r in rows]  # noqa: E731
    return RankTimeline.build(
        rank,
        np.array(col(1, 0.0)) + T0, np.array(col(2, 0.0)) + T0, np.array(col(0, COMPUTE)),
        launch_us=np.array(col(3, np.nan)) + T0,
        coll_type=[types.index(t) if t else -1 for t in col(4, "")],
        step=col(5, -1), coll_types=types, **meta,
    )


def breakdown(doc: dict, rank_index: int = 0) -> dict:
    entry = doc["ranks"][rank_index]
    assert sum(entry["breakdown_us"].values()) == entry["window_us"]
    return entry["breakdown_us"]


def test_gaps_either_side_of_30us_with_launch_times():
    tl = timeline(0, [
        (COMPUTE, 0, 100, -5),
        (COMPUTE, 120, 200, 90),    # gap 20 us -> small_kernel_overhead
        (COMPUTE, 250, 300, 240),   # gap 50, launched after the gap began (200) -> host_stall
        (COMPUTE, 400, 500, 150),   # gap 100, launched before the gap began (300) -> idle_other
        (COMPUTE, 530, 540, 529),   # gap exactly 30 us is not small; launched late -> host_stall
    ])
    b = breakdown(analyze([tl]).to_json())
    assert b["compute"] == 100 + 80 + 50 + 100 + 10
    assert b["small_kernel_overhead"] == 20
    assert b["host_stall"] == 50 + 30
    assert b["idle_other"] == 100
    assert sum(b.values()) == 540


def test_gaps_without_launch_times_are_idle_other():
    tl = timeline(0, [(COMPUTE, 0, 100), (COMPUTE, 120, 200), (COMPUTE, 250, 300)])
    b = breakdown(analyze([tl]).to_json())
    assert b["small_kernel_overhead"] == 20
    assert b["host_stall"] == 0
    assert b["idle_other"] == 50


def test_compute_overlapping_communication_counts_compute_and_overlap():
    tl = timeline(0, [(COMPUTE, 0, 100), (COLLECTIVE, 50, 150, None, "all_reduce")])
    entry = analyze([tl]).to_json()["ranks"][0]
    assert breakdown(analyze([tl]).to_json()) == {**dict.fromkeys(CATEGORIES, 0.0), "compute": 100.0,
                                                  "comm_transfer": 50.0}
    assert entry["comm_overlapped_us"] == 50
    assert entry["overlap_ratio"] == pytest.approx(0.5)


def test_memcpy_under_compute_is_compute():
    b = breakdown(analyze([timeline(0, [(COMPUTE, 0, 100), (MEMCPY, 50, 150)])]).to_json())
    assert (b["compute"], b["memcpy"]) == (100, 50)


def test_p2p_is_bubble_and_collective_takes_precedence_over_p2p():
    tl = timeline(0, [(P2P, 0, 100, None, "send"), (COLLECTIVE, 50, 120, None, "all_reduce"), (COMPUTE, 110, 130)])
    b = breakdown(analyze([tl]).to_json())
    assert b["bubble"] == 50
    assert b["comm_transfer"] == 60
    assert b["compute"] == 20


def test_staggered_arrivals_split_wait_and_transfer():
    # All three ranks finish the all-reduce at 200; they arrive at 100, 130 and 160.
    tls = [timeline(r, [(COMPUTE, 0, s), (COLLECTIVE, s, 200, None, "all_reduce")])
           for r, s in enumerate((100, 130, 160))]
    doc = analyze(tls).to_json()
    assert doc["matched_collectives"] == 1
    waits = [breakdown(doc, i)["comm_wait"] for i in range(3)]
    transfers = [breakdown(doc, i)["comm_transfer"] for i in range(3)]
    assert waits == [60, 30, 0]
    assert transfers == [40, 40, 40]


def test_wait_is_clamped_to_the_kernel_and_single_rank_has_no_wait():
    tls = [timeline(0, [(COLLECTIVE, 0, 10, None, "all_reduce")]),
           timeline(1, [(COLLECTIVE, 50, 60, None, "all_reduce")])]
    doc = analyze(tls).to_json()
    assert breakdown(doc, 0)["comm_wait"] == 10  # max(s) - s_0 = 50, clamped to d_0 = 10
    assert breakdown(doc, 1)["comm_wait"] == 0
    single = analyze([tls[0]]).to_json()
    assert single["matched_collectives"] == 0 and breakdown(single)["comm_wait"] == 0


def test_matching_by_process_group_and_seq_beats_order():
    # Rank 1 saw seq 7 first, then seq 6: matching by seq pairs them crosswise.
    def tl(rank, starts_seqs):
        rows = [(COLLECTIVE, s, s + 50, None, "all_reduce") for s, _ in starts_seqs]
        t = timeline(rank, rows)
        t.process_groups = ["0"]
        t.process_group[:] = 0
        t.seq[:] = [q for _, q in starts_seqs]
        return t

    doc = analyze([tl(0, [(0, 6), (100, 7)]), tl(1, [(10, 7), (110, 6)])]).to_json()
    assert doc["matched_collectives"] == 2
    assert breakdown(doc, 0)["comm_wait"] == 50 + 0   # seq 6: waits for rank 1 at 110 -> clamped 50
    assert breakdown(doc, 1)["comm_wait"] == 50 + 0   # seq 7: waits for rank 0 at 100 -> clamped 50


def _job(compute_us: list[float], delay_us: list[float], steps: int = 20, jitter: float = 0.0) -> list[RankTimeline]:
    """Ranks that compute, then all-reduce together each step; delay_us idles before the compute."""
    rng = np.random.default_rng(0)
    rows = {r: [] for r in range(len(compute_us))}
    t = 0.0
    for step in range(steps):
        arrive = {}
        for r, (c, d) in enumerate(zip(compute_us, delay_us)):
            c = c + rng.uniform(-jitter, jitter)
            rows[r].append((COMPUTE, t + d, t + d + c, t + d - 1, None, step))
            arrive[r] = t + d + c
        end = max(arrive.values()) + 50
        for r in rows:
            rows[r].append((COLLECTIVE, arrive[r], end, arrive[r] - 1, "all_reduce", step))
        t = end + 5
    return [timeline(r, rs) for r, rs in rows.items()]


def test_straggler_busier_and_last():
    doc = analyze(_job([100, 100, 125, 100], [0, 0, 0, 0], jitter=2)).to_json()
    assert [s["rank"] for s in doc["stragglers"]] == [2]
    s = doc["stragglers"][0]
    assert s["last_share"] == 1.0 and s["chance_share"] == 0.25
    assert s["mean_lateness_us"] == pytest.approx(25, abs=3)
    assert s["busy_ratio"] == pytest.approx(1.25, abs=0.05)
    assert doc["delayed"] == []


def test_delayed_rank_is_late_but_not_busy():
    doc = analyze(_job([100, 100, 100, 100], [0, 0, 0, 40], jitter=2)).to_json()
    assert doc["stragglers"] == []
    assert [d["rank"] for d in doc["delayed"]] == [3]


def test_balanced_job_has_no_straggler():
    doc = analyze(_job([100, 102, 101, 99], [0, 0, 0, 0], jitter=10)).to_json()
    assert doc["stragglers"] == [] and doc["delayed"] == []


def test_per_step_slices_sum_to_their_window_and_to_the_rank():
    doc = analyze(_job([100, 120], [0, 0], steps=5), per_step=True, flops_per_step=1e9, peak_tflops=1.0,
                  gpu_hour_price=3.0).to_json()
    for entry in doc["ranks"]:
        steps = entry["per_step"]
        assert [s["step"] for s in steps] == [0, 1, 2, 3, 4]
        for s in steps:
            assert sum(s["breakdown_us"].values()) == s["window_us"]
            assert s["mfu"] == pytest.approx(1e9 / (s["window_us"] * 1e-6 * 1e12))
        assert sum(s["window_us"] for s in steps) == entry["window_us"]
        for c in CATEGORIES:
            assert sum(s["breakdown_us"][c] for s in steps) == entry["breakdown_us"][c]
    job = doc["job"]
    assert job["lost_gpu_hours"] == pytest.approx(job["lost_us"] / 3.6e9)
    assert job["lost_cost"] == pytest.approx(3.0 * job["lost_gpu_hours"])


def test_short_kernels_counted():
    doc = analyze([timeline(0, [(COMPUTE, 0, 5), (COMPUTE, 5, 14), (COMPUTE, 20, 40), (MEMCPY, 40, 42)])]).to_json()
    assert doc["ranks"][0]["short_kernels"] == {"count": 2, "time_us": 14.0}


def test_fractional_microseconds_sum_exactly():
    rng = np.random.default_rng(1)
    starts = np.sort(rng.uniform(0, 10_000, 500)).round(3)
    rows = [(int(k), s, s + d) for k, s, d in zip(rng.integers(0, 4, 500), starts, rng.uniform(0.1, 80, 500).round(3))]
    entry = analyze([timeline(0, rows)], per_step=True).to_json()["ranks"][0]
    total_ns = sum(round(v * 1000) for v in entry["breakdown_us"].values())
    assert total_ns == round(entry["window_us"] * 1000)


def test_rank_twice_and_mixed_jobs_are_user_errors():
    a = timeline(0, [(COMPUTE, 0, 10)], source="a.json")
    b = timeline(0, [(COMPUTE, 0, 10)], source="b.json")
    with pytest.raises(UserError, match="rank 0 given twice: a.json and b.json"):
        analyze([a, b])
    c = timeline(1, [(COMPUTE, 0, 10)], source="c.json", world_size=4)
    d = timeline(2, [(COMPUTE, 0, 10)], source="d.json", world_size=8)
    with pytest.raises(UserError, match="different jobs.*c.json.*d.json"):
        analyze([c, d])
