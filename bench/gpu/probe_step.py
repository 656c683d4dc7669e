"""Point 3 of the validation: the training probe on CUDA with NCCL, and what it costs.

Runs train.py as separate processes (world size 1; then 2 ranks on the one GPU, which NCCL may refuse)
with a real :class:`~gpuwatch.agent.probe_socket.ProbeListener` in this process receiving the probe's
datagrams, as the agent would:

1. Flight Recorder on (``TORCH_NCCL_TRACE_BUFFER_SIZE``, ``TORCH_NCCL_ENABLE_TIMING=1``): the probe must
   harvest collective rows from it, DDP's C++ all-reduce included;
2. Flight Recorder off: the Python all-reduce must arrive timed with CUDA events;
3. the step-time A/B with and without the probe (Flight Recorder on, the production setting), with the
   interval from stats.paired_overhead;
4. two ranks on one GPU.

On CPU (tests) the same runs use gloo, where neither GPU timing path applies and rows are host-timed.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from gpuwatch.agent.probe_socket import ProbeListener
from stats import paired_overhead

HERE = Path(__file__).resolve().parent
FLIGHT_RECORDER_ENV = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_ENABLE_TIMING": "1"}
RUN_LIMIT_S = 90.0  # one short run: process start, NCCL init, a few dozen steps (a hung rank is killed then)
AB_START_S = 45.0  # the A/B's process start, NCCL init, warm-up and calibration, before its rounds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mode: str, out: Path, device: str, world: int, flight_recorder: bool, timeout_s: float,
           endpoint: str | None = None, extra: list[str] = ()) -> dict:
    """Run train.py on ``world`` ranks; rank 0's result JSON plus every rank's exit code and stderr tail."""
    env = {k: v for k, v in os.environ.items() if k not in FLIGHT_RECORDER_ENV and k != "TORCH_FR_BUFFER_SIZE"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world))
    if flight_recorder:
        env.update(FLIGHT_RECORDER_ENV)
    cmd = [sys.executable, str(HERE / "train.py"), "--mode", mode, "--out", str(out), "--device", device, *extra]
    if endpoint:
        cmd += ["--endpoint", endpoint]
    logs = [out.with_name(f"{out.stem}.rank{r}.stderr") for r in range(world)]  # files: a full pipe would stall
    procs = []
    for rank, log in enumerate(logs):
        with log.open("wb") as err:
            procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(rank), "LOCAL_RANK": "0"},
                                          stdout=subprocess.DEVNULL, stderr=err))
    deadline = time.monotonic() + timeout_s
    ranks = []
    for rank, proc in enumerate(procs):
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            timed_out = False
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            timed_out = True
        ranks.append({"rank": rank, "exit_code": proc.returncode, "timed_out": timed_out,
                      "stderr_tail": logs[rank].read_bytes()[-1500:].decode(errors="replace")})
    result = json.loads(out.read_text()) if out.exists() else {"error": "rank 0 wrote no result"}
    result["processes"] = ranks
    result["flight_recorder"] = flight_recorder
    return result


def received(listener: ProbeListener, settle_s: float = 0.5, limit_s: float = 10.0) -> dict:
    """Drain the listener once datagrams stop arriving; rows by kind and the collectives' names and times."""
    deadline, last = time.monotonic() + limit_s, -1
    while time.monotonic() < deadline and listener.pending() != last:
        last = listener.pending()
        time.sleep(settle_s)
    spans = listener.drain()
    collectives = [(n, d) for k, n, d in zip(spans.kind, spans.name, spans.dur_us) if k in ("collective", "p2p")]
    durations = sorted(d for _, d in collectives if d >= 0)
    return {"rows": len(spans.kind), "by_kind": dict(Counter(spans.kind)),
            "collective_names": dict(Counter(n for n, _ in collectives)),
            "process_groups": sorted(set(pg for k, pg in zip(spans.kind, spans.process_group) if k == "collective")),
            "collective_dur_us_median": durations[len(durations) // 2] if durations else None,
            "listener": listener.stats()}


def run(work: Path, device: str, total_s: float, steps: int = 30, block_s: float = 2.0,
        ab_max_s: float | None = None) -> dict:
    """Every probe run of point 3 within ``total_s`` seconds, each recorded whatever the others do: the short
    runs (``steps`` steps each) first, then the A/B with the time that is left (at most ``ab_max_s``)."""
    deadline = time.monotonic() + total_s
    listener = ProbeListener(str(work / "probe.sock"))
    result: dict = {}
    try:
        runs = (("flight_recorder", "probe", True, 1, ["--steps", str(steps)]),
                ("cuda_events", "probe", False, 1, ["--steps", str(steps)]),
                ("world2_one_gpu", "probe", True, 2, ["--steps", str(max(3, steps // 3))]),
                ("ab", "ab", True, 1, ["--block-s", str(block_s)]))
        for name, mode, fr, world, extra in runs:
            left = deadline - time.monotonic()
            if mode == "ab":
                ab_s = min(ab_max_s or left, left - AB_START_S)
                extra, limit = [*extra, "--seconds", f"{ab_s:.0f}"], left
            else:
                ab_s, limit = None, min(RUN_LIMIT_S, left)
            if limit < 5.0 or (ab_s is not None and ab_s < 3 * block_s):
                result[name] = {"error": f"time budget: {left:.0f} s left"}
                continue
            try:
                outcome = launch(mode, work / f"{name}.json", device, world, fr, limit, listener.path, extra)
            except Exception as exc:  # noqa: BLE001 - one run's failure is a result, not the end of the step
                outcome = {"error": f"{type(exc).__name__}: {exc}"}
            outcome["received"] = received(listener)
            result[name] = outcome
    finally:
        listener.close()
    ab = result.get("ab", {})
    rounds = ab.get("rounds_s")
    if rounds:
        try:
            ab["overhead"] = paired_overhead(rounds["without"], rounds["with"])
        except ValueError as exc:
            ab["overhead"] = {"error": str(exc)}
    result["checks"] = checks(result, device)
    return result


def checks(result: dict, device: str) -> list[dict]:
    def collectives(name: str) -> int:
        got = result.get(name, {}).get("received", {}).get("by_kind", {})
        return got.get("collective", 0)

    def ran(name: str) -> bool:
        return "error" not in result.get(name, {})

    out = [{"name": f"{name}: training ran with the probe", "ok": ran(name),
            "detail": result.get(name, {}).get("error", "ok")} for name in ("flight_recorder", "cuda_events")]
    if device == "cuda":
        fr_rows, fr_steps = collectives("flight_recorder"), result.get("flight_recorder", {}).get("steps")
        out.append({"name": "Flight Recorder harvested collective rows", "ok": fr_rows > 0,
                    "detail": f"{fr_rows} rows for {fr_steps} steps (more than one per step: DDP's C++ all-reduce "
                              "is seen beside the Python one)"})
        out.append({"name": "CUDA-event timed collectives without the Flight Recorder",
                    "ok": collectives("cuda_events") > 0, "detail": f"{collectives('cuda_events')} collective rows"})
    overhead = result.get("ab", {}).get("overhead", {})
    if "t_ci_pct" in overhead:
        low, high = overhead["t_ci_pct"]
        out.append({"name": "A/B resolves 1 % (95 % t interval at most 1 point wide)", "ok": overhead["resolves_1pct"],
                    "detail": f"overhead {overhead['overhead_pct_mean']:+.2f} % [{low:+.2f}, {high:+.2f}] over "
                              f"{overhead['rounds']} rounds"})
    else:
        why = overhead.get("error") or result.get("ab", {}).get("error")
        out.append({"name": "A/B ran", "ok": False, "detail": str(why)})
    return out
