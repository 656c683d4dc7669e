"""Bytes per GPU-day of each tier of GPU samples, on both engines side by side: raw rows (one per GPU per
tick) and per-minute rollups (min, max, mean, last of every field).

One agent's GPUs at 1 Hz for ``--hours``, every GPU field set, written through the store's writer (groups of
batches, as ingest does), the rollups built, then each tier's bytes measured apart: DuckDB, the table copied
into a fresh file and checkpointed; ClickHouse, the table's active parts after merging. Values are NVML-like:
each field a random walk rounded to whole units, as most NVML readings are (°C, MHz, W, %); ``--noise``
makes them full-precision uniform floats instead (the incompressible worst case). Each engine runs in a
process of its own (one chdb engine per process).

    python bench/tiers.py [--hours 2] [--gpus 8] [--noise]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

from gpuwatch.collector.store import open_store, rollups
from gpuwatch.core import fields
from gpuwatch.core.batches import BatchBuilder
from gpuwatch.v1 import telemetry_pb2 as pb

T0_MS = 1_767_225_600_000  # minute-aligned
TICKS = 5  # ticks per batch


def batches(hours: float, gpus: int, noise: bool) -> list[pb.TelemetryBatch]:
    rng = np.random.default_rng(7)
    ticks = int(hours * 3600)
    shape = (ticks, gpus, len(fields.GPU_FIELD_NAMES))
    if noise:
        values = rng.uniform(0, 1000, size=shape)
    else:
        values = np.round(np.abs(100 + np.cumsum(rng.normal(0, 0.7, size=shape), axis=0)))
    node = pb.NodeIdentity(node="tier-node", agent_version="bench")
    builder = BatchBuilder(node, "tier-agent", [pb.GpuInfo(index=i, uuid=f"GPU-tier-{i}") for i in range(gpus)])
    out = []
    for seq, start in enumerate(range(0, ticks, TICKS), 1):
        for tick in range(start, min(ticks, start + TICKS)):
            for gpu in range(gpus):
                row = dict(zip(fields.GPU_FIELD_NAMES, values[tick, gpu].tolist()))
                builder.add_gpu_row(gpu, T0_MS + 1000 * tick, row, job_id="job-1", rank=gpu, local_rank=gpu)
        out.append(builder.build(seq))
    return out


def table_bytes(store: Any, table: str, folder: str) -> int:
    if store.path.startswith("chdb://"):
        store._command(f"OPTIMIZE TABLE {store.database}.{table} FINAL")
        df = store.query_df(f"SELECT sum(bytes_on_disk) AS b FROM system.parts WHERE active AND "
                            f"database = '{store.database}' AND table = '{table}'")
        return int(df["b"].iloc[0])
    copy = os.path.join(folder, f"{table}.duckdb")

    def write(con: Any) -> None:
        con.execute(f"ATTACH '{copy}' AS copy_db")
        con.execute(f"CREATE TABLE copy_db.t AS SELECT * FROM {table}")
        con.execute("DETACH copy_db")

    store.run_write(write)
    return os.path.getsize(copy)


def measure(engine: str, args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as folder:
        url = os.path.join(folder, "t.duckdb") if engine == "duckdb" else f"chdb://{os.path.join(folder, 'chdb')}"
        store = open_store(url, raw_retention_s=2 * 86400.0)
        for batch in batches(args.hours, args.gpus, args.noise):
            store.submit(batch)
        store.flush()
        store.build_rollups()
        gpu_days = args.gpus * args.hours / 24
        raw, rolled = (table_bytes(store, t, folder) for t in ("gpu_samples", rollups.ROLLUP_TABLE))
        rows = store.count("gpu_samples")
        store.close()
    values = rows * len(fields.GPU_FIELD_NAMES)
    print(f"RESULT {engine} raw_MB_per_gpu_day={raw / gpu_days / 1e6:.2f} rollup_MB_per_gpu_day="
          f"{rolled / gpu_days / 1e6:.3f} raw_bytes_per_value={raw / values:.2f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=2.0)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--noise", action="store_true", help="uniform random floats instead of NVML-like values")
    parser.add_argument("--engine", choices=("duckdb", "chdb"), help="measure one engine in this process")
    args = parser.parse_args()
    if args.engine:
        measure(args.engine, args)
        return 0
    print(f"{args.gpus} GPUs x {args.hours:g} h at 1 Hz, {len(fields.GPU_FIELD_NAMES)} fields, "
          f"{'uniform noise' if args.noise else 'NVML-like'} values; load average {os.getloadavg()[0]:.1f}")
    for engine in ("duckdb", "chdb"):
        extra = ["--noise"] if args.noise else []
        out = subprocess.run([sys.executable, __file__, "--engine", engine, "--hours", str(args.hours),
                              "--gpus", str(args.gpus), *extra], capture_output=True, text=True)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        print(line or out.stdout + out.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
