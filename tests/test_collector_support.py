"""Shared helpers of the collector tests (batches, servers on loopback, a collector subprocess); no tests here."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

from gpuwatch.batches import BatchBuilder
from gpuwatch.v1 import telemetry_pb2 as pb

T0_MS = 1_700_000_000_000
GPUS = 2
TICKS = 3


def make_batch(seq: int, agent: str = "agent-1", node: str = "node-1", t0_ms: int = T0_MS) -> pb.TelemetryBatch:
    """GPUS x TICKS GPU rows (power varies, memory temperature only on the first tick), one host row, one event."""
    builder = BatchBuilder(pb.NodeIdentity(node=node), agent,
                           [pb.GpuInfo(index=i, uuid=f"GPU-{node}-{i}", name="H100") for i in range(GPUS)])
    for tick in range(TICKS):
        ts = t0_ms + 1000 * (seq * TICKS + tick)
        for gpu in range(GPUS):
            values = {"gpu_power_watts": 100.0 * gpu + seq + tick / 10, "gpu_utilization_ratio": 0.5}
            if tick == 0:
                values["gpu_memory_temperature_celsius"] = 60.0 + seq
            builder.add_gpu_row(gpu, ts, values, job_id="job-7" if gpu == 1 else "", rank=gpu if gpu == 1 else -1)
    builder.add_host_row(t0_ms + 1000 * seq * TICKS, {"host_load1": 1.5})
    builder.add_event("xid", t0_ms + 1000 * seq * TICKS, gpu_index=1, code=79, message="GPU fell off the bus",
                      attrs={"seq": str(seq)})
    return builder.build(seq)


ROWS_PER_BATCH = GPUS * TICKS


def start_collector_process(db_path: str, timeout_s: float = 60.0) -> tuple[subprocess.Popen, str]:
    """Run `gpuwatch collector` on a free loopback port; return the process and its address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "collector", "--listen", "127.0.0.1:0", "--db", db_path,
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if "listening on" in line:
                return proc, line.split("listening on ", 1)[1].split(",", 1)[0]
            if not line and proc.poll() is not None:
                break
    proc.kill()
    raise AssertionError(f"collector did not start: {proc.stderr.read()}")


def kill_process(proc: subprocess.Popen, sig: int = signal.SIGKILL, timeout_s: float = 30.0) -> int:
    os.kill(proc.pid, sig)
    return proc.wait(timeout_s)
