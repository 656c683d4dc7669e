"""Prove gpuwatch on a real GPU: the agent's NVML/GPM path, XID thread and --check, the probe on NCCL, a
real profiler trace through `gpuwatch analyze`; write every number and failure to --out.

    python bench/gpu/validate.py --out DIR [--budget-s 480] [--only STEP,...] [--quick]
    python bench/gpu/validate.py --out DIR --simulate 2 --quick     # no GPU: exercise the kit only

Writes DIR/results.json (everything measured, each step's status and checks), DIR/gpu-validation.md (the
same for docs/gpu-validation.md), DIR/kineto_<gpu>_rank0.json.gz (the profiler trace) and
DIR/agent_recording.tar.gz (the agent's recording under load). Both result files are rewritten after every
step, so a run cut short keeps what it measured. Each step records its own failure and the next one runs.
Steps, in order: machine, nvml_latency, capability, nvml_agent, trace, probe (the probe's A/B is last and
takes the time that is left). The whole run keeps within --budget-s (default 480 s, inside the device
machine's 10 minutes per command).

Exit codes: 0 every step ran and passed its checks; 1 a step failed, errored or was skipped; 2 bad
arguments; 3 no GPU here (one line says why; nothing is measured or written). See bench/gpu/README.md.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import capability
import machine
import nvml_latency
import nvml_step
import probe_step
import report
import trace_step
from gpuwatch.simulator.fleet import SimulatedFleet

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_GPU = 0, 1, 2, 3
STEPS = ("machine", "nvml_latency", "capability", "nvml_agent", "trace", "probe")


@dataclass
class Plan:
    """Where and how long: the run's settings, derived once from the flags."""

    out: Path
    work: Path
    simulate: int | None
    quick: bool
    budget_s: float
    started: float
    gpu_label: str = "gpu"  # set by the machine step; names the trace file

    @property
    def device(self) -> str:
        return "cpu" if self.simulate else "cuda"

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def phases(self) -> str:
        """idle, matmul, copy, idle: about 30 % of the budget (GPM needs tens of samples per phase)."""
        total = 24.0 if self.quick else 0.3 * self.budget_s
        return ",".join(f"{kind}:{share * total:.0f}" for kind, share in
                        (("idle", 0.2), ("matmul", 0.3), ("copy", 0.3), ("idle", 0.2)))

    def nvml(self) -> contextlib.AbstractContextManager:
        """The simulated fleet beneath pynvml for in-process NVML work when simulating; else nothing."""
        return SimulatedFleet(self.simulate) if self.simulate else contextlib.nullcontext()


def step_machine(plan: Plan, allowed_s: float) -> dict:
    with plan.nvml():
        info = machine.describe(simulated=bool(plan.simulate))
    plan.gpu_label = machine.gpu_label(info)
    return {"info": info, "checks": []}


def step_nvml_latency(plan: Plan, allowed_s: float) -> dict:
    with plan.nvml():
        result = nvml_latency.measure_latency(ticks=20 if plan.quick else 100)
        result["fields"] = nvml_latency.measure_field_latency(ticks=5 if plan.quick else 30)
    counts = {tier: result["tiers"][tier]["per_call"]["count"] for tier in nvml_latency.TIERS}
    result["checks"] = [{"name": f"{tier} tier made NVML calls", "ok": count > 0, "detail": f"{count} calls"}
                        for tier, count in counts.items()]
    return result


def step_capability(plan: Plan, allowed_s: float) -> dict:
    with plan.nvml():
        return capability.run(plan.simulate, xid_seconds=3.0 if plan.quick else 10.0)


def step_nvml_agent(plan: Plan, allowed_s: float) -> dict:
    result = nvml_step.run(plan.work, plan.phases(), plan.device, plan.simulate, timeout_s=allowed_s)
    recording = Path(result["recording"])
    if recording.is_dir():
        with tarfile.open(plan.out / "agent_recording.tar.gz", "w:gz") as tar:
            tar.add(recording, arcname="agent_recording")
        result["recording_archive"] = "agent_recording.tar.gz"
    return result


def step_trace(plan: Plan, allowed_s: float) -> dict:
    return trace_step.run(plan.work, plan.out, plan.device, plan.gpu_label, timeout_s=allowed_s)


def step_probe(plan: Plan, allowed_s: float) -> dict:
    return probe_step.run(plan.work, plan.device, total_s=allowed_s, steps=5 if plan.quick else 30,
                          block_s=0.3 if plan.quick else 2.0, ab_max_s=8.0 if plan.quick else None)


# name -> (function, minimum seconds to start it, share of the budget it may use at most)
RUNNERS: dict[str, tuple[Callable[[Plan, float], dict], float, float]] = {
    "machine": (step_machine, 1.0, 0.05),
    "nvml_latency": (step_nvml_latency, 10.0, 0.1),
    "capability": (step_capability, 20.0, 0.15),
    "nvml_agent": (step_nvml_agent, 40.0, 0.45),
    "trace": (step_trace, 30.0, 0.2),
    "probe": (step_probe, 60.0, 1.0),
}


def run_steps(plan: Plan, names: list[str], results: dict) -> None:
    """Run each step inside what is left of the budget; record result, status, failure; write after each."""
    for name in names:
        function, minimum_s, share = RUNNERS[name]
        allowed = min(plan.left_s() - 10.0, share * plan.budget_s if not plan.quick else plan.left_s())
        entry: dict = {}
        if allowed < (0.0 if plan.quick else minimum_s):
            entry.update(status="skipped", reason=f"time budget: {plan.left_s():.0f} s left, needs {minimum_s:.0f} s")
        else:
            t0 = time.monotonic()
            try:
                entry["result"] = function(plan, allowed)
                failed = [c for c in entry["result"].get("checks", []) if not c["ok"]]
                entry["status"] = "checks_failed" if failed else "ok"
            except Exception as exc:  # noqa: BLE001 - one step failing must not lose the others' results
                entry.update(status="error", error=f"{type(exc).__name__}: {exc}".splitlines()[0][:300],
                             traceback=traceback.format_exc()[-4000:])
            entry["seconds"] = time.monotonic() - t0
        results["steps"][name] = entry
        if name == "machine" and "result" in entry:
            results["machine"] = entry["result"]["info"]
        print(f"validate: {name}: {entry['status']} ({entry.get('seconds', 0):.0f} s)", file=sys.stderr, flush=True)
        write(plan, results)


def write(plan: Plan, results: dict) -> None:
    results["finished"] = _now()
    results["elapsed_s"] = time.monotonic() - plan.started
    (plan.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (plan.out / "gpu-validation.md").write_text(report.render(results))


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="exit codes: 0 every step passed, 1 a step failed, errored or was skipped, "
                                            "2 bad arguments, 3 no GPU here (see bench/gpu/README.md)")
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json, the report and the trace")
    parser.add_argument("--budget-s", type=float, default=480.0, help="total seconds for every step (default 480)")
    parser.add_argument("--only", default=",".join(STEPS),
                        help=f"comma-separated steps (default all: {','.join(STEPS)})")
    parser.add_argument("--quick", action="store_true",
                        help="minimal durations: checks the kit runs, numbers are rough")
    parser.add_argument("--simulate", type=int, default=None, metavar="N",
                        help="no GPU: N simulated GPUs beneath pynvml, training on the CPU (exercises the kit only)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in STEPS]
    if unknown or not names:
        parser.error(f"--only {args.only!r}: unknown step(s) {', '.join(unknown) or '(none given)'}; "
                     f"steps: {', '.join(STEPS)}")
    if not args.budget_s > 0:
        parser.error(f"--budget-s {args.budget_s}: must be > 0 seconds")
    if args.simulate is not None and args.simulate < 1:
        parser.error(f"--simulate {args.simulate}: must be a number of GPUs >= 1")
    args.steps = [n for n in STEPS if n in names]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.simulate:
        why = machine.find_gpu()
        if why is not None:
            print(f"validate.py: no GPU on this machine ({why}); nothing measured. Run it on a GPU machine "
                  "(bench/gpu/README.md), or --simulate N to exercise the kit.", file=sys.stderr)
            return EXIT_NO_GPU
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"validate.py: --out {args.out}: cannot create it ({exc.strerror})", file=sys.stderr)
        return EXIT_USAGE
    started = time.monotonic()
    results = {"kit": "bench/gpu/validate.py", "mode": "simulated" if args.simulate else "gpu", "quick": args.quick,
               "started": _now(), "budget_s": args.budget_s, "steps": {}}
    args.out = args.out.resolve()
    with tempfile.TemporaryDirectory(prefix="gpuwatch-validate-") as work:
        # The steps start `python -m gpuwatch` in the current folder. Run from the repository root (as the
        # device tool does), the tree's own `gpuwatch/` folder (core and apps only: package-dir maps the
        # rest in) shadowed the installed package, and every agent failed with "No module named
        # 'gpuwatch.agent'" on the first real GPU run.
        os.chdir(work)
        plan = Plan(args.out, Path(work), args.simulate, args.quick, args.budget_s, started)
        steps = args.steps if "machine" in args.steps else ["machine", *args.steps]
        run_steps(plan, steps, results)
    ok = all(step["status"] == "ok" for step in results["steps"].values())
    print(f"validate: {'all steps ok' if ok else 'some steps did not pass'}; results in {args.out}", file=sys.stderr)
    return EXIT_OK if ok else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
