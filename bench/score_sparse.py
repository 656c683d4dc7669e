"""`gpuwatch score` and `gpuwatch train` on sparse recordings (a fault log as a recording: one empty sample per
GPU life at insert and when last seen, faults as XID 48/79): wall time and peak memory, which should follow
the samples, not the time span times the GPUs.

    python bench/score_sparse.py                  # 12 nodes x 8 GPUs x 120 days (score), 2,000 slots x 6 years (train)
"""
from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from sparse_fleet import write_sparse_recording  # noqa: E402


def measured(cmd: list[str]) -> tuple[float, float, int]:
    """(seconds, peak MB of the child, exit status)."""
    started = time.monotonic()
    rc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return time.monotonic() - started, peak, rc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--score-gpus", type=int, default=96)
    p.add_argument("--score-days", type=float, default=120)
    p.add_argument("--train-slots", type=int, default=2000)
    p.add_argument("--train-days", type=float, default=6 * 365)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuwatch-bench-sparse-") as tmp:
        work = Path(tmp)
        n = write_sparse_recording(work / "score", nodes=args.score_gpus // 8, gpus_per_node=8,
                                   days=args.score_days, lives_per_gpu=3)
        s, mb, rc = measured([sys.executable, "-m", "gpuwatch", "score", str(work / "score"), "--model", "default",
                              "--json", "--quiet"])
        print(f"score {args.score_gpus} GPUs x {args.score_days:g} days sparse ({n['samples']} samples): "
              f"{s:.1f} s, peak {mb:.0f} MB, exit {rc}")
        n = write_sparse_recording(work / "train", nodes=args.train_slots, gpus_per_node=1, days=args.train_days,
                                   lives_per_gpu=3)
        s, mb, rc = measured([sys.executable, "-m", "gpuwatch", "train", str(work / "train"), "--horizon", "1h",
                              "-o", str(work / "m.skops"), "--quiet"])
        print(f"train {args.train_slots} slots x {args.train_days:g} days telemetry-free ({n['samples']} samples): "
              f"{s:.1f} s, peak {mb:.0f} MB, exit {rc} (2: refused in one line)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
