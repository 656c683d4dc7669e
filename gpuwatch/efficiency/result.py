"""What the efficiency engine finds about one job, typed: :class:`Analysis` and its parts.

`analyze()` returns an :class:`Analysis`; the reports read its attributes. :meth:`Analysis.to_json` gives the
breakdown document of the efficiency spec (`gpuwatch analyze --json`, the collector's Breakdown answer, the
stored documents): its keys are the field names below, in their order. :meth:`Analysis.from_json` reads a
document back (replay, documents the collector stored). The classified segments and the analysed timelines
(for the Perfetto trace) ride along in :attr:`Analysis.partitions` and :attr:`Analysis.timelines` and are
never part of the document.

The types are msgspec Structs, as are the engine's other records (timeline, partition, matching): a Struct
class is made in C, where a dataclass compiles generated methods for each class, 10 ms of the imports of a
small `gpuwatch analyze` (0.17 s) for the 21 classes it loads.
"""
from __future__ import annotations

import types
import typing
from typing import Any, TypeVar

import msgspec

from gpuwatch.efficiency.partition import Partition
from gpuwatch.efficiency.timeline import RankTimeline

#: Per category of partition.CATEGORIES: microseconds (``breakdown_us``) or a share of the window.
CategoryValues = dict[str, float]

# Fields never in the document (they ride along for the reports), and fields in it only when set.
_NOT_IN_DOCUMENT = frozenset({"partitions", "timelines"})
_ONLY_WHEN_SET = frozenset({"per_step"})


class ShortKernels(msgspec.Struct):
    """Kernels under 10 us (the launch-bound work behind ``small_kernel_overhead``)."""

    count: int
    time_us: float


class StepBreakdown(msgspec.Struct):
    """One step of one rank (``step`` None: the slice before the rank's first known step)."""

    step: int | None
    start_us: float
    window_us: float
    breakdown_us: CategoryValues
    lost_fraction: float
    mfu: float | None


class RankBreakdown(msgspec.Struct):
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
    per_step: list[StepBreakdown] | None = None  # analyze(per_step=True)


class JobBreakdown(msgspec.Struct):
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


class Straggler(msgspec.Struct):
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


class Coverage(msgspec.Struct):
    """Which ranks of the job were analysed, and so what can be said about waiting for peers."""

    ranks_present: int
    world_size: int | None
    ranks: list[int]
    complete: bool
    events_sampled: bool | None
    comm_wait_lower_bound: bool


class Window(msgspec.Struct):
    """The analysed stretch of time: how it was chosen (window.py) and what it holds."""

    selection: str
    rule: str
    start_us: float
    end_us: float
    steps: list[int]
    activities: int


class RankSlowdown(msgspec.Struct):
    rank: int
    slowdown: float
    share: float | None


class KindSlowdown(msgspec.Struct):
    kind: str
    slowdown: float
    share: float | None


class WhatIf(msgspec.Struct):
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


class KernelStat(msgspec.Struct):
    name: str
    kind: str
    count: int
    time_us: float
    mean_us: float
    short_count: int


class TopKernels(msgspec.Struct):
    by_time: list[KernelStat]
    by_count: list[KernelStat]


class Analysis(msgspec.Struct):
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
    partitions: list[Partition] | None = None  # keep_segments
    timelines: list[RankTimeline] | None = None  # keep_segments

    def to_json(self) -> dict[str, Any]:
        """The breakdown document (plain dicts and lists)."""
        doc: dict[str, Any] = _plain(self)
        return doc

    def json_text(self) -> str:
        """The breakdown document as JSON, indented by two spaces (as the command line prints JSON), by
        msgspec: `gpuwatch analyze` has it loaded already (orjson would add 4 ms of imports to it)."""
        return msgspec.json.format(msgspec.json.encode(self.to_json()), indent=2).decode()

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Analysis:
        """An analysis from its document; keys beyond the fields (the collector's ``source`` and ``history``)
        are left out."""
        return _typed(cls, doc)


def _plain(value: Any) -> Any:
    if isinstance(value, msgspec.Struct):
        out = {}
        for name in value.__struct_fields__:
            item = getattr(value, name)
            if name in _NOT_IN_DOCUMENT or (item is None and name in _ONLY_WHEN_SET):
                continue
            out[name] = _plain(item)
        return out
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


_T = TypeVar("_T")


def _typed(cls: type[_T], doc: dict[str, Any]) -> _T:
    hints = typing.get_type_hints(cls)
    return cls(**{name: _value(hints[name], doc[name]) for name in cls.__struct_fields__  # type: ignore[attr-defined]
                  if name not in _NOT_IN_DOCUMENT and name in doc})


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
    if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
        return _typed(hint, value)
    return value
