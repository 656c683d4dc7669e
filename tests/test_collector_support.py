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


def frames_to_batches(gpu: "pd.DataFrame", events: "pd.DataFrame", agent: str = "agent-sim",
                      rows_per_batch: int = 2000) -> list[pb.TelemetryBatch]:
    """Batches carrying a simulated node's gpu_samples and events frames (models.failsim shape); the events
    travel in the last batch."""
    import numpy as np

    from gpuwatch.fields import GPU_FIELD_NAMES
    from gpuwatch.recording import ts_ms

    node = str(gpu["node"].iloc[0])
    inventory = [pb.GpuInfo(index=int(i), uuid=f"GPU-{node}-{int(i)}", name="NVIDIA H100 80GB HBM3")
                 for i in sorted(gpu["gpu_index"].unique())]
    builder = BatchBuilder(pb.NodeIdentity(node=node), agent, inventory)
    t, values = ts_ms(gpu["ts"]), gpu[list(GPU_FIELD_NAMES)].to_numpy(float)
    index, jobs, ranks = gpu["gpu_index"].to_numpy(), gpu["job_id"].to_numpy(), gpu["rank"].to_numpy()
    batches = []
    for n, i in enumerate(np.argsort(t, kind="stable"), start=1):
        row = {name: v for name, v in zip(GPU_FIELD_NAMES, values[i]) if not np.isnan(v)}
        builder.add_gpu_row(int(index[i]), int(t[i]), row, job_id=str(jobs[i]), rank=int(ranks[i]))
        if n % rows_per_batch == 0:
            batches.append(builder.build(len(batches) + 1))
    for e, when in zip(events.itertuples(), ts_ms(events["ts"])):
        builder.add_event(e.kind, int(when), gpu_index=int(e.gpu_index), code=int(e.code), message=str(e.message))
    batches.append(builder.build(len(batches) + 1))
    return batches


def degrading_node(start_ms: int, hours: float, fault_after_h: float, failing_gpu: int = 1, gpus: int = 4,
                   node: int = 0) -> tuple["pd.DataFrame", "pd.DataFrame"]:
    """(gpu_samples, events) of one simulated node (models.failsim, 1-minute ticks, one job throughout) whose
    GPU ``failing_gpu`` has HBM degrading for 8 h before it faults at ``fault_after_h``; the rest stay healthy."""
    import numpy as np

    from gpuwatch.models import failsim

    cfg = failsim.FleetConfig(nodes=1, gpus_per_node=gpus, days=hours / 24, seed=3, start_ms=start_ms)
    ts = np.arange(start_ms + 60_000, start_ms + int(hours * failsim.HOUR_MS) + 1, 60_000, dtype=np.int64)
    fault = start_ms + int(fault_after_h * failsim.HOUR_MS)
    plan = failsim.FaultPlan(failsim.node_name(node), failing_gpu, "memory", fault - 8 * failsim.HOUR_MS, fault,
                             fault + 4 * failsim.HOUR_MS, 48, seed=7)
    gpu, _host, events = failsim.simulate_node(cfg, node, ts, np.full(len(ts), 5), np.full(len(ts), 0.9), [plan],
                                               np.random.default_rng(1))
    return gpu, events
