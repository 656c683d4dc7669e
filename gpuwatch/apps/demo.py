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

from gpuwatch.apps.commandline import Command, add_json_flag, print_json
from gpuwatch.v1 import query_pb2, query_pb2_grpc

#: Simulated seconds per agent tick. Two minutes (600x at 0.2 s ticks) give a one-minute demo ten simulated
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
             model: dict | None = None) -> DemoResult:
    """Run the simulated fleet into a fresh collector, score on the data clock, call ``show`` with each
    fleet view, and return what the store holds. ``model``: the failure model (default: the shipped one)."""
    from gpuwatch.collector.assembly import build_engines
    from gpuwatch.models.model import load_model
    from gpuwatch.collector.server import serve

    model = model if model is not None else load_model(None)
    # "now" is the agents' simulated time. The jobs monitor runs on the data clock too, over the last
    # JOBS_WINDOW_S of simulated time, so each job's breakdown follows what its ranks do now rather than
    # averaging the whole run; it shows job findings on screen and raises no job alerts.
    engines = build_engines(model=model, score_clock="data", jobs_window_s=JOBS_WINDOW_S,
                            hang_threshold_s=2 * plan.sim_span_s, job_alerts=False)
    scorer, jobs = engines.scorer, engines.jobs
    server = serve("127.0.0.1:0", str(workdir / "gpuwatch.duckdb"), services=[engines.hub])
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
                            data_ms=scorer.scored_at_ms, threshold=model["threshold"])

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


# ----------------------------------------------------------------------------------- the results
def failure_report(store: Any) -> dict[str, Any]:
    """From the store's alerts and events: per failed GPU when it was first flagged and when it failed
    (lead time; None when no alert came before the failure), and the alerts on GPUs that did not fail."""
    from gpuwatch.collector.alerts import ALERT_NAME
    from gpuwatch.models.faults import FATAL_XIDS

    faults = store.first_failures(sorted(FATAL_XIDS))
    alerts = store.alert_starts(ALERT_NAME)
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
@dataclass
class GpuCell:
    """One GPU as the view shows it; None: not known yet (shown as "-")."""

    index: int
    utilization: float | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    risk: float | None = None
    health: str | None = None
    failed: str | None = None  # why, when the GPU has failed (collector/failed.py)


@dataclass
class NodeRow:
    node: str
    samples: int | None
    gpus: list[GpuCell]
    alerts: int = 0


@dataclass
class JobRow:
    job_id: str
    ranks: int | None
    steps: int | None
    lost_fraction: float | None  # share of the recent window lost to anything but compute
    breakdown: dict[str, float]  # category -> share of the recent window
    stragglers: int = 0


@dataclass
class DemoView:
    """One screen of the demo, as plain data: the rich live view and the text view render the same thing."""

    elapsed_s: float
    duration_s: float
    sim_speed: float
    data_ms: int | None
    threshold: float | None
    nodes: list[NodeRow]
    jobs: list[JobRow]
    alerts: list[dict[str, Any]]


def collect_view(query: query_pb2_grpc.QueryStub, scores: dict[tuple[str, int], dict], jobs: list[dict[str, Any]],
                 *, elapsed_s: float, plan: DemoPlan, data_ms: int | None, threshold: float | None) -> DemoView:
    """Read one screen: nodes and their GPUs' latest values (Latest RPC), the scorer's last round, the jobs
    monitor's recent breakdowns and the firing alerts (Alerts RPC)."""
    nodes = {n.node: n for n in query.ListNodes(query_pb2.ListNodesRequest(), timeout=5).nodes}
    latest: dict[str, dict[int, Any]] = {}
    for row in query.Latest(query_pb2.LatestRequest(node="", gpu_index=-1), timeout=5).rows:
        latest.setdefault(row.node, {})[row.gpu_index] = row.values
    alerts = json.loads(query.Alerts(query_pb2.AlertsRequest(), timeout=5).json)
    rows = []
    for name in sorted(set(nodes) | set(latest)):
        gpus = []
        for index in sorted(set(latest.get(name, {})) | {g for n, g in scores if n == name}):
            values, score = latest.get(name, {}).get(index, {}), scores.get((name, index), {})
            gpus.append(GpuCell(index, values.get("gpu_utilization_ratio"), values.get("gpu_power_watts"),
                                values.get("gpu_temperature_celsius"), score.get("risk"), score.get("health"),
                                (score.get("failed") or {}).get("reason")))
        node = nodes.get(name)
        rows.append(NodeRow(name, node.samples if node else None, gpus, sum(a.get("node") == name for a in alerts)))
    job_rows = [JobRow(j["job_id"], j.get("ranks"), j.get("steps"), j.get("lost_fraction"), j.get("breakdown") or {},
                       len(j.get("stragglers") or [])) for j in jobs if "spans" in j.get("sources", ["spans"])]
    return DemoView(elapsed_s, plan.duration_s, plan.sim_speed, data_ms, threshold, rows, job_rows, alerts)


def _clock(ms: int | None) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%H:%M") if ms else "--:--"


def _num(value: float | None, fmt: str) -> str:
    """``value`` formatted, or "-" when it is unknown (None or NaN)."""
    return "-" if value is None or value != value else format(value, fmt)


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None and v == v]
    return sum(known) / len(known) if known else None


def _max(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None and v == v]
    return max(known) if known else None


def _top_loss(breakdown: dict[str, float]) -> str:
    """The largest share of the job's time that was not compute, e.g. "comm_wait 15.2%"."""
    losses = {k: v for k, v in breakdown.items() if k != "compute" and v is not None and v > 0}
    if not losses:
        return "-"
    top = max(losses, key=losses.__getitem__)
    return f"{top} {losses[top] * 100:.1f}%"


def _alert_line(a: dict[str, Any]) -> str:
    if a.get("alertname") == "GPUFailureRisk":
        signals = ", ".join(str(s.get("signal")) for s in (a.get("signals") or [])[:3]) or "-"
        return (f"{a.get('alertname')}: {a.get('summary', '')} since {str(a.get('starts_at') or '')[11:16]} UTC "
                f"({signals}); {a.get('action', '')}")
    return f"{a.get('alertname')}: {a.get('summary', '')}"


def render_text(view: DemoView) -> str:
    """The view as plain text (pipes, logs, tests); every unknown value is "-"."""
    lines = [f"gpuwatch demo: simulated fleet, {view.elapsed_s:3.0f}/{view.duration_s:.0f} s real, "
             f"{view.sim_speed:.0f}x simulated time, data clock {_clock(view.data_ms)} UTC", ""]
    lines.append(f"{'node':<14}{'GPUs':>5}{'samples':>9}  {'util %':>7}{'power W':>9}{'temp C':>8}"
                 f"{'max risk':>10}  {'alerts':>6}  failed")
    for n in view.nodes:
        util = _mean([g.utilization for g in n.gpus])
        failed = ", ".join(f"GPU {g.index}" for g in n.gpus if g.failed) or "-"
        lines.append(f"{n.node:<14}{len(n.gpus):>5}{_num(n.samples, 'd'):>9}  "
                     f"{_num(None if util is None else util * 100, '.1f'):>7}"
                     f"{_num(_mean([g.power_w for g in n.gpus]), '.0f'):>9}"
                     f"{_num(_mean([g.temperature_c for g in n.gpus]), '.1f'):>8}"
                     f"{_num(_max([g.risk for g in n.gpus]), '.2f'):>10}  {n.alerts:>6}  {failed}")
    if not view.nodes:
        lines.append("(waiting for the first batches)")
    lines += ["", f"{'job (synthetic)':<26}{'ranks':>6}{'steps':>7}{'lost %':>8}{'stragglers':>11}  top loss"]
    for j in view.jobs:
        lost = None if j.lost_fraction is None else j.lost_fraction * 100
        lines.append(f"{j.job_id:<26}{_num(j.ranks, 'd'):>6}{_num(j.steps, 'd'):>7}{_num(lost, '.1f'):>8}"
                     f"{j.stragglers:>11}  {_top_loss(j.breakdown)}")
    lines += ["", "active alerts:" if view.alerts else "active alerts: none"]
    lines += [f"  {_alert_line(a)}" for a in view.alerts]
    return "\n".join(lines)


# colours of the efficiency categories in the jobs' breakdown bars (compute green: the useful part)
CATEGORY_STYLES = {"compute": "green", "memcpy": "cyan", "comm_wait": "red", "comm_transfer": "blue",
                   "bubble": "magenta", "small_kernel_overhead": "yellow", "host_stall": "bright_red",
                   "idle_other": "grey50"}
BAR = 10  # characters of a utilisation bar


def _risk_style(gpu: GpuCell, threshold: float | None) -> str:
    """Green when healthy, turning yellow then red as its failure risk climbs toward the alert threshold."""
    risk, limit = gpu.risk, threshold or 0.5
    if gpu.health == "fail" or (risk is not None and risk >= limit):
        return "bold red"
    if gpu.health == "warn" or (risk is not None and risk >= limit / 2):
        return "yellow"
    if risk is None:
        return "grey62"
    return "green"


def _gpu_cell(gpu: GpuCell, threshold: float | None):
    from rich.text import Text

    if gpu.failed:
        return Text(f"{gpu.index} FAILED".ljust(BAR + 7), style="bold white on red")
    style = _risk_style(gpu, threshold)
    util = gpu.utilization
    filled = 0 if util is None or util != util else round(max(0.0, min(1.0, util)) * BAR)
    cell = Text(f"{gpu.index} ", style="bold")
    cell.append("█" * filled, style=style)
    cell.append("░" * (BAR - filled), style="grey35")
    cell.append(f" {_num(None if util is None else util * 100, '3.0f')}%", style=style)
    return cell


def _breakdown_bar(breakdown: dict[str, float], width: int = 30):
    from rich.text import Text

    bar = Text()
    shares = [(k, v) for k, v in breakdown.items() if v is not None and v > 0]
    total = sum(v for _, v in shares) or 1.0
    for category, share in shares:
        bar.append("█" * round(share / total * width), style=CATEGORY_STYLES.get(category, "white"))
    return bar if shares else Text("-")


def render_rich(view: DemoView):
    """The view for a terminal: per-GPU utilisation bars coloured by failure risk, failed GPUs in red, each
    job's breakdown as a coloured bar, the alerts; a one-line key under each part says what the numbers mean."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.console import JustifyMethod
    from rich.text import Text

    fleet = Table(box=None, padding=(0, 1), show_edge=False, expand=False)
    fleet.add_column("node", style="bold cyan", no_wrap=True)
    per_row = 4
    for i in range(per_row):
        fleet.add_column(f"GPUs {i}/{i + per_row}" if i == 0 else "", no_wrap=True)
    fleet.add_column("power W", justify="right")
    fleet.add_column("temp °C", justify="right")
    fleet.add_column("max risk", justify="right")
    fleet.add_column("alerts", justify="right")
    for n in view.nodes:
        cells = [_gpu_cell(g, view.threshold) for g in n.gpus]
        risk = _max([g.risk for g in n.gpus])
        risk_style = "bold red" if any(g.failed for g in n.gpus) or (risk or 0) >= (view.threshold or 0.5) else ""
        for first in range(0, max(len(cells), 1), per_row):
            row = cells[first:first + per_row] + [Text("")] * (per_row - len(cells[first:first + per_row]))
            head = first == 0
            fleet.add_row(n.node if head else "", *row,
                          _num(_mean([g.power_w for g in n.gpus]), ".0f") if head else "",
                          _num(_mean([g.temperature_c for g in n.gpus]), ".1f") if head else "",
                          Text("failed" if any(g.failed for g in n.gpus) else _num(risk, ".2f"), style=risk_style)
                          if head else "",
                          Text(str(n.alerts), style="bold red" if n.alerts else "") if head else "")
    if not view.nodes:
        fleet.add_row("(waiting for the first batches)")
    fleet_key = Text("bar: share of time a kernel ran · colour: failure risk, green → yellow (half the alert "
                     "threshold) → red (alert) · FAILED: fatal XID or lost, until reset · power, temp: node means",
                     style="grey62")
    jobs = Table(box=None, padding=(0, 1), show_edge=False)
    job_columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("job (synthetic)", "left"), ("ranks", "right"), ("steps", "right"), ("lost %", "right"),
        ("stragglers", "right"), ("where the time went", "left"), ("top loss", "left"))
    for column, justify in job_columns:
        jobs.add_column(column, justify=justify, no_wrap=True)
    for j in view.jobs:
        lost = None if j.lost_fraction is None else j.lost_fraction * 100
        jobs.add_row(j.job_id, _num(j.ranks, "d"), _num(j.steps, "d"),
                     Text(_num(lost, ".1f"),
                          style="red" if (lost or 0) >= 30 else "yellow" if (lost or 0) >= 10 else ""),
                     Text(str(j.stragglers), style="yellow" if j.stragglers else ""),
                     _breakdown_bar(j.breakdown), _top_loss(j.breakdown))
    legend = Text("key: ", style="grey62")
    for category, style in CATEGORY_STYLES.items():
        legend.append("█", style=style)
        legend.append(f" {category}  ", style="grey62")
    jobs_key = Text("lost %: share of the last 30 simulated minutes not spent computing · stragglers: ranks "
                    "the others wait for", style="grey62")
    alerts = Text()
    for a in view.alerts or []:
        failed = a.get("state") == "failed"
        alerts.append("FAILED  " if failed else "ALERT   ", style="bold white on red" if failed else "bold yellow")
        alerts.append(_alert_line(a) + "\n", style="red" if failed else "yellow")
    if not view.alerts:
        alerts.append("none firing", style="green")
    title = (f"gpuwatch demo · {view.elapsed_s:.0f}/{view.duration_s:.0f} s · {view.sim_speed:.0f}× simulated time · "
             f"data clock {_clock(view.data_ms)} UTC")
    return Group(Panel(Group(fleet, fleet_key), title=title, title_align="left", border_style="cyan"),
                 Panel(Group(jobs, legend, jobs_key), title="jobs: where GPU time goes", title_align="left",
                       border_style="blue"),
                 Panel(alerts, title="alerts", title_align="left", border_style="red" if view.alerts else "green"))


#: Piped (a log, `| tee`), a frame is printed when the alerts or failed GPUs change, and otherwise once per this
#: much simulated time: a frame per scoring round would be several a second.
PLAIN_EVERY_SIM_S = 3600.0


def plain_frame_due(view: DemoView, last: tuple[Any, float] | None) -> tuple[Any, float] | None:
    """The (what matters, simulated seconds) to remember when ``view`` is to be printed after the frame printed
    at ``last`` (None: nothing printed yet); None when it is not."""
    alerts = sorted((a.get("alertname", ""), a.get("node", ""), str(a.get("gpu_index", "")), a.get("status", ""))
                    for a in view.alerts)
    failed = sorted((n.node, g.index) for n in view.nodes for g in n.gpus if g.failed)
    state, sim_s = (alerts, failed), view.elapsed_s * view.sim_speed
    if last is None or state != last[0] or sim_s - last[1] >= PLAIN_EVERY_SIM_S:
        return state, sim_s
    return None


class TerminalView:
    """Shows each view: a rich live screen on a terminal, plain text screens otherwise (pipes, logs), those only
    when something changed or an hour of simulated time went by (:func:`plain_frame_due`); the last one always."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console()
        self._live = None
        self._printed: tuple[Any, float] | None = None
        self._held: DemoView | None = None  # the newest view not printed
        if self.console.is_terminal:
            from rich.live import Live

            self._live = Live(console=self.console, auto_refresh=False, transient=False)
            self._live.start()

    def __call__(self, view: DemoView) -> None:
        if self._live is not None:
            self._live.update(render_rich(view), refresh=True)
            return
        due = plain_frame_due(view, self._printed)
        self._held = None if due else view
        if due:
            self._printed = due
            print(render_text(view), flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
        elif self._held is not None:
            print(render_text(self._held), flush=True)


def summary_text(result: DemoResult) -> str:
    """The closing summary: what was stored, and for each failed GPU whether and how early it was flagged;
    every number with one short line saying what it is."""
    from gpuwatch.core.events import MEANINGS

    samples = sum(n["samples"] for n in result.nodes)
    lines = ["", "summary",
             f"  nodes {len(result.nodes)}, GPUs {sum(n['gpus'] for n in result.nodes)}: simulated, one agent process "
             "per node",
             f"  GPU samples stored {samples:,}: one row of every NVML reading per GPU per agent tick",
             "  events:" + ("" if result.events else " none")]
    lines += [f"    {kind} {count}: {MEANINGS.get(kind, 'events of this kind')}"
              for kind, count in result.events.items()]
    for f in result.report["failed"]:
        if f["flagged_ms"] is None:
            lines.append(f"  GPU {f['gpu_index']} on node {f['node']} failed at {_clock(f['failed_ms'])} UTC "
                         "(simulated) without an alert before it")
        else:
            lines.append(f"  GPU {f['gpu_index']} on node {f['node']} flagged at {_clock(f['flagged_ms'])} UTC, "
                         f"failed at "
                         f"{_clock(f['failed_ms'])} UTC: lead time {f['lead_time_s'] / 60:.0f} minutes (simulated), "
                         f"the time there was to checkpoint and drain (peak risk {_num(f.get('peak_risk'), '.2f')})")
    if not result.report["failed"]:
        lines.append("  no GPU failed")
    lines.append(f"  alerts on GPUs that did not fail: {len(result.report['false_alarms'])} (false alarms)")
    if result.recordings:
        lines.append(f"  recordings (gpuwatch replay): {', '.join(result.recordings)}")
    return "\n".join(lines)
