"""How the what-if scales with the ranks of a job: its time and peak memory at 8 to 128 (or more) ranks.

The what-if replays the job's graph once per rank (each rank's share of the slowdown) on a graph that grows
with the ranks, so its cost grew with the square of the job. The jobs here are built from a real trace
(control_rank3_of8, one rank of a real 8-GPU run): R copies of its timeline, rank r's compute and memory
kernels slower by 3 % x (r mod 7), its collectives matched across all R copies, as `gpuwatch analyze`
matches them. Each job size runs in a fresh process (`what_if()` alone, after loading and matching),
printing ops, replayed nodes, seconds and the process's peak RSS.

With `--old-tree DIR` (e.g. a `git worktree add DIR COMMIT`), that tree is installed into its own venv as
bench/analyze.py installs trees, and every size runs under both, taking turns: before and after, side by side.

    python bench/what_if.py [--ranks 8 32 64 128] [--old-tree DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(ROOT, "..", "shared", "data", "kineto", "control_rank3_of8")
if not os.path.isdir(TRACE):  # a worktree beside the main checkout
    TRACE = "/work/shared/data/kineto/control_rank3_of8"
OLD_VENV = os.path.expanduser("~/.cache/gpuwatch-bench/what-if-old-venv")

# One job size in a fresh interpreter: the what-if's time and the process's peak RSS, as JSON.
CHILD = """
import dataclasses, gc, json, resource, sys, time
import msgspec, numpy as np
from gpuwatch.efficiency.load import load_paths
from gpuwatch.efficiency.matching import match_collectives
from gpuwatch.efficiency.timeline import COLLECTIVE, P2P
from gpuwatch.efficiency.whatif import what_if

ranks, trace = int(sys.argv[1]), sys.argv[2]
gc.disable()  # as `gpuwatch analyze` runs
one = load_paths([trace])[0]
comm = (one.kind == COLLECTIVE) | (one.kind == P2P)
replace = msgspec.structs.replace if isinstance(one, msgspec.Struct) else dataclasses.replace  # an --old-tree's
job = [replace(one, rank=r, world_size=ranks, group_ranks={},
                end_us=one.start_us + (one.end_us - one.start_us) * np.where(comm, 1.0, 1 + 0.03 * (r % 7)))
       for r in range(ranks)]
try:  # the what-if on the ranks' graph parts (each built where its trace is read), timed with their building
    from gpuwatch.efficiency.matching import collectives_of
    from gpuwatch.efficiency.whatif import rank_graph
except ImportError:  # an --old-tree's: the what-if of the timelines
    collectives_of = None
if collectives_of is not None:
    collectives = [collectives_of(tl) for tl in job]
    matching = match_collectives(collectives)
    run = lambda: what_if([rank_graph(tl, c, peers=True) for tl, c in zip(job, collectives)],
                          [tl.rank for tl in job], matching)
else:
    matching = match_collectives(job)
    run = lambda: what_if(job, matching)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.perf_counter()
result = run()
seconds = time.perf_counter() - started
print(json.dumps({"ops": result.ops, "nodes": result.replayed_nodes, "seconds": seconds,
                  "slowdown": result.slowdown_unclamped, "replay_error": result.replay_error,
                  "per_rank": [r.slowdown for r in result.per_rank],
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "before_mb": before / 1024}))
"""


def measure(python: str, ranks: int) -> dict:
    done = subprocess.run([python, "-c", CHILD, str(ranks), TRACE], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{ranks} ranks under {python}: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 64, 128])
    parser.add_argument("--old-tree", metavar="DIR", help="also run the what-if of this tree, installed in a venv")
    args = parser.parse_args()
    if min(args.ranks) < 1:
        parser.error(f"--ranks: a job has at least 1 rank, got {min(args.ranks)}")
    tools = {"this tree": sys.executable}
    if args.old_tree:
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        from analyze import gpuwatch_command

        tools = {"older tree": os.path.join(os.path.dirname(gpuwatch_command(OLD_VENV, args.old_tree)[0]), "python"),
                 **tools}
    print(f"{'ranks':>6}{'ops':>10}{'nodes':>8}  " + "".join(f"{name + ' s':>16}{'peak MB':>9}" for name in tools)
          + "   same result")
    for ranks in args.ranks:
        found = {name: measure(python, ranks) for name, python in tools.items()}
        first = next(iter(found.values()))
        same = all((r["slowdown"], r["replay_error"], r["per_rank"]) == (first["slowdown"], first["replay_error"],
                   first["per_rank"]) for r in found.values())
        print(f"{ranks:>6}{first['ops']:>10}{first['nodes']:>8}  "
              + "".join(f"{r['seconds']:>16.3f}{r['peak_mb']:>9.0f}" for r in found.values())
              + f"   {'yes' if same else 'NO'}", flush=True)


if __name__ == "__main__":
    main()
