"""The `gpuwatch` command: a thin dispatcher over the subcommands.

COMMANDS names each command's :class:`~gpuwatch.apps.commandline.Command` as ``module:NAME`` with its help
text. Only the module of the command being run is imported, so `gpuwatch --help` and the agent start fast.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
from typing import TYPE_CHECKING

from gpuwatch import __version__
from gpuwatch.core.errors import UserError

if TYPE_CHECKING:  # imported with the command's module, not for `gpuwatch --help`
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType

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
    "jobs": ("gpuwatch.apps.query_cli:JOBS", "jobs the collector knows, with ranks, nodes, step rate, lost time"),
    "alerts": ("gpuwatch.apps.query_cli:ALERTS", "active (and resolved) early-failure and slow-rank alerts"),
    "simulate": ("gpuwatch.apps.models_cli:SIMULATE", "write a recording of a simulated fleet with failures"),
    "train": ("gpuwatch.apps.models_cli:TRAIN", "train the failure classifier on a recording or a store"),
    "evaluate": ("gpuwatch.apps.models_cli:EVALUATE", "time-split evaluation of a model against the rule baseline"),
    "score": ("gpuwatch.apps.models_cli:SCORE",
              "replay a recording or store through failure scoring and alerts, budget-calibrated"),
    "advise": ("gpuwatch.apps.models_cli:ADVISE",
               "checkpoint interval from the failure rate, and what a failure predictor changes"),
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


def _exit_now(status: int) -> None:
    """End the process with `status` once stdout and stderr are flushed, skipping the interpreter's teardown
    (a closed stdout raises BrokenPipeError here, handled by `main`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _keep_freed_memory() -> None:
    """Tell glibc's malloc to keep the memory a one-shot command frees for its next allocations, rather
    than give it back and fault it in again. A trace is read in blocks of 1 MB, each freed as the next is
    made; by default each is an mmap of its own, or heap that is trimmed and grown again, and every page of
    it is faulted in anew (about 3.7 us a page on a VM): ns_resolution_rank0's analyze 9,125 page faults,
    7,340 so, best of 31 156 -> 152 ms, median 163 -> 156 ms, for 2 MB more peak. A no-op where malloc is
    not glibc's."""
    import ctypes  # loaded already, by numpy

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # allocations below 32 MB from the heap (the default moves up to it)
    mallopt(_M_TRIM_THRESHOLD, 64 << 20)  # up to 64 MB free at the heap's top kept


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>


class _LazyNumpyDocstrings:
    """An import finder that makes numpy's two docstring modules lazy (`importlib.util.LazyLoader`): they
    run when something first touches them, not at numpy's import. numpy runs them only to attach docstrings
    to its C functions and types, about 350 `inspect.cleandoc` calls and the textwrap import: 6 ms of the
    150 ms of a small `analyze` (numpy 2.4), for text no command shows. Whatever reads those modules (a numpy
    that imports a name from them; pandas, torch and others that walk `sys.modules` do touch them) runs
    them then, in full, and numpy's own documentation build mocks the second one out: both only attach
    text. Until then `numpy.ndarray.all.__doc__` is None, as under `python -OO`."""

    modules = frozenset(("numpy._core._add_newdocs", "numpy._core._add_newdocs_scalars",
                         "numpy.core._add_newdocs", "numpy.core._add_newdocs_scalars"))  # numpy 2.x, 1.x

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:  # the meta path finder protocol
        if name not in self.modules:
            return None
        import importlib.machinery
        import importlib.util

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = importlib.util.LazyLoader(spec.loader)
        return spec


def _help_formatter(prog: str) -> argparse.HelpFormatter:
    """argparse's help formatter at the terminal's width, read as `shutil.get_terminal_size` reads it
    ($COLUMNS, else the terminal of stdout, else 80 columns). argparse makes a formatter for every argument
    added, and left to itself imports shutil (with bz2 and lzma) for the width: 2 ms of a small `analyze`."""
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns if sys.__stdout__ else 0
        except (AttributeError, ValueError, OSError):  # no stdout, or not a terminal
            columns = 0
    return argparse.HelpFormatter(prog, width=(columns if columns > 0 else 80) - 2)


def _main(given: list[str] | None) -> int:
    argv = sys.argv[1:] if given is None else given
    if given is None:
        # The cycle collector's passes while the command's modules import find nothing to free (modules,
        # classes and functions live on) and cost 6 ms of numpy's import; back on below unless one-shot.
        gc.disable()
        if not any(isinstance(finder, _LazyNumpyDocstrings) for finder in sys.meta_path):
            sys.meta_path.insert(0, _LazyNumpyDocstrings())  # before a command's modules import numpy
    parser = argparse.ArgumentParser(
        prog="gpuwatch",
        description="Where GPU time goes in training clusters, and which GPU is about to fail.",
        formatter_class=_help_formatter,
    )
    parser.add_argument("--version", action="version", version=f"gpuwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    # Only the command being run is declared (each parser costs its formatter's set-up: 6 ms for all of them,
    # 3 % of a small `analyze`); all of them for the overall help and for an unknown command's error.
    for name in [wanted] if wanted in COMMANDS else COMMANDS:
        help_text = COMMANDS[name][1]
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_help_formatter)
        if name == wanted:
            command(name).add_arguments(p)
    try:
        args = parser.parse_args(argv)  # an argument type may raise UserError: one line naming the flag
        if args.command is None:
            parser.print_help()
            return 2
        chosen = command(args.command)
        one_shot = chosen.one_shot and given is None  # gpuwatch is the process, not a library call
        if given is None and not one_shot:
            gc.enable()
        if one_shot:
            _keep_freed_memory()
        status = int(chosen.run(args) or 0)
        if one_shot:
            _exit_now(status)
        return status
    except UserError as exc:
        print(f"gpuwatch {wanted}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
