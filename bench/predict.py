"""Failure-prediction benchmark across fleet configurations: train on one simulated configuration, judge on a
held-out fleet of another (different noise, counter levels, lead times, precursor strength, look-alikes),
the retrained model and the shipped model, both with the alert threshold calibrated online to the budget,
beside the DCGM-style rules tuned to the same budget on the training data. Also times `gpuwatch score` on
the held-out fleet.

Both models are also judged on a fleet of the `validation` configuration (seed 303), neither trained on nor
held out: changes to features, training and calibration are chosen on it, and the held-out numbers are
looked at only after.

    python bench/predict.py                        # 16 nodes x 8 GPUs x 30 days per fleet, noisy -> shifted
    python bench/predict.py --nodes 4 --days 10    # a quick look
    python bench/predict.py --save-default         # retrain the shipped model on base+noisy+subtle, write its card
    python bench/predict.py --keep /data/bench     # keep the recordings and models
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd

from gpuwatch.models.dataset import build_dataset
from gpuwatch.models.evaluate import evaluate_model, format_table
from gpuwatch.simulator.failing_fleet import PROFILES, simulate_fleet
from gpuwatch.models.model import default_model_path, load_model, save_model
from gpuwatch.models.train import train_model

#: The configurations the shipped model is trained on (the held-out one is never among them).
SHIPPED_PROFILES = ("base", "noisy", "subtle")
#: Fleets per configuration for the shipped model (seeds 11.. in turn): more faults to learn a precursor's
#: shape from; on the validation configuration two fleets each raised recall at the training threshold from
#: 0.89 to 0.97 and PR AUC from 0.22 to 0.26 over one each.
SHIPPED_FLEETS_PER_PROFILE = 2
#: Fleets of the one training configuration for the retrained model (seeds 101..): still "trained on one
#: configuration, tested on another", with more faults to learn the precursor shapes from; on the validation
#: configuration three fleets instead of one raised its recall at the budget from 0.49/0.47 to 0.85/0.52
#: (seeds 303/304).
RETRAIN_FLEETS = 3
MODEL_CARD = default_model_path().with_name("MODEL_CARD.md")


def timed(label: str, fn, *args, **kwargs):
    started = time.monotonic()
    result = fn(*args, **kwargs)
    seconds = time.monotonic() - started
    print(f"{label:44} {seconds:8.1f} s", flush=True)
    return result, seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--days", type=float, default=30)
    p.add_argument("--resolution", type=float, default=60.0, help="seconds")
    p.add_argument("--fault-rate-multiplier", type=float, default=30.0)
    p.add_argument("--train-profile", default="noisy", choices=sorted(PROFILES))
    p.add_argument("--heldout-profile", default="shifted", choices=sorted(PROFILES))
    p.add_argument("--validation-profile", default="validation", choices=sorted(PROFILES),
                   help="where design choices are judged (neither trained on nor held out)")
    p.add_argument("--budget", type=float, default=1.0, help="false alarms per 1,000 GPU-days")
    p.add_argument("--keep", metavar="DIR",
                   help="write the recordings and models here and keep them (default: a temporary directory, deleted)")
    p.add_argument("--save-default", action="store_true",
                   help=f"train the shipped model on {', '.join(SHIPPED_PROFILES)} and write it with its model card")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    trained_on = {args.train_profile, *(SHIPPED_PROFILES if args.save_default else ())}
    if trained_on & {args.heldout_profile, args.validation_profile} or args.heldout_profile == args.validation_profile:
        p.error("the held-out and validation configurations must differ from each other and from the training ones")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="gpuwatch-bench-predict-"))
    try:
        return run(args, work)
    finally:
        if not args.keep:  # a full-size run leaves GBs of recordings
            shutil.rmtree(work, ignore_errors=True)


def fleet(args: argparse.Namespace, work: Path, profile: str, seed: int, times: dict) -> tuple:
    """Simulate one fleet of a configuration and build its dataset; returns (dataset, summary, truth)."""
    out = work / f"{profile}-{seed}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = replace(PROFILES[profile], nodes=args.nodes, gpus_per_node=args.gpus, days=args.days,
                  resolution_s=args.resolution, seed=seed, fault_rate_multiplier=args.fault_rate_multiplier)
    summary, times[f"simulate_{profile}_s"] = timed(f"simulate {profile} (seed {seed})", simulate_fleet, cfg, out,
                                                    quiet=True)
    ds, times[f"features_{profile}_s"] = timed(f"features + labels {profile}", build_dataset, out, quiet=True)
    truth = pd.DataFrame(json.loads((out / "simulation_truth.json").read_text()))
    return ds, summary, truth


def run(args: argparse.Namespace, work: Path) -> int:
    work.mkdir(parents=True, exist_ok=True)
    gpu_days = args.nodes * args.gpus * args.days
    print(f"fleets: {args.nodes} nodes x {args.gpus} GPUs x {args.days:g} days at {args.resolution:g} s "
          f"({gpu_days:,.0f} GPU-days each), fault rate x{args.fault_rate_multiplier:g}; budget {args.budget:g} "
          f"false alarms per 1,000 GPU-days")
    times: dict[str, float] = {}
    held, held_sim, held_truth = fleet(args, work, args.heldout_profile, 202, times)
    val, _, val_truth = fleet(args, work, args.validation_profile, 303, times)
    train_sets = [fleet(args, work, args.train_profile, 101 + k, times)[0] for k in range(RETRAIN_FLEETS)]
    desc = f"trained on one configuration ({args.train_profile}, {RETRAIN_FLEETS} fleets)"
    model, times["train_s"] = timed(f"train on {args.train_profile}", train_model, train_sets, description=desc,
                                    false_alarm_budget=args.budget, quiet=True)
    save_model(model, work / "retrained.skops")
    retrained, times["evaluate_retrained_s"] = timed("evaluate retrained on held-out", evaluate_model, model, held,
                                                     budget=args.budget, truth=held_truth)
    if args.save_default:
        shipped_model, shipped_sets = train_shipped(args, work, times)
    else:
        shipped_model, shipped_sets = load_model(None), None
    shipped, times["evaluate_shipped_s"] = timed("evaluate shipped on held-out", evaluate_model, shipped_model, held,
                                                 budget=args.budget, truth=held_truth)
    validation = {name: evaluate_model(m, val, budget=args.budget, truth=val_truth)
                  for name, m in (("retrained", model), ("shipped", shipped_model))}
    if args.save_default:
        save_model(shipped_model, default_model_path())
        MODEL_CARD.write_text(model_card(shipped_model, shipped_sets, shipped, validation["shipped"], args))
        print(f"default model written: {default_model_path()} ({default_model_path().stat().st_size:,} bytes), "
              f"card {MODEL_CARD}")
    score_s = time_score(work / f"{args.heldout_profile}-202", args.budget)
    times["gpuwatch_score_heldout_s"] = score_s
    print(f"\nheld-out fleet: {args.heldout_profile}, faults simulated {held_sim['faults']}, "
          f"near misses {held_sim['near_misses']}")
    for name, result in ((f"model retrained on {args.train_profile}", validation["retrained"]),
                         ("shipped default model", validation["shipped"])):
        print(f"\n== {name}: validation {args.validation_profile} (seed 303) ==")
        print(format_table(result))
    for name, result in ((f"model retrained on {args.train_profile}", retrained), ("shipped default model", shipped)):
        print(f"\n== {name}: held-out {args.heldout_profile}, horizon {result['evaluated_on']['horizon_s']:g} s ==")
        print(format_table(result))
    print(f"\n`gpuwatch score` on the held-out fleet ({gpu_days:,.0f} GPU-days): {score_s:.1f} s")
    if args.json:
        print(json.dumps({"times": times, "retrained": retrained, "shipped": shipped, "validation": validation},
                         default=str))
    if args.keep:
        print(f"\nrecordings and models in {work}")
    return 0


def train_shipped(args: argparse.Namespace, work: Path, times: dict) -> tuple[dict, list[str]]:
    """The default model: trained across several configurations (each split in time on its own)."""
    sets, names = [], []
    for k in range(SHIPPED_FLEETS_PER_PROFILE * len(SHIPPED_PROFILES)):
        profile = SHIPPED_PROFILES[k % len(SHIPPED_PROFILES)]
        ds, _, _ = fleet(args, work, profile, 11 + k, times)
        sets.append(ds)
        names.append(f"{profile} (seed {11 + k})")
    desc = (f"simulated-fleet-trained: gpuwatch failsim configurations {', '.join(names)}, "
            f"each {args.nodes}x{args.gpus} GPUs, {args.days:g} days, fault rate x{args.fault_rate_multiplier:g}; "
            "not trained on real hardware data")
    model, times["train_shipped_s"] = timed("train shipped model", train_model, sets, description=desc,
                                            false_alarm_budget=args.budget, quiet=True)
    return model, names


def model_card(model: dict, trained_on: list[str], result: dict, validation: dict, args: argparse.Namespace) -> str:
    """The shipped model's card: what it was trained on and how it did on a configuration it never saw."""
    return "\n".join([
        "# Shipped failure model (models/data/default_model.skops)", "",
        "Regenerate: `python bench/predict.py --save-default` (writes the model and this card).", "",
        "## Trained on", "",
        f"Simulated fleets (`gpuwatch simulate --profile NAME`, docs/failure-model.md §1): {', '.join(trained_on)}; "
        f"each {args.nodes} nodes x {args.gpus} GPUs x {args.days:g} days at {args.resolution:g} s, fault rate "
        f"x{args.fault_rate_multiplier:g}. No real hardware data. Horizon {model['horizon_s']:g} s; "
        f"{len(model['features'])} features; start threshold {model['threshold']:.4f} (only the start value: the "
        "collector and `gpuwatch score` calibrate it online to the false-alarm budget).", "",
        f"## Held-out configuration: `{args.heldout_profile}` (seed 202), never trained on", "",
        f"Budget {args.budget:g} false alarms per 1,000 GPU-days, threshold calibrated online on the fleet's own "
        "unlabelled scores; rules = DCGM health limits on 1-h rates, one scale factor tuned to the same budget on the "
        "training data.", "", "```", format_table(result), "```", "",
        f"## Validation configuration: `{args.validation_profile}` (seed 303), neither trained on nor held out", "",
        "Where the features, the training set and the calibration were chosen; same budget and columns.", "",
        "```", format_table(validation), "```", "",
        "Sudden faults (GSP, fell off the bus without warning) are not predictable from telemetry; they are "
        "reported apart (`event_recall_sudden`). Re-evaluate on your own fleet (`gpuwatch evaluate`, `gpuwatch "
        "score`) before trusting the numbers above.", ""])


def time_score(recording: Path, budget: float) -> float:
    """Wall time of `gpuwatch score` with the shipped model on a recording, as an operator runs it."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "gpuwatch", "score", str(recording), "--model", "default",
                    "--false-alarm-budget", str(budget), "--json", "--quiet"], check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - started


if __name__ == "__main__":
    sys.exit(main())
