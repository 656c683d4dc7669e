"""Agent cost on an 8-GPU simulated node at 1 Hz through the full NVML code path.

Runs ``gpuwatch agent --simulate 8`` as a subprocess into a throwaway in-process gRPC sink for --seconds,
then prints the agent's CPU seconds per node-second (as % of one core) and its peak RSS. Target: <= 1 % of
one core and <= 100 MiB. The first seconds (imports, inventory) are excluded from the CPU rate.
``--metrics`` also serves the agent's node-local /metrics and scrapes it every 15 s, as Prometheus would.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import socket
import time
import urllib.request

import psutil

from gpuwatch.simulator.collector_sink import IngestSink


SCRAPE_EVERY_S = 15.0


def measure(seconds: float, gpus: int, interval: float, warmup: float, metrics: bool = False) -> dict[str, float]:
    sink = IngestSink()
    port = sink.start()
    with tempfile.TemporaryDirectory() as spool:
        cmd = [sys.executable, "-m", "gpuwatch", "agent", "--collector", f"127.0.0.1:{port}", "--simulate", str(gpus),
               "--interval", str(interval), "--spool", spool, "--log-level", "WARNING"]
        metrics_url = None
        if metrics:
            metrics_port = _free_port()
            cmd += ["--metrics-listen", f"127.0.0.1:{metrics_port}"]
            metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        proc = subprocess.Popen(cmd)
        ps = psutil.Process(proc.pid)
        time.sleep(warmup)
        cpu0, t0 = sum(ps.cpu_times()[:2]), time.monotonic()
        scrapes = 0
        while (left := seconds - (time.monotonic() - t0)) > 0:
            if metrics_url:
                with urllib.request.urlopen(metrics_url, timeout=10) as response:
                    response.read()
                scrapes += 1
            time.sleep(min(left, SCRAPE_EVERY_S) if metrics_url else left)
        cpu1, t1 = sum(ps.cpu_times()[:2]), time.monotonic()
        rss = ps.memory_info().rss
        proc.terminate()
        proc.wait(timeout=30)
    peak_children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    sink.stop()
    batches = len(sink.store.batches)
    return {"cpu_percent_of_core": 100.0 * (cpu1 - cpu0) / (t1 - t0), "rss_mib": rss / 2**20,
            "peak_rss_mib": max(rss, peak_children) / 2**20, "batches_acked": batches, "scrapes": scrapes}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--metrics", action="store_true",
                        help=f"serve the node-local /metrics and scrape it every {SCRAPE_EVERY_S:g} s")
    args = parser.parse_args()
    r = measure(args.seconds, args.gpus, args.interval, args.warmup, args.metrics)
    print(f"agent, {args.gpus} simulated GPUs at {1 / args.interval:g} Hz for {args.seconds:g} s "
          f"(machine: {os.cpu_count()} cores, shared)")
    print(f"  cpu: {r['cpu_percent_of_core']:.2f} % of one core (target <= 1 %)")
    print(f"  rss: {r['rss_mib']:.1f} MiB at the end, peak {r['peak_rss_mib']:.1f} MiB (target <= 100 MiB)")
    print(f"  batches acknowledged by the sink: {r['batches_acked']}"
          + (f"; /metrics scraped {r['scrapes']} times" if args.metrics else ""))


if __name__ == "__main__":
    main()
