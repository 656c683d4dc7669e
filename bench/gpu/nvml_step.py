"""Point 1 of the validation: the real agent records the GPU while known loads run, and what it saw.

``run_agent_under_load`` starts ``gpuwatch agent --record`` and a streaming ``gpuwatch agent --collector``
as their own processes (the commands a node runs), then the load phases of loads.py in another, watching
the agents' CPU time and RSS with psutil, and stops them with SIGTERM as a service manager would. The
analysis functions read only the recording and the phase windows, so they run on the simulated fleet's
recordings in CI exactly as on a real GPU's.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import psutil

from gpuwatch.core import events as ev
from gpuwatch.core.fields import GPU_FIELDS, Tier
from gpuwatch.core.recording import open_recording

HERE = Path(__file__).resolve().parent
GPM_REPORTED = ("gpu_sm_active_ratio", "gpu_sm_occupancy_ratio", "gpu_tensor_active_ratio",
                "gpu_dram_bandwidth_utilization_ratio")
ALSO_PER_PHASE = ("gpu_utilization_ratio", "gpu_memory_utilization_ratio", "gpu_power_watts",
                  "gpu_sm_clock_hertz", "gpu_temperature_celsius")
# A load "raises" a GPM ratio when its phase median is at least this far above the idle phases' median
# (ratios are 0..1): far above noise, far below what a saturating load does on any GPU.
RISE_MIN = 0.10
PHASE_MARGIN_S = 2.0  # GPM and utilisation average over the last sample period: skip each phase's edges
AGENT_WARMUP_S = 5.0  # imports and inventory are not the steady-state cost


def agent_command(record: Path, node: str, simulate: int | None) -> list[str]:
    """The recording agent: its recording is what the analysis below reads."""
    cmd = [sys.executable, "-m", "gpuwatch", "agent", "--record", str(record), "--node", node, "--interval", "1",
           "--no-probe-socket", "--log-level", "WARNING"]
    return cmd + (["--simulate", str(simulate)] if simulate else [])


def streaming_command(collector: str, spool: Path, node: str, simulate: int | None) -> list[str]:
    """The production agent (stream to a collector, no recording): its cost is the one README quotes."""
    cmd = [sys.executable, "-m", "gpuwatch", "agent", "--collector", collector, "--spool", str(spool), "--node", node,
           "--interval", "1", "--no-probe-socket", "--log-level", "WARNING"]
    return cmd + (["--simulate", str(simulate)] if simulate else [])


class _Usage:
    """CPU seconds per wall second (after a warm-up) and peak RSS of one child process, sampled by polling."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.process = proc, psutil.Process(proc.pid)
        self.started = time.monotonic()
        self.rss: list[int] = []
        self.threads = 0
        self.cpu0 = self.t0 = self.cpu1 = self.t1 = None

    def sample(self) -> None:
        if self.proc.poll() is not None:
            return
        with self.process.oneshot():
            self.rss.append(self.process.memory_info().rss)
            self.threads = max(self.threads, self.process.num_threads())
            cpu, now = sum(self.process.cpu_times()[:2]), time.monotonic()
        if self.cpu0 is None and now - self.started >= AGENT_WARMUP_S:
            self.cpu0, self.t0 = cpu, now
        self.cpu1, self.t1 = cpu, now

    def summary(self) -> dict:
        out = {"threads": self.threads, "rss_mib_peak": max(self.rss) / 2**20 if self.rss else None,
               "rss_mib_last": self.rss[-1] / 2**20 if self.rss else None}
        if self.cpu0 is not None and self.t1 > self.t0:
            out["cpu_s_per_node_s"] = (self.cpu1 - self.cpu0) / (self.t1 - self.t0)
            out["cpu_window_s"] = self.t1 - self.t0
        return out


def run_agent_under_load(work: Path, phases: str, device: str, simulate: int | None, timeout_s: float) -> dict:
    """Two agents watch the GPU while loads.py runs ``phases``: one records (for the analysis), one streams
    to an in-process Ingest sink on loopback (the production setting, for its cost). Returns the phases,
    each agent's cost and exit, and the recording's path."""
    from gpuwatch.simulator.collector_sink import IngestSink  # grpc: imported only for this step

    record, phases_json = work / "recording", work / "phases.json"
    sink = IngestSink()
    port = sink.start()
    commands = {"recording": agent_command(record, "gpu-validate", simulate),
                "streaming": streaming_command(f"127.0.0.1:{port}", work / "spool", "gpu-validate-stream", simulate)}
    logs = {name: (work / f"{name}.stderr").open("wb") for name in (*commands, "loads")}
    agents = {name: subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=logs[name])
              for name, cmd in commands.items()}
    usage = {name: _Usage(proc) for name, proc in agents.items()}
    loads = subprocess.Popen([sys.executable, str(HERE / "loads.py"), "--phases", phases, "--out", str(phases_json),
                              "--device", device], stdout=subprocess.DEVNULL, stderr=logs["loads"])
    deadline = time.monotonic() + timeout_s
    died_early = {}
    try:
        while loads.poll() is None and all(a.poll() is None for a in agents.values()) and time.monotonic() < deadline:
            for u in usage.values():
                u.sample()
            time.sleep(0.5)
    finally:
        _finish(loads, kill=True)
        for name, proc in agents.items():
            died_early[name] = proc.poll() is not None
            if not died_early[name]:
                proc.send_signal(signal.SIGTERM)  # as a service manager stops it
        for proc in agents.values():
            _finish(proc, kill=False)
        for log in logs.values():
            log.close()
        batches = len(sink.store.batches)
        sink.stop()
    result = {
        "agent_command": " ".join(commands["recording"][1:]),
        "streaming_command": " ".join(commands["streaming"][1:]),
        "agents": {name: {"exit_code": agents[name].returncode, "died_early": died_early[name],
                          "stderr_tail": _tail(work / f"{name}.stderr"), **usage[name].summary()} for name in agents},
        "streaming_batches_acknowledged": batches,
        "loads_exit_code": loads.returncode, "loads_stderr_tail": _tail(work / "loads.stderr"),
        "phases": json.loads(phases_json.read_text())["phases"] if phases_json.exists() else [],
        "recording": str(record),
    }
    return result


def _finish(proc: subprocess.Popen, kill: bool, timeout_s: float = 30.0) -> None:
    """Wait for our child, killing it if asked or if it will not stop."""
    if kill and proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail(path: Path, size: int = 1500) -> str:
    return path.read_bytes()[-size:].decode(errors="replace") if path.exists() else ""


def fields_by_tier(record: Path) -> dict:
    """Per tier: the fields that returned values (with counts), those the agent reported unsupported, and
    those that never returned a value without being reported (a silent gap is a bug to look at)."""
    rec = open_recording(record)
    samples = rec.table("gpu_samples")
    events = rec.table("events")
    refused = events[events["kind"] == ev.FIELD_UNSUPPORTED]
    unsupported = []
    for _, row in refused.iterrows():
        attrs = json.loads(row["attrs"] or "{}")
        unsupported.append({"gpu": int(row["gpu_index"]), "nvml": attrs.get("nvml", ""),
                            "field": attrs.get("field", ""), "message": row["message"]})
    refused_names = {u["field"] for u in unsupported} | {u["nvml"] for u in unsupported}
    tiers = {}
    for tier in Tier:
        returned, silent = {}, []
        for f in (f for f in GPU_FIELDS if f.tier == tier):
            count = int(samples[f.name].notna().sum()) if f.name in samples else 0
            if count:
                returned[f.name] = count
            elif f.name not in refused_names:
                silent.append(f.name)
        tiers[tier.value] = {"returned": returned, "never_returned_unreported": silent}
    kinds = events["kind"].value_counts().to_dict()
    return {"rows": int(len(samples)), "gpus": int(samples["gpu_index"].nunique()) if len(samples) else 0,
            "tiers": tiers, "unsupported": unsupported, "event_kinds": {k: int(v) for k, v in kinds.items()},
            "xid_events": int(kinds.get(ev.XID, 0))}


def phase_metrics(samples: pd.DataFrame, phases: list[dict], margin_s: float = PHASE_MARGIN_S) -> list[dict]:
    """Per phase (edges trimmed by ``margin_s``, at most a quarter of the phase each): rows inside it and the
    median of each reported field."""
    ts_ms = _epoch_ms(samples["ts"])
    out = []
    for phase in phases:
        trim_ms = min(margin_s * 1000, (phase["end_ms"] - phase["start_ms"]) / 4)
        lo, hi = phase["start_ms"] + trim_ms, phase["end_ms"] - trim_ms
        inside = samples[(ts_ms >= lo) & (ts_ms <= hi)]
        medians = {}
        for name in GPM_REPORTED + ALSO_PER_PHASE:
            values = inside[name].dropna() if name in inside else pd.Series(dtype=float)
            medians[name] = float(values.median()) if len(values) else None
        out.append({"kind": phase["kind"], "rows": int(len(inside)), "median": medians,
                    **{k: phase[k] for k in ("tflops", "gb_per_s") if k in phase}})
    return out


def _epoch_ms(ts: pd.Series) -> np.ndarray:
    if pd.api.types.is_datetime64_any_dtype(ts):
        return (ts.dt.tz_convert("UTC").dt.tz_localize(None) - pd.Timestamp(0)) // pd.Timedelta(milliseconds=1)
    return ts.to_numpy(dtype=np.int64)


def gpm_checks(per_phase: list[dict]) -> list[dict]:
    """The issue's checks: DRAM bandwidth rises under the copy loop, tensor activity under the matmul."""
    def pooled(kind: str, name: str) -> float | None:
        values = [p["median"][name] for p in per_phase if p["kind"] == kind and p["median"].get(name) is not None]
        return float(np.median(values)) if values else None

    checks = []
    for load, name in (("copy", "gpu_dram_bandwidth_utilization_ratio"), ("matmul", "gpu_tensor_active_ratio")):
        idle, busy = pooled("idle", name), pooled(load, name)
        label = f"{name} rises under {load}"
        if idle is None or busy is None:
            checks.append({"name": label, "ok": False, "detail": f"no values: idle {idle}, {load} {busy}"})
            continue
        checks.append({"name": label, "ok": busy - idle >= RISE_MIN,
                       "detail": f"idle {idle:.3f} -> {load} {busy:.3f} (needs +{RISE_MIN:.2f})"})
    return checks


def run(work: Path, phases: str, device: str, simulate: int | None, timeout_s: float) -> dict:
    """The whole of point 1 except NVML latency: record under load, then analyse the recording."""
    result = run_agent_under_load(work, phases, device, simulate, timeout_s)
    record = Path(result["recording"])
    if not (record / "manifest.json").exists():
        result["checks"] = [{"name": "agent wrote a recording", "ok": False,
                             "detail": f"no manifest in {record}: {result['agents']['recording']['stderr_tail']}"}]
        return result
    try:
        result["fields"] = fields_by_tier(record)
        samples = open_recording(record).table("gpu_samples")
        result["per_phase"] = phase_metrics(samples, result["phases"])
    except Exception as exc:  # noqa: BLE001 - keep the agent's cost and phases measured above
        result["checks"] = [{"name": "recording analysed", "ok": False, "detail": f"{type(exc).__name__}: {exc}"}]
        return result
    result["checks"] = [
        *({"name": f"{name} agent ran until stopped and exited 0", "ok": not a["died_early"] and a["exit_code"] == 0,
           "detail": f"exit {a['exit_code']}" + (f": {a['stderr_tail'][-300:]}" if a["exit_code"] else "")}
          for name, a in result["agents"].items()),
        {"name": "the collector acknowledged the streaming agent's batches",
         "ok": result["streaming_batches_acknowledged"] > 0,
         "detail": f"{result['streaming_batches_acknowledged']} batches"},
        {"name": "every load phase finished", "ok": result["loads_exit_code"] == 0,
         "detail": f"{len(result['phases'])} phases, loads.py exit {result['loads_exit_code']}"},
        {"name": "no XID events on a healthy GPU", "ok": result["fields"]["xid_events"] == 0,
         "detail": f"{result['fields']['xid_events']} xid events"},
        *gpm_checks(result["per_phase"]),
    ]
    return result
