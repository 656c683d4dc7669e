"""Which part of each rank's timeline is analysed (`--steps`), and the words that say so.

By default every GPU activity counts, from the first to the last (the spec's window; unlike
HolisticTraceAnalysis the last profiler step is kept). `--steps A:B` keeps the activities of steps A to B
(either end may be left open); `--steps hta` keeps what HTA analyses by default: the GPU work launched
before the last `ProfilerStep` began (the last step and kernels without a launch record are dropped).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from gpuwatch.efficiency.arrays import distinct
from gpuwatch.efficiency.timeline import RankTimeline
from gpuwatch.core.errors import UserError

HTA = "hta"


def select_steps(timelines: list[RankTimeline], spec: str | None) -> tuple[list[RankTimeline], dict[str, Any]]:
    """The timelines restricted to `spec` (None: everything), and the description of the window."""
    if spec is None:
        return timelines, {"selection": "all", "rule": "every GPU activity, from the first to the last "
                           "(the last profiler step included)"}
    if spec == HTA:
        chosen = [_before_last_step(tl) for tl in timelines]
        rule = ("HolisticTraceAnalysis's default: GPU work launched before the last ProfilerStep began "
                "(the last step and kernels without a launch record dropped)")
    else:
        low, high = _parse(spec)
        chosen = [tl.select((tl.step >= low) & (tl.step <= high)) for tl in timelines]
        shown = f"{'' if low < 0 else low}..{'' if high == _OPEN else high}"
        rule = f"activities of steps {shown} (by the step whose annotation holds their launch)"
    for before, after in zip(timelines, chosen):
        if not len(after):
            known = sorted({int(s) for s in distinct(before.step) if s >= 0})
            have = f"steps {known[0]}..{known[-1]}" if known else "no step annotations"
            raise UserError(f"--steps {spec}: {before.source or f'rank {before.rank}'} "
                            f"has no GPU activity there ({have})")
    return chosen, {"selection": spec, "rule": rule}


_OPEN = np.iinfo(np.int64).max


def _parse(spec: str) -> tuple[int, int]:
    low, sep, high = spec.partition(":")
    try:
        bounds = (int(low), int(low)) if not sep else ((int(low) if low else -1), (int(high) if high else _OPEN))
    except ValueError:
        raise UserError(f"--steps {spec}: expected A:B (step ids, either end may be empty), N, or {HTA}") from None
    if bounds[0] > bounds[1]:
        raise UserError(f"--steps {spec}: the range is empty ({low} comes after {high}); give A:B with A <= B")
    return bounds


def _before_last_step(tl: RankTimeline) -> RankTimeline:
    if len(tl.step_marks) < 2:
        return tl
    return tl.select(tl.launch_us < tl.step_marks[:, 1].max())
