"""What the efficiency engine finds about one job, typed: :class:`Analysis` and its parts.

`analyze()` returns an :class:`Analysis`; the reports read its attributes. :meth:`Analysis.to_json` gives the
breakdown document of the efficiency spec (`gpuwatch analyze --json`, the collector's Breakdown answer, the
stored documents): its keys are the field names below, in their order. :meth:`Analysis.from_json` reads a
document back (replay, documents the collector stored). The classified segments and the analysed timelines
(for the Perfetto trace) ride along in :attr:`Analysis.partitions` and :attr:`Analysis.timelines` and are
never part of the document.
"""
from __future__ import annotations

import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, TypeVar

from gpuwatch.efficiency.partition import Partition
from gpuwatch.efficiency.timeline import RankTimeline

#: Per category of partition.CATEGORIES: microseconds (``breakdown_us``) or a share of the window.
CategoryValues = dict[str, float]

_SKIP = {"json": "skip"}  # never in the document
_OMIT_NONE = {"json": "omit_none"}  # in the document only when set


@dataclass
class ShortKernels:
    """Kernels under 10 us (the launch-bound work behind ``small_kernel_overhead``)."""

    count: int
    time_us: float


@dataclass
class StepBreakdown:
    """One step of one rank (``step`` None: the slice before the rank's first known step)."""

    step: int | None
    start_us: float
    window_us: float
    breakdown_us: CategoryValues
    lost_fraction: float
    mfu: float | None


@dataclass
class RankBreakdown:
    rank: int
    source: str
    window_start_us: float
    window_us: float
    breakdown_us: CategoryValues
    breakdown_fraction: CategoryValues
    lost_us: float
    comm_total_us: float
    comm_overlapped_us: float
    overlap_ratio: float | None
    short_kernels: ShortKernels
    matched_collectives: int
    steps: int
    busy_per_step_us: float
    mfu: float | None
    per_step: list[StepBreakdown] | None = field(default=None, metadata=_OMIT_NONE)  # analyze(per_step=True)


@dataclass
class JobBreakdown:
    """All ranks together: times summed over ranks, so a GPU-hour lost on any rank counts once."""

    ranks: int
    world_size: int | None
    job_id: str | None
    window_us: float
    breakdown_us: CategoryValues
    breakdown_fraction: CategoryValues
    lost_us: float
    lost_gpu_hours: float
    lost_cost: float | None
    comm_overlapped_us: float
    overlap_ratio: float | None
    short_kernels: ShortKernels
    mfu: float | None


@dataclass
class Straggler:
    """The evidence against a rank that arrives last at collectives more often than chance (stragglers.py)."""

    rank: int
    last_share: float
    chance_share: float
    collectives: int
    last_count: int
    mean_lateness_us: float
    busy_per_step_us: float
    peer_median_busy_per_step_us: float
    busy_ratio: float | None


@dataclass
class Coverage:
    """Which ranks of the job were analysed, and so what can be said about waiting for peers."""

    ranks_present: int
    world_size: int | None
    ranks: list[int]
    complete: bool
    events_sampled: bool | None
    comm_wait_lower_bound: bool


@dataclass
class Window:
    """The analysed stretch of time: how it was chosen (window.py) and what it holds."""

    selection: str
    rule: str
    start_us: float
    end_us: float
    steps: list[int]
    activities: int


@dataclass
class RankSlowdown:
    rank: int
    slowdown: float
    share: float | None


@dataclass
class KindSlowdown:
    kind: str
    slowdown: float
    share: float | None


@dataclass
class WhatIf:
    """How much faster a step would be with every op at its typical duration (whatif.py)."""

    slowdown: float
    slowdown_unclamped: float
    actual_step_us: float
    replayed_step_us: float
    replay_error: float
    no_launch_delay_step_us: float
    actual_over_no_launch_delay: float
    ideal_step_us: float
    steps: int
    ops: int
    replayed_nodes: int
    per_rank: list[RankSlowdown]
    per_op_kind: list[KindSlowdown]


@dataclass
class KernelStat:
    name: str
    kind: str
    count: int
    time_us: float
    mean_us: float
    short_count: int


@dataclass
class TopKernels:
    by_time: list[KernelStat]
    by_count: list[KernelStat]


@dataclass
class Analysis:
    """The efficiency of one job: per rank, the job, stragglers, coverage, window, what-if, top kernels."""

    spec: str
    categories: list[str]
    ranks: list[RankBreakdown]
    job: JobBreakdown
    stragglers: list[Straggler]
    delayed: list[Straggler]  # last more often than chance, but not busier than their peers: held back
    matched_collectives: int
    coverage: Coverage
    straggler_verdict: str  # "found", "none", or "undetermined" when ranks are missing
    window: Window
    what_if: WhatIf | None
    top_kernels: TopKernels
    trace_meta: dict[str, Any]
    partitions: list[Partition] | None = field(default=None, repr=False, metadata=_SKIP)  # keep_segments
    timelines: list[RankTimeline] | None = field(default=None, repr=False, metadata=_SKIP)  # keep_segments

    def to_json(self) -> dict[str, Any]:
        """The breakdown document (plain dicts and lists, ready for orjson)."""
        return _plain(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Analysis:
        """An analysis from its document; keys beyond the fields (the collector's ``source`` and ``history``)
        are left out."""
        return _typed(cls, doc)


def _plain(value: Any) -> Any:
    if is_dataclass(value):
        out = {}
        for f in fields(value):
            item = getattr(value, f.name)
            how = f.metadata.get("json")
            if how == "skip" or (how == "omit_none" and item is None):
                continue
            out[f.name] = _plain(item)
        return out
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


_T = TypeVar("_T")


def _typed(cls: type[_T], doc: dict[str, Any]) -> _T:
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _value(hints[f.name], doc[f.name]) for f in fields(cls)  # type: ignore[arg-type]
                  if f.metadata.get("json") != "skip" and f.name in doc})


def _value(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):  # X | None
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return _value(hint, value)
    if origin is list:
        (item,) = typing.get_args(hint)
        return [_value(item, v) for v in value]
    if isinstance(hint, type) and is_dataclass(hint):
        return _typed(hint, value)
    return value
