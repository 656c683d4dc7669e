"""Point 4 of the validation: a real Kineto trace of the training loop, and `gpuwatch analyze` on it.

train.py ``--mode profile`` writes the trace (CPU and CUDA activities) gzip-compressed; ``gpuwatch analyze
--json`` runs on it as a user would run it, and where HolisticTraceAnalysis imports, its temporal breakdown
runs beside it over the same window (the scripts of bench/analyze.py, so both benches compare alike). The
compressed trace is copied to the output folder so it can become test data of the current Kineto format.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from probe_step import launch


def _bench_analyze():
    """bench/analyze.py as a module (bench/ is no package): its HTA and same-window scripts."""
    path = Path(__file__).resolve().parent.parent / "analyze.py"
    spec = importlib.util.spec_from_file_location("bench_analyze", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_BENCH_ANALYZE = _bench_analyze()
HTA_SCRIPT, GPUWATCH_WINDOW = _BENCH_ANALYZE.HTA_SCRIPT, _BENCH_ANALYZE.GPUWATCH_WINDOW

# What the issue asks to see first; every category of the document is kept too.
HEADLINE = ("compute", "small_kernel_overhead", "host_stall", "idle_other")
TEST_DATA_MAX_BYTES = 2 << 20  # a trace this small can live in the repository as test data
HTA_AGREEMENT_PCT = 0.5  # README's target for compute and idle against HTA, % of the window


def analyze_trace(trace: Path, timeout_s: float) -> dict:
    """`gpuwatch analyze TRACE --json`: exit code, and the job's breakdown fractions and short kernels, or
    the one-line error it printed."""
    try:
        done = subprocess.run([sys.executable, "-m", "gpuwatch", "analyze", str(trace), "--json", "--per-step"],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"exit_code": None, "error": f"no answer within {timeout_s:.0f} s"}
    result: dict = {"exit_code": done.returncode}
    if done.returncode != 0:
        result["error"] = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no message"
        return result
    return {**result, **summarize(json.loads(done.stdout))}


def summarize(doc: dict) -> dict:
    """The numbers of an analyze document the validation reports."""
    job = doc["job"]
    fractions = job["breakdown_fraction"]
    return {
        "window_us": job["window_us"],
        "headline_pct": {c: 100 * fractions[c] for c in HEADLINE},
        "breakdown_pct": {c: 100 * v for c, v in fractions.items()},
        "short_kernels": job["short_kernels"],
        "ranks": len(doc["ranks"]),
        "steps": sum(len(r.get("per_step", [])) for r in doc["ranks"]),
    }


def hta_beside(trace: Path, timeout_s: float) -> dict:
    """HTA's temporal breakdown and gpuwatch's over HTA's window, when HTA imports; else why not."""
    probe = subprocess.run([sys.executable, "-c", "import hta"], capture_output=True, text=True)
    if probe.returncode != 0:
        return {"available": False, "reason": (probe.stderr.strip().splitlines() or ["import hta failed"])[-1]}
    try:
        hta = subprocess.run([sys.executable, "-c", HTA_SCRIPT, str(trace.parent)], capture_output=True, text=True,
                             timeout=timeout_s)
        mine = subprocess.run([sys.executable, "-c", GPUWATCH_WINDOW, str(trace)], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"available": True, "hta_error": f"no answer within {timeout_s:.0f} s"}
    result: dict = {"available": True}
    for name, done in (("hta", hta), ("gpuwatch_same_window", mine)):
        if done.returncode == 0:
            result[name] = json.loads(done.stdout)
        else:
            result[name + "_error"] = done.stderr.strip()[-800:]
    if result.get("hta") and result.get("gpuwatch_same_window"):
        result["agreement"] = agreement(result["hta"][0], result["gpuwatch_same_window"][0])
    return result


def agreement(hta: dict, mine: dict) -> dict:
    """Compute and idle of HTA's temporal breakdown against gpuwatch's over the same window, as % of the
    window (idle = gpuwatch's small-kernel overhead + host stalls + other idle, as bench/analyze.py counts)."""
    b, window = mine["breakdown_us"], mine["window_us"]
    idle = b["small_kernel_overhead"] + b["host_stall"] + b["idle_other"]
    return {"window_us": window, "hta_compute_pct": hta["compute_time_pctg"], "hta_idle_pct": hta["idle_time_pctg"],
            "gpuwatch_compute_pct": 100 * b["compute"] / window, "gpuwatch_idle_pct": 100 * idle / window,
            "compute_diff_pct_of_window": 100 * abs(b["compute"] - hta["compute_time(us)"]) / window,
            "idle_diff_pct_of_window": 100 * abs(idle - hta["idle_time(us)"]) / window}


def run(work: Path, out: Path, device: str, gpu_label: str, timeout_s: float) -> dict:
    """Profile, keep the trace in ``out``, analyse it (and HTA beside it), all within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    left = lambda: max(1.0, deadline - time.monotonic())  # noqa: E731
    trace_dir = work / "trace"
    trace_dir.mkdir(parents=True, exist_ok=True)
    profiled = launch("profile", work / "profile.json", device, 1, False, left(),
                      extra=["--trace-dir", str(trace_dir)])
    result: dict = {"profile": profiled}
    trace = Path(profiled.get("trace", ""))
    if "error" in profiled or not trace.is_file():
        why = profiled.get("error", "no trace")
        result["checks"] = [{"name": "profiler wrote a trace", "ok": False, "detail": why}]
        return result
    kept = out / f"kineto_{gpu_label}_rank0.json.gz"
    shutil.copyfile(trace, kept)
    result["trace_file"] = kept.name
    result["trace_gz_bytes"] = kept.stat().st_size
    result["small_enough_for_test_data"] = kept.stat().st_size <= TEST_DATA_MAX_BYTES
    result["analyze"] = analyze_trace(trace, left())
    result["hta"] = hta_beside(trace, left())
    analysis = result["analyze"]
    result["checks"] = [
        {"name": "profiler wrote a trace", "ok": True, "detail": f"{result['trace_gz_bytes']} bytes gzip"},
        {"name": "gpuwatch analyze reads it", "ok": analysis["exit_code"] == 0,
         "detail": analysis.get("error") or ", ".join(f"{c} {v:.1f} %" for c, v in analysis["headline_pct"].items())},
    ]
    agree = result["hta"].get("agreement")
    if agree:
        worst = max(agree["compute_diff_pct_of_window"], agree["idle_diff_pct_of_window"])
        result["checks"].append({"name": f"agrees with HTA within {HTA_AGREEMENT_PCT} % of the window",
                                 "ok": worst <= HTA_AGREEMENT_PCT, "detail": f"worst difference {worst:.3f} %"})
    return result
