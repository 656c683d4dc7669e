"""`gpuwatch simulate`, `train`, `evaluate`, `score` and `advise`: thin wrappers over the models library
(each ``_name(args)`` turns its flags into the library's keyword arguments and returns the result document)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from gpuwatch.apps.commandline import duration, positive_float, result_command
from gpuwatch.core.errors import UserError
from gpuwatch.core.settings import DEFAULT_FALSE_ALARM_BUDGET
from gpuwatch.simulator.failing_fleet import FLEET_KNOBS, PROFILES
from gpuwatch.simulator.prior import PRIORS

def recall_value(text: str) -> float:
    """A predictor recall in [0, 1): at 1 no failure is left to checkpoint against."""
    try:
        r = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= r < 1:
        raise argparse.ArgumentTypeError(f"recall must be in [0, 1), got {text}")
    return r


def _timed(compute: Callable[[argparse.Namespace], dict]) -> Callable[[argparse.Namespace], dict]:
    """``compute`` whose result also says how many ``seconds`` it took."""

    def timed(args: argparse.Namespace) -> dict:
        started = time.monotonic()
        result = compute(args)
        result["seconds"] = round(time.monotonic() - started, 1)
        return result

    return timed


def as_text(result: dict) -> str:
    """A result's ``table`` entry when it has one, else its items one per line."""
    return (result.pop("table", None) or "\n".join(f"{k}: {readable(v)}" for k, v in result.items())) + "\n"


def _advise_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the job")
    p.add_argument("--checkpoint-cost", type=duration, default=300.0,
                   help="time one checkpoint stalls the job (default 5m)")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--failure-rate", type=float, help="faults per GPU-hour (default: the Llama 3 rate)")
    rate.add_argument("--data", help="recording or collector .duckdb store to measure the fault rate on")
    p.add_argument("--recall", type=recall_value, nargs="+", default=[],
                   help="more predictor recalls to tabulate (0, 0.5, 0.8, 0.9 and the model's are always shown)")


def _simulate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=4, help="nodes in the fleet (default 4)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    p.add_argument("--days", type=float, default=2.0, help="simulated days to record (default 2)")
    p.add_argument("--seed", type=int, default=0, help="random seed: the same seed writes the same fleet (default 0)")
    p.add_argument("--resolution", type=duration, default=60.0, help="sample interval (default 60s)")
    p.add_argument("--fault-rate-multiplier", type=float, default=1.0,
                   help="scale the published base rate so small fleets contain enough faults")
    p.add_argument("--profile", choices=sorted(PROFILES), default="base",
                   help="a fleet configuration to start from (the options below override it)")
    for name, help_text in FLEET_KNOBS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=float,
                       help=help_text.replace("%", "%%"))  # argparse %-formats help: the texts are plain prose
    p.add_argument("--out", required=True, help="recording directory to write")


def _data_arguments(p: argparse.ArgumentParser) -> None:
    """The data and false-alarm budget of train, evaluate and score."""
    p.add_argument("data", help="recording directory or collector .duckdb store")
    p.add_argument("--false-alarm-budget", type=positive_float, default=DEFAULT_FALSE_ALARM_BUDGET,
                   help="false alarms per 1,000 GPU-days the operator accepts (default 1): the alert threshold "
                   "is calibrated to it on the fleet's own recent scores")


def _train_arguments(p: argparse.ArgumentParser) -> None:
    _data_arguments(p)
    p.add_argument("--horizon", type=duration, default=3600.0, help="predict faults within (default 1h)")
    p.add_argument("-o", "--output", required=True, help="model file to write (.skops)")
    p.add_argument("--prior", choices=PRIORS, default=PRIORS[0],
                   help="what to learn from beside DATA: 'simulated' (default) adds simulated fleets of randomized "
                   "configurations, so a site with few faults still gets a model that ranks; 'none' learns from "
                   "DATA alone (needs >= 3 faults in its first 60%%)")


def _evaluate_arguments(p: argparse.ArgumentParser) -> None:
    _data_arguments(p)
    p.add_argument("--model", help="model file (default: the shipped simulated-fleet model)")


def _score_arguments(p: argparse.ArgumentParser) -> None:
    _data_arguments(p)
    p.add_argument("--model", required=True, help="model file, or 'default' for the shipped model")


def readable(value: object) -> str:
    """A result value as a person reads it: "sudden 1, memory 2" rather than Python's "{'sudden': 1, ...}"."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {readable(v)}" for k, v in value.items()) or "none"
    if isinstance(value, (list, tuple)):
        return ", ".join(readable(v) for v in value) or "none"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _simulate(args: argparse.Namespace) -> dict:
    from gpuwatch.simulator.failing_fleet import simulate_fleet

    for name in ("nodes", "gpus", "days"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name} must be positive, got {getattr(args, name)}")
    knobs = {k: getattr(args, k) for k in FLEET_KNOBS if getattr(args, k) is not None}
    bad = [f"--{k.replace('_', '-')}" for k, v in knobs.items() if v < 0]
    if bad:
        raise UserError(f"{', '.join(bad)} must not be negative")
    cfg = replace(PROFILES[args.profile], nodes=args.nodes, gpus_per_node=args.gpus, days=args.days,
                  resolution_s=args.resolution, seed=args.seed, fault_rate_multiplier=args.fault_rate_multiplier,
                  **knobs)
    return {"out": args.out, **simulate_fleet(cfg, args.out, quiet=args.quiet)}


def _train(args: argparse.Namespace) -> dict:
    from gpuwatch.models.dataset import build_dataset, open_source
    from gpuwatch.models.model import save_model
    from gpuwatch.models.train import train_model

    check_writable(args.output)  # before minutes of training, not after
    if not open_source(args.data).has_telemetry():  # before a grid of empty windows over the data's span
        raise UserError(f"{args.data}: holds no telemetry (every sample's fields are empty, as in a fault log "
                        "converted to a recording): a failure model learns warning signs from telemetry; "
                        "`gpuwatch advise --data` measures fault rates from such data")
    ds = build_dataset(args.data, horizon_s=args.horizon, quiet=args.quiet)
    prior, prior_name = None, "none"
    if args.prior == "simulated":
        from gpuwatch.simulator.prior import describe_prior, prior_datasets

        prior = prior_datasets(horizon_s=ds.horizon_s, warning_s=ds.warning_s, step_s=ds.step_s)
        prior_name = describe_prior()
    model = train_model(ds, false_alarm_budget=args.false_alarm_budget, description=f"trained on {args.data}",
                        quiet=args.quiet, prior=prior, prior_name=prior_name)
    if ds.uninformative_fields or model.training.dropped_features:
        fields = ", ".join(f"{k} ({v})" for k, v in (ds.uninformative_fields or {}).items()) or "none"
        print(f"gpuwatch train: left out {len(model.training.dropped_features)} features without information "
              f"in {args.data}; fields never recorded or constant: {fields}", file=sys.stderr)
    try:
        save_model(model, args.output)
    except OSError as exc:
        raise UserError(f"{args.output}: cannot write the model: {exc.strerror or exc}") from None
    return {"model": args.output, "threshold": model.threshold, "training": model.training.to_dict(),
            "validation": model.validation_metrics}


def check_writable(path: str) -> None:
    """A UserError unless ``path`` can be created or overwritten as a file."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{path}: is a directory; give a model file name (.skops)")
    parent = p.parent
    if not parent.is_dir():
        raise UserError(f"{path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UserError(f"{path}: not writable")


def _advise(args: argparse.Namespace) -> dict:
    from gpuwatch.models.advisor import advice_table

    if args.gpus <= 0:
        raise UserError(f"--gpus must be positive, got {args.gpus}")
    if args.failure_rate is not None and args.failure_rate <= 0:
        raise UserError(f"--failure-rate must be positive, got {args.failure_rate}")
    result = advice_table(args.gpus, args.checkpoint_cost, failure_rate=args.failure_rate, data=args.data,
                          recalls=args.recall)
    if not args.json:
        result["table"] = format_advice(result)
    return result


def format_advice(result: dict) -> str:
    """The advice as text: rate and its source, the two intervals, then interval/waste per recall."""
    rate = result["rate"]
    lines = [f"failure rate: {rate['faults_per_gpu_hour']:.3g} per GPU-hour of {rate['counts']} ({rate['source']})",
             *([f"  why: {rate['why']}"] if rate.get("why") else []),
             f"job: {result['gpus']} GPUs, MTBF {result['mtbf_s'] / 3600:.2f} h, "
             f"checkpoint cost {result['checkpoint_s'] / 60:g} min",
             f"Young interval: {result['young_interval_s'] / 60:.1f} min, waste {result['waste']:.1%}",
             f"Daly interval:  {result['daly_interval_s'] / 60:.1f} min",
             "", f"{'recall':<14}  {'interval':>10}  {'waste':>6}"]
    for row in result["by_recall"]:
        label = f"{row['recall']:.2f}" + (" (model)" if row.get("model") else "")
        lines.append(f"{label:<14}  {row['interval_s'] / 60:>6.1f} min  {row['waste']:>6.1%}")
    return "\n".join(lines)


def _evaluate(args: argparse.Namespace) -> dict:
    from gpuwatch.models.dataset import build_dataset
    from gpuwatch.models.evaluate import evaluate_model, format_table
    from gpuwatch.models.model import load_model

    model = load_model(args.model)
    ds = build_dataset(args.data, horizon_s=model.horizon_s, warning_s=model.warning_s, step_s=model.step_s,
                       quiet=args.quiet)
    result = evaluate_model(model, ds, budget=args.false_alarm_budget)
    if not args.json:
        result["table"] = format_table(result)
    return result


def _score(args: argparse.Namespace) -> dict:
    """Replay the data in time order through scoring, budget calibration and the alert policy."""
    from gpuwatch.models.alerting import replay
    from gpuwatch.models.dataset import build_dataset
    from gpuwatch.models.model import load_model

    model = load_model(None if args.model == "default" else args.model)
    ds = build_dataset(args.data, horizon_s=model.horizon_s, warning_s=model.warning_s, step_s=model.step_s,
                       quiet=args.quiet)
    r = replay(ds.rows, model.risk(ds.rows), ds.episodes, policy=model.alert_policy(), step_s=ds.step_s,
               budget=args.false_alarm_budget, horizon_s=ds.horizon_s)
    alerts = [{"node": a.node, "gpu_index": int(a.gpu_index), "start_ms": int(a.start_ms),
               "end_ms": None if a.end_ms != a.end_ms else int(a.end_ms), "peak_risk": round(float(a.peak_risk), 4)}
              for a in r.alerts.sort_values(["start_ms", "node", "gpu_index"]).itertuples()]
    result = {"alerts": alerts, "gpu_days": round(len(ds.rows) * ds.step_s / 86400, 1),
              "false_alarm_budget": args.false_alarm_budget, "model": model.description[:120],
              "threshold_last": float(r.threshold[np.argmax(ds.rows["t_ms"].to_numpy())]) if len(ds.rows) else None}
    if not args.json:
        lines = [f"{len(alerts)} alerts over {result['gpu_days']} GPU-days (budget {args.false_alarm_budget:g} "
                 "false alarms per 1,000 GPU-days)"]
        lines += [f"{a['node']} GPU {a['gpu_index']}: {_iso(a['start_ms'])} .. "
                  f"{_iso(a['end_ms']) if a['end_ms'] else 'firing'}  peak risk {a['peak_risk']:.3f}" for a in alerts]
        result["table"] = "\n".join(lines)
    return result


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))


ADVISE = result_command(_advise_arguments, _timed(_advise), as_text)
SIMULATE = result_command(_simulate_arguments, _timed(_simulate), as_text)
TRAIN = result_command(_train_arguments, _timed(_train), as_text)
EVALUATE = result_command(_evaluate_arguments, _timed(_evaluate), as_text)
SCORE = result_command(_score_arguments, _timed(_score), as_text)
