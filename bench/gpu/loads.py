"""GPU loads in timed phases, for the agent to watch: idle, a bf16 matmul loop, a memory-bound copy loop.

Run as its own process (the agent must see the load from outside, as it would a training job):

    python bench/gpu/loads.py --phases idle:30,matmul:45,copy:45,idle:15 --out phases.json [--device cuda]

Each phase records its start and end (epoch ms) and what the load achieved (TFLOP/s of the matmuls,
GB/s of the copies counting bytes read plus written), so the agent's recording can be cut by phase and
GPM's tensor activity and DRAM bandwidth compared with loads of known character. The JSON is rewritten
after every phase, so a killed run keeps the phases it finished. On ``--device cpu`` the same code runs
small (tests).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

KINDS = ("idle", "matmul", "copy")
SIZES = {  # matmul edge, copy bytes
    "cuda": (8192, 2 << 30),
    "cpu": (256, 16 << 20),
}


def parse_phases(text: str) -> list[tuple[str, float]]:
    """'idle:30,matmul:45' -> [('idle', 30.0), ('matmul', 45.0)]; ValueError naming a bad item."""
    phases = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, seconds = item.partition(":")
        try:
            duration = float(seconds)
        except ValueError:
            raise ValueError(f"phase {item!r}: expected KIND:SECONDS") from None
        if kind not in KINDS or not duration > 0:
            raise ValueError(f"phase {item!r}: kind must be one of {', '.join(KINDS)} and seconds > 0")
        phases.append((kind, duration))
    if not phases:
        raise ValueError("no phases given")
    return phases


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_phase(kind: str, seconds: float, device: str) -> dict:
    """Run one phase for ``seconds`` and return its window and achieved rate."""
    edge, copy_bytes = SIZES[device]
    if kind == "matmul":
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(edge, edge, device=device, dtype=torch.bfloat16, generator=gen)  # never zeros (METHOD.md)
        b = torch.randn(edge, edge, device=device, dtype=torch.bfloat16, generator=gen)
        c = torch.empty_like(a)
        work = lambda: torch.matmul(a, b, out=c)  # noqa: E731
        unit, per_op = "tflops", 2.0 * edge ** 3 / 1e12
    elif kind == "copy":
        src = torch.rand(copy_bytes // 4, device=device)
        dst = torch.empty_like(src)
        work = lambda: dst.copy_(src)  # noqa: E731
        unit, per_op = "gb_per_s", 2.0 * copy_bytes / 1e9  # read + write
    else:
        work, unit, per_op = None, None, 0.0
    if work is not None:
        work()  # warm-up outside the window (handles, allocations)
        _sync(device)
    start = time.time()
    ops = 0
    end_at = time.monotonic() + seconds
    while time.monotonic() < end_at:
        if work is None:
            time.sleep(min(0.5, max(0.0, end_at - time.monotonic())))
            continue
        for _ in range(8):  # a few launches per check keeps the device queue full
            work()
        ops += 8
        _sync(device)
    end = time.time()
    phase = {"kind": kind, "start_ms": int(start * 1000), "end_ms": int(end * 1000), "ops": ops}
    if unit:
        phase[unit] = ops * per_op / (end - start)
    return phase


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", required=True, help="KIND:SECONDS,... with KIND in " + ", ".join(KINDS))
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the phase windows")
    parser.add_argument("--device", default="cuda", choices=sorted(SIZES))
    args = parser.parse_args(argv)
    try:
        phases = parse_phases(args.phases)
    except ValueError as exc:
        print(f"loads.py: --phases: {exc}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("loads.py: --device cuda: torch sees no CUDA device", file=sys.stderr)
        return 3
    done = []
    for kind, seconds in phases:
        done.append(run_phase(kind, seconds, args.device))
        args.out.write_text(json.dumps({"device": args.device, "phases": done}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
