"""`gpuwatch import` of a wide CSV shaped like a converted long-lived fleet: many GPUs, few rows each.

The shape of the case reported slow (79,833 rows for 18,687 GPUs, one GPU per node as on Titan): most rows
are the empty samples that mark a GPU's life in service, some carry an XID (48 or 79) or a DBE count. Times
the whole command (read, shape, write) in this process, wall and CPU (a loaded machine stretches wall
time), best of ``--repeat``.

    python bench/import_wide.py [--rows 79833] [--gpus 18687] [--repeat 3]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd


def make_csv(path: Path, rows: int, gpus: int, seed: int = 0) -> None:
    """A wide CSV: node, gpu_index, ts (ISO 8601), UUID, a DBE counter and DCGM's last-XID column."""
    rng = np.random.default_rng(seed)
    gpu = np.sort(np.concatenate([np.arange(gpus), rng.integers(0, gpus, rows - gpus)]))
    start = pd.Timestamp("2013-01-01", tz="UTC").value // 10**6
    ts = start + rng.integers(0, 6 * 365 * 86_400_000, rows)
    xid = np.where(rng.random(rows) < 0.05, rng.choice([48, 79], rows), np.nan)
    dbe = np.where(rng.random(rows) < 0.3, rng.integers(0, 3, rows), np.nan)
    pd.DataFrame({"node": np.char.add("c", (gpu // 1).astype(str)), "gpu_index": 0,
                  "ts": pd.to_datetime(ts, unit="ms", utc=True).strftime("%Y-%m-%dT%H:%M:%SZ"),
                  "UUID": np.char.add("GPU-", gpu.astype(str)), "gpu_ecc_dbe_volatile_total": dbe,
                  "DCGM_FI_DEV_XID_ERRORS": xid}).to_csv(path, index=False)


def main() -> None:
    from gpuwatch.apps.cli import main as gpuwatch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=79_833)
    p.add_argument("--gpus", type=int, default=18_687)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        csv = Path(tmp) / "fleet.csv"
        make_csv(csv, args.rows, args.gpus)
        wall = cpu = float("inf")
        for k in range(args.repeat):
            out = Path(tmp) / f"rec{k}"
            started, cpu_started = time.perf_counter(), time.process_time()
            with contextlib.redirect_stdout(io.StringIO()):
                assert gpuwatch(["import", str(csv), "--out", str(out), "--format", "wide", "--json", "--quiet"]) == 0
            wall = min(wall, time.perf_counter() - started)
            cpu = min(cpu, time.process_time() - cpu_started)
        parts = sum(1 for _ in out.rglob("*.parquet"))
        print(f"import of {args.rows:,} rows for {args.gpus:,} GPUs ({csv.stat().st_size / 2**20:.1f} MiB CSV): "
              f"best of {args.repeat}: {wall:.2f} s wall, {cpu:.2f} s CPU, {parts} part files")


if __name__ == "__main__":
    main()
