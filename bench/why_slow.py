"""Why is it slow, measured: every fail-slow kind injected many times at random onsets, ranks and severities
over several simulated jobs, each job sampled at 1 s (the agent's NVML sampler over the simulated GPUs,
tests/slow_jobs.py) and checked every --check-every simulated seconds as the jobs monitor checks.

Prints, per kind and in total, beside the same numbers from the straggler verdict alone (the efficiency
engine's stragglers over the same window, which name a rank but no cause):
- the share of injections named on the right rank with the right cause (the verdict alone: right rank);
- the median simulated seconds from the onset to the first check that named it (at 1 s sampling);
- wrong: checks that blamed a wrong rank or named a cause other than the injected one (before the onset:
  any rank blamed);
- false causes per job-day on healthy jobs (any rank named on a job with nothing injected).

Synthetic: the slow ranks and their counters come from gpuwatch.simulator.fail_slow; real jobs are noisier.

    python bench/why_slow.py [--trials 5] [--healthy-hours 8] [--check-every 10] [--seed 1]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from gpuwatch.collector.live import probe_timelines  # noqa: E402
from gpuwatch.efficiency.engine import analyze  # noqa: E402
from gpuwatch.collector.why_slow import find_slow_ranks  # noqa: E402
from gpuwatch.simulator.fail_slow import KINDS, FailSlowSpec  # noqa: E402
from slow_jobs import run_job  # noqa: E402

AFTER_ONSET_S = 150  # each injection is watched this long after its onset


def stragglers(spans, job: str) -> set[int]:
    """The straggler verdict alone: the engine's stragglers over the window (as the jobs monitor gets them)."""
    timelines = probe_timelines(spans[spans["job_id"] == job], source=job)
    return {s.rank for s in analyze(timelines, with_what_if=False).stragglers} if timelines else set()


def trial(kind: str, rng: random.Random, check_every: float, n: int) -> tuple[dict, dict]:
    """One injection: (why_slow's outcome, the straggler verdict's outcome), each {"hit": bool, "delay": s}."""
    gpus = rng.choice((4, 8))
    spec = FailSlowSpec(rng.randrange(gpus), kind, float(rng.randint(60, 240)), None, round(rng.uniform(1.3, 2.0), 2))
    job = f"bench-{kind}-{n}"
    ours: dict = {"hit": False, "delay": None, "wrong": 0}
    verdict: dict = {"hit": False, "delay": None, "wrong": 0}
    for check in run_job(job, gpus, [spec], seconds=spec.after_s + AFTER_ONSET_S, check_every_s=check_every):
        late = check.t - spec.after_s
        found = find_slow_ranks(*check.evidence(job))
        blamed = {(s.rank, s.cause) for s in found if s.cause != "peer"}
        if late >= 0 and (spec.gpu, kind) in blamed and ours["delay"] is None:
            ours.update(hit=True, delay=late)
        # a wrong rank, or a cause named that is not the injected one ("unknown" names none)
        ours["wrong"] += len({(r, c) for r, c in blamed if r != spec.gpu or c not in (kind, "unknown")}
                             if late >= 0 else blamed)
        flagged = stragglers(check.spans, job)
        if late < 0:
            verdict["wrong"] += len(flagged)
        elif spec.gpu in flagged and verdict["delay"] is None:
            verdict.update(hit=True, delay=late)
    return ours, verdict


def healthy(hours: float, rng: random.Random, check_every: float) -> tuple[int, int, float]:
    """(causes raised, stragglers flagged, job-days watched) over healthy jobs of 4 and 8 GPUs, an hour each."""
    ours = verdict = 0
    days = 0.0
    for n in range(max(1, round(hours))):
        job = f"healthy-{n}"
        for check in run_job(job, rng.choice((4, 8)), [], seconds=3600, check_every_s=max(check_every, 30)):
            ours += len(find_slow_ranks(*check.evidence(job)))
            verdict += len(stragglers(check.spans, job))
        days += 3600 / 86400
    return ours, verdict, days


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5, help="injections per kind")
    parser.add_argument("--healthy-hours", type=float, default=8, help="hours of healthy jobs (one hour per job)")
    parser.add_argument("--check-every", type=float, default=10, help="simulated seconds between checks")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    started = time.time()
    rows = []
    all_ours, all_verdict = [], []
    for kind in KINDS:
        results = [trial(kind, rng, args.check_every, n) for n in range(args.trials)]
        ours, verdict = [r[0] for r in results], [r[1] for r in results]
        all_ours += ours
        all_verdict += verdict
        rows.append((kind, ours, verdict))
    print(f"{'kind':<14} {'right cause':>11} {'median s':>9} {'wrong':>6}   {'verdict: right rank':>19} "
          f"{'median s':>9} {'wrong':>6}")
    for kind, ours, verdict in [*rows, ("all", all_ours, all_verdict)]:
        print(f"{kind:<14} {_share(ours):>11} {_median(ours):>9} {sum(o['wrong'] for o in ours):>6}   "
              f"{_share(verdict):>19} {_median(verdict):>9} {sum(v['wrong'] for v in verdict):>6}")
    raised, flagged, days = healthy(args.healthy_hours, rng, args.check_every)
    print(f"healthy jobs: {days * 24:.0f} job-hours; false causes per job-day {raised / days:.2f} "
          f"(straggler verdict alone: {flagged / days:.2f} false stragglers per job-day)")
    print(f"{len(all_ours)} injections, sampling 1 s, checks every {args.check_every:g} s; "
          f"{time.time() - started:.0f} s wall")


def _share(results: list[dict]) -> str:
    return f"{sum(r['hit'] for r in results) / len(results):.0%}" if results else "-"


def _median(results: list[dict]) -> str:
    delays = [r["delay"] for r in results if r["delay"] is not None]
    return f"{statistics.median(delays):.0f}" if delays else "-"


if __name__ == "__main__":
    main()
