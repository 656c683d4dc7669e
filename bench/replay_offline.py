"""Benchmark `gpuwatch replay --offline` on a simulated fleet recording: replay, scoring, whole command.

Writes a recording with `gpuwatch simulate` (faults scaled up so some GPUs fail), then runs the real command
as a subprocess, once with the default scoring (every model step in one vectorised pass) and, with
`--live-cadence`, once with `--score-interval 60` (a live scorer round per recorded minute, each re-reading a
day of history: how `replay --offline` scored before). Prints, side by side: GPU samples, the replay
stage's seconds and samples/s (ingest over the real gRPC stream into DuckDB), the scoring stage's seconds,
the whole command's wall and CPU seconds and samples/s, and the load average, as the machine may be shared.
Target: >= 50,000 samples/s for the replay stage.

    python bench/replay_offline.py [--nodes 8] [--gpus 8] [--days 1] [--live-cadence]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _run(argv: list[str]) -> tuple[dict, float, float]:
    """(JSON result, wall seconds, CPU seconds of the child) of one gpuwatch command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "gpuwatch", *argv, "--json", "--quiet"], check=True,
                         capture_output=True, text=True).stdout
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(out), wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--days", type=float, default=1.0)
    parser.add_argument("--live-cadence", action="store_true",
                        help="also run with --score-interval 60 (slow: minutes per simulated day)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuwatch-bench-replay-") as tmp:
        rec = Path(tmp) / "rec"
        sim, _, _ = _run(["simulate", "--nodes", str(args.nodes), "--gpus", str(args.gpus), "--days", str(args.days),
                          "--fault-rate-multiplier", "50", "--seed", "4", "--out", str(rec)])
        samples = int(sim["gpu_rows"])
        runs = [("default (one pass per model step)", [])]
        if args.live_cadence:
            runs.append(("--score-interval 60 (live rounds)", ["--score-interval", "60"]))
        print(f"recording: {args.nodes} nodes x {args.gpus} GPUs x {args.days:g} days = {samples:,} GPU samples, "
              f"load average before: {os.getloadavg()[0]:.1f}")
        print(f"{'scoring':<36}{'replay s':>9}{'replay samples/s':>18}{'scoring s':>10}{'wall s':>8}{'cpu s':>7}"
              f"{'samples/s (wall)':>18}{'failed GPUs':>12}")
        for name, extra in runs:
            result, wall, cpu = _run(["replay", str(rec), "--offline", *extra])
            scoring = result.get("scoring", {})
            print(f"{name:<36}{result['seconds']:>9.2f}{samples / result['seconds']:>18,.0f}"
                  f"{scoring.get('seconds', float('nan')):>10.2f}{wall:>8.1f}{cpu:>7.1f}{samples / wall:>18,.0f}"
                  f"{len(scoring.get('failed', [])):>12}")
        print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
