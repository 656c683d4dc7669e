"""Ingest throughput of one collector: sender processes stream pre-built batches as fast as acks come back.

Each sender is one agent (its own process, one gRPC stream, a bounded in-flight window) sending distinct
batches of GPUS GPUs x TICKS ticks with every GPU and host field of gpuwatch.core.fields, serialized before the
clock starts so the collector, not the senders, is the bottleneck. Prints metric values per second acked
(= stored: acks come after commit), batches/s, the collector's CPU seconds per batch (user + sys of its
process: a measure of its own cost that other load on the machine inflates far less than wall time), the
senders' own CPU per batch (what the load generator takes from the same cores), the collector's CPU once the
engine has also done the work it defers (DuckDB's checkpoint, ClickHouse's merges: "settled"), and checks the
row counts in the store at the end, with the store's bytes on disk per value stored (DuckDB: the file after a
checkpoint; ClickHouse: the active parts after merging). ``--values random`` (default) sends uniform floats no
codec compresses; ``--values nvml`` integer readings that move by small steps, as NVML's do.
Target on a 2-core machine: >= 500,000 metric values/s. Then runs bench/agent_cost.py if it exists.
``--store duckdb|chdb`` picks the engine; ``--compare ROUNDS`` runs both engines alternately, each run in a
process of its own (one chdb engine per process), and prints them side by side.

    python bench/ingest.py [--senders 4] [--batches 600] [--store duckdb|chdb] [--compare 3] [--values random|nvml]
                           [--collector HOST:PORT]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from gpuwatch.core import fields
from gpuwatch.core.batches import BatchBuilder
from gpuwatch.v1 import telemetry_pb2 as pb

T0_MS = 1_700_000_000_000


def field_values(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """Values for ``shape`` (ticks, ..., fields). ``random``: uniform full-precision floats, which no codec
    compresses (a worst case for the engines' compression CPU). ``nvml``: what NVML reports, integer readings
    (degrees, MHz, W, %, counters) that move by small steps from tick to tick, a third of the fields constant
    (clocks held, memory total, link widths)."""
    if kind == "random":
        return rng.uniform(0, 1000, size=shape)
    walk = np.cumsum(rng.integers(-1, 2, size=shape), axis=0) + rng.integers(0, 1000, size=shape[1:])
    held = rng.random(shape[-1]) < 1 / 3
    walk[..., held] = walk[:1, ..., held]
    return walk.astype(float)


def build_batches(agent: int, count: int, gpus: int, ticks: int, values: str = "random") -> list[bytes]:
    """``count`` distinct serialized batches of one agent (node "bench-<agent>"), one tick per second."""
    rng = np.random.default_rng(agent)
    node = pb.NodeIdentity(node=f"bench-{agent}", agent_version="bench")
    inventory = [pb.GpuInfo(index=i, uuid=f"GPU-bench-{agent}-{i}", name="NVIDIA H100 80GB HBM3",
                            architecture="hopper", gpm_supported=True, memory_total_bytes=80 << 30)
                 for i in range(gpus)]
    builder = BatchBuilder(node, f"bench-agent-{agent}", inventory)
    gpu_values = field_values(rng, (count * ticks, gpus, len(fields.GPU_FIELD_NAMES)), values)
    host_values = field_values(rng, (count * ticks, len(fields.HOST_FIELD_NAMES)), values)
    out = []
    for seq in range(1, count + 1):
        for tick in range((seq - 1) * ticks, seq * ticks):
            ts = T0_MS + 1000 * tick
            for gpu in range(gpus):
                builder.add_gpu_row(gpu, ts, dict(zip(fields.GPU_FIELD_NAMES, gpu_values[tick, gpu].tolist())),
                                    job_id="bench-job", rank=agent * gpus + gpu, local_rank=gpu)
            builder.add_host_row(ts, dict(zip(fields.HOST_FIELD_NAMES, host_values[tick].tolist())))
        out.append(builder.build(seq).SerializeToString())
    return out


def sender(agent: int, address: str, args: argparse.Namespace, ready: mp.Barrier, results: mp.Queue) -> None:
    from gpuwatch.collector import client

    batches = build_batches(agent, args.batches, args.gpus, args.ticks, args.values)
    ch = client.channel(address, timeout=30)
    ready.wait()
    start, cpu = time.perf_counter(), _cpu_seconds()
    acked = sum(1 for ack in client.stream_batches(ch, batches, window=args.window) if not ack.duplicate)
    results.put((agent, acked, start, time.perf_counter(), sum(map(len, batches)), _cpu_seconds() - cpu))


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _thread_cpu() -> Counter:
    """CPU seconds of this process per thread name (Linux /proc; empty elsewhere): the event loop (grpc-aio),
    the store writer, the engine's and gRPC's own threads."""
    out: Counter = Counter()
    tick = os.sysconf("SC_CLK_TCK")
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    for task in Path("/proc/self/task").glob("*") if Path("/proc/self/task").exists() else ():
        try:
            name = python_names.get(int(task.name)) or (task / "comm").read_text().strip()
            fields_ = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[name] += (int(fields_[11]) + int(fields_[12])) / tick
    return out


def disk_bytes(store: Any) -> int:
    """What the store holds on disk: the DuckDB file after a checkpoint, or ClickHouse's active parts after
    merging them (what a store settles to; parts not yet merged hold duplicates and unmerged blocks)."""
    if store.path.startswith("chdb://"):
        for table in store.query_df(f"SELECT name FROM system.tables WHERE database = '{store.database}'")["name"]:
            store._command(f"OPTIMIZE TABLE {store.database}.{table} FINAL")
        df = store.query_df(f"SELECT sum(bytes_on_disk) AS b FROM system.parts WHERE active AND "
                            f"database = '{store.database}'")
        return int(df["b"].iloc[0])
    store.run_write(lambda con: con.execute("CHECKPOINT"))
    return os.path.getsize(store.path)


def settle(store: Any) -> None:
    """Let the engine finish the work it deferred, so that its CPU is counted too: DuckDB's checkpoint (its
    compression), ClickHouse's merges of the parts the run made (until none has run for 1.5 s)."""
    if not store.path.startswith("chdb://"):
        store.run_write(lambda con: con.execute("CHECKPOINT"))
        return
    deadline, quiet = time.monotonic() + 300, 0
    while quiet < 3 and time.monotonic() < deadline:
        running = int(store.query_df("SELECT count() AS n FROM system.merges")["n"].iloc[0])
        quiet = quiet + 1 if running == 0 else 0
        time.sleep(0.5)


def compare(args: argparse.Namespace) -> int:
    """Both engines, alternately, each run in a fresh process; the side-by-side ranges at the end."""
    results: dict[str, list[dict[str, float]]] = {"duckdb": [], "chdb": []}
    for _ in range(args.compare):
        for engine in results:
            out = subprocess.run([sys.executable, __file__, "--store", engine, "--no-agent-cost",
                                  "--senders", str(args.senders), "--batches", str(args.batches),
                                  "--gpus", str(args.gpus), "--ticks", str(args.ticks), "--window", str(args.window),
                                  "--values", args.values],
                                 capture_output=True, text=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(out.stdout + out.stderr)
                return 1
            print(line, flush=True)
            results[engine].append({k: float(v) for k, v in (w.split("=") for w in line.split()[2:])})
    print(f"{'':28}{'DuckDB':>20}{'chdb':>20}{'chdb / DuckDB':>16}")
    for key in ("cpu_s_per_M_values", "settled_cpu_s_per_M_values", "bytes_per_value", "values_per_s"):
        low = {e: min(r[key] for r in rs) for e, rs in results.items()}
        high = {e: max(r[key] for r in rs) for e, rs in results.items()}
        ratio = sorted(c / d for c in (r[key] for r in results["chdb"]) for d in (r[key] for r in results["duckdb"]))
        print(f"{key:28}{low['duckdb']:>9.3g} – {high['duckdb']:<8.3g}{low['chdb']:>9.3g} – {high['chdb']:<8.3g}"
              f"{ratio[len(ratio) // 2]:>12.2f}x (median)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--batches", type=int, default=600, help="batches per sender")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--ticks", type=int, default=5, help="ticks (rows per GPU) per batch")
    parser.add_argument("--window", type=int, default=64, help="unacked batches in flight per stream")
    parser.add_argument("--values", choices=("random", "nvml"), default="random",
                        help="random: uniform floats no codec compresses (the worst case); nvml: integer readings "
                             "moving by small steps, as NVML reports them")
    parser.add_argument("--collector", help="an already running collector (default: start one in this process)")
    parser.add_argument("--no-agent-cost", action="store_true", help="skip bench/agent_cost.py at the end")
    parser.add_argument("--store", choices=("duckdb", "chdb"), default="duckdb", help="the collector's engine")
    parser.add_argument("--compare", type=int, metavar="ROUNDS", help="run DuckDB and chdb alternately ROUNDS "
                        "times each and print CPU and bytes per value side by side")
    args = parser.parse_args()
    if args.compare:
        return compare(args)

    tmp = tempfile.TemporaryDirectory()
    server = None
    if args.collector:
        address = args.collector
    else:
        from gpuwatch.collector.server import serve
        from gpuwatch.core.settings import local_collector
        url = (os.path.join(tmp.name, "bench.duckdb") if args.store == "duckdb"
               else f"chdb://{os.path.join(tmp.name, 'bench-chdb')}")
        server = serve(local_collector(url))
        address = server.address

    ctx = mp.get_context("spawn")
    ready, results = ctx.Barrier(args.senders + 1), ctx.Queue()
    procs = [ctx.Process(target=sender, args=(i, address, args, ready, results)) for i in range(args.senders)]
    for p in procs:
        p.start()
    print(f"building {args.senders} x {args.batches} batches ({args.gpus} GPUs x {args.ticks} ticks, "
          f"{len(fields.GPU_FIELD_NAMES)} GPU + {len(fields.HOST_FIELD_NAMES)} host fields) ...", flush=True)
    ready.wait(timeout=600)  # raises BrokenBarrierError if a sender died while building
    cpu_before, threads_before = _cpu_seconds(), _thread_cpu()
    reports = [results.get(timeout=600) for _ in procs]
    cpu, threads = _cpu_seconds() - cpu_before, _thread_cpu()
    threads.subtract(threads_before)
    for p in procs:
        p.join()

    start = min(r[2] for r in reports)
    elapsed = max(r[3] for r in reports) - start
    batches = sum(r[1] for r in reports)
    gpu_rows = batches * args.gpus * args.ticks
    host_rows = batches * args.ticks
    values = gpu_rows * len(fields.GPU_FIELD_NAMES) + host_rows * len(fields.HOST_FIELD_NAMES)
    megabytes = sum(r[4] for r in reports) / 1e6
    sender_cpu = sum(r[5] for r in reports)
    print(f"senders: {args.senders}, window {args.window}, wall {elapsed:.2f} s, {megabytes:.1f} MB sent, "
          f"load average {os.getloadavg()[0]:.1f}; the senders' own CPU: {sender_cpu:.2f} s, "
          f"{sender_cpu / max(1, sum(r[1] for r in reports)) * 1000:.3f} ms per batch")
    print(f"acked (= committed): {batches} batches, {batches / elapsed:,.0f} batches/s, "
          f"{values / elapsed:,.0f} metric values/s, {gpu_rows / elapsed:,.0f} GPU rows/s")
    if server is not None:  # CPU of this process: the collector's, as the senders are processes of their own
        print(f"collector CPU: {cpu:.2f} s user+sys, {cpu / batches * 1000:.3f} ms per batch "
              f"({values / cpu:,.0f} values per CPU-second of the collector)")
        busiest = [(name, seconds) for name, seconds in threads.most_common(6) if seconds > 0]
        print("  by thread, ms per batch: " + ", ".join(f"{name} {seconds / batches * 1000:.3f}"
                                                      for name, seconds in busiest))
        settle(server.store)
        settled = _cpu_seconds() - cpu_before
        print(f"collector CPU once the engine settled (checkpoint or merges done): {settled:.2f} s")
        stored_gpu, stored_host = server.store.count("gpu_samples"), server.store.count("host_samples")
        ok = (stored_gpu, stored_host) == (gpu_rows, host_rows)
        print(f"stored: gpu_samples {stored_gpu} (expected {gpu_rows}), host_samples {stored_host} "
              f"(expected {host_rows}) -> {'OK' if ok else 'MISMATCH'}")
        disk = disk_bytes(server.store)
        print(f"RESULT {args.store} cpu_s_per_M_values={cpu / values * 1e6:.3f} "
              f"settled_cpu_s_per_M_values={settled / values * 1e6:.3f} bytes_per_value={disk / values:.2f} "
              f"values_per_s={values / elapsed:.0f} load={os.getloadavg()[0]:.1f}", flush=True)
        server.stop()
        if not ok:
            return 1
    tmp.cleanup()

    agent_cost = Path(__file__).with_name("agent_cost.py")
    if agent_cost.exists() and not args.no_agent_cost:
        print(f"--- {agent_cost.name} ---", flush=True)
        return subprocess.call([sys.executable, str(agent_cost)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
