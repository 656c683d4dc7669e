"""How `gpuwatch analyze DIR --json` scales with the rank count: wall, CPU and peak memory summed over the
process tree, for sets of 8, 64, 256 and 1,024 ranks side by side, in one run.

Each set is made of copies of the shared real traces (by default control_rank3_of8, a real A100 rank of an
8-rank job) with the rank id and world size rewritten in `distributedInfo`, nothing else changed: every rank
holds the same events, so the set's cross-rank matching pairs every collective, as a real job's would. A
copy is written as two gzip members, a freshly compressed head (up to the end of `distributedInfo`) and the
trace's remaining bytes compressed once for the whole set: a gzip reader sees one stream, and building 1,024
ranks costs a copy of bytes, not 1,024 compressions.

Memory is the peak of the RSS summed over the command's whole process tree, sampled every 10 ms (and at
least the largest `ru_maxrss` of one process); CPU is user+system summed over the tree (the rusage of the
waited-for children, or the sampled sum, the larger). Load average is printed beside each row: the machine
may be shared, and CPU time moves far less with load than wall time does.

    python bench/analyze_scale.py [--ranks 8,64,256,1024] [--trace FILE] [--sets DIR] [--old-tree DIR]
                                  [--hta-ranks 8,64 | --no-hta] [--hta-venv DIR] [--hta-timeout S]

`--old-tree DIR` also runs the gpuwatch of an older tree (e.g. a `git worktree` of the commit before a change)
on each set, beside this one. Sets are kept in `--sets` (default: a temporary folder, removed at the end);
a set already there with the right number of ranks is reused.

HTA 0.5.0's temporal breakdown runs on the same set folders for the rank counts in `--hta-ranks` (default 8
and 64; `--no-hta` skips it), measured the same way, in a row beside gpuwatch's with HTA/gpuwatch ratios of CPU
and peak memory. It comes from bench/analyze.py's venv (`--hta-venv`, installed on first use). Its memory grows
with the rank count far faster than gpuwatch's, so larger counts are opt-in; a failure or a run past
`--hta-timeout` (default 1,200 s) is printed in its row and the run goes on.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from analyze import HTA_SCRIPT, MEASURE, VENV, hta_python  # noqa: E402  (shared with bench/analyze.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINETO = os.path.join(ROOT, "..", "shared", "data", "kineto")
if not os.path.isdir(KINETO):  # a worktree beside the main checkout
    KINETO = "/work/shared/data/kineto"
DEFAULT_TRACE = os.path.join(KINETO, "control_rank3_of8", "rank3.json.gz")
_INFO = b'"distributedInfo"'


def build_set(trace: str, folder: str, ranks: int) -> int:
    """Write `ranks` copies of `trace` into `folder` as rank<N>.json.gz, each with its rank id and the world
    size rewritten. Returns the bytes written."""
    with gzip.open(trace, "rb") as f:
        data = f.read()
    at = data.find(_INFO)
    if at < 0:
        raise SystemExit(f"{trace}: no distributedInfo to rewrite")
    end = data.index(b"}", at) + 1
    info = json.loads(data[at + len(_INFO):end].lstrip(b": "))
    body = gzip.compress(data[end:], compresslevel=6)
    total = 0
    os.makedirs(folder, exist_ok=True)
    for rank in range(ranks):
        head = data[:at] + _INFO + b": " + json.dumps({**info, "rank": rank, "world_size": ranks}).encode()
        path = os.path.join(folder, f"rank{rank}.json.gz")
        with open(path, "wb") as out:
            out.write(gzip.compress(head, compresslevel=6))
            out.write(body)
        total += os.path.getsize(path)
    return total


def measure(tree: str, folder: str) -> dict:
    """`gpuwatch analyze folder --json` of `tree`, run through the sampling wrapper."""
    env = {**os.environ, "PYTHONPATH": tree}
    command = [sys.executable, "-m", "gpuwatch", "analyze", folder, "--json"]
    done = subprocess.run([sys.executable, "-c", MEASURE, *command], capture_output=True, text=True, env=env,
                          cwd=tempfile.gettempdir())
    if done.returncode != 0:
        raise SystemExit(f"the wrapper failed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout)
    if result["rc"] != 0:
        raise SystemExit(f"gpuwatch analyze {folder} failed (rc {result['rc']})")
    return result


def measure_hta(python: str, folder: str, timeout: float) -> dict | str:
    """HTA's temporal breakdown of `folder` through the sampling wrapper; a one-line reason when it fails."""
    command = [python, "-c", HTA_SCRIPT, folder]
    try:
        done = subprocess.run([sys.executable, "-c", MEASURE, *command], capture_output=True, text=True,
                              cwd=tempfile.gettempdir(), timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    if done.returncode != 0:
        return f"the wrapper failed (rc {done.returncode}): {done.stderr.strip().splitlines()[-1:]}"
    result: dict = json.loads(done.stdout)
    if result["rc"] != 0:
        why = "killed (out of memory?)" if result["rc"] in (-9, 137) else f"rc {result['rc']}"
        last = done.stderr.strip().splitlines()[-1:] or [""]
        return f"failed, {why}, after {result['wall_s']:.0f} s, peak {result['peak_mb']:.0f} MB: {last[0][:120]}"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="8,64,256,1024", help="rank counts, comma-separated")
    parser.add_argument("--trace", default=DEFAULT_TRACE, help="the real trace each rank is a copy of")
    parser.add_argument("--sets", help="keep the rank sets here (reused when present)")
    parser.add_argument("--old-tree", metavar="DIR", help="also run the gpuwatch of this tree")
    parser.add_argument("--hta-ranks", default="8,64", help="rank counts HTA 0.5.0 runs on, comma-separated")
    parser.add_argument("--no-hta", action="store_true", help="do not run HTA")
    parser.add_argument("--hta-venv", default=os.environ.get("GPUWATCH_HTA_VENV", VENV),
                        help="venv with HolisticTraceAnalysis 0.5.0 (created on first use)")
    parser.add_argument("--hta-timeout", type=float, default=1200.0, help="seconds HTA may run per set")
    args = parser.parse_args()
    hta_ranks = set() if args.no_hta else {int(r) for r in args.hta_ranks.split(",") if r}
    python = hta_python(bool(hta_ranks), args.hta_venv)
    sets = args.sets or tempfile.mkdtemp(prefix="gw-bench-scale-")
    trees = {"this tree": ROOT, **({"old tree": os.path.abspath(args.old_tree)} if args.old_tree else {})}
    print(f"{'ranks':>6} {'MB in':>8} {'tree':>10} {'wall s':>8} {'CPU s':>8} {'CPU s/rank':>10} {'peak MB':>8} "
          f"{'MB/rank':>8}  load before/after")
    try:
        for ranks in [int(r) for r in args.ranks.split(",")]:
            folder = os.path.join(sets, f"ranks{ranks}")
            if len([n for n in os.listdir(folder)] if os.path.isdir(folder) else []) != ranks:
                shutil.rmtree(folder, ignore_errors=True)
                build_set(args.trace, folder, ranks)
            size = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)) / 1e6
            outputs = {}
            for name, tree in trees.items():
                before = os.getloadavg()[0]
                r = measure(tree, folder)
                outputs[name] = r["stdout"]
                if name == "this tree":
                    gw = r
                print(f"{ranks:>6} {size:>8.0f} {name:>10} {r['wall_s']:>8.1f} {r['cpu_s']:>8.1f} "
                      f"{r['cpu_s'] / ranks:>10.3f} {r['peak_mb']:>8.0f} {r['peak_mb'] / ranks:>8.2f}  "
                      f"{before:.1f}/{os.getloadavg()[0]:.1f}", flush=True)
            if len(set(outputs.values())) > 1:
                print(f"       the trees' --json documents differ at {ranks} ranks")
            if python and ranks in hta_ranks:
                before = os.getloadavg()[0]
                h = measure_hta(python, folder, args.hta_timeout)
                if isinstance(h, str):
                    print(f"{ranks:>6} {size:>8.0f} {'HTA 0.5.0':>10}  {h}", flush=True)
                    continue
                print(f"{ranks:>6} {size:>8.0f} {'HTA 0.5.0':>10} {h['wall_s']:>8.1f} {h['cpu_s']:>8.1f} "
                      f"{h['cpu_s'] / ranks:>10.3f} {h['peak_mb']:>8.0f} {h['peak_mb'] / ranks:>8.2f}  "
                      f"{before:.1f}/{os.getloadavg()[0]:.1f}", flush=True)
                print(f"       HTA/gpuwatch at {ranks} ranks: CPU {h['cpu_s'] / gw['cpu_s']:.1f}x, "
                      f"peak memory {h['peak_mb'] / gw['peak_mb']:.1f}x", flush=True)
    finally:
        if not args.sets:
            shutil.rmtree(sets)


if __name__ == "__main__":
    main()
