"""The training job of the validation: a small bf16 transformer under torch.distributed, one process per rank.

    python bench/gpu/train.py --mode ab|probe|profile --out result.json [--device cuda] [--seconds 60]

with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment (probe_step.py sets them). Backend:
NCCL on CUDA, gloo on CPU (the tests run it small on CPU). The model is wrapped in DDP, whose gradient
all-reduce is issued from C++ (seen only through the NCCL Flight Recorder), and every step also all-reduces
the loss from Python (seen by the probe's wrapper, CUDA-event timed when the Flight Recorder is off).

* ``ab``: rounds of one block of steps (``--block-s`` long) without the probe and one with it (order
  alternating), each block timed from a device synchronisation to the next, until the t interval of the
  overhead resolves 1 % (stats.resolved) or ``--seconds`` run out. World size 1 only.
* ``probe``: the probe on for ``--steps`` steps; reports its stats and which GPU timing path it took.
* ``profile``: ``torch.profiler`` (CPU and CUDA activities) over a few steps, written as a Kineto trace.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gpuwatch.probe
from gpuwatch.probe.flight_recorder import find_dump_functions, flight_recorder_enabled
from machine import nccl_version
from stats import resolved

JOB = "gpu-validate"
# vocab, d_model, heads, feed-forward, layers, sequence, batch: ~100 M parameters and ~50 ms steps on an
# H100 (big enough that kernels, not launches, dominate); tiny on CPU.
SIZES = {"cuda": (32000, 1024, 16, 4096, 8, 1024, 8), "cpu": (256, 32, 2, 64, 1, 16, 2)}

class TinyLM(nn.Module):
    def __init__(self, vocab: int, d_model: int, heads: int, ff: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


class Trainer:
    """Model, optimiser and one random batch; ``step()`` is one bf16 training step plus a Python all-reduce."""

    def __init__(self, device: str) -> None:
        vocab, d_model, heads, ff, layers, seq, batch = SIZES[device]
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        torch.manual_seed(0)
        model = TinyLM(vocab, d_model, heads, ff, layers).to(self.device)
        self.model = nn.parallel.DistributedDataParallel(model, device_ids=[0] if device == "cuda" else None)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.tokens = torch.randint(0, vocab, (batch, seq + 1), device=self.device)
        self.loss_sum = torch.zeros((), device=self.device)

    def step(self) -> None:
        inputs, targets = self.tokens[:, :-1], self.tokens[:, 1:]
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            logits = self.model(inputs)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.loss_sum.copy_(loss.detach())
        dist.all_reduce(self.loss_sum)  # a collective issued from Python

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def _timed_block(trainer: Trainer, steps: int, probe) -> float:
    """Mean seconds per step over one block, from one device synchronisation to the next."""
    trainer.sync()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step()
        if probe is not None:
            probe.step()
    trainer.sync()
    return (time.perf_counter() - start) / steps


def run_ab(trainer: Trainer, seconds: float, block_s: float, endpoint: str) -> dict:
    """Interleaved rounds; each block lasts about ``block_s`` (longer than the probe's 1 s Flight Recorder
    interval, so its periodic harvests fall inside), after one untimed step in each variant: the probe's
    start reads the whole recorder buffer once to skip earlier probes' entries (a restart cost, not the steady
    state timed here)."""
    block = max(3, round(block_s / _timed_block(trainer, 3, None)))
    rounds: dict[str, list[float]] = {"without": [], "with": []}
    stats = []
    end_at = time.monotonic() + seconds
    while time.monotonic() < end_at and not resolved(rounds["without"], rounds["with"]):
        order = ("without", "with") if len(rounds["with"]) % 2 == 0 else ("with", "without")
        for variant in order:
            probe = gpuwatch.probe.start(job=JOB, endpoint=endpoint) if variant == "with" else None
            _timed_block(trainer, 1, probe)  # untimed: the same extra step in both variants
            rounds[variant].append(_timed_block(trainer, block, probe))
            if probe is not None:
                probe.close()  # outside the timed block, as in bench/probe_overhead.py
                stats.append(probe.stats())
    return {"block_steps": block, "block_s": block_s, "rounds_s": rounds, "probe_stats": _sum_stats(stats)}


def run_probe(trainer: Trainer, steps: int, endpoint: str) -> dict:
    probe = gpuwatch.probe.start(job=JOB, endpoint=endpoint)
    times = [_timed_block(trainer, 1, probe) for _ in range(steps)]
    probe.close()
    return {"steps": steps, "median_step_s": sorted(times)[len(times) // 2], "probe_stats": probe.stats()}


def run_profile(trainer: Trainer, device: str, out_dir: Path, active: int) -> dict:
    """A few steps under torch.profiler; the Kineto trace gzip-compressed as rank<R>.json.gz."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    raw = out_dir / f"rank{dist.get_rank()}.json"
    schedule = torch.profiler.schedule(wait=1, warmup=2, active=active, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule,
                                on_trace_ready=lambda p: p.export_chrome_trace(str(raw))) as prof:
        for _ in range(1 + 2 + active):
            trainer.step()
            prof.step()
    trainer.sync()
    packed = raw.with_suffix(".json.gz")
    with raw.open("rb") as src, gzip.open(packed, "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst)
    raw_bytes = raw.stat().st_size
    raw.unlink()
    return {"trace": str(packed), "raw_bytes": raw_bytes, "gz_bytes": packed.stat().st_size, "active_steps": active}


def _sum_stats(stats: list[dict]) -> dict:
    return {key: sum(s[key] for s in stats) for key in (stats[0] if stats else {})}


def environment(device: str) -> dict:
    """What this process runs on and which GPU timing path the probe will take (same rule as the probe)."""
    fr_on = flight_recorder_enabled(os.environ)
    fr_dump = dist.is_available() and bool(find_dump_functions(torch._C._distributed_c10d))
    info = {"torch": torch.__version__, "device": device, "backend": dist.get_backend(),
            "world_size": dist.get_world_size(), "rank": dist.get_rank(),
            "flight_recorder_env": fr_on, "flight_recorder_dump_available": fr_dump,
            "probe_gpu_timing": ("host time (CPU tensors)" if device != "cuda" else
                                 "flight recorder" if fr_on and fr_dump else "cuda events")}
    if device == "cuda":
        info.update(cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(0), nccl=nccl_version(torch))
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", required=True, choices=("ab", "probe", "profile"))
    parser.add_argument("--out", type=Path, required=True, help="result JSON (rank 0 writes it)")
    parser.add_argument("--device", default="cuda", choices=sorted(SIZES))
    parser.add_argument("--seconds", type=float, default=60.0, help="ab: time limit of the rounds")
    parser.add_argument("--block-s", type=float, default=2.0, help="ab: seconds of steps per variant and round")
    parser.add_argument("--steps", type=int, default=30, help="probe: steps with the probe on")
    parser.add_argument("--active", type=int, default=3, help="profile: profiled steps")
    parser.add_argument("--trace-dir", type=Path, default=None, help="profile: folder of the trace (default: --out's)")
    parser.add_argument("--warmup", type=int, default=5, help="steps before any measurement")
    parser.add_argument("--endpoint", default=None, help="probe socket (default: the probe's own rule)")
    args = parser.parse_args(argv)
    result: dict = {"mode": args.mode}
    try:
        if args.device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        result["environment"] = environment(args.device)
        trainer = Trainer(args.device)
        for _ in range(args.warmup):
            trainer.step()
        trainer.sync()
        if args.mode == "ab":
            result.update(run_ab(trainer, args.seconds, args.block_s, args.endpoint))
        elif args.mode == "probe":
            result.update(run_probe(trainer, args.steps, args.endpoint))
        else:
            result.update(run_profile(trainer, args.device, args.trace_dir or args.out.parent, args.active))
        dist.destroy_process_group()
        rc = 0
    except Exception as exc:  # the parent records it; the other steps of the validation go on
        result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        result["traceback"] = traceback.format_exc()[-3000:]
        rc = 1
    if int(os.environ.get("RANK", "0")) == 0:
        args.out.write_text(json.dumps(result, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
