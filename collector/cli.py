"""`gpuwatch collector`: run the collector in the foreground until SIGTERM or SIGINT."""
from __future__ import annotations

import argparse
import logging
import signal
import threading

from gpuwatch.collector.server import DEFAULT_PORT, serve


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_PORT}",
                        help=f"HOST:PORT for agents and queries (default 127.0.0.1:{DEFAULT_PORT}; port 0 picks one)")
    parser.add_argument("--db", default="gpuwatch.duckdb", help="DuckDB file of the store (default gpuwatch.duckdb)")
    parser.add_argument("--retention-days", type=float, default=30.0,
                        help="delete samples, events and spans older than this many days (default 30; 0 keeps all)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--max-workers", type=int, default=256,
                        help="concurrent RPCs; each connected agent holds one (default 256)")


def run(command: str, args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = serve(args.listen, args.db, retention_days=args.retention_days or None, max_workers=args.max_workers)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"gpuwatch collector listening on {server.address}, store {args.db}", flush=True)
    stop.wait()
    logging.getLogger(__name__).info("stopping: committing queued batches")
    server.stop()
    return 0
