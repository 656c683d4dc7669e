"""`gpuwatch demo`: a simulated cluster on loopback, one GPU degrading and flagged before it fails.

Starts a collector on the embedded store with the failure scorer and alerts, and several agent processes
(8 simulated GPUs each) on accelerated simulated time: each 0.2 s tick is two simulated minutes, so a
one-minute demo covers ten simulated hours, and one GPU of the last node is scripted (``--sim-fault``) to
degrade over most of them and fail near the end. The scorer runs on the data clock (the newest stored sample),
the fleet view shows
per node utilisation, power, temperature, the highest failure risk and the active alerts, and the summary
states when the GPU was flagged and when it failed, both read back from the store. Each node also runs a
synthetic training job (``--sim-job``, one rank slower than the rest); the view shows each job's lost share
and top loss from the ``Jobs`` RPC. Nothing is written
outside a temp dir or ``--dir`` (which also keeps each agent's recording for `gpuwatch replay`).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from gpuwatch.apps.commandline import Command, add_json_flag, print_json
from gpuwatch.apps.demo_report import DemoResult, event_counts, failure_report, node_row, summary_text
from gpuwatch.apps.demo_view import DemoView, TerminalView, collect_view
from gpuwatch.v1 import query_pb2, query_pb2_grpc

if TYPE_CHECKING:  # loaded when the demo runs, not when the CLI starts
    from gpuwatch.models.model import FailureModel

#: hours: room for a precursor as long as failsim's typical memory fault (median 8 h). At one minute per tick
#: (the model's training resolution) the 4 h span left a 3 h precursor, flagged only ~24 min ahead.
SIM_TICK_S = 120.0
#: The scripted GPU starts degrading and fails at these shares of the simulated span.
ONSET_SHARE, FAIL_SHARE = 0.1, 0.85
DEFAULT_FAULT = "ecc"
FAULT_GPU = 3
#: Simulated seconds of spans behind each job's breakdown in the view (15 agent ticks at the default speed).
JOBS_WINDOW_S = 1800.0
#: Steps of each node's synthetic training job per agent tick: few enough that the job monitor re-analyses
#: every span of a whole demo in well under a second.
STEPS_PER_TICK = 2


@dataclass(frozen=True)
class DemoPlan:
    """What a demo run simulates: fleet size, real and simulated time, and the scripted fault."""

    nodes: int = 4
    gpus: int = 8
    duration_s: float = 60.0
    interval_s: float = 0.2
    speed: float | None = None  # simulated seconds per real second; default: one simulated minute per tick
    fault: str | None = DEFAULT_FAULT  # a --sim-fault kind, or None for a healthy fleet
    score_every_s: float = 1.0

    @property
    def sim_speed(self) -> float:
        return self.speed if self.speed is not None else SIM_TICK_S / self.interval_s

    @property
    def sim_span_s(self) -> float:
        return self.duration_s * self.sim_speed

    @property
    def fault_node(self) -> str:
        return node_name(self.nodes - 1)

    @property
    def fault_gpu(self) -> int:
        return min(FAULT_GPU, self.gpus - 1)

    def fault_spec(self) -> str | None:
        """The --sim-fault of the last node: degrading from ONSET_SHARE, failing at FAIL_SHARE of the span."""
        if self.fault is None:
            return None
        onset, fail = self.sim_span_s * ONSET_SHARE, self.sim_span_s * FAIL_SHARE
        return f"gpu={self.fault_gpu},kind={self.fault},after={onset:.0f}s,fail={fail:.0f}s"


def node_name(i: int) -> str:
    return f"demo-node-{i:02d}"


def job_name(node: str) -> str:
    return f"demo-job-{node}"


# ------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=4, help="simulated nodes (agent processes), default 4")
    parser.add_argument("--gpus", type=int, default=8, help="simulated GPUs per node, default 8")
    parser.add_argument("--duration", type=float, default=60.0, help="real seconds to run, default 60")
    parser.add_argument("--interval", type=float, default=DemoPlan.interval_s,
                        help=f"agent tick in real seconds, default {DemoPlan.interval_s}")
    parser.add_argument("--speed", type=float, default=None,
                        help=f"simulated seconds per real second (default: {SIM_TICK_S:.0f} simulated s per tick, "
                             f"{SIM_TICK_S / DemoPlan.interval_s:.0f}x at a {DemoPlan.interval_s} s --interval)")
    parser.add_argument("--fault", default=DEFAULT_FAULT,
                        help=f"how GPU {FAULT_GPU} of the last node degrades and fails: ecc, remap, pcie, nvlink, "
                             "thermal, sudden, or none (default ecc)")
    parser.add_argument("--dir", help="keep the store, logs and the agents' recordings here instead of a temp dir")
    add_json_flag(parser, "no live view; print the result as JSON")


def run(args: argparse.Namespace) -> int:
    from gpuwatch.simulator.degrade import KINDS
    from gpuwatch.core.errors import UserError

    if (args.nodes < 1 or args.gpus < 1 or args.duration <= 0 or args.interval <= 0
            or (args.speed is not None and not args.speed > 0)):
        raise UserError("--nodes, --gpus, --duration, --interval and --speed must be positive")
    if args.fault != "none" and args.fault not in KINDS:
        raise UserError(f"--fault {args.fault}: must be one of {', '.join(KINDS)} or none")
    plan = DemoPlan(args.nodes, args.gpus, args.duration, args.interval, args.speed,
                    None if args.fault == "none" else args.fault)
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="gpuwatch-demo-"))
    if args.dir and workdir.exists() and any(workdir.iterdir()):
        raise UserError(f"--dir {workdir}: not empty; give a new or empty directory")
    workdir.mkdir(parents=True, exist_ok=True)
    view = None if args.json else TerminalView()
    try:
        result = run_demo(workdir, plan, show=view or (lambda _: None), record=bool(args.dir))
    finally:
        if view is not None:
            view.close()
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print_json(result.as_dict())
    else:
        print(summary_text(result))
    return 0


DEMO = Command(add_arguments, run)


# ------------------------------------------------------------------------------------------ run
def run_demo(workdir: Path, plan: DemoPlan, *, show: Callable[[DemoView], None], record: bool = False,
             model: FailureModel | None = None) -> DemoResult:
    """Run the simulated fleet into a fresh collector, score on the data clock, call ``show`` with each
    fleet view, and return what the store holds. ``model``: the failure model (default: the shipped one)."""
    from gpuwatch.collector.assembly import build_engines
    from gpuwatch.models.model import load_model
    from gpuwatch.collector.server import serve
    from gpuwatch.core.settings import local_collector

    model = model if model is not None else load_model(None)
    # "now" is the agents' simulated time. The jobs monitor runs on the data clock too, over the last
    # JOBS_WINDOW_S of simulated time, so each job's breakdown follows what its ranks do now rather than
    # averaging the whole run; it shows job findings on screen and raises no job alerts.
    engines = build_engines(model=model, score_clock="data", jobs_window_s=JOBS_WINDOW_S,
                            hang_threshold_s=2 * plan.sim_span_s, job_alerts=False)
    scorer, jobs = engines.scorer, engines.jobs
    server = serve(local_collector(str(workdir / "gpuwatch.duckdb")), services=[engines.hub])
    scorer.bind(server.store)  # no periodic threads: the demo scores and checks jobs before each view below
    jobs.bind(server.store)
    origin = time.time()
    sim_start = origin - plan.sim_span_s  # the simulated clock reaches the present when the demo ends
    recordings = [workdir / "recordings" / node_name(i) for i in range(plan.nodes)] if record else []
    agents = [_start_agent(server.address, workdir, plan, i, origin, sim_start,
                           recordings[i] if record else None) for i in range(plan.nodes)]
    channel = grpc.insecure_channel(server.address)
    query = query_pb2_grpc.QueryStub(channel)
    started = time.monotonic()
    rounds = 0

    def view_now(elapsed_s: float) -> DemoView:
        job_rows = []
        if scorer.scored_at_ms is not None:
            jobs.check_once(scorer.scored_at_ms * 1000.0)
            job_rows = jobs.jobs(scorer.scored_at_ms * 1000.0)
        return collect_view(query, scorer.latest(), job_rows, elapsed_s=elapsed_s, plan=plan,
                            data_ms=scorer.scored_at_ms, threshold=model.threshold)

    try:
        while (elapsed := time.monotonic() - started) < plan.duration_s:
            scorer.score_once()
            show(view_now(elapsed))
            rounds += 1  # rounds keep their cadence however long scoring and the view took
            next_round = min(rounds * plan.score_every_s, plan.duration_s)
            _wait_for_any_exit(agents, timeout=next_round - (time.monotonic() - started))
        for proc in agents:
            proc.terminate()
        for proc in agents:
            proc.wait(timeout=30)
        _check_agents(agents, workdir)
        server.store.flush()
        scorer.score_once()
        show(view_now(plan.duration_s))  # the final screen: everything the agents sent, scored
        return DemoResult(nodes=[node_row(n) for n in query.ListNodes(query_pb2.ListNodesRequest(), timeout=5).nodes],
                          events=event_counts(query), report=failure_report(server.store), workdir=str(workdir),
                          recordings=[str(p) for p in recordings])
    finally:
        for proc in agents:
            if proc.poll() is None:
                proc.kill()
        channel.close()
        server.stop()


def _start_agent(address: str, workdir: Path, plan: DemoPlan, i: int, origin: float, sim_start: float,
                 record: Path | None) -> subprocess.Popen:
    node = node_name(i)
    command = [sys.executable, "-m", "gpuwatch", "agent", "--collector", address, "--simulate", str(plan.gpus),
               "--node", node, "--interval", str(plan.interval_s), "--spool", str(workdir / "spool" / node),
               "--slow-interval", str(plan.interval_s), "--batch-interval", str(max(0.5, plan.interval_s)),
               "--sim-speed", str(plan.sim_speed), "--sim-start", str(sim_start), "--sim-origin", str(origin),
               "--sim-job", job_name(node), "--sim-job-step", str(plan.interval_s * plan.sim_speed / STEPS_PER_TICK)]
    if node == plan.fault_node and (fault := plan.fault_spec()):
        command += ["--sim-fault", fault]
    if record is not None:
        command += ["--record", str(record)]
    log = open(workdir / f"{node}.log", "wb")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=workdir)


def _wait_for_any_exit(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait up to ``timeout`` seconds, returning early if an agent died (the view then shows it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return
        time.sleep(0.1)  # polling the agent processes, not waiting for a result


def _check_agents(agents: list[subprocess.Popen], workdir: Path) -> None:
    from gpuwatch.core.errors import UserError

    failed = [(i, p.returncode) for i, p in enumerate(agents) if p.returncode not in (0, -15)]
    if failed:
        i, rc = failed[0]
        tail = (workdir / f"{node_name(i)}.log").read_text(errors="replace").strip().splitlines()[-1:]
        raise UserError(f"agent {node_name(i)} exited with status {rc}: {' '.join(tail) or 'no output'}")
