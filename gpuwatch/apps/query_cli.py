"""Read commands against a running collector: nodes, gpus, latest, series, events, jobs, alerts.

Each command is a public function ``fetch_<name>(stub, args) -> list[dict]`` (what tests and scripts call)
plus one entry in :data:`COMMANDS`; the CLI prints the rows as JSON (``--json``) or as a table.
Other features add their commands (submit-trace, breakdown, jobs, alerts) as one more entry each.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from gpuwatch.collector.client import add_connection_arguments, connect_args
from gpuwatch.collector.server import DEFAULT_PORT
from gpuwatch.core.errors import UserError
from gpuwatch.core.times import iso_utc
from gpuwatch.v1 import query_pb2 as q
from gpuwatch.v1 import query_pb2_grpc

DEFAULT_COLLECTOR = f"127.0.0.1:{DEFAULT_PORT}"
_RPC_TIMEOUT_S = 30.0


_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_MS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_time_ms(text: str, now_ms: int | None = None, flag: str = "--since") -> int:
    """A point in time as epoch ms from "15m"/"2h"/"7d" (ago), an ISO 8601 time (UTC if no zone) or epoch ms;
    a UserError naming ``flag`` otherwise."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    if m := _RELATIVE.match(text):
        return now_ms - int(float(m.group(1)) * _UNIT_MS[m.group(2)])
    if text.isdigit():
        return int(text)
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise UserError(f"{flag} {text!r} is not a duration like 15m/2h/7d, an ISO 8601 time or epoch ms") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return int(when.timestamp() * 1000)


# ----------------------------------------------------------------------------- fetch (library API)
def fetch_nodes(stub: query_pb2_grpc.QueryStub, args: argparse.Namespace | None = None) -> list[dict[str, Any]]:
    """One dict per node: node, gpus, samples, last_seen (ISO UTC), agent_id, last_sequence."""
    reply = stub.ListNodes(q.ListNodesRequest(), timeout=_RPC_TIMEOUT_S)
    return [{"node": n.node, "gpus": n.gpus, "samples": n.samples, "last_seen": iso_utc(n.last_seen_ms),
             "agent_id": n.agent_id, "last_sequence": n.last_sequence} for n in reply.nodes]


def fetch_gpus(stub: query_pb2_grpc.QueryStub, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One dict per GPU: node, index, uuid, name, samples, last_seen, job_id, rank, state (running or failed)
    and, for a failed GPU, failure (what failed and what to do)."""
    reply = stub.ListGpus(q.ListGpusRequest(node=args.node or ""), timeout=_RPC_TIMEOUT_S)
    return [{"node": g.node, "index": g.info.index, "uuid": g.info.uuid, "name": g.info.name,
             "architecture": g.info.architecture, "samples": g.samples, "last_seen": iso_utc(g.last_seen_ms),
             "job_id": g.job_id or None, "rank": None if g.rank < 0 else g.rank, "state": g.state or "running",
             "failure": g.failure or None} for g in reply.gpus]


def fetch_latest(stub: query_pb2_grpc.QueryStub, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One dict per GPU: node, gpu_index, ts (ISO UTC) and the last value of every field it reported."""
    gpu = -1 if args.gpu is None else args.gpu
    reply = stub.Latest(q.LatestRequest(node=args.node or "", gpu_index=gpu), timeout=_RPC_TIMEOUT_S)
    return [{"node": r.node, "gpu_index": r.gpu_index, "ts": iso_utc(r.ts_ms), **dict(sorted(r.values.items()))}
            for r in reply.rows]


def fetch_series(stub: query_pb2_grpc.QueryStub, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One dict per point: ts (ISO UTC), ts_ms, value."""
    request = q.SeriesRequest(node=args.node, gpu_index=args.gpu, field=args.field, limit=args.limit or 0,
                              since_ms=parse_time_ms(args.since) if args.since else 0)
    reply = stub.Series(request, timeout=_RPC_TIMEOUT_S)
    return [{"ts": iso_utc(t), "ts_ms": t, "value": v} for t, v in zip(reply.ts_ms, reply.values)]


def fetch_events(stub: query_pb2_grpc.QueryStub, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One dict per event, newest first: ts, node, gpu_index, kind, code, message, attrs."""
    request = q.EventsRequest(node=args.node or "", kind=args.kind or "", limit=args.limit or 0,
                              since_ms=parse_time_ms(args.since) if args.since else 0)
    reply = stub.Events(request, timeout=_RPC_TIMEOUT_S)
    return [{"ts": iso_utc(r.event.ts_ms), "node": r.node, "gpu_index": r.event.gpu_index, "kind": r.event.kind,
             "code": r.event.code, "message": r.event.message, "attrs": dict(r.event.attrs)} for r in reply.events]


def fetch_jobs(stub: query_pb2_grpc.QueryStub, args: argparse.Namespace | None = None) -> list[dict[str, Any]]:
    """One dict per job: job_id, ranks, nodes, steps, step_rate, lost_fraction, stragglers, delayed, hang."""
    return json.loads(stub.Jobs(q.JobsRequest(), timeout=_RPC_TIMEOUT_S).json)


def fetch_alerts(stub: query_pb2_grpc.QueryStub, args: argparse.Namespace | None = None) -> list[dict[str, Any]]:
    """One dict per alert (GPUFailureRisk, SlowRank, JobHang), firing first; resolved ones with ``--all``."""
    request = q.AlertsRequest(include_resolved=bool(getattr(args, "all", False)))
    return json.loads(stub.Alerts(request, timeout=_RPC_TIMEOUT_S).json)


# ------------------------------------------------------------------------------------ commands
@dataclass(frozen=True)
class Command:
    fetch: Callable[[query_pb2_grpc.QueryStub, argparse.Namespace], list[dict[str, Any]]]
    add_arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    table_columns: Sequence[str] | None = None  # None: every key of the first row
    empty: str = "nothing"  # said on stderr in table mode when there are no rows, so silence is never ambiguous
    table_row: Callable[[dict[str, Any]], dict[str, Any]] = lambda row: row  # a row as the table shows it


def _node_gpu_filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node", help="only this node")
    parser.add_argument("--gpu", type=int, help="only this GPU index")


def _series_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node", required=True)
    parser.add_argument("--gpu", type=int, required=True, help="GPU index")
    parser.add_argument("--field", required=True, help="field name from gpuwatch.core.fields, e.g. gpu_power_watts")
    parser.add_argument("--since", help="15m, 2h, 7d (ago), ISO 8601 time or epoch ms")
    parser.add_argument("--limit", type=int, help="at most this many of the newest points")


def _events_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node")
    parser.add_argument("--kind", help="e.g. xid, gpu_lost, agent_start")
    parser.add_argument("--since", help="15m, 2h, 7d (ago), ISO 8601 time or epoch ms")
    parser.add_argument("--limit", type=int, default=100, help="newest N events (default 100; 0: all)")


COMMANDS: dict[str, Command] = {
    "nodes": Command(fetch_nodes, table_columns=("node", "gpus", "samples", "last_seen", "agent_id"),
                     empty="no nodes"),
    "gpus": Command(fetch_gpus, lambda p: p.add_argument("--node", help="only this node"),
                    ("node", "index", "name", "state", "samples", "last_seen", "job_id", "rank", "failure"), "no GPUs"),
    "latest": Command(fetch_latest, _node_gpu_filters, ("node", "gpu_index", "ts", "gpu_utilization_ratio",
                      "gpu_power_watts", "gpu_temperature_celsius", "gpu_memory_used_bytes"), "no samples"),
    "series": Command(fetch_series, _series_arguments, ("ts", "value"), "no points"),
    "events": Command(fetch_events, _events_arguments, ("ts", "node", "gpu_index", "kind", "code", "message"),
                      "no events"),
    "jobs": Command(fetch_jobs, table_columns=("job_id", "sources", "ranks", "nodes", "gpus", "steps", "step_rate",
                                               "lost_fraction", "stragglers", "hang"), empty="no jobs",
                    # the table counts straggler ranks (--json keeps each one's evidence)
                    table_row=lambda job: {**job, "stragglers": len(job.get("stragglers") or [])}),
    "alerts": Command(fetch_alerts, lambda p: p.add_argument("--all", action="store_true",
                                                             help="include resolved alerts"),
                      ("alertname", "status", "starts_at", "ends_at", "summary"), "no alerts"),
}


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    add_connection_arguments(parser, DEFAULT_COLLECTOR)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    COMMANDS[command].add_arguments(parser)


def run(command: str, args: argparse.Namespace) -> int:
    spec = COMMANDS[command]
    stub = connect_args(args)
    try:
        rows = spec.fetch(stub, args)
    except grpc.RpcError as exc:
        raise UserError(f"collector at {args.collector}: {exc.details()} ({exc.code().name})") from None
    if args.json:
        sys.stdout.write(json_text(rows) + "\n")
    elif not rows:
        print(spec.empty, file=sys.stderr)
    else:
        sys.stdout.write(format_table([spec.table_row(row) for row in rows], spec.table_columns))
    return 0


def json_text(rows: Any) -> str:
    """Standard JSON for ``rows``: a non-finite number (from a store written before ingest refused them) is
    null, never the ``Infinity``/``NaN`` tokens that strict parsers reject."""
    return json.dumps(_finite(rows), indent=2, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def format_table(rows: list[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Rows as an aligned text table (floats with 4 significant digits, nested values by name); "(none)" when
    empty."""
    if not rows:
        return "(none)\n"
    columns = list(columns or rows[0].keys())
    cells = [[format_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def format_cell(value: Any) -> str:
    """One value as a short cell: lists joined with commas, a dict by its name (a signal, a straggler's rank,
    a hang's summary) or else as k=v pairs, so nested rows stay readable instead of collapsing to "yes"."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ",".join(format_cell(v) for v in value) or "-"
    if isinstance(value, dict):
        for key in _NAME_KEYS:
            if key in value:
                return format_cell(value[key])
        return " ".join(f"{k}={format_cell(v)}" for k, v in value.items()) or "-"
    return str(value)


_NAME_KEYS = ("signal", "name", "rank", "summary")  # what names a nested dict, in order of preference
