"""`gpuwatch agent`: run the node agent (a thin layer over gpuwatch.agent.daemon.Agent)."""
from __future__ import annotations

import argparse
import logging
import signal
import socket
from pathlib import Path

from gpuwatch.agent.daemon import Agent, AgentConfig, default_spool_dir
from gpuwatch.agent.simfleet import MODELS
from gpuwatch.errors import UserError


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--collector", required=True, metavar="HOST:PORT", help="collector gRPC address")
    parser.add_argument("--simulate", type=int, default=0, metavar="N",
                        help="sample N simulated GPUs instead of the node's real ones")
    parser.add_argument("--sim-model", default="H100", choices=sorted(MODELS), help="simulated GPU model")
    parser.add_argument("--node", default=socket.gethostname(), help="node name (default: hostname)")
    parser.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="fast-tier period")
    parser.add_argument("--slow-interval", type=float, default=30.0, metavar="SECONDS", help="slow-tier period")
    parser.add_argument("--batch-interval", type=float, default=5.0, metavar="SECONDS",
                        help="how often a batch is cut (every tick when --interval is larger)")
    parser.add_argument("--ticks", type=int, default=None, metavar="K",
                        help="sample K times, wait until the collector acknowledged everything, exit")
    parser.add_argument("--drain-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="with --ticks: how long to wait for the collector before giving up")
    parser.add_argument("--spool", type=Path, default=None, metavar="DIR",
                        help=f"spool directory (default: {default_spool_dir()})")
    parser.add_argument("--spool-max-bytes", type=int, default=256 * 2**20, help="spool size bound")
    parser.add_argument("--job-label", default="", help="job id for GPU processes that name none")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """Check the flags and turn them into an AgentConfig; bad values raise UserError naming the flag."""
    host, _, port = args.collector.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--collector {args.collector!r}: expected HOST:PORT")
    for flag, value in (("--interval", args.interval), ("--slow-interval", args.slow_interval),
                        ("--batch-interval", args.batch_interval), ("--drain-timeout", args.drain_timeout)):
        if not value > 0:
            raise UserError(f"{flag} {value}: must be a positive number of seconds")
    if args.simulate < 0:
        raise UserError(f"--simulate {args.simulate}: must be a number of GPUs (>= 1)")
    if args.ticks is not None and args.ticks < 1:
        raise UserError(f"--ticks {args.ticks}: must be >= 1")
    if args.spool_max_bytes < 1:
        raise UserError(f"--spool-max-bytes {args.spool_max_bytes}: must be positive")
    return AgentConfig(
        collector=args.collector, node=args.node, interval=args.interval, slow_interval=args.slow_interval,
        batch_interval=args.batch_interval, spool_dir=args.spool or default_spool_dir(),
        spool_max_bytes=args.spool_max_bytes, job_label=args.job_label, simulate=args.simulate,
        sim_model=args.sim_model, drain_timeout=args.drain_timeout,
    )


def run(command: str, args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    agent = Agent(config_from_args(args))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.stop())
    agent.run(ticks=args.ticks)
    return 0
