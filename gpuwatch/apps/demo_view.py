"""The demo's screens: one fleet view read over the query API, rendered as a rich live screen on a terminal
or as plain text frames (pipes, logs, tests); both render the same :class:`DemoView`."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from gpuwatch.collector.query_documents import alert_documents
from gpuwatch.core.vocabulary import FAIL, WARN
from gpuwatch.v1 import query_pb2, query_pb2_grpc

if TYPE_CHECKING:
    from gpuwatch.apps.demo import DemoPlan


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
    alerts = alert_documents(query.Alerts(query_pb2.AlertsRequest(), timeout=5))
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


def hhmm(ms: int | None) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%H:%M") if ms else "--:--"


def shown(value: float | None, fmt: str) -> str:
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
             f"{view.sim_speed:.0f}x simulated time, data clock {hhmm(view.data_ms)} UTC", ""]
    lines.append(f"{'node':<14}{'GPUs':>5}{'samples':>9}  {'util %':>7}{'power W':>9}{'temp C':>8}"
                 f"{'max risk':>10}  {'alerts':>6}  failed")
    for n in view.nodes:
        util = _mean([g.utilization for g in n.gpus])
        failed = ", ".join(f"GPU {g.index}" for g in n.gpus if g.failed) or "-"
        lines.append(f"{n.node:<14}{len(n.gpus):>5}{shown(n.samples, 'd'):>9}  "
                     f"{shown(None if util is None else util * 100, '.1f'):>7}"
                     f"{shown(_mean([g.power_w for g in n.gpus]), '.0f'):>9}"
                     f"{shown(_mean([g.temperature_c for g in n.gpus]), '.1f'):>8}"
                     f"{shown(_max([g.risk for g in n.gpus]), '.2f'):>10}  {n.alerts:>6}  {failed}")
    if not view.nodes:
        lines.append("(waiting for the first batches)")
    lines += ["", f"{'job (synthetic)':<26}{'ranks':>6}{'steps':>7}{'lost %':>8}{'stragglers':>11}  top loss"]
    for j in view.jobs:
        lost = None if j.lost_fraction is None else j.lost_fraction * 100
        lines.append(f"{j.job_id:<26}{shown(j.ranks, 'd'):>6}{shown(j.steps, 'd'):>7}{shown(lost, '.1f'):>8}"
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
    if gpu.health == FAIL or (risk is not None and risk >= limit):
        return "bold red"
    if gpu.health == WARN or (risk is not None and risk >= limit / 2):
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
    cell.append(f" {shown(None if util is None else util * 100, '3.0f')}%", style=style)
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
                          shown(_mean([g.power_w for g in n.gpus]), ".0f") if head else "",
                          shown(_mean([g.temperature_c for g in n.gpus]), ".1f") if head else "",
                          Text("failed" if any(g.failed for g in n.gpus) else shown(risk, ".2f"), style=risk_style)
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
        jobs.add_row(j.job_id, shown(j.ranks, "d"), shown(j.steps, "d"),
                     Text(shown(lost, ".1f"),
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
             f"data clock {hhmm(view.data_ms)} UTC")
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
