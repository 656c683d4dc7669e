"""Disk per GPU-day on both stores, and ClickHouse's compression ratio, from a simulated fleet at 1 Hz.

Writes a recording with `gpuwatch simulate` (NODES nodes x GPUS GPUs, HOURS hours at --resolution), replays it
with `gpuwatch replay --fast` through a real collector on each store (the ingest path agents use), stops the
collector, and prints per store: replay wall time, stored GPU sample rows, bytes on disk per GPU sample row
and per GPU-day at the simulated resolution (ClickHouse: the tables' parts, system.parts); for ClickHouse also
compressed vs uncompressed bytes per table (system.columns), i.e. the codecs' compression ratio.
`gpuwatch simulate` draws every value as a full-precision float with noise, which no codec compresses much;
NVML's integer-valued readings compress far better (see docs/store-schema.md for both).

    python bench/store_size.py [--nodes 2] [--gpus 8] [--hours 6] [--resolution 1s]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import clickhouse_connect

from gpuwatch.collector.store import open_store

GPUWATCH = [sys.executable, "-m", "gpuwatch"]


def collector(store_args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([*GPUWATCH, "collector", "--listen", "127.0.0.1:0", *store_args, "--retention-days", "0",
                             "--score-interval", "3600", "--jobs-interval", "3600"],
                            stdout=subprocess.PIPE, stderr=log.open("wb"), text=True)
    line = proc.stdout.readline()
    if "listening on " not in line:
        sys.exit(f"collector did not start: {line!r} (see {log})")
    return proc, line.split("listening on ", 1)[1].split(",", 1)[0]


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def parts_bytes(url: str) -> int:
    """The gpuwatch tables' active parts on disk (the engine directory also holds its own system logs)."""
    client = clickhouse_connect.get_client(dsn=url)
    try:
        return int(client.query("SELECT sum(bytes_on_disk) FROM system.parts WHERE database = 'gpuwatch' AND active")
                   .result_rows[0][0])
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--hours", type=float, default=6.0)
    parser.add_argument("--resolution", default="1s")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpuwatch-store-size-"))
    recording = work / "fleet"
    subprocess.run([*GPUWATCH, "simulate", "--nodes", str(args.nodes), "--gpus", str(args.gpus), "--days",
                    str(args.hours / 24), "--resolution", args.resolution, "--out", str(recording), "--quiet"],
                   check=True)
    seconds = {"s": 1, "m": 60}[args.resolution[-1]] * float(args.resolution[:-1])
    stores = {"duckdb": (["--db", str(work / "store.duckdb")], work / "store.duckdb"),
              "clickhouse (chdb)": (["--store", f"chdb://{work / 'chdb'}"], work / "chdb")}
    print(f"{args.nodes} nodes x {args.gpus} GPUs, {args.hours:g} h at {args.resolution}; work dir {work}")
    for name, (store_args, path) in stores.items():
        proc, address = collector(store_args, work / f"{name.split()[0]}.log")
        started = time.perf_counter()
        subprocess.run([*GPUWATCH, "replay", str(recording), "--collector", address, "--fast", "--quiet"], check=True,
                       stdout=subprocess.DEVNULL)
        replay_s = time.perf_counter() - started
        proc.terminate()
        proc.wait(120)
        url = str(path) if name == "duckdb" else f"chdb://{path}"
        store = open_store(url)
        try:
            rows = store.count("gpu_samples")
        finally:
            store.close()
        size = du(path) if name == "duckdb" else parts_bytes(url)
        per_gpu_day = size / rows * 86400 / seconds
        print(f"\n{name}: replay {replay_s:.1f} s, {rows} GPU sample rows, {size / 2**20:.1f} MiB on disk, "
              f"{size / rows:.0f} B per GPU sample row (all tables), {per_gpu_day / 2**20:.2f} MiB per GPU-day "
              f"at {args.resolution}")
        if name != "duckdb":
            client = clickhouse_connect.get_client(dsn=url)
            try:
                table = client.query_df("""
                    SELECT table, sum(data_compressed_bytes) AS compressed, sum(data_uncompressed_bytes) AS raw
                    FROM system.columns WHERE database = 'gpuwatch' GROUP BY table HAVING raw > 0 ORDER BY raw DESC""")
            finally:
                client.close()
            for r in table.itertuples():
                print(f"  {r.table:<16} {r.raw / 2**20:8.1f} MiB -> {r.compressed / 2**20:7.1f} MiB "
                      f"({r.raw / max(r.compressed, 1):.1f}x)")
            total_raw, total = table["raw"].sum(), table["compressed"].sum()
            print(f"  {'all':<16} {total_raw / 2**20:8.1f} MiB -> {total / 2**20:7.1f} MiB ({total_raw / total:.1f}x)")


if __name__ == "__main__":
    main()
