"""`gpuwatch demo`: a simulated cluster on loopback, shown live in the terminal.

Starts a collector on the embedded store and several agent processes (8 simulated GPUs each) in a temp
dir (or --dir), shows a fleet view refreshed every few seconds, then a summary. No GPU needed; nothing is
written outside that dir.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from gpuwatch.v1 import query_pb2, query_pb2_grpc


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=4, help="simulated nodes (agent processes), default 4")
    parser.add_argument("--gpus", type=int, default=8, help="simulated GPUs per node, default 8")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds to run, default 60")
    parser.add_argument("--interval", type=float, default=1.0, help="agent sampling interval in seconds")
    parser.add_argument("--dir", help="keep the store and spools here instead of a temp dir")


def run(command: str, args: argparse.Namespace) -> int:
    from gpuwatch.errors import UserError

    if args.nodes < 1 or args.gpus < 1 or args.duration <= 0 or args.interval <= 0:
        raise UserError("--nodes, --gpus, --duration and --interval must be positive")
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="gpuwatch-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        summary = run_demo(workdir, nodes=args.nodes, gpus=args.gpus, duration_s=args.duration,
                           interval_s=args.interval, show=_terminal_view())
        print(summary)
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


def run_demo(workdir: Path, *, nodes: int, gpus: int, duration_s: float, interval_s: float,
             show: Callable[[str], None]) -> str:
    """Run the simulated fleet into a fresh collector; call ``show`` with each fleet view; return a summary."""
    from gpuwatch.collector.server import serve

    server = serve("127.0.0.1:0", str(workdir / "gpuwatch.duckdb"))
    address = f"127.0.0.1:{server.port}"
    agents = [_start_agent(address, workdir, f"demo-node-{i:02d}", gpus, interval_s) for i in range(nodes)]
    channel = grpc.insecure_channel(address)
    query = query_pb2_grpc.QueryStub(channel)
    started = time.monotonic()
    try:
        while time.monotonic() - started < duration_s:
            show(fleet_view(query, elapsed_s=time.monotonic() - started, duration_s=duration_s))
            _wait_for_any_exit(agents, timeout=min(3.0, max(0.0, duration_s - (time.monotonic() - started))))
        for proc in agents:
            proc.terminate()
        for proc in agents:
            proc.wait(timeout=30)
        return summary_view(query)
    finally:
        for proc in agents:
            if proc.poll() is None:
                proc.kill()
        channel.close()
        server.stop()


def _start_agent(address: str, workdir: Path, node: str, gpus: int, interval_s: float) -> subprocess.Popen:
    log = open(workdir / f"{node}.log", "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "agent", "--collector", address, "--simulate", str(gpus),
         "--node", node, "--interval", str(interval_s), "--spool", str(workdir / "spool" / node),
         "--slow-interval", "10"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _wait_for_any_exit(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait up to ``timeout`` seconds, returning early if an agent died (the view then shows it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return
        time.sleep(0.1)


def _terminal_view() -> Callable[[str], None]:
    clear = "\x1b[2J\x1b[H" if sys.stdout.isatty() else ""

    def show(text: str) -> None:
        print(clear + text, flush=True)

    return show


def fleet_view(query: query_pb2_grpc.QueryStub, *, elapsed_s: float, duration_s: float) -> str:
    """One screen: per node, its GPUs' utilisation, power, temperature and memory, and stored samples."""
    nodes = query.ListNodes(query_pb2.ListNodesRequest(), timeout=5).nodes
    latest = query.Latest(query_pb2.LatestRequest(node="", gpu_index=-1), timeout=5).rows
    by_node: dict[str, list] = {}
    for row in latest:
        by_node.setdefault(row.node, []).append(row)
    lines = [f"gpuwatch demo: simulated fleet, {elapsed_s:4.0f}/{duration_s:.0f} s", ""]
    lines.append(f"{'node':<14}{'GPUs':>5}{'samples':>9}  {'util %':>7}{'power W':>9}{'temp C':>8}{'mem GiB':>9}")
    for node in sorted(nodes, key=lambda n: n.node):
        rows = by_node.get(node.node, [])
        util = _mean(rows, "gpu_utilization_ratio") * 100
        power = _mean(rows, "gpu_power_watts")
        temp = _mean(rows, "gpu_temperature_celsius")
        mem = _mean(rows, "gpu_memory_used_bytes") / 2**30
        lines.append(f"{node.node:<14}{node.gpus:>5}{node.samples:>9}  {util:>7.1f}{power:>9.0f}{temp:>8.1f}{mem:>9.1f}")
    if not nodes:
        lines.append("(waiting for the first batches)")
    return "\n".join(lines)


def summary_view(query: query_pb2_grpc.QueryStub) -> str:
    nodes = query.ListNodes(query_pb2.ListNodesRequest(), timeout=5).nodes
    events = query.Events(query_pb2.EventsRequest(limit=100000), timeout=5).events
    kinds: dict[str, int] = {}
    for row in events:
        kinds[row.event.kind] = kinds.get(row.event.kind, 0) + 1
    total = sum(n.samples for n in nodes)
    lines = ["", "summary", f"  nodes: {len(nodes)}, GPUs: {sum(n.gpus for n in nodes)}, per-GPU samples stored: {total}"]
    lines.append("  events: " + (", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) or "none"))
    return "\n".join(lines)


def _mean(rows: list, field: str) -> float:
    values = [r.values[field] for r in rows if field in r.values]
    return sum(values) / len(values) if values else float("nan")
