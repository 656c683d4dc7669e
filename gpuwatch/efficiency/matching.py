"""Cross-rank matching of collective instances and the waiting-for-peers time of each.

An instance is identified by (process group, seq) where the source gives them, else by (collective
type, order of occurrence on the rank). Communication of unknown type (a kernel nothing in the trace
types) is matched only by process group and seq: matching it by order could pair unrelated kernels.
For an instance seen on two or more ranks, with s_r the start of its kernel on rank r and d_r its
duration: wait_r = clamp(max(s) - s_r, 0, d_r).

Matching reads each rank's :class:`Collectives` (its collective kernels, a few per step), never a timeline,
so the ranks' timelines can be reduced where they are read and dropped before the job is matched.
"""
from __future__ import annotations

import msgspec
import numpy as np

from gpuwatch.efficiency.timeline import COLLECTIVE, RankTimeline


class Collectives(msgspec.Struct):
    """One rank's matchable collective kernels in start order: `index` is each one's activity row in the
    rank's timeline (for the reports that still hold it), the others what matching reads."""

    rank: int
    index: np.ndarray
    start_us: np.ndarray
    end_us: np.ndarray
    group: list[str]
    ctype: list[str]
    seq: np.ndarray


class Matching(msgspec.Struct):
    """`waits[i]` and `instance_of[i]` (the matched instance of each collective, -1 if none) are aligned with
    rank i's :class:`Collectives`. The arrival columns (instance, rank, start_us) hold one row per rank and
    matched instance (those seen on two or more ranks)."""

    waits: list[np.ndarray]
    instance_of: list[np.ndarray]
    matched: int
    matched_per_rank: list[int]
    instance: np.ndarray
    rank: np.ndarray
    start_us: np.ndarray


def collectives_of(tl: RankTimeline) -> Collectives:
    """The collective kernels of `tl` that matching can pair: typed ones, and untyped ones with a group and seq."""
    idx = np.flatnonzero(tl.kind == COLLECTIVE)
    typed = tl.type_names()[idx] != "unknown"
    idx = idx[typed | ((tl.seq[idx] >= 0) & (tl.process_group[idx] >= 0))]
    idx = idx[np.argsort(tl.start_us[idx], kind="stable")]
    return Collectives(rank=tl.rank, index=idx, start_us=tl.start_us[idx], end_us=tl.end_us[idx],
                       group=[str(g) for g in tl.group_names()[idx]], ctype=[str(t) for t in tl.type_names()[idx]],
                       seq=tl.seq[idx])


def match_collectives(ranks: list[Collectives]) -> Matching:
    """Match collective kernels across ranks and compute each kernel's wait."""
    waits = [np.zeros(len(c.index)) for c in ranks]
    instance_of = [np.full(len(c.index), -1, np.int64) for c in ranks]
    owner = np.concatenate([np.full(len(c.index), i) for i, c in enumerate(ranks)] + [np.empty(0, np.int64)])
    if len(owner) == 0:
        return Matching(waits, instance_of, 0, [0] * len(ranks), *(np.empty(0, np.int64),) * 2, np.empty(0))
    index = np.concatenate([np.arange(len(c.index)) for c in ranks])
    start = np.concatenate([c.start_us for c in ranks])
    dur = np.concatenate([c.end_us for c in ranks]) - start
    group = np.array([g for c in ranks for g in c.group], dtype=object)
    ctype = np.array([t for c in ranks for t in c.ctype], dtype=object)
    seq = np.concatenate([c.seq for c in ranks])

    by_group = (seq >= 0) & (group != "")
    name = np.where(by_group, group, ctype)
    _, name_code = np.unique(name.astype(str), return_inverse=True)
    # Ordinal of each kernel among same-key kernels of its rank (rows are in start order per rank).
    number = np.where(by_group, seq, 0)
    ordinal = _cumcount(np.column_stack([owner, by_group, name_code, number]))
    number = np.where(by_group, seq, ordinal)
    sub = np.where(by_group, ordinal, 0)
    keys = np.column_stack([by_group, name_code, number, sub]).astype(np.int64)
    _, instance = np.unique(keys, axis=0, return_inverse=True)
    instance = instance.ravel()

    size = np.bincount(instance)
    latest = np.full(len(size), -np.inf)
    np.maximum.at(latest, instance, start)
    matched_row = size[instance] >= 2
    wait = np.where(matched_row, np.clip(latest[instance] - start, 0, dur), 0.0)
    for i in range(len(ranks)):
        mine = owner == i
        waits[i][index[mine]] = wait[mine]
        instance_of[i][index[mine]] = np.where(matched_row[mine], instance[mine], -1)
    per_rank = np.bincount(owner[matched_row], minlength=len(ranks))
    rank_ids = np.array([c.rank for c in ranks])
    return Matching(
        waits=waits, instance_of=instance_of, matched=int((size >= 2).sum()),
        matched_per_rank=[int(x) for x in per_rank],
        instance=instance[matched_row], rank=rank_ids[owner[matched_row]], start_us=start[matched_row],
    )


def _cumcount(keys: np.ndarray) -> np.ndarray:
    """For each row, how many earlier rows have the same key (rows keep their order within a key)."""
    _, code = np.unique(keys, axis=0, return_inverse=True)
    code = code.ravel()
    order = np.argsort(code, kind="stable")
    sorted_code = code[order]
    first = np.concatenate([[True], sorted_code[1:] != sorted_code[:-1]])
    group_start = np.maximum.accumulate(np.where(first, np.arange(len(code)), 0))
    out = np.empty(len(code), np.int64)
    out[order] = np.arange(len(code)) - group_start
    return out
