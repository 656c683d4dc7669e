"""`gpuwatch demo`: a simulated cluster on loopback, one GPU degrading and flagged before it fails.

Starts a collector on the embedded store with the failure scorer and alerts, and several agent processes
(8 simulated GPUs each) on accelerated simulated time: each 0.2 s tick is two simulated minutes, so a
one-minute demo covers ten simulated hours, and one GPU of the last node is scripted (``--sim-fault``) to
degrade over most of them and fail near the end. The scorer runs on the data clock (the newest stored sample), the fleet view shows
per node utilisation, power, temperature, the highest failure risk and the active alerts, and the summary
states when the GPU was flagged and when it failed, both read back from the store. Each node also runs a
synthetic training job (``--sim-job``, one rank slower than the rest); the view shows each job's lost share
and top loss from the ``Jobs`` RPC. Nothing is written
outside a temp dir or ``--dir`` (which also keeps each agent's recording for `gpuwatch replay`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import grpc

from gpuwatch.v1 import query_pb2, query_pb2_grpc

#: Simulated seconds per agent tick. Two minutes (600x at 0.2 s ticks) give a one-minute demo ten simulated
#: hours: room for a precursor as long as failsim's typical memory fault (median 8 h). At one minute per tick
#: (the model's training resolution) the 4 h span left a 3 h precursor, flagged only ~24 min ahead.
SIM_TICK_S = 120.0
#: The scripted GPU starts degrading and fails at these shares of the simulated span.
ONSET_SHARE, FAIL_SHARE = 0.1, 0.85
DEFAULT_FAULT = "ecc"
FAULT_GPU = 3
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


@dataclass
class DemoResult:
    """A finished demo: what the store holds and the failure report computed from it."""

    nodes: list[dict[str, Any]]
    events: dict[str, int]
    report: dict[str, Any]
    workdir: str
    recordings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def node_name(i: int) -> str:
    return f"demo-node-{i:02d}"


def job_name(node: str) -> str:
    return f"demo-job-{node}"


# ------------------------------------------------------------------------------------------- CLI
def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=4, help="simulated nodes (agent processes), default 4")
    parser.add_argument("--gpus", type=int, default=8, help="simulated GPUs per node, default 8")
    parser.add_argument("--duration", type=float, default=60.0, help="real seconds to run, default 60")
    parser.add_argument("--interval", type=float, default=DemoPlan.interval_s,
                        help=f"agent tick in real seconds, default {DemoPlan.interval_s}")
    parser.add_argument("--speed", type=float, default=None,
                        help=f"simulated seconds per real second (default: {SIM_TICK_S:.0f} simulated s per tick, "
                             f"{SIM_TICK_S / DemoPlan.interval_s:.0f}x at the default interval)")
    parser.add_argument("--fault", default=DEFAULT_FAULT,
                        help=f"how GPU {FAULT_GPU} of the last node degrades and fails: ecc, remap, pcie, nvlink, "
                             "thermal, sudden, or none (default ecc)")
    parser.add_argument("--dir", help="keep the store, logs and the agents' recordings here instead of a temp dir")
    parser.add_argument("--json", action="store_true", help="no live view; print the result as JSON")


def run(command: str, args: argparse.Namespace) -> int:
    from gpuwatch.agent.simdegrade import KINDS
    from gpuwatch.errors import UserError

    if args.nodes < 1 or args.gpus < 1 or args.duration <= 0 or args.interval <= 0 or (args.speed or 1) <= 0:
        raise UserError("--nodes, --gpus, --duration, --interval and --speed must be positive")
    if args.fault != "none" and args.fault not in KINDS:
        raise UserError(f"--fault {args.fault}: must be one of {', '.join(KINDS)} or none")
    plan = DemoPlan(args.nodes, args.gpus, args.duration, args.interval, args.speed,
                    None if args.fault == "none" else args.fault)
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="gpuwatch-demo-"))
    if args.dir and workdir.exists() and any(workdir.iterdir()):
        raise UserError(f"--dir {workdir}: not empty; give a new or empty directory")
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        result = run_demo(workdir, plan, show=(lambda _: None) if args.json else _terminal_view(),
                          record=bool(args.dir))
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(result.as_dict(), indent=2) if args.json else summary_text(result))
    return 0


# ------------------------------------------------------------------------------------------ run
def run_demo(workdir: Path, plan: DemoPlan, *, show: Callable[[str], None], record: bool = False,
             model: dict | None = None) -> DemoResult:
    """Run the simulated fleet into a fresh collector, score on the data clock, call ``show`` with each
    fleet view, and return what the store holds. ``model``: the failure model (default: the shipped one)."""
    from gpuwatch.collector.alert_hub import AlertHub
    from gpuwatch.collector.jobs import JobsMonitor
    from gpuwatch.collector.scoring import Scorer
    from gpuwatch.collector.server import serve
    from gpuwatch.models.model import load_model
    from gpuwatch.models.policy import AlertPolicy

    model = model if model is not None else load_model(None)
    hub = AlertHub(AlertPolicy(model["threshold"]))
    # The monitor's window and hang limit span the whole simulated run: its "now" is the wall clock, which the
    # simulated clock only reaches at the end.
    jobs = JobsMonitor(None, interval_s=plan.score_every_s, window_s=2 * plan.sim_span_s,
                       hang_threshold_s=2 * plan.sim_span_s)
    server = serve("127.0.0.1:0", str(workdir / "gpuwatch.duckdb"), services=[hub, jobs])
    scorer = Scorer(model, hub, clock="data")  # "now" is the agents' simulated time
    scorer.bind(server.store)  # no periodic thread: the demo scores before each view below
    origin = time.time()
    sim_start = origin - plan.sim_span_s  # the simulated clock reaches the present when the demo ends
    recordings = [workdir / "recordings" / node_name(i) for i in range(plan.nodes)] if record else []
    agents = [_start_agent(server.address, workdir, plan, i, origin, sim_start,
                           recordings[i] if record else None) for i in range(plan.nodes)]
    channel = grpc.insecure_channel(server.address)
    query = query_pb2_grpc.QueryStub(channel)
    started = time.monotonic()
    rounds = 0
    try:
        while (elapsed := time.monotonic() - started) < plan.duration_s:
            scorer.score_once()
            show(fleet_view(query, scorer.latest(), elapsed_s=elapsed, plan=plan, data_ms=scorer.scored_at_ms))
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
        return DemoResult(nodes=[_node_row(n) for n in query.ListNodes(query_pb2.ListNodesRequest(), timeout=5).nodes],
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
    if node == plan.fault_node and plan.fault_spec():
        command += ["--sim-fault", plan.fault_spec()]
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
    from gpuwatch.errors import UserError

    failed = [(i, p.returncode) for i, p in enumerate(agents) if p.returncode not in (0, -15)]
    if failed:
        i, rc = failed[0]
        tail = (workdir / f"{node_name(i)}.log").read_text(errors="replace").strip().splitlines()[-1:]
        raise UserError(f"agent {node_name(i)} exited with status {rc}: {' '.join(tail) or 'no output'}")


# ----------------------------------------------------------------------------------- the results
def failure_report(store: Any) -> dict[str, Any]:
    """From the store's alerts and events: per failed GPU when it was first flagged and when it failed
    (lead time; None when no alert came before the failure), and the alerts on GPUs that did not fail."""
    from gpuwatch.collector.alerts import ALERT_NAME
    from gpuwatch.models.faults import FATAL_XIDS

    faults = store.query_df("""
        SELECT node, gpu_index, epoch_ms(min(ts)) AS failed_ms FROM events
        WHERE gpu_index >= 0 AND (kind = 'gpu_lost' OR (kind = 'xid' AND list_contains($fatal, code)))
        GROUP BY node, gpu_index ORDER BY node, gpu_index""", {"fatal": sorted(FATAL_XIDS)})
    alerts = store.query_df("""
        SELECT doc->>'node' AS node, CAST(doc->>'gpu_index' AS INTEGER) AS gpu_index,
               epoch_ms(starts_at) AS starts_ms, CAST(doc->>'peak_risk' AS DOUBLE) AS peak_risk
        FROM alerts WHERE alertname = $name ORDER BY starts_at""", {"name": ALERT_NAME})
    failed = []
    for f in faults.itertuples():
        mine = alerts[(alerts["node"] == f.node) & (alerts["gpu_index"] == f.gpu_index)
                       & (alerts["starts_ms"] <= f.failed_ms)]
        flagged = int(mine["starts_ms"].iloc[0]) if len(mine) else None
        failed.append({"node": f.node, "gpu_index": int(f.gpu_index), "failed_ms": int(f.failed_ms),
                       "flagged_ms": flagged, "lead_time_s": (f.failed_ms - flagged) / 1000 if flagged else None,
                       "peak_risk": float(mine["peak_risk"].max()) if len(mine) else None})
    failed_keys = {(f["node"], f["gpu_index"]) for f in failed}
    false_alarms = [{"node": a.node, "gpu_index": int(a.gpu_index), "starts_ms": int(a.starts_ms),
                     "peak_risk": float(a.peak_risk)}
                    for a in alerts.itertuples() if (a.node, a.gpu_index) not in failed_keys]
    return {"failed": failed, "false_alarms": false_alarms}


def event_counts(query: query_pb2_grpc.QueryStub) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for row in query.Events(query_pb2.EventsRequest(limit=1_000_000), timeout=10).events:
        kinds[row.event.kind] = kinds.get(row.event.kind, 0) + 1
    return dict(sorted(kinds.items()))


def _node_row(n: query_pb2.NodeSummary) -> dict[str, Any]:
    return {"node": n.node, "gpus": n.gpus, "samples": n.samples, "last_seen_ms": n.last_seen_ms}


# ------------------------------------------------------------------------------------------- views
def _terminal_view() -> Callable[[str], None]:
    clear = "\x1b[2J\x1b[H" if sys.stdout.isatty() else ""

    def show(text: str) -> None:
        print(clear + text, flush=True)

    return show


def _clock(ms: int | None) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%H:%M") if ms else "--:--"


def fleet_view(query: query_pb2_grpc.QueryStub, scores: dict[tuple[str, int], dict], *, elapsed_s: float,
               plan: DemoPlan, data_ms: int | None) -> str:
    """One screen: per node its GPUs' utilisation, power, temperature, stored samples and highest failure
    risk, then the active alerts."""
    nodes = query.ListNodes(query_pb2.ListNodesRequest(), timeout=5).nodes
    latest = query.Latest(query_pb2.LatestRequest(node="", gpu_index=-1), timeout=5).rows
    alerts = json.loads(query.Alerts(query_pb2.AlertsRequest(), timeout=5).json)
    by_node: dict[str, list] = {}
    for row in latest:
        by_node.setdefault(row.node, []).append(row)
    lines = [f"gpuwatch demo: simulated fleet, {elapsed_s:3.0f}/{plan.duration_s:.0f} s real, "
             f"{plan.sim_speed:.0f}x simulated time, data clock {_clock(data_ms)} UTC", ""]
    lines.append(f"{'node':<14}{'GPUs':>5}{'samples':>9}  {'util %':>7}{'power W':>9}{'temp C':>8}"
                 f"{'max risk':>10}  {'alerts':>6}")
    for node in sorted(nodes, key=lambda n: n.node):
        rows = by_node.get(node.node, [])
        risks = [s["risk"] for (n, _), s in scores.items() if n == node.node and s["risk"] is not None]
        risk = f"{max(risks):.2f}" if risks else "-"
        firing = sum(a.get("node") == node.node for a in alerts)
        lines.append(f"{node.node:<14}{node.gpus:>5}{node.samples:>9}  {_mean(rows, 'gpu_utilization_ratio') * 100:>7.1f}"
                     f"{_mean(rows, 'gpu_power_watts'):>9.0f}{_mean(rows, 'gpu_temperature_celsius'):>8.1f}"
                     f"{risk:>10}  {firing:>6}")
    if not nodes:
        lines.append("(waiting for the first batches)")
    lines += ["", f"{'job (synthetic)':<26}{'ranks':>6}{'steps':>7}{'lost %':>8}  top loss"]
    for job in json.loads(query.Jobs(query_pb2.JobsRequest(), timeout=5).json):
        # A job seen on GPU samples before its step data arrived has no ranks, steps or losses yet.
        lost = job.get("lost_fraction")
        lines.append(f"{job['job_id']:<26}{_known(job.get('ranks')):>6}{_known(job.get('steps')):>7}"
                     f"{_known(None if lost is None else lost * 100, '.1f'):>8}  "
                     f"{_top_loss(job.get('breakdown') or {})}")
    lines += ["", "active alerts:" if alerts else "active alerts: none"]
    for a in alerts:
        signals = ", ".join(str(s.get("signal")) for s in (a.get("signals") or [])[:3])
        lines.append(f"  {a.get('alertname')}: GPU {_known(a.get('gpu_index'))} on {_known(a.get('node'))}, "
                     f"risk {_known(a.get('risk'), '.2f')} since {(a.get('starts_at') or '')[11:16] or '-'} UTC "
                     f"({signals}); {a.get('action') or ''}")
    return "\n".join(lines)


def summary_text(result: DemoResult) -> str:
    """The closing summary: what was stored, and for each failed GPU whether and how early it was flagged."""
    samples = sum(n["samples"] for n in result.nodes)
    lines = ["", "summary",
             f"  nodes: {len(result.nodes)}, GPUs: {sum(n['gpus'] for n in result.nodes)}, "
             f"per-GPU samples stored: {samples}",
             "  events: " + (", ".join(f"{k} {v}" for k, v in result.events.items()) or "none")]
    for f in result.report["failed"]:
        if f["flagged_ms"] is None:
            lines.append(f"  GPU {f['gpu_index']} on node {f['node']} failed at {_clock(f['failed_ms'])} UTC "
                         "(simulated) without an alert before it")
        else:
            lines.append(f"  GPU {f['gpu_index']} on node {f['node']} flagged at {_clock(f['flagged_ms'])} UTC, failed at "
                         f"{_clock(f['failed_ms'])} UTC: lead time {f['lead_time_s'] / 60:.0f} minutes (simulated)")
    if not result.report["failed"]:
        lines.append("  no GPU failed")
    lines.append(f"  alerts on GPUs that did not fail: {len(result.report['false_alarms'])}")
    if result.recordings:
        lines.append(f"  recordings (gpuwatch replay): {', '.join(result.recordings)}")
    return "\n".join(lines)


def _top_loss(breakdown: dict[str, float]) -> str:
    """The largest share of the job's time that was not compute, e.g. "comm_wait 15.2%"."""
    losses = {k: v for k, v in breakdown.items() if k != "compute" and v > 0}
    if not losses:
        return "-"
    top = max(losses, key=losses.get)
    return f"{top} {losses[top] * 100:.1f}%"


def _known(value: Any, spec: str = "") -> str:
    """``value`` formatted with ``spec``, or "-" while it is not known."""
    return "-" if value is None else format(value, spec)


def _mean(rows: list, field: str) -> float:
    values = [r.values[field] for r in rows if field in r.values]
    return sum(values) / len(values) if values else float("nan")
