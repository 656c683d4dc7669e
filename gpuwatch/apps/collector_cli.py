"""`gpuwatch collector`: run the collector in the foreground until SIGTERM or SIGINT.

Settings come from a TOML file, ``GPUWATCH_<KEY>`` variables and flags (gpuwatch.core.settings). Beside ingest
and queries the collector runs the failure scorer, the jobs monitor, the alert path and, with
``--metrics-listen``, the Prometheus endpoint; :func:`gpuwatch.collector.assembly.start_collector` wires them.
"""
from __future__ import annotations

import argparse
import logging
import os
import resource
import signal
import socket
import threading

from gpuwatch.apps.commandline import Command
from gpuwatch.core import settings as config
from gpuwatch.collector.assembly import start_collector
from gpuwatch.collector.store import redacted
from gpuwatch.core.errors import UserError

log = logging.getLogger(__name__)

def add_arguments(parser: argparse.ArgumentParser) -> None:
    config.add_arguments(parser, config.COLLECTOR_OPTIONS)


def raise_open_file_limit() -> int:
    """Raise the soft limit on open files to the hard one: every connected agent holds a socket."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def refuse_busy_addresses(listens: dict[str, str | None]) -> None:
    """Each ``flag -> HOST:PORT`` that cannot be listened on now is a UserError naming it, before the store is
    opened: found after, a new store file was left behind, and gRPC's own log line came before ours. A probe
    socket is bound and closed (SO_REUSEADDR, as the servers bind: a port left in TIME_WAIT is free)."""
    for flag, listen in listens.items():
        if not listen:
            continue
        host, port = config.split_address(listen)
        if port == 0:
            continue
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
        except OSError as exc:
            raise UserError(f"{flag} {listen}: cannot listen there ({exc.strerror or exc})") from None


def run(args: argparse.Namespace) -> int:
    cfg = config.load_config(config.COLLECTOR_OPTIONS, args).build(config.CollectorSettings)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if raise_open_file_limit() < 4 * 1024:
        log.warning("open-file limit %d: the collector can hold fewer agents than that; raise it (ulimit -n)",
                    resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    refuse_busy_addresses({"--listen": cfg.listen, "--metrics-listen": cfg.metrics_listen})
    os.umask(os.umask(0o077) | 0o077)  # whatever a store engine creates later (a WAL, parts) is private at once
    server = start_collector(cfg)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    from gpuwatch.collector.snapshot import MetricsService  # imported once the port was bound (assembly)

    metrics = next((s.server.url for s in server.services if isinstance(s, MetricsService) and s.server), None)
    print(f"gpuwatch collector listening on {server.address}, store {redacted(cfg.store or cfg.db)}"
          + (f", metrics {metrics}" if metrics else ""), flush=True)
    stop.wait()
    log.info("stopping: committing queued batches")
    server.stop()
    return 0


COLLECTOR = Command(add_arguments, run)
