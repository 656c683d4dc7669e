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


def window_of(spec: str | None) -> dict[str, Any]:
    """The description of the window `spec` picks (None: everything); a malformed spec stops here."""
    if spec is None:
        return {"selection": "all", "rule": "every GPU activity, from the first to the last "
                "(the last profiler step included)"}
    if spec == HTA:
        return {"selection": spec, "rule": "HolisticTraceAnalysis's default: GPU work launched before the last "
                "ProfilerStep began (the last step and kernels without a launch record dropped)"}
    low, high = _parse(spec)
    shown = f"{'' if low < 0 else low}..{'' if high == _OPEN else high}"
    return {"selection": spec, "rule": f"activities of steps {shown} (by the step whose annotation holds their launch)"}


def select_steps(tl: RankTimeline, spec: str | None) -> RankTimeline:
    """One rank's timeline restricted to `spec` (None: everything); a rank left with nothing stops here."""
    if spec is None:
        return tl
    if spec == HTA:
        chosen = _before_last_step(tl)
    else:
        low, high = _parse(spec)
        chosen = tl.select((tl.step >= low) & (tl.step <= high))
    if not len(chosen):
        known = sorted({int(s) for s in distinct(tl.step) if s >= 0})
        have = f"steps {known[0]}..{known[-1]}" if known else "no step annotations"
        raise UserError(f"--steps {spec}: {tl.source or f'rank {tl.rank}'} has no GPU activity there ({have})")
    return chosen


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
