"""How soon a fresh `gpuwatch collector` process serves: port open, first query answered, scoring ready.

Starts ``gpuwatch collector --listen 127.0.0.1:PORT --db <temp>`` ``--runs`` times and measures from the
process start: when the port accepts a connection, when a ListNodes query is answered, and when the log
says the failure model is loaded (scoring starts then). Target: listening within 1 s.

    python bench/startup.py [--runs 3]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import grpc

from gpuwatch.v1 import query_pb2 as q
from gpuwatch.v1 import query_pb2_grpc

MODEL_LOADED = "failure model loaded"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def one_start(tmp: str) -> dict[str, float | None]:
    port = _free_port()
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "gpuwatch", "collector", "--listen", f"127.0.0.1:{port}",
                             "--db", os.path.join(tmp, f"{port}.duckdb"), "--log-level", "info"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp)
    model_at: list[float] = []

    def watch_log() -> None:
        for line in proc.stderr:
            if MODEL_LOADED in line and not model_at:
                model_at.append(time.perf_counter() - started)

    threading.Thread(target=watch_log, daemon=True).start()
    try:
        while not _accepts(port):
            if proc.poll() is not None:
                raise SystemExit(f"collector exited with {proc.returncode}")
            time.sleep(0.005)
        listening = time.perf_counter() - started
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        query_pb2_grpc.QueryStub(channel).ListNodes(q.ListNodesRequest(), timeout=120, wait_for_ready=True)
        answered = time.perf_counter() - started
        channel.close()
        deadline = time.perf_counter() + 120
        while not model_at and time.perf_counter() < deadline and proc.poll() is None:
            time.sleep(0.05)
        return {"listening": listening, "answered": answered, "model": model_at[0] if model_at else None}
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [one_start(tmp) for _ in range(args.runs)]
    for key, what in (("listening", "port accepts connections"), ("answered", "first ListNodes answered"),
                      ("model", "failure model loaded, scoring starts")):
        values = [r[key] for r in runs if r[key] is not None]
        shown = ", ".join(f"{v:.2f}" for v in values) if values else "not logged (loaded before listening)"
        median = f" (median {statistics.median(values):.2f} s)" if values else ""
        print(f"{what:38s} {shown}{median}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
