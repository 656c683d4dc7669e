"""Soak test of one collector under probe data: RSS over time, then query latency and shutdown time.

NODES simulated agents (GPUS GPUs each, one synthetic training job per node with one rank per GPU, so
64 ranks on 8 nodes by default) stream GPU samples and probe spans on a simulated clock running SPEED times
faster than real time, until HOURS simulated hours are covered. Every --every real seconds it prints the
collector's resident memory (RSS); at the end the latency of the `jobs`, `breakdown JOB` and `nodes` RPCs
(each three times, the worst shown) and how long the collector takes to exit after SIGTERM.
Targets (issue 11): RSS <= 1 GiB throughout, jobs <= 1 s, breakdown <= 2 s, SIGTERM exit <= 5 s.

    python bench/soak.py [--nodes 8] [--gpus 8] [--hours 24] [--speed 144] [--store chdb:///DIR | --db FILE]
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import psutil

from gpuwatch.collector.client import connect
from gpuwatch.v1 import query_pb2 as q

GIB = 2**30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_collector(args: argparse.Namespace, workdir: Path, address: str) -> subprocess.Popen:
    store = ["--store", args.store] if args.store else ["--db", args.db or str(workdir / "soak.duckdb")]
    command = [sys.executable, "-m", "gpuwatch", "collector", "--listen", address, *store,
               "--jobs-interval", str(args.jobs_interval), "--score-interval", str(args.score_interval),
               *args.collector_arg]
    log = open(workdir / "collector.log", "wb")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def start_agents(args: argparse.Namespace, workdir: Path, address: str) -> list[subprocess.Popen]:
    origin, start = time.time(), time.time()
    agents = []
    for i in range(args.nodes):
        node = f"soak-{i:02d}"
        command = [sys.executable, "-m", "gpuwatch", "agent", "--collector", address, "--simulate", str(args.gpus),
                   "--node", node, "--spool", str(workdir / "spool" / node), "--interval", "1",
                   "--batch-interval", "2", "--sim-speed", str(args.speed), "--sim-start", str(start),
                   "--sim-origin", str(origin), "--sim-job", f"soak-job-{i:02d}", "--sim-job-step",
                   str(args.job_step)]
        log = open(workdir / f"{node}.log", "wb")
        agents.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
    return agents


def wait_listening(address: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"collector exited with status {proc.returncode} (see its log)")
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    sys.exit(f"collector not listening on {address} after {timeout:g} s")


def rss(proc: psutil.Process) -> int:
    """Resident bytes of the collector and its children (chdb runs in-process; DuckDB too)."""
    return proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))


def timed(call, repeats: int = 3) -> tuple[float, str]:
    """The worst latency of ``repeats`` calls, and an error text ('' when every call answered)."""
    worst, error = 0.0, ""
    for _ in range(repeats):
        started = time.perf_counter()
        try:
            call()
        except Exception as exc:  # a deadline or an error is a result here, printed beside the numbers
            error = (exc.details() if isinstance(exc, grpc.RpcError) else str(exc)).splitlines()[0]
        worst = max(worst, time.perf_counter() - started)
    return worst, error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs, and ranks of the node's job, per node")
    parser.add_argument("--hours", type=float, default=24.0, help="simulated hours to cover")
    parser.add_argument("--speed", type=float, default=144.0, help="simulated seconds per real second")
    parser.add_argument("--job-step", type=float, default=1.0, help="simulated step time of every job, seconds")
    parser.add_argument("--jobs-interval", type=float, default=30.0)
    parser.add_argument("--score-interval", type=float, default=60.0)
    parser.add_argument("--every", type=float, default=30.0, help="real seconds between RSS lines")
    parser.add_argument("--store", help="collector --store URL (default: a DuckDB file in the work dir)")
    parser.add_argument("--db", help="collector --db PATH")
    parser.add_argument("--dir", help="work dir (default: a temporary one)")
    parser.add_argument("--collector-arg", action="append", default=[], help="extra collector argument")
    args = parser.parse_args()
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="gpuwatch-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    address = f"127.0.0.1:{free_port()}"
    collector = start_collector(args, workdir, address)
    wait_listening(address, collector)
    agents = start_agents(args, workdir, address)
    proc = psutil.Process(collector.pid)
    duration = args.hours * 3600 / args.speed
    print(f"{args.nodes} nodes x {args.gpus} GPUs/ranks, {args.hours:g} simulated h at {args.speed:g}x "
          f"= {duration / 60:.1f} real min; work dir {workdir}", flush=True)
    print(f"{'real s':>7} {'sim h':>6} {'RSS MiB':>8}", flush=True)
    started = time.monotonic()
    peak = 0
    try:
        while (elapsed := time.monotonic() - started) < duration:
            if collector.poll() is not None:
                sys.exit(f"collector exited with status {collector.returncode} (see {workdir}/collector.log)")
            now = rss(proc)
            peak = max(peak, now)
            print(f"{elapsed:7.0f} {elapsed * args.speed / 3600:6.2f} {now / 2**20:8.0f}", flush=True)
            time.sleep(min(args.every, max(0.1, duration - elapsed)))
    finally:
        for agent in agents:
            agent.send_signal(signal.SIGTERM)
        for agent in agents:
            try:
                agent.wait(30)
            except subprocess.TimeoutExpired:
                agent.kill()
    peak = max(peak, rss(proc))
    stub = connect(address, timeout=60)
    jobs_s, jobs_err = timed(lambda: stub.Jobs(q.JobsRequest(), timeout=60))
    breakdown_s, breakdown_err = timed(lambda: stub.Breakdown(q.BreakdownRequest(job_id="soak-job-00"), timeout=60))
    nodes_s, nodes_err = timed(lambda: stub.ListNodes(q.ListNodesRequest(), timeout=60))
    peak = max(peak, rss(proc))
    collector.send_signal(signal.SIGTERM)
    stop_started = time.perf_counter()
    try:
        collector.wait(120)
    except subprocess.TimeoutExpired:
        collector.kill()
    sigterm_s = time.perf_counter() - stop_started
    size = sum(f.stat().st_size for f in workdir.rglob("*") if f.is_file() and "spool" not in f.parts)
    print(f"\npeak RSS {peak / 2**20:.0f} MiB (target <= {GIB / 2**20:.0f}) | store on disk {size / 2**20:.0f} MiB")
    for name, seconds, error, target in (("jobs", jobs_s, jobs_err, 1.0), ("breakdown JOB", breakdown_s,
                                          breakdown_err, 2.0), ("nodes", nodes_s, nodes_err, None)):
        goal = f" (target <= {target:g} s)" if target else ""
        print(f"{name:<14} {seconds:7.3f} s{goal}{'  ERROR: ' + error if error else ''}")
    print(f"{'SIGTERM exit':<14} {sigterm_s:7.3f} s (target <= 5 s), status {collector.returncode}")
    if os.environ.get("SOAK_KEEP") is None and not args.dir:
        subprocess.run(["rm", "-rf", str(workdir)], check=False)


if __name__ == "__main__":
    main()
