"""Overhead of the training probe per step: the same gloo job with and without the probe, interleaved.

Each step is ~100 ms of compute (matmuls) cut into 50 pieces, each followed by a small collective. Both
ranks alternate short blocks without and with the probe (started/closed between blocks, timing excludes
that), so machine noise hits both variants alike; the overhead is the median over rounds of the paired
block ratio. Process CPU time per step (all threads, the probe's flush thread included) is reported too: it
is less disturbed by other load on a shared machine. A real ProbeListener receives the datagrams.

    python bench/probe_overhead.py [--rounds 30] [--block 2] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gpuwatch.probe
from gpuwatch.agent.probe_socket import ProbeListener

COLLECTIVES_PER_STEP = 50
STEP_TARGET_S = 0.100
SIZE = 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _compute(a: torch.Tensor, b: torch.Tensor, matmuls: int) -> None:
    for _ in range(matmuls):
        a = torch.tanh(a @ b)


def _calibrated_matmuls(a: torch.Tensor, b: torch.Tensor) -> int:
    """Matmuls per piece so that a step's compute takes about STEP_TARGET_S on this machine."""
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        _compute(a, b, 200)
        samples.append((time.perf_counter() - start) / 200)
    per_matmul = min(samples)
    return max(1, round(STEP_TARGET_S / COLLECTIVES_PER_STEP / per_matmul))


def _step(a, b, matmuls: int, small: torch.Tensor, gathered: list[torch.Tensor]) -> None:
    for i in range(COLLECTIVES_PER_STEP):
        _compute(a, b, matmuls)
        if i % 3 == 0:
            dist.all_reduce(small)
        elif i % 3 == 1:
            dist.all_gather(gathered, small)
        else:
            dist.broadcast(small, src=0)


def _worker(rank: int, world: int, port: int, sock: str, rounds: int, block: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    a, b = torch.randn(SIZE, SIZE), torch.randn(SIZE, SIZE) / SIZE ** 0.5
    count = torch.tensor([_calibrated_matmuls(a, b)])
    dist.broadcast(count, src=0)  # every rank does the same work
    matmuls = int(count.item())
    small = torch.ones(64)
    gathered = [torch.zeros(64) for _ in range(world)]
    times: dict[str, list[float]] = {"without": [], "with": []}
    cpu: dict[str, list[float]] = {"without": [], "with": []}
    stats = []
    _step(a, b, matmuls, small, gathered)  # warm-up
    for round_index in range(rounds):
        order = ("without", "with") if round_index % 2 == 0 else ("with", "without")  # cancels order effects
        for variant in order:
            probe = gpuwatch.probe.start(job="bench", endpoint=sock) if variant == "with" else None
            dist.barrier()
            for _ in range(block):
                start, start_cpu = time.perf_counter(), time.process_time()
                _step(a, b, matmuls, small, gathered)
                if probe is not None:
                    probe.step()
                times[variant].append(time.perf_counter() - start)
                cpu[variant].append(time.process_time() - start_cpu)
            if probe is not None:
                probe.close()
                stats.append(probe.stats())
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "cpu": cpu, "stats": stats, "matmuls": matmuls}, f)
    dist.destroy_process_group()


def _per_op_cpu_us(sock: str, tmp: str, rounds: int = 15, ops: int = 2000) -> dict[str, float]:
    """Median CPU µs per collective on a one-rank gloo group, without and with the probe, interleaved:
    the probe's own cost, nearly free of the noise of waiting for a peer."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    small, gathered = torch.ones(64), [torch.zeros(64)]

    def run() -> float:
        start = time.process_time()
        for i in range(ops):
            (dist.all_reduce(small) if i % 3 == 0 else dist.all_gather(gathered, small) if i % 3 == 1
             else dist.broadcast(small, src=0))
        return (time.process_time() - start) / ops * 1e6

    samples: dict[str, list[float]] = {"without": [], "with": []}
    try:
        for _ in range(rounds):
            samples["without"].append(run())
            probe = gpuwatch.probe.start(job="bench-op", endpoint=sock)
            samples["with"].append(run())
            probe.close()
    finally:
        dist.destroy_process_group()
    return {variant: statistics.median(values) for variant, values in samples.items()}


def _paired_overhead_pct(without: list[float], with_probe: list[float], block: int) -> float:
    """Median over rounds of (with / without - 1) for the adjacent blocks of one round, in %."""
    ratios = [sum(with_probe[i:i + block]) / sum(without[i:i + block]) - 1 for i in range(0, len(without), block)]
    return 100 * statistics.median(ratios)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--block", type=int, default=2, help="steps per variant per round")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        listener = ProbeListener(os.path.join(tmp, "probe.sock"))
        out = os.path.join(tmp, "result.json")
        try:
            mp.spawn(_worker, args=(args.world, _free_port(), listener.path, args.rounds, args.block, out),
                     nprocs=args.world)
            per_op = _per_op_cpu_us(listener.path, tmp)
            received = len(listener.drain().step)
        finally:
            listener.close()
        with open(out) as f:
            result = json.load(f)
    times, cpu = result["times"], result["cpu"]
    report = {
        "world": args.world, "collectives_per_step": COLLECTIVES_PER_STEP, "steps_per_variant": len(times["with"]),
        "median_step_s_without": statistics.median(times["without"]),
        "median_step_s_with": statistics.median(times["with"]),
        "overhead_pct_paired": _paired_overhead_pct(times["without"], times["with"], args.block),
        "median_step_cpu_s_without": statistics.median(cpu["without"]),
        "median_step_cpu_s_with": statistics.median(cpu["with"]),
        "cpu_overhead_pct_paired": _paired_overhead_pct(cpu["without"], cpu["with"], args.block),
        "probe_records_rank0": sum(s["records"] for s in result["stats"]),
        "probe_dropped_rank0": sum(s["dropped"] for s in result["stats"]),
        "rows_received_by_listener": received,
        "per_op_cpu_us_without": per_op["without"],
        "per_op_cpu_us_with": per_op["with"],
    }
    added_per_step_s = COLLECTIVES_PER_STEP * (per_op["with"] - per_op["without"]) / 1e6
    report["estimated_overhead_pct_of_100ms_step"] = 100 * added_per_step_s / STEP_TARGET_S
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{args.world} ranks (gloo, CPU), {COLLECTIVES_PER_STEP} collectives per step, "
              f"{report['steps_per_variant']} steps per variant, interleaved")
        for label, key in (("wall", "median_step_s"), ("cpu ", "median_step_cpu_s")):
            print(f"{label} median step: without {report[key + '_without'] * 1e3:8.2f} ms, "
                  f"with {report[key + '_with'] * 1e3:8.2f} ms")
        print(f"overhead (median of paired block ratios): wall {report['overhead_pct_paired']:+.2f} %, "
              f"cpu {report['cpu_overhead_pct_paired']:+.2f} %  (target <= 1 %)")
        print(f"per collective (1-rank group, CPU): without {per_op['without']:.2f} us, with {per_op['with']:.2f} us"
              f" -> {report['estimated_overhead_pct_of_100ms_step']:.2f} % of a 100 ms step with "
              f"{COLLECTIVES_PER_STEP} collectives")
        print(f"rows received by the listener: {received}, dropped on rank 0: {report['probe_dropped_rank0']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
