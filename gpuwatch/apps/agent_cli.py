"""`gpuwatch agent`: run the node agent (a thin layer over gpuwatch.agent.daemon.Agent), or `--check` a node.

Settings come from ``--config FILE``, ``GPUWATCH_*`` variables and flags with the precedence and checks of
:mod:`gpuwatch.core.settings` (AGENT_OPTIONS, the keys of deploy/agent.toml); the flags below them are for one run.
With ``--simulate N`` this layer installs a :class:`~gpuwatch.simulator.node.SimulatedNode` beneath pynvml and
points the unchanged agent at it (:func:`simulated_agent`); the agent itself knows nothing of the simulator.
"""
from __future__ import annotations

import argparse
import logging
import signal
from contextlib import nullcontext
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from gpuwatch.apps.commandline import Command, add_json_flag, print_json
from gpuwatch.core import settings as config
from gpuwatch.agent.daemon import Agent, AgentConfig
from gpuwatch.agent.kubelet import DEFAULT_KUBELET_SOCKET
from gpuwatch.simulator.degrade import KINDS, FaultSpec, parse_fault_spec
from gpuwatch.simulator.fail_slow import KINDS as SLOW_KINDS
from gpuwatch.simulator.fail_slow import FailSlowSpec, parse_fail_slow_spec
from gpuwatch.simulator.gpu import MODELS
from gpuwatch.simulator.node import SimulatedNode
from gpuwatch.core.errors import UserError
from gpuwatch.core.security import read_token
from gpuwatch.probe.endpoint import default_endpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The settings (AgentSettings), the simulated fleet's flags, then the flags of one run."""
    config.add_arguments(parser, config.AGENT_OPTIONS)
    _add_simulation_arguments(parser)
    parser.add_argument("--no-probe-socket", action="store_true",
                        help="do not listen for training probes (default: listen on --probe-socket, else "
                             f"{default_endpoint()} unless --simulate)")
    parser.add_argument("--ticks", type=int, default=None, metavar="K",
                        help="sample K times, wait until the collector acknowledged everything, exit")
    parser.add_argument("--drain-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="with --ticks: how long to wait for the collector before giving up")
    parser.add_argument("--record", type=Path, default=None, metavar="DIR",
                        help="also write every batch into this recording (record-only when no collector is set)")
    parser.add_argument("--check", action="store_true",
                        help="diagnose the node (NVML, supported fields, collector, spool) and exit 0 if all is well")
    add_json_flag(parser, "with --check: print the report as JSON")
    parser.add_argument("--new-agent-id", action="store_true",
                        help="give the spool a new agent id (it was copied from another agent's: a cloned VM "
                             "image or spool), renumber its unsent batches under it, and exit")


def _add_simulation_arguments(parser: argparse.ArgumentParser) -> None:
    """--simulate and the --sim-* flags: a simulated fleet instead of the node's GPUs (AgentConfig's sim_*)."""
    parser.add_argument("--simulate", type=int, default=None, metavar="N",
                        help="sample N simulated GPUs instead of the node's real ones")
    parser.add_argument("--sim-model", default="H100", choices=sorted(MODELS), help="simulated GPU model")
    parser.add_argument("--sim-speed", type=float, default=1.0, metavar="X",
                        help="with --simulate: simulated seconds per real second (timestamps; ticks stay at "
                             "--interval real seconds), default 1")
    parser.add_argument("--sim-start", default=None, metavar="TIME",
                        help="with --simulate: simulated time when the agent starts (epoch seconds or ISO 8601, "
                             "default now)")
    parser.add_argument("--sim-origin", type=float, default=None, metavar="EPOCH_S",
                        help="with --simulate: wall-clock time at which the simulated clock reads --sim-start "
                             "(default: the agent's start); agents given the same pair share one clock")
    parser.add_argument("--sim-fault", action="append", default=[], metavar="SPEC",
                        help="with --simulate, repeatable: script a GPU's degradation and failure, e.g. "
                             f"gpu=3,kind=ecc,after=5m,fail=50m (kinds: {', '.join(KINDS)}; optional xid=, seed=); "
                             "times count from --sim-start")
    parser.add_argument("--sim-job", default=None, metavar="JOB_ID",
                        help="with --simulate: run a synthetic training job JOB_ID on the simulated GPUs (one rank "
                             "per GPU, one of them slow) and send its probe-style spans (docs/simfleet.md)")
    parser.add_argument("--sim-fail-slow", action="append", default=[], metavar="SPEC",
                        help="with --simulate and --sim-job, repeatable: make a GPU (or its host) slow but alive, "
                             f"e.g. gpu=3,kind=thermal,after=5m,until=20m (kinds: {', '.join(SLOW_KINDS)}; optional "
                             "factor=, default 1.6 times slower); times count from --sim-start (docs/simfleet.md)")
    parser.add_argument("--sim-job-step", type=float, default=1.0, metavar="SECONDS",
                        help="with --sim-job: its step time in simulated seconds, default 1")


def load_settings(args: argparse.Namespace) -> config.Config:
    """The AGENT_OPTIONS merged from file, environment and flags (UserError naming key and source)."""
    flags = dict(vars(args))
    if flags.get("log_level"):
        flags["log_level"] = flags["log_level"].lower()  # --log-level WARNING worked before the shared schema
    return config.load_config(config.AGENT_OPTIONS, flags)


def config_from_args(args: argparse.Namespace, cfg: config.Config | None = None) -> AgentConfig:
    """Settings plus the one-run flags as an AgentConfig; bad values raise UserError naming the flag."""
    cfg = cfg if cfg is not None else load_settings(args)
    if not args.drain_timeout > 0:
        raise UserError(f"--drain-timeout {args.drain_timeout}: must be a positive number of seconds")
    if args.simulate is not None and args.simulate < 1:
        raise UserError(f"--simulate {args.simulate}: must be a number of GPUs (>= 1)")
    if args.ticks is not None and args.ticks < 1:
        raise UserError(f"--ticks {args.ticks}: must be >= 1")
    record_only = args.record is not None and cfg.source("collector") == "default"
    probe_socket = None
    if not args.no_probe_socket and (cfg.probe_socket or not args.simulate):
        probe_socket = cfg.probe_socket or default_endpoint()
    kubelet_socket = cfg.kubelet_socket
    if kubelet_socket is None and not args.simulate and Path(DEFAULT_KUBELET_SOCKET).exists():
        kubelet_socket = DEFAULT_KUBELET_SOCKET
    if cfg.metrics_token_file:
        read_token(cfg.metrics_token_file)  # a bad token file stops the agent here, before it samples
    return cfg.build(AgentConfig, collector=None if record_only else cfg.collector, probe_socket=probe_socket,
                     drain_timeout=args.drain_timeout, record=args.record,
                     kubelet_socket=kubelet_socket)


def simulated_node(args: argparse.Namespace, node: str) -> SimulatedNode | None:
    """The node --simulate N and the --sim-* flags describe (None without --simulate); UserError naming a bad flag."""
    start = _sim_start(args.sim_start)
    faults = _sim_faults(args)
    slow = _sim_fail_slow(args)
    if not args.simulate:
        return None
    return SimulatedNode(args.simulate, node=node, model=args.sim_model, speed=args.sim_speed, start=start,
                         origin=args.sim_origin, faults=faults, job=args.sim_job or None, job_step_s=args.sim_job_step,
                         fail_slow=slow)


def simulated_agent(config: AgentConfig, node: SimulatedNode) -> Agent:
    """The agent pointed at ``node`` (installed beneath pynvml by whoever enters it): its clock, process
    environments and synthetic job's spans; batches say ``simulated``; no host kernel log is read for XIDs."""
    config = replace(config, kmsg_path=None, labels={**config.labels, "simulated": "true"})
    return Agent(config, clock=node.clock, environ=node.environ, span_sources=node.span_sources, host=node.host)


def _sim_start(text: str | None) -> float | None:
    """--sim-start as epoch seconds (a number, or ISO 8601 with UTC assumed when no offset is given)."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise UserError(f"--sim-start {text!r}: not epoch seconds or an ISO 8601 time") from None
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


def _sim_faults(args: argparse.Namespace) -> tuple[FaultSpec, ...]:
    """The --sim-fault specs, checked; the simulation flags need --simulate."""
    if not args.simulate and (args.sim_fault or args.sim_speed != 1.0 or args.sim_start or args.sim_origin
                              or args.sim_job):
        raise UserError("--sim-speed, --sim-start, --sim-origin, --sim-fault and --sim-job need --simulate N")
    if not args.sim_job_step > 0:
        raise UserError(f"--sim-job-step {args.sim_job_step}: must be > 0 simulated seconds")
    if not args.sim_speed > 0:
        raise UserError(f"--sim-speed {args.sim_speed}: must be > 0 (simulated seconds per real second)")
    specs = []
    for text in args.sim_fault:
        try:
            specs.append(parse_fault_spec(text))
        except ValueError as exc:
            raise UserError(f"--sim-fault {text!r}: {exc}") from None
        if args.simulate and specs[-1].gpu >= args.simulate:
            raise UserError(f"--sim-fault gpu={specs[-1].gpu}: the node simulates GPUs 0-{args.simulate - 1}")
    return tuple(specs)


def _sim_fail_slow(args: argparse.Namespace) -> tuple[FailSlowSpec, ...]:
    """The --sim-fail-slow specs, checked: they slow a rank of --sim-job on a GPU the node simulates."""
    if args.sim_fail_slow and not (args.simulate and args.sim_job):
        raise UserError("--sim-fail-slow needs --simulate N and --sim-job JOB (it slows a rank of that job)")
    specs = []
    for text in args.sim_fail_slow:
        try:
            specs.append(parse_fail_slow_spec(text))
        except ValueError as exc:
            raise UserError(f"--sim-fail-slow {text!r}: {exc}") from None
        if specs[-1].gpu >= args.simulate:
            raise UserError(f"--sim-fail-slow gpu={specs[-1].gpu}: the node simulates GPUs 0-{args.simulate - 1}")
    return tuple(specs)


def run(args: argparse.Namespace) -> int:
    settings = load_settings(args)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(args, settings)
    simulation = simulated_node(args, cfg.node_name)
    if args.check:
        return _check(cfg, args.json, simulation)
    if args.new_agent_id:
        return _new_agent_id(cfg)
    with simulation or nullcontext():
        agent = simulated_agent(cfg, simulation) if simulation else Agent(cfg)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: agent.stop())
        agent.run(ticks=args.ticks)
    return 0


def _new_agent_id(cfg: AgentConfig) -> int:
    from gpuwatch.agent.spool import Spool

    spool = Spool(cfg.spool_dir, cfg.spool_max_bytes)
    old = spool.agent_id
    new = spool.renew_identity()
    print(f"spool {cfg.spool_dir}: agent id {old} -> {new}; {len(spool.pending())} unsent batches renumbered")
    return 0


def _check(cfg: AgentConfig, as_json: bool, simulation: SimulatedNode | None) -> int:
    from gpuwatch.apps.agent_check import check_node, format_check

    report = check_node(cfg, simulation=simulation)
    if as_json:
        print_json(report.to_dict())
    else:
        print(format_check(report))
    return 0 if report.ok else 1


AGENT = Command(add_arguments, run)
