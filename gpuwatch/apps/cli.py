"""The `gpuwatch` command: a thin dispatcher over the subcommands.

COMMANDS names each command's :class:`~gpuwatch.apps.commandline.Command` as ``module:NAME`` with its help
text. Only the module of the command being run is imported, so `gpuwatch --help` and the agent start fast.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import TYPE_CHECKING

from gpuwatch import __version__
from gpuwatch.core.errors import UserError

if TYPE_CHECKING:  # imported with the command's module, not for `gpuwatch --help`
    from gpuwatch.apps.commandline import Command

COMMANDS: dict[str, tuple[str, str]] = {
    "agent": ("gpuwatch.apps.agent_cli:AGENT", "run the node agent: sample GPUs and stream them to a collector"),
    "collector": ("gpuwatch.apps.collector_cli:COLLECTOR", "run the collector: receive, store, analyse, alert"),
    "nodes": ("gpuwatch.apps.query_cli:NODES", "list the nodes a collector has seen"),
    "gpus": ("gpuwatch.apps.query_cli:GPUS", "list GPUs with their latest job"),
    "latest": ("gpuwatch.apps.query_cli:LATEST", "latest values of every field, per GPU"),
    "series": ("gpuwatch.apps.query_cli:SERIES", "one field's time series for one GPU"),
    "events": ("gpuwatch.apps.query_cli:EVENTS", "events (XIDs, GPU lost, agent start/stop, ...)"),
    "demo": ("gpuwatch.apps.demo:DEMO", "run a simulated fleet into a local collector and show it live"),
    "analyze": ("gpuwatch.apps.analyze_cli:ANALYZE", "efficiency breakdown of profiler traces or span tables"),
    "submit-trace": ("gpuwatch.apps.breakdown_cli:SUBMIT_TRACE", "send traces of a job to the collector for analysis"),
    "breakdown": ("gpuwatch.apps.breakdown_cli:BREAKDOWN", "a job's efficiency breakdown from the collector"),
    "usage": ("gpuwatch.apps.query_cli:USAGE", "GPU-hours, lost time, utilisation and energy per pod, namespace, "
                                               "job or user"),
    "jobs": ("gpuwatch.apps.query_cli:JOBS", "jobs the collector knows, with ranks, nodes, step rate, lost time"),
    "alerts": ("gpuwatch.apps.query_cli:ALERTS", "active (and resolved) early-failure and slow-rank alerts"),
    "simulate": ("gpuwatch.apps.models_cli:SIMULATE", "write a recording of a simulated fleet with failures"),
    "train": ("gpuwatch.apps.models_cli:TRAIN", "train the failure classifier on a recording or a store"),
    "evaluate": ("gpuwatch.apps.models_cli:EVALUATE", "time-split evaluation of a model against the rule baseline"),
    "score": ("gpuwatch.apps.models_cli:SCORE",
              "replay a recording or store through failure scoring and alerts, budget-calibrated"),
    "advise": ("gpuwatch.apps.models_cli:ADVISE",
               "checkpoint interval from the failure rate, and what a failure predictor changes"),
    "fleet": ("gpuwatch.apps.fleet_cli:FLEET",
              "fleet reliability: fault rates, repair times, repeats and lemon GPUs and nodes"),
    "replay": ("gpuwatch.apps.recording_cli:REPLAY", "run a recording through the pipeline"),
    "import": ("gpuwatch.apps.recording_cli:IMPORT", "turn CSV/Parquet telemetry into a recording"),
    "export": ("gpuwatch.apps.recording_cli:EXPORT", "write a collector store (stopped, or a copy) out as a recording"),
}


def command(name: str) -> Command:
    """The Command registered under ``name`` (its module imported now)."""
    module, _, attribute = COMMANDS[name][0].partition(":")
    return getattr(importlib.import_module(module), attribute)


def main(argv: list[str] | None = None) -> int:
    """Run one command; a reader that closed the pipe (`gpuwatch ... | head`) ends it quietly with 141."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # here, not at exit, so a closed pipe is caught below
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's own flush at exit
        return 141


def _main(given: list[str] | None) -> int:
    argv = sys.argv[1:] if given is None else given
    parser = argparse.ArgumentParser(
        prog="gpuwatch",
        description="Where GPU time goes in training clusters, and which GPU is about to fail.",
    )
    parser.add_argument("--version", action="version", version=f"gpuwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    # Only the command being run is declared, so only its module is imported; all of them for the overall
    # help and for an unknown command's error.
    for name in [wanted] if wanted in COMMANDS else COMMANDS:
        help_text = COMMANDS[name][1]
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            command(name).add_arguments(p)
    try:
        args = parser.parse_args(argv)  # an argument type may raise UserError: one line naming the flag
        if args.command is None:
            parser.print_help()
            return 2
        return int(command(args.command).run(args) or 0)
    except UserError as exc:
        print(f"gpuwatch {wanted}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
