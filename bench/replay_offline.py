"""Benchmark `gpuwatch replay --offline` on a simulated fleet recording: replay, scoring, whole command.

Writes a recording with `gpuwatch simulate` (faults scaled up so some GPUs fail), then measures, side by side
in one run, the ways a replay can store it:

- ``--offline``: the real command as a subprocess (batches decoded by the collector's Ingest decoder and
  committed by its store writer in this process, no network), once with the default scoring (every model
  step in one vectorised pass) and, with ``--live-cadence``, once with ``--score-interval 60`` (a live scorer
  round per recorded minute, each re-reading a day of history);
- ``--before-python PY``: the same command run by another installation's interpreter (a checkout of an
  earlier commit installed in its own virtualenv), for before/after in one run;
- the replay stage streamed over loopback gRPC into a collector started in this process (what ``--offline``
  did before) and into ``gpuwatch collector`` in a process of its own (the network path using a second core).

Prints GPU samples, each way's replay seconds and samples/s, the scoring seconds, the command's wall and CPU
seconds and samples/s, and the load average before each row, as the machine may be shared.
Target: >= 50,000 samples/s for the replay stage of ``--offline``.

    python bench/replay_offline.py [--nodes 8] [--gpus 8] [--days 1] [--live-cadence] [--before-python PY]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuwatch.apps.replay import replay
from gpuwatch.collector import client
from gpuwatch.collector.server import serve
from gpuwatch.core.settings import local_collector
from gpuwatch.core.recording import open_recording

_HEADER = (f"{'way':<52}{'load':>5}{'replay s':>9}{'replay samples/s':>18}{'scoring s':>10}{'wall s':>8}{'cpu s':>7}"
           f"{'samples/s (wall)':>18}{'failed GPUs':>12}")


def _run(argv: list[str], python: str = sys.executable, cwd: str | None = None) -> tuple[dict, float, float]:
    """(JSON result, wall seconds, CPU seconds of the child) of one gpuwatch command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    out = subprocess.run([python, "-m", "gpuwatch", *argv, "--json", "--quiet"], check=True, capture_output=True,
                         text=True, cwd=cwd).stdout
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(out), wall, cpu


def _row(name: str, load: float, samples: int, replay_s: float, scoring: dict | None = None,
         wall: float | None = None, cpu: float | None = None) -> str:
    def cell(value: float | None, width: int, fmt: str) -> str:
        return f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}"

    return (f"{name:<52}{load:>5.1f}{replay_s:>9.2f}{samples / replay_s:>18,.0f}"
            f"{cell(scoring.get('seconds') if scoring else None, 10, '.2f')}{cell(wall, 8, '.1f')}"
            f"{cell(cpu, 7, '.1f')}{cell(samples / wall if wall else None, 18, ',.0f')}"
            f"{cell(len(scoring.get('failed', [])) if scoring else None, 12, 'd')}")


def _in_process_grpc(rec_path: Path, db: Path) -> float:
    """Replay stage seconds streaming into a collector started in this process (the former --offline)."""
    server = serve(local_collector(str(db)))
    try:
        ch = client.channel(server.address)
        try:
            return replay(open_recording(rec_path), ch, quiet=True).seconds
        finally:
            ch.close()
    finally:
        server.stop()


def _collector_process_grpc(rec_path: Path, db: Path) -> float:
    """Replay stage seconds of `gpuwatch replay --collector` into `gpuwatch collector` running in its own process."""
    proc = subprocess.Popen([sys.executable, "-m", "gpuwatch", "collector", "--listen", "127.0.0.1:0", "--db", str(db),
                             "--log-level", "warning"], stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        if "listening on " not in line:
            raise SystemExit(f"the collector did not start: {line!r}")
        address = line.split("listening on ", 1)[1].split(" ", 1)[0].rstrip(",")
        result, _, _ = _run(["replay", str(rec_path), "--collector", address])
        return result["seconds"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--days", type=float, default=1.0)
    parser.add_argument("--live-cadence", action="store_true",
                        help="also run with --score-interval 60 (slow: minutes per simulated day)")
    parser.add_argument("--before-python", metavar="PY",
                        help="also run `replay --offline` with this interpreter (an earlier commit's installation)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuwatch-bench-replay-") as tmp:
        rec = Path(tmp) / "rec"
        sim, _, _ = _run(["simulate", "--nodes", str(args.nodes), "--gpus", str(args.gpus), "--days", str(args.days),
                          "--fault-rate-multiplier", "50", "--seed", "4", "--out", str(rec)])
        samples = int(sim["gpu_rows"])
        print(f"recording: {args.nodes} nodes x {args.gpus} GPUs x {args.days:g} days = {samples:,} GPU samples")
        print(_HEADER)
        if args.before_python:
            load = os.getloadavg()[0]
            result, wall, cpu = _run(["replay", str(rec), "--offline"], python=args.before_python, cwd=tmp)
            print(_row("before: --offline of --before-python", load, samples, result["seconds"],
                       result.get("scoring", {}), wall, cpu), flush=True)
        load = os.getloadavg()[0]
        print(_row("in-process collector, loopback gRPC (replay stage)", load, samples,
                   _in_process_grpc(rec, Path(tmp) / "in-process.duckdb")), flush=True)
        load = os.getloadavg()[0]
        print(_row("collector process, loopback gRPC (replay stage)", load, samples,
                   _collector_process_grpc(rec, Path(tmp) / "process.duckdb")), flush=True)
        runs = [("after: --offline (one pass per model step)", [])]
        if args.live_cadence:
            runs.append(("after: --offline --score-interval 60", ["--score-interval", "60"]))
        for name, extra in runs:
            load = os.getloadavg()[0]
            result, wall, cpu = _run(["replay", str(rec), "--offline", *extra])
            print(_row(name, load, samples, result["seconds"], result.get("scoring", {}), wall, cpu), flush=True)
        print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
