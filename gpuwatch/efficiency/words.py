"""The coverage, window and what-if of an `analyze()` result in words, for the text and HTML reports."""
from __future__ import annotations

from gpuwatch.efficiency.result import Analysis, WhatIf


def coverage_lines(doc: Analysis) -> list[str]:
    """Coverage and window in words (the text and HTML reports say the same)."""
    cov, win = doc.coverage, doc.window
    world = cov.world_size or "?"
    lines = [f"analysed window: {win.rule}; {win.activities} GPU activities"
             + (f", steps {win.steps[0]}..{win.steps[-1]}" if win.steps else ", no step annotations")]
    lines.append(f"coverage: {cov.ranks_present} of {world} rank(s) present"
                 + {True: "; events were sampled",
                    None: "; some GPU activities have no launch record (partial recording)",
                    False: ""}[cov.events_sampled])
    if cov.comm_wait_lower_bound:
        lines.append("comm_wait is a lower bound: ranks are missing, so the last arrival at a collective may be a rank "
                     "not here (that waiting is counted in comm_transfer)")
    if doc.straggler_verdict == "undetermined":
        lines.append("stragglers: undetermined (peers missing: no rank can be cleared or blamed)")
    return lines


#: Replay error past which the what-if's model (dependencies, launch delays) plainly does not fit the trace.
ROUGH_REPLAY_ERROR = 0.10


def what_if_lines(w: WhatIf | None) -> list[str]:
    if not w:
        return []
    ranks = sorted(w.per_rank, key=lambda r: -r.slowdown)[:3]
    kinds = sorted(w.per_op_kind, key=lambda r: -r.slowdown)
    caution = [] if w.replay_error <= ROUGH_REPLAY_ERROR else [
        f"  caution: replaying the measured durations misses the measured steps by {100 * w.replay_error:.0f} %, "
        "so the what-if is a rough estimate here (launch records missing, or host time the trace does not show)"]
    return [
        f"what-if: {w.slowdown:.3f}x slower than with every op at its typical duration "
        f"(step {w.no_launch_delay_step_us / 1000:.2f} ms without launch delays "
        f"vs ideal {w.ideal_step_us / 1000:.2f} ms)",
        f"  replay check: replayed step {w.replayed_step_us / 1000:.2f} ms "
        f"vs measured {w.actual_step_us / 1000:.2f} ms "
        f"(error {100 * w.replay_error:.1f} %); measured / no-launch-delay {w.actual_over_no_launch_delay:.3f}",
        *caution,
        *([] if w.slowdown_unclamped >= 1 else [
            f"  the ideal is longer than the step without launch delays ({w.slowdown_unclamped:.3f}x): the ops on "
            "its critical path ran faster than their kind's typical duration, so evening durations out would not "
            "speed it up; the slowdown is shown as 1.000x"]),
        "  by rank: " + ", ".join(f"rank {r.rank} {r.slowdown:.3f}x" for r in ranks),
        "  by op kind: " + ", ".join(f"{k.kind} {k.slowdown:.3f}x" for k in kinds),
    ]
