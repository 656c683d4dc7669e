"""Stragglers (ranks that hold their peers back through their own work) and delayed ranks.

A rank arrives last "clearly more often than chance" when its share of last arrivals is at least halfway
from chance (1 / group size) to always, and a one-sided binomial test against chance gives p < 0.05 (so a
handful of instances cannot make a straggler). It is a straggler when, besides, its busy time per step
(compute + memcpy) is at least 10 % above the median of its peers; otherwise it is `delayed`: late
because it waited on someone else.
"""
from __future__ import annotations

from math import exp, lgamma, log

import numpy as np

from gpuwatch.efficiency.arrays import distinct, median
from gpuwatch.efficiency.matching import Matching
from gpuwatch.efficiency.result import Straggler

BUSY_EXCESS = 1.10
P_VALUE = 0.05


def find_stragglers(matching: Matching, busy_per_step_us: dict[int, float]) -> tuple[list[Straggler], list[Straggler]]:
    """(stragglers, delayed), each a list of evidence objects, from matched arrivals and per-rank busy time."""
    inst, rank, start = matching.instance, matching.rank, matching.start_us
    if not len(inst):
        return [], []
    ids, inst = np.unique(inst, return_inverse=True)
    size = np.bincount(inst)
    latest = np.full(len(ids), -np.inf)
    np.maximum.at(latest, inst, start)
    at_latest = start == latest[inst]
    unique_last = at_latest & (np.bincount(inst, weights=at_latest)[inst] == 1)
    median_start = _group_median(inst, start, len(ids))

    stragglers: list[Straggler] = []
    delayed: list[Straggler] = []
    for r in distinct(rank):
        mine = rank == r
        n = int(mine.sum())
        last = int(unique_last[mine].sum())
        chance = float(np.mean(1.0 / size[inst[mine]]))
        share = last / n
        peers = [p for p in distinct(rank[np.isin(inst, inst[mine])]) if p != r]
        peer_busy = [busy_per_step_us[int(p)] for p in peers if int(p) in busy_per_step_us]
        if not peer_busy or share < (1 + chance) / 2 or _binomial_tail(n, last, chance) >= P_VALUE:
            continue
        peer_median = median(peer_busy)
        busy = busy_per_step_us.get(int(r), 0.0)
        evidence = Straggler(
            rank=int(r),
            last_share=round(share, 4),
            chance_share=round(chance, 4),
            collectives=n,
            last_count=last,
            mean_lateness_us=round(float(np.mean(start[mine] - median_start[inst[mine]])), 3),
            busy_per_step_us=round(busy, 3),
            peer_median_busy_per_step_us=round(peer_median, 3),
            busy_ratio=round(busy / peer_median, 4) if peer_median > 0 else None,
        )
        (stragglers if busy >= BUSY_EXCESS * peer_median else delayed).append(evidence)
    return stragglers, delayed


def _group_median(inst: np.ndarray, value: np.ndarray, n: int) -> np.ndarray:
    order = np.lexsort((value, inst))
    counts = np.bincount(inst, minlength=n)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    sorted_values = value[order]
    lo = sorted_values[first + (counts - 1) // 2]
    hi = sorted_values[first + counts // 2]
    medians: np.ndarray = (lo + hi) / 2
    return medians


def _binomial_tail(n: int, k: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    def log_pmf(i: int) -> float:
        return lgamma(n + 1) - lgamma(i + 1) - lgamma(n - i + 1) + i * log(p) + (n - i) * log(1 - p)

    return min(1.0, sum(exp(log_pmf(i)) for i in range(k, n + 1)))
