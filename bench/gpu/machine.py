"""What the validation ran on: GPU, driver, CUDA, NCCL, torch, nvidia-ml-py, gpuwatch's commit; and whether
there is a GPU at all (``find_gpu``), decided before anything is measured."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import pynvml

REPO = Path(__file__).resolve().parent.parent.parent


def find_gpu() -> str | None:
    """None when NVML and torch both see a GPU; otherwise why not, in one line."""
    try:
        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        return f"NVML: {exc}"
    if count == 0:
        return "NVML sees no GPU"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"NVML sees {count} GPU(s) but torch {torch.__version__} has no CUDA device"
    return None


def describe(simulated: bool) -> dict:
    """The machine's software and GPU, as far as it can be read (each part failing alone)."""
    info: dict = {"simulated_gpus": simulated, "python": platform.python_version(), "kernel": platform.release(),
                  "cpus": os.cpu_count(), "gpuwatch_commit": _git("rev-parse", "HEAD"),
                  "gpuwatch_dirty": bool(_git("status", "--porcelain"))}
    for package in ("nvidia-ml-py", "torch", "grpcio", "pandas", "pyarrow", "duckdb", "orjson", "scipy"):
        try:
            info[f"{package}_version"] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[f"{package}_version"] = None
    try:
        pynvml.nvmlInit()
        try:
            info["driver"] = _text(pynvml.nvmlSystemGetDriverVersion())
            cuda = pynvml.nvmlSystemGetCudaDriverVersion()
            info["driver_cuda"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
            info["gpus"] = [_text(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)))
                            for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        info["nvml_error"] = str(exc)
    try:
        import torch

        info["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["nccl"] = nccl_version(torch)
            props = torch.cuda.get_device_properties(0)
            info["torch_gpu"] = f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB"
    except Exception as exc:  # noqa: BLE001 - a broken torch is itself worth reporting
        info["torch_error"] = f"{type(exc).__name__}: {exc}"
    return info


def nccl_version(torch) -> str:
    """NCCL's version as text (torch gives a tuple, older releases an int such as 21803)."""
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def gpu_label(info: dict) -> str:
    """A short file-name-safe label of the first GPU ('h100', 'h200', ...; 'simulated' or 'cpu')."""
    if info.get("simulated_gpus"):
        return "simulated"
    name = (info.get("gpus") or [""])[0].lower()
    for word in name.replace("-", " ").split():
        if word[:1] in "abhlv" and word[1:].isdigit():
            return word
    return "gpu"


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value
