"""Many agents against one collector: values/s, ack latency and collector memory per fleet size.

For each N (default 500, 2,000 and 5,000) a fresh ``gpuwatch collector`` runs in its own process on a
temporary DuckDB file, and emulator processes (grpc.aio, one event loop each) open one channel and one
Ingest stream per agent. Every agent sends what a real agent sends at its real cadence: one batch every
``--interval`` seconds (the agent's batch_interval, 5 s) of ``--ticks`` 1 Hz ticks of ``--gpus`` GPUs with
every GPU and host field, at a random phase, with its own agent id, node name and GPU inventory. The
sample part of a batch is built once per time slot per emulator process (same values for every agent of
that process, timestamps of that slot); the collector decodes and stores each batch in full.

Printed per N: metric values/s acknowledged (= committed; acks follow the commit), batches/s, ack latency
p50/p99 (send to ack, measured in the emulator), how many agents got at least one ack, the latency of
``ListNodes`` queries issued during the run, the collector's peak RSS, the CPU (user + system) per acked
batch of the collector and of the emulator processes (what the emulator itself takes from the shared
cores), and the load average. Streams that failed are counted by status, with how long after they were
opened they failed and whether before their first ack. ``--idle K`` first opens K streams that never
send (the "idle streams starve the server" reproduction). ``--before-python PY`` runs each N first against
the collector of another installation (the previous code in its own venv), with the same emulator.

    python bench/agents.py [--agents 500,2000,5000] [--seconds 30] [--procs 2] [--idle 0] [--connect-rate 400]
                           [--before-python PY]
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import psutil

from gpuwatch.core import fields
from gpuwatch.core.batches import SCHEMA_VERSION, BatchBuilder
from gpuwatch.apps.collector_cli import raise_open_file_limit
from gpuwatch.v1 import telemetry_pb2 as pb

_STREAM = "/gpuwatch.v1.Ingest/Stream"
# Each agent gets its own connection, as agents on different machines do (channels in one process would
# otherwise share one connection, and its concurrent-stream limit).
_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1),
            ("grpc.keepalive_time_ms", 60_000), ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.use_local_subchannel_pool", 1)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def values_per_batch(gpus: int, ticks: int) -> int:
    return ticks * (gpus * len(fields.GPU_FIELD_NAMES) + len(fields.HOST_FIELD_NAMES))


class SlotBodies:
    """The serialized samples + host part of a batch per time slot, built once and shared by the agents."""

    def __init__(self, gpus: int, ticks: int, seed: int) -> None:
        self.gpus, self.ticks = gpus, ticks
        self._rng = np.random.default_rng(seed)
        self._bodies: dict[int, bytes] = {}

    def body(self, slot_end_ms: int) -> bytes:
        body = self._bodies.get(slot_end_ms)
        if body is None:
            if len(self._bodies) > 8:
                self._bodies.clear()
            builder = BatchBuilder(pb.NodeIdentity(node="x"), "x")
            for tick in range(self.ticks):
                ts = slot_end_ms - 1000 * (self.ticks - 1 - tick)
                gpu_values = self._rng.uniform(0, 1000, (self.gpus, len(fields.GPU_FIELD_NAMES)))
                for gpu in range(self.gpus):
                    builder.add_gpu_row(gpu, ts, dict(zip(fields.GPU_FIELD_NAMES, gpu_values[gpu].tolist())),
                                        job_id="bench-job", rank=gpu, local_rank=gpu)
                builder.add_host_row(ts, dict(zip(fields.HOST_FIELD_NAMES,
                                                  self._rng.uniform(0, 100, len(fields.HOST_FIELD_NAMES)).tolist())))
            built = builder.build(1)
            body = pb.TelemetryBatch(samples=built.samples, host=built.host).SerializeToString()
            self._bodies[slot_end_ms] = body
        return body


async def _agent(index: int, address: str, args: argparse.Namespace, bodies: SlotBodies, stats: dict,
                 stop: asyncio.Event, connected: list) -> None:
    """One agent: a batch every ``args.interval`` s on one stream; like gpuwatch.agent.uplink it reconnects
    with jittered backoff when the stream fails and resends what was not acknowledged."""
    import grpc

    node = f"bench-{os.getpid()}-{index}"
    identity = pb.TelemetryBatch(
        schema_version=SCHEMA_VERSION, agent_id=f"agent-{node}", node=pb.NodeIdentity(node=node, agent_version="bench"),
        gpus=[pb.GpuInfo(index=i, uuid=f"GPU-{node}-{i}", name="NVIDIA H100 80GB HBM3", architecture="hopper",
                         memory_total_bytes=80 << 30) for i in range(args.gpus)]).SerializeToString()
    channel = grpc.aio.insecure_channel(address, options=_OPTIONS)
    new_batches: asyncio.Queue = asyncio.Queue()
    unacked: dict[int, bytes] = {}
    sent_at: dict[int, float] = {}
    interval = args.interval

    async def produce() -> None:
        await asyncio.sleep(random.uniform(0, interval))
        seq = 0
        while not stop.is_set():
            seq += 1
            now_ms = int(time.time() * 1000)
            header = pb.TelemetryBatch(sequence=seq, created_ms=now_ms).SerializeToString()
            sent_at[seq] = time.perf_counter()
            data = unacked[seq] = identity + header + bodies.body(now_ms // int(interval * 1000) * int(interval * 1000))
            await new_batches.put(data)
            stats["sent"] += 1
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass
        await new_batches.put(None)

    async def requests(resend: list[bytes]):
        for data in resend:
            yield data
        while (data := await new_batches.get()) is not None:
            yield data

    producer = asyncio.create_task(produce())
    first, backoff = True, 0.2
    try:
        while not stop.is_set():
            while not new_batches.empty():  # queued batches are in unacked already
                new_batches.get_nowait()
            resend = [unacked[seq] for seq in sorted(unacked)]
            call_started, call_acks = time.perf_counter(), 0
            try:
                call = channel.stream_stream(_STREAM, request_serializer=None,
                                             response_deserializer=pb.BatchAck.FromString)(requests(resend))
                async for ack in call:
                    unacked.pop(ack.sequence, None)
                    call_acks += 1
                    t = sent_at.pop(ack.sequence, None)
                    if t is not None and stats["measuring"]:
                        stats["latencies"].append(time.perf_counter() - t)
                        stats["acked"] += 1
                    if first:
                        connected[0] += 1
                        first = False
                    backoff = 0.2
                return
            except grpc.aio.AioRpcError as exc:
                if stop.is_set():
                    return
                stats["errors"][f"{exc.code().name} (reconnected)"] += 1
                stats["details"].setdefault(exc.code().name, exc.details())
                stats["failed_calls"].append((time.perf_counter() - call_started, call_acks))
                await asyncio.sleep(random.uniform(backoff / 2, backoff))
                backoff = min(10.0, backoff * 2)
    finally:
        producer.cancel()
        await channel.close()


async def _idle_stream(address: str, stop: asyncio.Event) -> None:
    import grpc

    channel = grpc.aio.insecure_channel(address, options=_OPTIONS)

    async def never():
        await stop.wait()
        if False:  # pragma: no cover - an async generator that yields nothing
            yield b""

    try:
        call = channel.stream_stream(_STREAM, request_serializer=None, response_deserializer=pb.BatchAck.FromString)(
            never())
        async for _ in call:
            pass
    except Exception:  # noqa: BLE001 - idle streams may be closed by the collector's idle limit
        pass
    finally:
        await channel.close()


def emulator(first: int, count: int, idle: int, address: str, args: argparse.Namespace, control: mp.Queue,
             results: mp.Queue) -> None:
    """One process: ``count`` agents (and ``idle`` idle streams) on one event loop; measures when told."""
    import logging
    from collections import Counter

    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # streams torn down at the end are not news
    raise_open_file_limit()  # one connection, i.e. one fd, per agent
    stats = {"sent": 0, "acked": 0, "latencies": [], "measuring": False, "errors": Counter(), "details": {},
             "failed_calls": []}

    async def main() -> None:
        stop = asyncio.Event()
        connected = [0]
        bodies = SlotBodies(args.gpus, args.ticks, first)
        idle_tasks = [asyncio.create_task(_idle_stream(address, stop)) for _ in range(idle)]
        tasks = []
        for i in range(count):
            tasks.append(asyncio.create_task(_agent(first + i, address, args, bodies, stats, stop, connected)))
            if i % 50 == 49:  # connect in waves of 50, as a rolling fleet start would, at --connect-rate
                await asyncio.sleep(50 * args.procs / args.connect_rate)
        loop = asyncio.get_running_loop()
        while True:
            command = await loop.run_in_executor(None, control.get)
            if command == "measure":
                stats["measuring"] = True
            elif command == "report":
                stats["measuring"] = False
                results.put({"acked": stats["acked"], "sent": stats["sent"], "latencies": stats["latencies"],
                             "connected": connected[0], "errors": dict(stats["errors"]),
                             "details": stats["details"], "failed_calls": stats["failed_calls"]})
            elif command == "stop":
                stop.set()
                await asyncio.wait(tasks + idle_tasks, timeout=10)
                return

    asyncio.run(main())


def start_collector(tmp: str, log_level: str, python: str = sys.executable) -> tuple[subprocess.Popen, str]:
    address = f"127.0.0.1:{_free_port()}"
    log = open(os.path.join(tmp, "collector.log"), "w")
    proc = subprocess.Popen(
        [python, "-m", "gpuwatch", "collector", "--listen", address, "--db", os.path.join(tmp, "agents.duckdb"),
         "--score-interval", "3600", "--jobs-interval", "3600", "--log-level", log_level],
        stdout=subprocess.PIPE, stderr=log, text=True, preexec_fn=raise_open_file_limit, cwd=tmp)
    line = proc.stdout.readline()
    if "listening" not in line:
        raise SystemExit(f"collector did not start: {line}{open(log.name).read()}")
    return proc, address


def query_latencies(address: str, stop: threading.Event, out: list) -> None:
    """ListNodes every second during the run (what `gpuwatch nodes` asks); None for a failed query."""
    import grpc

    from gpuwatch.v1 import query_pb2 as q
    from gpuwatch.v1 import query_pb2_grpc

    stub = query_pb2_grpc.QueryStub(grpc.insecure_channel(address))
    while not stop.wait(1.0):
        t = time.perf_counter()
        try:
            stub.ListNodes(q.ListNodesRequest(), timeout=10)
            out.append(time.perf_counter() - t)
        except grpc.RpcError:
            out.append(None)


def _cpu(processes: list[psutil.Process]) -> float:
    """User + system CPU seconds of ``processes`` (0 for one that is gone)."""
    total = 0.0
    for p in processes:
        try:
            times = p.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def run_fleet(n: int, args: argparse.Namespace, python: str = sys.executable) -> dict:
    tmp = tempfile.TemporaryDirectory()
    collector, address = start_collector(tmp.name, args.log_level, python)
    ps = psutil.Process(collector.pid)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    per = [n // args.procs + (1 if i < n % args.procs else 0) for i in range(args.procs)]
    idle = [args.idle // args.procs + (1 if i < args.idle % args.procs else 0) for i in range(args.procs)]
    controls, procs, first = [], [], 0
    for i in range(args.procs):
        control = ctx.Queue()
        p = ctx.Process(target=emulator, args=(first, per[i], idle[i], address, args, control, results), daemon=True)
        p.start()
        controls.append(control)
        procs.append(p)
        first += per[i]
    time.sleep(args.warmup)  # connections opened, every agent has sent at least once
    queries: list = []
    stop_queries = threading.Event()
    querier = threading.Thread(target=query_latencies, args=(address, stop_queries, queries), daemon=True)
    querier.start()
    emulators = [psutil.Process(p.pid) for p in procs]
    for c in controls:
        c.put("measure")
    start = time.perf_counter()
    cpu_before = _cpu([ps]), _cpu(emulators)
    peak_rss = 0
    while time.perf_counter() - start < args.seconds:
        peak_rss = max(peak_rss, ps.memory_info().rss)
        time.sleep(0.5)
    for c in controls:
        c.put("report")
    elapsed = time.perf_counter() - start
    collector_cpu, emulator_cpu = _cpu([ps]) - cpu_before[0], _cpu(emulators) - cpu_before[1]
    load = os.getloadavg()[0]
    reports = [results.get(timeout=120) for _ in procs]
    stop_queries.set()
    querier.join(15)
    for c in controls:
        c.put("stop")
    for p in procs:
        p.join(30)
    collector.terminate()
    try:
        collector.wait(60)
    except subprocess.TimeoutExpired:
        collector.kill()
    with open(os.path.join(tmp.name, "collector.log")) as fh:
        collector_log = fh.read().splitlines()
    tmp.cleanup()
    latencies = np.array([x for r in reports for x in r["latencies"]]) * 1000
    acked = sum(r["acked"] for r in reports)
    errors: dict = {}
    for r in reports:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    ok_queries = [x * 1000 for x in queries if x is not None]
    return {
        "agents": n, "acked_batches": acked, "batches_s": acked / elapsed,
        "values_s": acked * values_per_batch(args.gpus, args.ticks) / elapsed,
        "expected_batches_s": n / args.interval,
        "p50_ms": float(np.percentile(latencies, 50)) if len(latencies) else float("nan"),
        "p99_ms": float(np.percentile(latencies, 99)) if len(latencies) else float("nan"),
        "agents_acked": sum(r["connected"] for r in reports), "rss_mib": peak_rss / 2**20,
        "query_p50_ms": float(np.median(ok_queries)) if ok_queries else float("nan"),
        "query_max_ms": max(ok_queries) if ok_queries else float("nan"),
        "queries_failed": sum(1 for x in queries if x is None), "queries": len(queries), "errors": errors,
        "collector_log": collector_log[-5:], "load": load,
        "collector_ms_per_batch": collector_cpu / acked * 1000 if acked else float("nan"),
        "emulator_ms_per_batch": emulator_cpu / acked * 1000 if acked else float("nan"),
        "details": {code: detail for r in reports for code, detail in r["details"].items()},
        "failed_calls": [f for r in reports for f in r["failed_calls"]],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", default="500,2000,5000", help="comma-separated fleet sizes")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured seconds per fleet size")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds to connect before measuring")
    parser.add_argument("--procs", type=int, default=2, help="emulator processes")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--ticks", type=int, default=5, help="1 Hz ticks per batch")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between an agent's batches")
    parser.add_argument("--idle", type=int, default=0, help="extra streams that never send")
    parser.add_argument("--connect-rate", type=float, default=400.0,
                        help="new agent connections per second, all emulator processes together (at 800/s about "
                             "1,000 of 5,000 agents' first streams failed within 50 ms and backed off)")
    parser.add_argument("--log-level", default="warning", help="the collector's log level")
    parser.add_argument("--before-python", metavar="PY",
                        help="also run each N against the collector of another installation (the previous code in "
                             "its own venv), right before this one, with the same emulator")
    args = parser.parse_args()
    raise_open_file_limit()
    print(f"{values_per_batch(args.gpus, args.ticks)} values per batch ({args.gpus} GPUs x {args.ticks} ticks), "
          f"one batch per agent every {args.interval:g} s; agents connect at {args.connect_rate:g}/s; "
          f"{args.idle} idle streams; {os.cpu_count()} CPUs", flush=True)
    print(f"{'collector':>9} {'agents':>7} {'expected b/s':>12} {'acked b/s':>10} {'values/s':>11} {'ack p50 ms':>10} "
          f"{'ack p99 ms':>10} {'agents acked':>12} {'nodes p50/max ms':>16} {'RSS MiB':>8} {'CPU ms/b coll/emu':>17} "
          f"{'load':>5}", flush=True)
    runs = ([("before", args.before_python), ("this", sys.executable)] if args.before_python
            else [("this", sys.executable)])
    for n in (int(x) for x in args.agents.split(",")):
        for label, python in runs:
            r = run_fleet(n, args, python)
            print(f"{label:>9} {r['agents']:>7} {r['expected_batches_s']:>12.0f} {r['batches_s']:>10.0f} "
                  f"{r['values_s']:>11,.0f} {r['p50_ms']:>10.1f} {r['p99_ms']:>10.1f} "
                  f"{r['agents_acked']:>6}/{r['agents']:<5} "
                  f"{r['query_p50_ms']:>7.0f}/{r['query_max_ms']:<8.0f} {r['rss_mib']:>8.0f} "
                  f"{r['collector_ms_per_batch']:>8.2f}/{r['emulator_ms_per_batch']:<8.2f} {r['load']:>5.1f}"
                  + (f"  failed queries {r['queries_failed']}/{r['queries']}" if r["queries_failed"] else "")
                  + (f"  errors {r['errors']}" if r["errors"] else ""), flush=True)
            if r["errors"]:
                ages = np.array([age for age, _ in r["failed_calls"]])
                print(f"   failed streams: median {np.median(ages):.1f} s / p90 {np.percentile(ages, 90):.1f} s after "
                      f"they were opened, {sum(acks == 0 for _, acks in r['failed_calls'])} of {len(ages)} before "
                      "their first ack; first error of each kind:",
                      *(f"{k}: {v}" for k, v in r["details"].items()), sep="\n   ")
                print("   collector log:", *r["collector_log"], sep="\n   ", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
