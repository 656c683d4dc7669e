"""Read commands against a running collector: nodes, gpus, latest, series, events, jobs, alerts.

Each command is a public function ``fetch_<name>(stub, *, filters...) -> list[dict]`` (what tests and scripts
call) plus one :func:`query_command` whose flags are named as the function's keyword arguments; the CLI prints
the rows as JSON (``--json``) or as a table.
"""
from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

from gpuwatch.apps.commandline import (Command, add_connection_arguments, add_json_flag, collector_errors,
                                       connection, format_table, int_in, print_json, time_flag)
from gpuwatch.collector.client import connect
from gpuwatch.collector.query_documents import alert_documents, job_documents, usage_documents
from gpuwatch.core.times import iso_utc
from gpuwatch.v1 import query_pb2 as q
from gpuwatch.v1 import query_pb2_grpc

_RPC_TIMEOUT_S = 30.0
_GPU_INDEX = int_in("--gpu", 0, 2**31 - 1)  # int32 on the wire, where -1 means every GPU
_LIMIT = int_in("--limit", 0, 2**32 - 1)  # uint32 on the wire; 0: no limit


# ----------------------------------------------------------------------------- fetch (library API)
def fetch_nodes(stub: query_pb2_grpc.QueryStub) -> list[dict[str, Any]]:
    """One dict per node: node, gpus, samples, last_seen (ISO UTC), agent_id, last_sequence."""
    reply = stub.ListNodes(q.ListNodesRequest(), timeout=_RPC_TIMEOUT_S)
    return [{"node": n.node, "gpus": n.gpus, "samples": n.samples, "last_seen": iso_utc(n.last_seen_ms),
             "agent_id": n.agent_id, "last_sequence": n.last_sequence} for n in reply.nodes]


def fetch_gpus(stub: query_pb2_grpc.QueryStub, *, node: str | None = None) -> list[dict[str, Any]]:
    """One dict per GPU (of ``node``, else all): node, index, uuid, name, samples, last_seen, job_id, rank, state
    (running or failed) and, for a failed GPU, failure (what failed and what to do)."""
    reply = stub.ListGpus(q.ListGpusRequest(node=node or ""), timeout=_RPC_TIMEOUT_S)
    return [{"node": g.node, "index": g.info.index, "uuid": g.info.uuid, "name": g.info.name,
             "architecture": g.info.architecture, "samples": g.samples, "last_seen": iso_utc(g.last_seen_ms),
             "job_id": g.job_id or None, "rank": None if g.rank < 0 else g.rank, "state": g.state or "running",
             "failure": g.failure or None, "pod": g.pod or None, "namespace": g.namespace or None,
             "container": g.container or None} for g in reply.gpus]


def fetch_latest(stub: query_pb2_grpc.QueryStub, *, node: str | None = None, gpu: int | None = None
                 ) -> list[dict[str, Any]]:
    """One dict per GPU: node, gpu_index, ts (ISO UTC) and the last value of every field it reported."""
    request = q.LatestRequest(node=node or "", gpu_index=-1 if gpu is None else gpu)
    reply = stub.Latest(request, timeout=_RPC_TIMEOUT_S)
    return [{"node": r.node, "gpu_index": r.gpu_index, "ts": iso_utc(r.ts_ms), **dict(sorted(r.values.items()))}
            for r in reply.rows]


def fetch_series(stub: query_pb2_grpc.QueryStub, *, node: str, gpu: int, field: str, since_ms: int | None = None,
                 limit: int | None = None) -> list[dict[str, Any]]:
    """One dict per point of ``field`` on GPU ``gpu`` of ``node`` (from ``since_ms``; the newest ``limit``):
    ts (ISO UTC), ts_ms, value and resolution_s (seconds the point stands for: the sample interval for raw
    samples, 60 for per-minute rollups; None from a collector that does not say)."""
    request = q.SeriesRequest(node=node, gpu_index=gpu, field=field, limit=limit or 0, since_ms=since_ms or 0)
    reply = stub.Series(request, timeout=_RPC_TIMEOUT_S)
    resolutions = list(reply.resolution_s) or [None] * len(reply.ts_ms)
    return [{"ts": iso_utc(t), "ts_ms": t, "value": v, "resolution_s": r}
            for t, v, r in zip(reply.ts_ms, reply.values, resolutions)]


def fetch_events(stub: query_pb2_grpc.QueryStub, *, node: str | None = None, kind: str | None = None,
                 since_ms: int | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """One dict per event, newest first: ts, node, gpu_index, kind, code, message, attrs."""
    request = q.EventsRequest(node=node or "", kind=kind or "", limit=limit or 0, since_ms=since_ms or 0)
    reply = stub.Events(request, timeout=_RPC_TIMEOUT_S)
    return [{"ts": iso_utc(r.event.ts_ms), "node": r.node, "gpu_index": r.event.gpu_index, "kind": r.event.kind,
             "code": r.event.code, "message": r.event.message, "attrs": dict(r.event.attrs)} for r in reply.events]


def fetch_jobs(stub: query_pb2_grpc.QueryStub) -> list[dict[str, Any]]:
    """One dict per job: job_id, ranks, nodes, steps, step_rate, lost_fraction, stragglers, delayed, slow_ranks,
    hang."""
    return job_documents(stub.Jobs(q.JobsRequest(), timeout=_RPC_TIMEOUT_S))


def fetch_alerts(stub: query_pb2_grpc.QueryStub, *, include_resolved: bool = False) -> list[dict[str, Any]]:
    """One dict per alert (GPUFailureRisk, SlowRank, JobHang), firing first; resolved ones too if asked."""
    request = q.AlertsRequest(include_resolved=include_resolved)
    return alert_documents(stub.Alerts(request, timeout=_RPC_TIMEOUT_S))


def fetch_usage(stub: query_pb2_grpc.QueryStub, *, by: str = "pod", since_ms: int | None = None
                ) -> list[dict[str, Any]]:
    """One dict per owner (``by``: pod, namespace, job or user), most GPU time first: the owner's columns
    (namespace and pod; namespace; job_id; user), gpu_seconds, lost_gpu_seconds, mean_utilization, energy_kwh."""
    request = q.UsageRequest(by=by, since_ms=since_ms or 0)
    return usage_documents(stub.Usage(request, timeout=_RPC_TIMEOUT_S))


# ------------------------------------------------------------------------------------ commands
def query_command(fetch: Callable[..., list[dict[str, Any]]],
                  add_filters: Callable[[argparse.ArgumentParser], Any] = lambda parser: None,
                  table_columns: Sequence[str] | None = None, empty: str = "nothing",
                  table_row: Callable[[dict[str, Any]], dict[str, Any]] = lambda row: row) -> Command:
    """A command that prints what ``fetch`` returns. ``add_filters`` declares flags whose destinations are
    ``fetch``'s keyword arguments; the table shows ``table_columns`` (None: every key of the first row) of
    ``table_row(row)``; ``empty`` is said on stderr in table mode when there are no rows, so silence is never
    ambiguous."""
    filters = [name for name, p in inspect.signature(fetch).parameters.items() if p.kind is p.KEYWORD_ONLY]

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        add_connection_arguments(parser)
        add_json_flag(parser)
        add_filters(parser)

    def run(args: argparse.Namespace) -> int:
        address, security = connection(args)
        stub = connect(address, security=security)
        with collector_errors(address):
            rows = fetch(stub, **{name: getattr(args, name) for name in filters})
        if args.json:
            print_json(rows)
        elif not rows:
            print(empty, file=sys.stderr)
        else:
            sys.stdout.write(format_table([table_row(row) for row in rows], table_columns))
        return 0

    return Command(add_arguments, run)


def _since_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--since", dest="since_ms", type=time_flag("--since"), metavar="WHEN",
                        help="15m, 2h, 7d (ago), ISO 8601 time or epoch ms")


def _node_gpu_filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node", help="only this node")
    parser.add_argument("--gpu", type=_GPU_INDEX, help="only this GPU index")


def _series_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node", required=True, help="the GPU's node, as `gpuwatch nodes` names it")
    parser.add_argument("--gpu", type=_GPU_INDEX, required=True, help="GPU index")
    parser.add_argument("--field", required=True, help="field name from gpuwatch.core.fields, e.g. gpu_power_watts")
    _since_argument(parser)
    parser.add_argument("--limit", type=_LIMIT, help="at most this many of the newest points (0: all)")


def _events_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node", help="only this node")
    parser.add_argument("--kind", help="e.g. xid, gpu_lost, agent_start")
    _since_argument(parser)
    parser.add_argument("--limit", type=_LIMIT, default=100, help="newest N events (default 100; 0: all)")


def _usage_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--by", default="pod", choices=("pod", "namespace", "job", "user"),
                        help="group GPU time by Kubernetes pod (default), namespace, job or user")
    _since_argument(parser)


NODES = query_command(fetch_nodes, table_columns=("node", "gpus", "samples", "last_seen", "agent_id"),
                      empty="no nodes")
GPUS = query_command(fetch_gpus, lambda p: p.add_argument("--node", help="only this node"),
                     ("node", "index", "name", "state", "samples", "last_seen", "job_id", "rank", "failure"),
                     "no GPUs")
LATEST = query_command(fetch_latest, _node_gpu_filters, ("node", "gpu_index", "ts", "gpu_utilization_ratio",
                       "gpu_power_watts", "gpu_temperature_celsius", "gpu_memory_used_bytes"), "no samples")
SERIES = query_command(fetch_series, _series_arguments, ("ts", "value"), "no points")
EVENTS = query_command(fetch_events, _events_arguments, ("ts", "node", "gpu_index", "kind", "code", "message"),
                       "no events")
def _slow_ranks_cell(slow_ranks: list[dict[str, Any]]) -> str:
    """``rank:cause`` of each slow rank (``-:network`` for the path between ranks)."""
    return ",".join(f"{'-' if r['rank'] is None else r['rank']}:{r['cause']}" for r in slow_ranks)


JOBS = query_command(fetch_jobs, table_columns=("job_id", "sources", "ranks", "nodes", "gpus", "steps", "step_rate",
                                                "lost_fraction", "stragglers", "slow_ranks", "hang"), empty="no jobs",
                     # the table counts straggler ranks and names slow ones rank:cause (--json keeps the evidence)
                     table_row=lambda job: {**job, "stragglers": len(job.get("stragglers") or []),
                                            "slow_ranks": _slow_ranks_cell(job.get("slow_ranks") or [])})
ALERTS = query_command(fetch_alerts, lambda p: p.add_argument("--all", dest="include_resolved", action="store_true",
                                                              help="include resolved alerts"),
                       ("alertname", "status", "starts_at", "ends_at", "summary"), "no alerts")
USAGE = query_command(fetch_usage, _usage_arguments, None, "no owned GPU time")
