"""Failure-prediction benchmark on fleets of configurations the shipped model was never trained on.

For each held-out configuration one fleet is simulated for two periods ("months", ``--days`` each), as a new
site would meet it. Side by side on the second period:

- **retrained**: `train --prior none` on the site's own first period (rows whose horizon reaches into the
  second are left out), alert threshold calibrated online to the budget;
- **retrained+prior**: `train` as shipped (`--prior simulated`): the same first period beside simulated fleets
  of randomized configurations (simulator/prior.py), the site's rows weighted up;
- **shipped**: the default model as shipped, threshold calibrated online to the budget on the site's scores;
- **candidate MIXTURE** (``--candidate``): a shipped model trained here on a training mixture — ``profiles``
  (SHIPPED_PROFILES, two fleets each) or ``randomized`` (as many fleets, every site knob drawn at random:
  simulator.failing_fleet.randomized_config) — calibrated as the shipped one;
- **rules**: the DCGM-style rules at the threshold chosen for the budget on the site's first period.

Reported: recall of faults with precursors (and by kind), false alarms per 1,000 GPU-days, median lead.
The `validation` configuration (neither trained on nor held out) is where design choices are judged; the
held-out numbers are looked at only after. `--save-default` writes, with its model card, the candidate
(default: ``profiles``) that does best on `validation` — within the budget first, then recall — unless the
shipped model does better there. Also times `gpuwatch score`.

    python bench/predict.py                                   # 8 nodes x 8 GPUs, 2 x 21 days per fleet
    python bench/predict.py --heldout shifted real busy-idle  # the unseen fleets (default)
    python bench/predict.py --candidate profiles --candidate randomized   # training mixtures side by side
    python bench/predict.py --save-default --candidate randomized         # ... and write the best one
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
from typing import Any

import pandas as pd

from gpuwatch.core.errors import UserError
from gpuwatch.models.dataset import Dataset, build_dataset
from gpuwatch.models.evaluate import predictor_metrics
from gpuwatch.models.model import FailureModel, default_model_path, load_model, save_model
from gpuwatch.models.rules import rule_scores
from gpuwatch.models.train import train_model
from gpuwatch.simulator.failing_fleet import PROFILES, FleetConfig, randomized_config, simulate_fleet
from gpuwatch.simulator.prior import describe_prior, prior_datasets

#: The configurations the shipped model is trained on (a held-out one is never among them).
SHIPPED_PROFILES = ("base", "noisy", "subtle")
HELDOUT_PROFILES = ("shifted", "real", "busy-idle")
MODEL_CARD = default_model_path().with_name("MODEL_CARD.md")
MIXTURES = ("profiles", "randomized")


def timed(label: str, fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    started = time.monotonic()
    result = fn(*args, **kwargs)
    seconds = time.monotonic() - started
    print(f"{label:48} {seconds:8.1f} s", flush=True)
    return result, seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--days", type=float, default=21, help="days of one period (the fleet runs two)")
    p.add_argument("--resolution", type=float, default=120.0, help="seconds")
    p.add_argument("--fault-rate-multiplier", type=float, default=100.0,
                   help="scale the real GPU fault rate so small fleets hold enough faults to learn and judge")
    p.add_argument("--heldout", nargs="+", default=list(HELDOUT_PROFILES), choices=sorted(PROFILES))
    p.add_argument("--validation-profile", default="validation", choices=sorted(PROFILES),
                   help="where design choices are judged (neither trained on nor held out)")
    p.add_argument("--budget", type=float, default=1.0, help="false alarms per 1,000 GPU-days")
    p.add_argument("--keep", metavar="DIR",
                   help="write the recordings and models here and keep them (default: a temporary directory, deleted)")
    p.add_argument("--candidate", action="append", choices=MIXTURES, default=[],
                   help="train a candidate shipped model on this mixture and judge it beside the shipped one")
    p.add_argument("--save-default", action="store_true",
                   help="write the candidate that does best on the validation fleet (default candidate: profiles) "
                        "as the shipped model, with its model card")
    p.add_argument("--fleets-per-profile", type=int, default=2,
                   help=f"training fleets per configuration of {', '.join(SHIPPED_PROFILES)} (candidates; "
                        "randomized trains on as many)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.save_default and not args.candidate:
        args.candidate = ["profiles"]
    judged = {*args.heldout, args.validation_profile}
    if judged & set(SHIPPED_PROFILES) or args.validation_profile in args.heldout:
        p.error("held-out and validation configurations must differ from each other and from the training ones")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="gpuwatch-bench-predict-"))
    try:
        return run(args, work)
    finally:
        if not args.keep:  # a full-size run leaves GBs of recordings
            shutil.rmtree(work, ignore_errors=True)


def fleet(args: argparse.Namespace, work: Path, profile: str, seed: int, days: float, times: dict,
          config: FleetConfig | None = None) -> tuple[Dataset, dict, pd.DataFrame]:
    """Simulate one fleet of a configuration (``config`` where given, else the named profile) and build its
    dataset; returns (dataset, summary, truth)."""
    out = work / f"{profile}-{seed}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = replace(config or PROFILES[profile], nodes=args.nodes, gpus_per_node=args.gpus, days=days,
                  resolution_s=args.resolution, seed=seed, fault_rate_multiplier=args.fault_rate_multiplier)
    summary, times[f"simulate_{profile}_s"] = timed(f"simulate {profile} (seed {seed}, {days:g} days)",
                                                    simulate_fleet, cfg, out, quiet=True)
    ds, times[f"features_{profile}_s"] = timed(f"features + labels {profile}", build_dataset, out, quiet=True)
    truth = pd.DataFrame(json.loads((out / "simulation_truth.json").read_text()))
    return ds, summary, truth


def first_period(ds: Dataset, end_ms: int) -> Dataset:
    """The site's data up to ``end_ms`` as if nothing later were recorded (labels censored where their horizon
    passes it)."""
    keep = ds.rows["t_ms"].to_numpy() < end_ms
    rows = ds.rows[keep].copy()
    rows["censored"] |= rows["t_ms"].to_numpy() + ds.horizon_s * 1000 > end_ms
    eps = ds.episodes[ds.episodes["start_ms"] < end_ms]
    source = replace(ds.source, end_ms=end_ms, fingerprint=ds.source.fingerprint + "-first")
    return Dataset(rows, eps, source, ds.horizon_s, ds.warning_s, ds.step_s, ds.uninformative_fields)


def judge(ds: Dataset, truth: pd.DataFrame, shipped: dict[str, FailureModel], args: argparse.Namespace, times: dict,
          name: str) -> dict:
    """Every predictor on the second period of ``ds``; ``shipped`` maps a column name to a model calibrated
    online as shipped (the shipped model, the candidates)."""
    mid = ds.source.start_ms + (ds.source.end_ms - ds.source.start_ms) // 2
    block = (mid + int(ds.horizon_s * 1000), ds.source.end_ms + 1)
    site = first_period(ds, mid)
    out: dict[str, dict] = {}
    try:
        retrained, times[f"train_{name}_s"] = timed(f"train on {name}'s first period", train_model, site,
                                                    description=f"{name} first period",
                                                    false_alarm_budget=args.budget, quiet=True)
        out["retrained"] = predictor_metrics(ds, retrained.risk(ds.rows), block, threshold=retrained.threshold,
                                             budget=args.budget, truth=truth)
    except UserError as exc:  # a small fleet's first period may hold too few faults to retrain on alone
        print(f"== {name}: retrained without a prior: not judged: {exc}", flush=True)
    with_prior, times[f"train_prior_{name}_s"] = timed(
        f"train on {name}'s first period + prior", train_model, site, description=f"{name} first period",
        false_alarm_budget=args.budget, quiet=True, prior=prior_datasets(
            horizon_s=ds.horizon_s, warning_s=ds.warning_s, step_s=ds.step_s), prior_name=describe_prior())
    out["retrained+prior"] = predictor_metrics(ds, with_prior.risk(ds.rows), block, threshold=with_prior.threshold,
                                               budget=args.budget, truth=truth)
    for column, model in shipped.items():
        out[column] = predictor_metrics(ds, model.risk(ds.rows), block, threshold=model.threshold,
                                        budget=args.budget, truth=truth)
    out["rules"] = predictor_metrics(ds, rule_scores(ds.rows), block, threshold=with_prior.baseline_threshold,
                                     budget=None, truth=truth)
    return out


def side_by_side(name: str, result: dict) -> str:
    """One line per predictor: recall, by kind, false alarms per 1,000 GPU-days, median lead."""
    def f(v: Any, fmt: str = ".2f") -> str:
        return "-" if v is None else format(v, fmt)

    lines = [f"== {name} ==", f"{'':20} {'recall':>7} {'FA/1000d':>9} {'lead min':>9} {'sudden':>7}  by kind"]
    for k, r in result.items():
        lead = None if r["median_lead_time_s"] is None else r["median_lead_time_s"] / 60
        kinds = ", ".join(f"{a} {b}" for a, b in (r.get("recall_by_mechanism") or r["recall_by_kind"]).items())
        lines.append(f"{k:20} {f(r['event_recall']):>7} {f(r['false_alarms_per_1000_gpu_days']):>9} "
                     f"{f(lead, '.0f'):>9} {f(r['event_recall_sudden']):>7}  {kinds}")
    r = result["rules"]
    lines.append(f"({r['faults']} faults with precursors, {r['faults_sudden']} sudden, {r['gpu_days']} GPU-days)")
    return "\n".join(lines)


def run(args: argparse.Namespace, work: Path) -> int:
    work.mkdir(parents=True, exist_ok=True)
    print(f"fleets: {args.nodes} nodes x {args.gpus} GPUs x 2 x {args.days:g} days at {args.resolution:g} s, "
          f"fault rate x{args.fault_rate_multiplier:g}; budget {args.budget:g} false alarms per 1,000 GPU-days")
    times: dict[str, float] = {}
    shipped = {"shipped": load_model(None)}
    trained_on: dict[str, list[str]] = {}
    for mixture in dict.fromkeys(args.candidate):
        shipped[f"candidate {mixture}"], trained_on[f"candidate {mixture}"] = train_candidate(
            args, work, times, mixture)
    results: dict[str, dict] = {}
    for k, profile in enumerate([args.validation_profile, *args.heldout]):
        ds, _, truth = fleet(args, work, profile, 202 + k, 2 * args.days, times)
        try:
            results[profile] = judge(ds, truth, shipped, args, times, profile)
        except UserError as exc:  # a small fleet's first period may hold too few faults to retrain on
            print(f"== {profile}: not judged: {exc}", flush=True)
            continue
        print(side_by_side(profile + (" (validation)" if k == 0 else " (held out)"), results[profile]), flush=True)
    if args.save_default:
        best = choose(results.get(args.validation_profile), list(shipped), args.budget)
        if best == "shipped":
            print("the shipped model does best on the validation fleet: default model not replaced")
        else:
            save_model(shipped[best], default_model_path())
            MODEL_CARD.write_text(model_card(shipped[best], best, trained_on[best], results, args))
            print(f"default model written ({best}): {default_model_path()} "
                  f"({default_model_path().stat().st_size:,} bytes), card {MODEL_CARD}")
    score_s = time_score(work / f"{args.heldout[0]}-203", args.budget)
    times["gpuwatch_score_heldout_s"] = score_s
    print(f"\n`gpuwatch score` on the {args.heldout[0]} fleet: {score_s:.1f} s")
    if args.json:
        print(json.dumps({"times": times, "results": results}, default=str))
    if args.keep:
        print(f"\nrecordings and models in {work}")
    return 0


def choose(validation: dict | None, columns: list[str], budget: float) -> str:
    """The column that does best on the validation fleet: within the budget first, then recall, then fewer false
    alarms; the shipped model where nothing was judged there."""
    if validation is None:
        return "shipped"

    def rank(column: str) -> tuple[bool, float, float]:
        r = validation[column]
        fa = r["false_alarms_per_1000_gpu_days"] or 0.0
        return fa <= budget, r["event_recall"] or 0.0, -fa

    return max(columns, key=rank)


def train_candidate(args: argparse.Namespace, work: Path, times: dict, mixture: str) -> tuple[FailureModel, list[str]]:
    """A shipped model trained across several fleets (each split in time on its own): the SHIPPED_PROFILES, or
    as many fleets each of a randomized configuration. Never a validation or held-out profile."""
    sets, names = [], []
    for k in range(args.fleets_per_profile * len(SHIPPED_PROFILES)):
        seed = 11 + k
        if mixture == "profiles":
            profile, config = SHIPPED_PROFILES[k % len(SHIPPED_PROFILES)], None
        else:
            profile, config = "randomized", randomized_config(seed)
        ds, _, _ = fleet(args, work, profile, seed, 2 * args.days, times, config)
        sets.append(ds)
        names.append(f"{profile} (seed {seed})")
    desc = (f"simulated-fleet-trained: gpuwatch simulate configurations {', '.join(names)}, "
            f"each {args.nodes}x{args.gpus} GPUs, {2 * args.days:g} days, fault rate x{args.fault_rate_multiplier:g}; "
            "not trained on real hardware data")
    model, times[f"train_{mixture}_s"] = timed(f"train candidate ({mixture})", train_model, sets, description=desc,
                                               false_alarm_budget=args.budget, quiet=True)
    return model, names


def model_card(model: FailureModel, column: str, trained_on: list[str], results: dict, args: argparse.Namespace) -> str:
    """The shipped model's card: what it was trained on and how it did on configurations it never saw."""
    candidates = " ".join(f"--candidate {c}" for c in dict.fromkeys(args.candidate))
    lines = [
        "# Shipped failure model (models/data/default_model.skops)", "",
        "Regenerate: `python bench/predict.py --save-default` (writes the model and this card; "
        f"this one: `--nodes {args.nodes} --gpus {args.gpus} --days {args.days:g} --resolution {args.resolution:g} "
        f"--fault-rate-multiplier {args.fault_rate_multiplier:g} --fleets-per-profile {args.fleets_per_profile} "
        f"{candidates}`: this model is the column `{column}` below, chosen on `{args.validation_profile}` — within "
        "the budget first, then recall).",
        "",
        "## Trained on", "",
        "Simulated fleets (`gpuwatch simulate --profile NAME`; `randomized`: every site knob drawn at random, "
        f"simulator.failing_fleet.randomized_config; docs/failure-model.md): {', '.join(trained_on)}; "
        f"each {args.nodes} nodes x {args.gpus} GPUs x {2 * args.days:g} days at {args.resolution:g} s, fault rate "
        f"x{args.fault_rate_multiplier:g}, each split in time on its own. No real hardware data. Horizon "
        f"{model.horizon_s:g} s; {len(model.features)} features (the history across faults among them); "
        f"start threshold {model.threshold:.4f}, the highest of the training fleets' (only the start value: the "
        "collector and `gpuwatch score` calibrate it online to the false-alarm budget).", "",
        f"## Judged on fleets never trained on (budget {args.budget:g} false alarms per 1,000 GPU-days)", "",
        "Each fleet runs two periods; numbers are for the second. retrained = trained on the site's own first "
        f"period; shipped = the model shipped before this one; `{column}` = this model; candidates and both "
        "calibrated online to the budget. rules = DCGM health limits at the threshold chosen for the budget on the "
        "first period.", ""]
    for profile, result in results.items():
        lines += ["```", side_by_side(profile, result), "```", ""]
    lines += ["Sudden faults (no warning in telemetry) are reported apart. Re-evaluate on your own fleet "
              "(`gpuwatch evaluate`, `gpuwatch score`) before trusting the numbers above.", ""]
    return "\n".join(lines)


def time_score(recording: Path, budget: float) -> float:
    """Wall time of `gpuwatch score` with the shipped model on a recording, as an operator runs it."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "gpuwatch", "score", str(recording), "--model", "default",
                    "--false-alarm-budget", str(budget), "--json", "--quiet"], check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - started


if __name__ == "__main__":
    sys.exit(main())
