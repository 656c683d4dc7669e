"""The commands that move recordings: `gpuwatch replay`, `import` and `export` (arguments, dispatch, and the
text form of their results, which all three share)."""
from __future__ import annotations

import argparse
from typing import Any

from gpuwatch.apps.commandline import (add_client_security_arguments, client_security, format_cell, format_table,
                                       result_command, time_flag)
from gpuwatch.apps.replay import replay
from gpuwatch.apps.replay_offline import replay_offline
from gpuwatch.collector import client
from gpuwatch.core.errors import UserError
from gpuwatch.core.batch_tables import DEFAULT_TICKS_PER_BATCH
from gpuwatch.core.recording import open_recording


def _replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="recording directory (gpuwatch agent --record, simulate, import, export)")
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--speed", type=float, metavar="X", help="pace by recorded time, X times real time")
    pace.add_argument("--fast", action="store_true", help="as fast as the collector acknowledges (default)")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--collector", metavar="ADDR", help="stream into the collector at HOST:PORT")
    target.add_argument("--offline", action="store_true",
                        help="replay into a collector started here and print its results (default)")
    p.add_argument("--db", help="with --offline: keep the store in this DuckDB file (default: a temporary one)")
    p.add_argument("--model", help="with --offline: failure model for scoring (default: the shipped model)")
    p.add_argument("--score-interval", type=float, default=None, metavar="S",
                   help="with --offline: score GPUs every S seconds of recorded time, each round re-reading its day "
                        "of history as live (default: every step of the model in one pass, as the evaluation)")
    p.add_argument("--ticks-per-batch", type=int, default=DEFAULT_TICKS_PER_BATCH, metavar="N",
                   help=f"sample timestamps per batch (default {DEFAULT_TICKS_PER_BATCH})")
    add_client_security_arguments(p.add_argument_group("with --collector: its TLS and token"))


def _run_replay(args: argparse.Namespace) -> dict[str, Any]:
    if args.ticks_per_batch < 1:
        raise UserError(f"--ticks-per-batch {args.ticks_per_batch}: must be >= 1")
    if args.collector is None:
        return replay_offline(args.path, db=args.db, speed=args.speed, ticks_per_batch=args.ticks_per_batch,
                              model_path=args.model, score_interval_s=args.score_interval, quiet=args.quiet)
    if args.db or args.model:
        raise UserError("--db and --model are for --offline; with --collector the collector keeps its own store "
                        "and scores with its own model")
    rec = open_recording(args.path)
    ch = client.channel(args.collector, timeout=5.0, security=client_security(args))
    try:
        return replay(rec, ch, speed=args.speed, ticks_per_batch=args.ticks_per_batch, quiet=args.quiet).as_dict()
    finally:
        ch.close()


def _import_arguments(p: argparse.ArgumentParser) -> None:
    from gpuwatch.apps.importer import FORMATS

    from gpuwatch.apps.fault_log import TIME_UNITS

    p.add_argument("files", nargs="+", metavar="FILE", help="CSV or Parquet telemetry files, or fault logs")
    p.add_argument("--out", required=True, help="recording directory to write (new or empty)")
    p.add_argument("--format", choices=(*FORMATS, "faults"), default="auto",
                   help="wide: one column per field; long: metric/value rows (dcgm-exporter via Prometheus); "
                   "faults: a fault log (node, GPU, time, kind or XID, end; CSV, Parquet, JSON, JSON lines)")
    faults = p.add_argument_group("fault logs (--format faults): the fleet the log covers")
    faults.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    faults.add_argument("--nodes", type=int,
                        help="nodes in the fleet, with those that never failed (default: the nodes in the log)")
    faults.add_argument("--start", help="start of the period, and time 0 of relative times (ISO 8601 date or "
                        "time; default: the first fault, or 2000-01-01 for relative times)")
    end = faults.add_mutually_exclusive_group()
    end.add_argument("--end", help="end of the period (default: the last time in the log)")
    end.add_argument("--days", type=float, help="length of the period in days from --start")
    faults.add_argument("--time-unit", choices=TIME_UNITS, default="auto",
                        help="numeric times are offsets from --start in this unit (auto: days when too small "
                        "for epoch times, else epoch seconds or ms)")
    p.add_argument("--node-column", help="column naming the node (default: node, Hostname, hostname, instance)")
    p.add_argument("--gpu-column", help="column with the GPU index (default: gpu_index, gpu)")
    p.add_argument("--time-column", help="column with the time (default: ts, timestamp, time)")


def _run_import(args: argparse.Namespace) -> dict[str, Any]:
    from gpuwatch.apps.importer import Columns, import_files

    if args.format == "faults":
        from gpuwatch.apps.fault_log import import_fault_log

        return import_fault_log(args.files, args.out, gpus_per_node=args.gpus_per_node, nodes=args.nodes,
                                start=args.start, end=args.end, days=args.days, time_unit=args.time_unit,
                                node_column=args.node_column, gpu_column=args.gpu_column,
                                time_column=args.time_column)
    columns = Columns(node=args.node_column, gpu=args.gpu_column, time=args.time_column)
    return import_files(args.files, args.out, fmt=args.format, columns=columns, quiet=args.quiet)


def _export_arguments(p: argparse.ArgumentParser) -> None:
    store = p.add_mutually_exclusive_group(required=True)
    store.add_argument("--db", help="collector DuckDB store file (of a stopped collector, or a copy)")
    store.add_argument("--store", help="collector store URL: chdb:///DIR, a DuckDB file or duckdb:///PATH, "
                       "clickhouse://host:8123/db (a stopped collector's, or a copy)")
    p.add_argument("--out", required=True, help="recording directory to write (new or empty)")
    p.add_argument("--since", dest="since_ms", type=time_flag("--since"),
                   help="from this time: 15m, 2h, 7d (ago), ISO 8601 time or epoch ms")
    p.add_argument("--until", dest="until_ms", type=time_flag("--until"), help="up to this time (same forms)")


def _run_export(args: argparse.Namespace) -> dict[str, Any]:
    from gpuwatch.apps.export import export_store

    return export_store(args.store or args.db, args.out, since_ms=args.since_ms, until_ms=args.until_ms,
                        quiet=args.quiet)


def format_result(result: dict[str, Any]) -> str:
    """A result as text: its scalar entries, then one aligned table per list or mapping of rows; the
    collector's side of an offline replay (``store``, ``scoring``) as sections of their own."""
    lines = [f"{k}: {format_cell(v)}" for k, v in result.items() if not isinstance(v, (dict, list))]
    for key, value in result.items():
        if key in _SECTIONS and isinstance(value, dict):
            lines += [_SECTIONS[key], format_result(value).rstrip()]
        elif isinstance(value, dict) and value:
            rows = [{"name": k, **(v if isinstance(v, dict) else {"value": v})} for k, v in value.items()]
            lines += [f"{key}:", format_table(rows).rstrip()]
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            lines += [f"{key}:", format_table(value).rstrip()]
        elif isinstance(value, list):
            lines.append(f"{key}: {', '.join(map(format_cell, value)) or '(none)'}")
    return "\n".join(lines) + "\n"


_SECTIONS = {"store": "stored by the collector:", "scoring": "scored over the replayed time range:"}

REPLAY = result_command(_replay_arguments, _run_replay, format_result)
IMPORT = result_command(_import_arguments, _run_import, format_result)
EXPORT = result_command(_export_arguments, _run_export, format_result)
