"""A profiler trace taken on a real H100 (torch 2.11, CUDA 13, Kineto with nanosecond timestamps) by
bench/gpu/validate.py (docs/gpu-validation.md): CI reads the current Kineto format from a real GPU."""
from __future__ import annotations

import json
from pathlib import Path

from gpuwatch.apps.cli import main

TRACE = str(Path(__file__).parent / "data" / "kineto" / "h100_torch2.11_cuda13_rank0.json.gz")


def test_a_real_h100_trace_is_read_whole_and_its_losses_are_the_ones_seen_on_the_gpu(capsys):
    assert main(["analyze", TRACE, "--json", "--per-step"]) == 0
    doc = json.loads(capsys.readouterr().out)
    [rank] = doc["ranks"]
    share = {k: v / rank["window_us"] for k, v in rank["breakdown_us"].items()}
    assert sum(rank["breakdown_us"].values()) == rank["window_us"]
    # One GPU, no collectives: the bf16 transformer loop is compute-bound, with the small kernels and host
    # gaps the report on the GPU showed (compute 90.3 %, small kernels 4.7 %, host stall 1.8 %).
    assert share["compute"] > 0.8
    assert share["comm_transfer"] == share["comm_wait"] == share["bubble"] == 0
    assert 0 < share["small_kernel_overhead"] < 0.2 and 0 < share["host_stall"] < 0.1
    assert rank["short_kernels"]["count"] > 100
    assert len(rank["per_step"]) >= 3
