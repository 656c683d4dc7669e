"""`gpuwatch agent --check`: is this node ready to run the agent, and what will its GPUs report?

Installing an agent on a new node type goes wrong in a handful of ways (no driver, fields the GPU does not
support, a firewalled collector, a bad certificate, a read-only spool). The check runs the agent's own code
paths once (NVML inventory, a fast and a slow sample with GPM, the collector channel, the directories) and
says what works and what does not, so the answer does not come from reading logs hours later.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpuwatch.core import events as ev
from gpuwatch.agent.daemon import AgentConfig
from gpuwatch.agent.kubelet import DEFAULT_KUBELET_SOCKET, KubeletUnavailable, PodResourcesClient
from gpuwatch.agent.nvml import GPM_METRICS, GPM_MIN_SPACING_S, NvmlSampler
from gpuwatch.simulator.node import SimulatedNode
from gpuwatch.agent.uplink import collector_addresses, make_channel
from gpuwatch.core.settings import ClientSecurity
from gpuwatch.core.errors import UserError

_GPM_FIELDS = [name for _, name, _ in GPM_METRICS]


@dataclass
class CheckItem:
    name: str
    ok: bool
    detail: str


@dataclass
class GpuSupport:
    index: int
    name: str
    uuid: str
    lost: bool
    fields: list[str] = field(default_factory=list)  # gpuwatch fields this GPU reported (GPM ones included)
    unsupported: list[str] = field(default_factory=list)  # NVML calls, fields and GPM metrics it refused
    gpm: bool = False


@dataclass
class NodeCheck:
    checks: list[CheckItem]
    gpus: list[GpuSupport]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "checks": [asdict(c) for c in self.checks], "gpus": [asdict(g) for g in self.gpus]}


def check_node(cfg: AgentConfig, collector_timeout_s: float = 2.0, *,
               simulation: SimulatedNode | None = None) -> NodeCheck:
    """Run every check (on ``simulation``'s GPUs, installed beneath pynvml meanwhile, when given); never raises
    for a failing one (it becomes a failed item)."""
    items = [_check_directory("spool", cfg.spool_dir) if cfg.collector else None,
             _check_spool_health(cfg.spool_dir) if cfg.collector else None,
             _check_directory("recording", cfg.record) if cfg.record else None,
             _check_directory("probe socket directory", Path(cfg.probe_socket).parent) if cfg.probe_socket else None]
    nvml, gpus = _check_gpus(simulation)
    collector = _check_collector(cfg, collector_timeout_s)
    return NodeCheck([nvml, *_lost_gpus(gpus), collector, _check_kubelet(cfg.kubelet_socket),
                      *(i for i in items if i is not None)], gpus)


def _check_kubelet(socket_path: str | None) -> CheckItem:
    """Without a pod-resources socket the agent is not in Kubernetes (or the socket is not mounted): fine, but said."""
    if socket_path is None:
        return CheckItem("kubelet", True, f"no pod-resources socket ({DEFAULT_KUBELET_SOCKET} absent, no "
                                          "--kubelet-socket): GPU owners from process environments only")
    client = PodResourcesClient(socket_path)
    try:
        devices = client.list_devices()
    except KubeletUnavailable as exc:
        return CheckItem("kubelet", False, f"{exc}; GPU owners fall back to process environments")
    finally:
        client.close()
    pods = sorted({f"{o.namespace}/{o.pod}" for o in devices.values()})
    return CheckItem("kubelet", True, f"{socket_path} answers: {len(devices)} GPU devices held by "
                                      f"{len(pods)} pods{': ' + ', '.join(pods[:5]) if pods else ''}")


def _lost_gpus(gpus: list[GpuSupport]) -> list[CheckItem]:
    return [CheckItem(f"GPU {g.index}", False, f"{g.uuid or 'unknown uuid'} is lost (off the bus)")
            for g in gpus if g.lost]


def _check_gpus(simulation: SimulatedNode | None) -> tuple[CheckItem, list[GpuSupport]]:
    with ExitStack() as stack:
        if simulation is not None:
            stack.enter_context(simulation)
        sampler = NvmlSampler(slow_interval=3600.0)
        stack.callback(sampler.close)
        try:
            devices = sampler.open()
        except UserError as exc:
            return CheckItem("nvml", False, str(exc)), []
        first = sampler.sample()  # fast + slow tier, first GPM snapshot
        time.sleep(GPM_MIN_SPACING_S)  # GPM metrics need two snapshots at least this far apart
        second = sampler.sample()
        gpus = []
        for dev in devices:
            reported = set(first.rows.get(dev.index, {})) | set(second.rows.get(dev.index, {}))
            refused = {e.attrs.get("field") or e.attrs.get("nvml", "") for e in first.events + second.events
                       if e.kind == ev.FIELD_UNSUPPORTED and e.gpu_index == dev.index}
            gpus.append(GpuSupport(dev.index, dev.name, dev.uuid, dev.lost, sorted(reported), sorted(refused),
                                   gpm=any(f in reported for f in _GPM_FIELDS)))
        simulated = f", simulated {simulation.model}" if simulation is not None else ""
        detail = f"driver {sampler.driver_version}, CUDA {sampler.cuda_version or '?'}, {len(devices)} GPUs{simulated}"
        return CheckItem("nvml", bool(devices), detail if devices else detail + " (no GPU visible)"), gpus


def _check_collector(cfg: AgentConfig, timeout_s: float) -> CheckItem:
    if cfg.collector is None:
        return CheckItem("collector", True, "none configured (record-only)")
    how = (("mutual TLS" if cfg.tls_cert else "TLS" if cfg.tls_ca else "plaintext")
           + (", bearer token" if cfg.token_file else ""))
    results = [_reach(address, cfg, how, timeout_s) for address in collector_addresses(cfg.collector)]
    return CheckItem("collector", all(ok for ok, _ in results), "; ".join(detail for _, detail in results))


def _reach(address: str, cs: ClientSecurity, how: str, timeout_s: float) -> tuple[bool, str]:
    try:
        channel = make_channel(address, channel_security=cs)
    except UserError as exc:
        return False, f"{address}: {exc}"
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        return False, f"{address} ({how}): no connection within {timeout_s:g} s"
    finally:
        channel.close()
    return True, f"{address} reachable ({how})"


def _check_directory(what: str, path: Path) -> CheckItem:
    """Writable means a file can be created there now (or the directory can be created)."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            return CheckItem(what, False, f"{path} exists and is not a directory")
        try:
            with tempfile.NamedTemporaryFile(dir=path, prefix=".gpuwatch-check-"):
                pass
        except OSError as exc:
            return CheckItem(what, False, f"{path} is not writable ({exc.strerror})")
        return CheckItem(what, True, f"{path} is writable")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        return CheckItem(what, False, f"{path} does not exist and {parent} is not writable")
    return CheckItem(what, True, f"{path} can be created (in {parent})")


def _check_spool_health(spool_dir: Path) -> CheckItem | None:
    """What the spool's state says: a refused agent id (two agents share it), drops and set-aside batches."""
    if not Path(spool_dir).is_dir():
        return None  # the directory check says what is wrong with it
    try:
        state = json.loads((Path(spool_dir) / "state.json").read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return CheckItem("agent identity", False, f"{spool_dir}/state.json is unreadable ({exc}): move it away; "
                                                  "the agent id is then taken from the spooled batches")
    conflict = state.get("identity_conflict")
    if conflict:
        return CheckItem("agent identity", False,
                         f"the collector refuses agent id {state.get('agent_id')}: another running agent uses it "
                         f"(this spool or VM image was copied). Stop this agent, run `gpuwatch agent --new-agent-id "
                         f"--spool {spool_dir}` (its unsent batches are kept) and start it again. Collector said: "
                         f"{conflict}")
    rejected = len(list((Path(spool_dir) / "rejected").glob("*.pb")))
    return CheckItem("agent identity", True,
                     f"agent id {state.get('agent_id')}; {state.get('dropped_batches_total', 0)} batches dropped "
                     f"(spool full) and {rejected} set aside in {spool_dir}/rejected so far")


def format_check(report: NodeCheck) -> str:
    """The report as text for a terminal: one line per check, then what each GPU supports."""
    lines = [f"{'ok  ' if c.ok else 'FAIL'}  {c.name}: {c.detail}" for c in report.checks]
    for g in report.gpus:
        lines.append(f"GPU {g.index} {g.name} {g.uuid}: {len(g.fields)} fields"
                     f"{', GPM' if g.gpm else ', no GPM'}{', LOST' if g.lost else ''}")
        if g.unsupported:
            lines.append("    unsupported: " + ", ".join(g.unsupported))
    lines.append("all checks passed" if report.ok else "some checks FAILED")
    return "\n".join(lines)
