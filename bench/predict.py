"""Failure-prediction benchmark: simulate a training fleet and a held-out fleet (another seed), train,
evaluate against the rule baseline, and print the evaluation table and the simulate/train/evaluate times.

    python bench/predict.py                       # 64 nodes x 8 GPUs x 30 days at 60 s (minutes)
    python bench/predict.py --nodes 8 --days 10   # a quick look
    python bench/predict.py --save-default        # also refresh models/data/default_model.skops
    python bench/predict.py --keep /data/bench    # keep the recordings and model (GBs at full size)
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from gpuwatch.models.dataset import build_dataset
from gpuwatch.models.evaluate import evaluate_model, format_table
from gpuwatch.models.failsim import FleetConfig, simulate_fleet
from gpuwatch.models.model import default_model_path, save_model
from gpuwatch.models.train import train_model


def timed(label: str, fn, *args, **kwargs):
    started = time.monotonic()
    result = fn(*args, **kwargs)
    seconds = time.monotonic() - started
    print(f"{label:38} {seconds:8.1f} s", flush=True)
    return result, seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--days", type=float, default=30)
    p.add_argument("--resolution", type=float, default=60.0, help="seconds")
    p.add_argument("--fault-rate-multiplier", type=float, default=30.0)
    p.add_argument("--train-seed", type=int, default=101)
    p.add_argument("--test-seed", type=int, default=202)
    p.add_argument("--keep", metavar="DIR",
                   help="write the recordings and model here and keep them (default: a temporary directory, deleted)")
    p.add_argument("--save-default", action="store_true", help="ship the trained model as the default model")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="gpuwatch-bench-predict-"))
    try:
        return run(args, work)
    finally:
        if not args.keep:  # a full-size run leaves ~7 GB of recordings
            shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> int:
    """Simulate, train, evaluate in ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    common = dict(nodes=args.nodes, gpus_per_node=args.gpus, days=args.days, resolution_s=args.resolution,
                  fault_rate_multiplier=args.fault_rate_multiplier)
    for name in ("train", "heldout"):
        shutil.rmtree(work / name, ignore_errors=True)
    gpu_days = args.nodes * args.gpus * args.days
    print(f"fleet: {args.nodes} nodes x {args.gpus} GPUs x {args.days:g} days at {args.resolution:g} s "
          f"({gpu_days:,.0f} GPU-days per fleet), fault rate x{args.fault_rate_multiplier:g}")
    times = {}
    sim_train, times["simulate_train_s"] = timed("simulate training fleet", simulate_fleet,
                                                 FleetConfig(seed=args.train_seed, **common), work / "train")
    sim_test, times["simulate_heldout_s"] = timed("simulate held-out fleet", simulate_fleet,
                                                  FleetConfig(seed=args.test_seed, **common), work / "heldout")
    ds, times["features_train_s"] = timed("features + labels (training fleet)", build_dataset, work / "train")
    desc = (f"simulated-fleet-trained: gpuwatch failsim seed {args.train_seed}, {args.nodes}x{args.gpus} GPUs, "
            f"{args.days:g} days, fault rate x{args.fault_rate_multiplier:g}; not trained on real hardware data")
    model, times["train_s"] = timed("train + calibrate + threshold", train_model, ds, description=desc)
    save_model(model, work / "model.skops")
    held, times["features_heldout_s"] = timed("features + labels (held-out fleet)", build_dataset, work / "heldout")
    result, times["evaluate_s"] = timed("evaluate (model and rules)", evaluate_model, model, held)
    if args.save_default:
        save_model(model, default_model_path())
        print(f"default model written: {default_model_path()} ({default_model_path().stat().st_size:,} bytes)")
    print(f"\nfaults simulated: training {sim_train['faults']}, held-out {sim_test['faults']}")
    print(f"held-out evaluation (seed {args.test_seed}), horizon {model['horizon_s']:g} s:\n")
    print(format_table(result))
    if args.json:
        print(json.dumps({"times": times, "result": result, "simulated": [sim_train, sim_test]}, default=str))
    if args.keep:
        print(f"\nrecordings and model in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
