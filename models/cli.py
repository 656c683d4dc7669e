"""`gpuwatch simulate`, `gpuwatch train` and `gpuwatch evaluate`: thin wrappers over the models library."""
from __future__ import annotations

import argparse
import json
import re
import time

from gpuwatch.errors import UserError

_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def duration_s(text: str) -> float:
    """'90s', '10m', '1h', '24h', '2d' or plain seconds -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|m|min|h|d)?\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"not a positive duration: {text!r} (e.g. 60s, 10m, 1h, 24h)")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def add_arguments(command: str, p: argparse.ArgumentParser) -> None:
    if command == "simulate":
        p.add_argument("--nodes", type=int, default=4)
        p.add_argument("--gpus", type=int, default=8, help="GPUs per node")
        p.add_argument("--days", type=float, default=2.0)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--resolution", type=duration_s, default=60.0, help="sample interval (default 60s)")
        p.add_argument("--fault-rate-multiplier", type=float, default=1.0,
                       help="scale the published base rate so small fleets contain enough faults")
        p.add_argument("--out", required=True, help="recording directory to write")
        p.add_argument("--json", action="store_true")
    else:
        p.add_argument("data", help="recording directory or collector .duckdb store")
        p.add_argument("--json", action="store_true")
    if command == "train":
        p.add_argument("--horizon", type=duration_s, default=3600.0, help="predict faults within (default 1h)")
        p.add_argument("--false-alarm-budget", type=float, default=2.0,
                       help="alerts per 1,000 GPU-days allowed on the validation block (sets the threshold)")
        p.add_argument("-o", "--output", required=True, help="model file to write (.skops)")
    if command == "evaluate":
        p.add_argument("--model", help="model file (default: the shipped simulated-fleet model)")
    p.add_argument("--quiet", action="store_true", help="no progress line on stderr")


def run(command: str, args: argparse.Namespace) -> int:
    started = time.monotonic()
    if command == "simulate":
        result = simulate(args)
    elif command == "train":
        result = train(args)
    else:
        result = evaluate(args)
    result["seconds"] = round(time.monotonic() - started, 1)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(result.pop("table", None) or "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


def simulate(args: argparse.Namespace) -> dict:
    from gpuwatch.models.failsim import FleetConfig, simulate_fleet

    for name in ("nodes", "gpus", "days"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name} must be positive, got {getattr(args, name)}")
    cfg = FleetConfig(nodes=args.nodes, gpus_per_node=args.gpus, days=args.days, resolution_s=args.resolution,
                      seed=args.seed, fault_rate_multiplier=args.fault_rate_multiplier)
    return {"out": args.out, **simulate_fleet(cfg, args.out, quiet=args.quiet)}


def train(args: argparse.Namespace) -> dict:
    from gpuwatch.models.dataset import build_dataset
    from gpuwatch.models.model import save_model
    from gpuwatch.models.train import train_model

    ds = build_dataset(args.data, horizon_s=args.horizon, quiet=args.quiet)
    model = train_model(ds, false_alarm_budget=args.false_alarm_budget,
                        description=f"trained on {args.data}", quiet=args.quiet)
    save_model(model, args.output)
    return {"model": args.output, "threshold": model["threshold"], "training": model["training"],
            "validation": model["validation_metrics"]}


def evaluate(args: argparse.Namespace) -> dict:
    from gpuwatch.models.dataset import build_dataset
    from gpuwatch.models.evaluate import evaluate_model, format_table
    from gpuwatch.models.model import load_model

    model = load_model(args.model)
    ds = build_dataset(args.data, horizon_s=model["horizon_s"], warning_s=model["warning_s"],
                       step_s=model["step_s"], quiet=args.quiet)
    result = evaluate_model(model, ds)
    if not args.json:
        result["table"] = format_table(result)
    return result
