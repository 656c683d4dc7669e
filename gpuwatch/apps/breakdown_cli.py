"""`gpuwatch submit-trace --job J PATH...` and `gpuwatch breakdown JOB`: the collector's breakdowns.

Thin over `submit_traces()` and `fetch_breakdown()`, which tests and scripts call with a Query stub.
Plain JSON traces are gzipped on the way (Kineto JSON shrinks ~15x), so large traces fit in one message.
With `--summarize` the traces are reduced here, where they are, to their ranks' summaries
(efficiency/summary.py), and only those are sent: the collector does the cross-rank part.
"""
from __future__ import annotations

import argparse
import functools
import gzip
import sys
from collections.abc import Callable

import orjson

from gpuwatch.apps.analyze_cli import format_table, read_in_pool
from gpuwatch.apps.commandline import (Command, add_connection_arguments, add_json_flag, collector_errors,
                                       connection, print_json)
from gpuwatch.collector.client import connect
from gpuwatch.efficiency.result import Analysis
from gpuwatch.efficiency.load import expand_paths
from gpuwatch.efficiency.summary import encode, summarize_paths
from gpuwatch.core.errors import UserError
from gpuwatch.v1 import query_pb2 as q
from gpuwatch.v1 import query_pb2_grpc

_RPC_TIMEOUT_S = 600.0  # the collector parses and re-analyses the whole job


def submit_traces(stub: query_pb2_grpc.QueryStub, job_id: str, paths: list[str],
                  progress: Callable[[str, int], None] | None = None, *, summarize: bool = False) -> dict:
    """Send every trace file under `paths` (files or folders) for `job_id`, one call per file (with
    `summarize`: their ranks' summaries, made here, in one call); return the job's breakdown document after
    the last one (it covers every rank the collector has for the job)."""
    if summarize:
        content = encode(read_in_pool(paths, functools.partial(summarize_paths, part=True)))
        name = paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1})"
        if progress is not None:
            progress(f"summaries of {name}", len(content))
        summary = stub.SubmitTrace(q.SubmitTraceRequest(job_id=job_id, filename=name, content=content),
                                   timeout=_RPC_TIMEOUT_S)
        return orjson.loads(summary.json)
    reply = None
    for path in expand_paths(paths):
        content = _file_content(path)
        if progress is not None:
            progress(path, len(content))
        reply = stub.SubmitTrace(q.SubmitTraceRequest(job_id=job_id, filename=path, content=content),
                                 timeout=_RPC_TIMEOUT_S)
    assert reply is not None, "expand_paths names at least one file"
    return orjson.loads(reply.json)


def fetch_breakdown(stub: query_pb2_grpc.QueryStub, job_id: str, per_step: bool = False) -> dict:
    """The job's breakdown document (the `gpuwatch analyze --json` shape plus `source`: traces or live)."""
    reply = stub.Breakdown(q.BreakdownRequest(job_id=job_id, per_step=per_step), timeout=_RPC_TIMEOUT_S)
    return orjson.loads(reply.json)


def _file_content(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            content = f.read()
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    if path.endswith(".json") and not content.startswith(b"\x1f\x8b"):
        content = gzip.compress(content, compresslevel=1)  # the collector detects gzip by its magic bytes
    return content


def _submit_arguments(parser: argparse.ArgumentParser) -> None:
    _common_arguments(parser)
    parser.add_argument("--job", required=True, help="job id the traces belong to")
    parser.add_argument("--summarize", action="store_true",
                        help="reduce the traces here and send only their ranks' summaries (a fraction of their "
                             "size; the collector does the cross-rank part)")
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="Kineto traces (.json/.json.gz, one per rank), span tables (.csv/.parquet), or folders")


def _breakdown_arguments(parser: argparse.ArgumentParser) -> None:
    _common_arguments(parser)
    parser.add_argument("job", help="job id")
    parser.add_argument("--per-step", action="store_true", help="add a breakdown per step for each rank")


def _common_arguments(parser: argparse.ArgumentParser) -> None:
    add_connection_arguments(parser)
    add_json_flag(parser, "print the breakdown document as JSON")


def _run_submit(args: argparse.Namespace) -> int:
    address, security = connection(args)
    with collector_errors(address):
        doc = submit_traces(connect(address, security=security), args.job, args.paths, progress=_progress,
                            summarize=args.summarize)
    print(f"job {args.job}: {len(doc['ranks'])} rank(s) analysed", file=sys.stderr)
    return _show(args, doc)


def _run_breakdown(args: argparse.Namespace) -> int:
    address, security = connection(args)
    with collector_errors(address):
        doc = fetch_breakdown(connect(address, security=security), args.job, args.per_step)
    return _show(args, doc)


def _show(args: argparse.Namespace, doc: dict) -> int:
    if args.json:
        print_json(doc)
    else:
        sys.stdout.write(f"job {args.job} (from {doc['source']})\n" + format_table(Analysis.from_json(doc)))
    return 0


SUBMIT_TRACE = Command(_submit_arguments, _run_submit)
BREAKDOWN = Command(_breakdown_arguments, _run_breakdown)


def _progress(path: str, nbytes: int) -> None:
    print(f"sending {path} ({nbytes / 1e6:.1f} MB)", file=sys.stderr, flush=True)
