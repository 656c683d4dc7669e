"""The node agent: samples GPUs and host every tick, cuts batches into the spool, streams them out.

Wiring only: :class:`~gpuwatch.agent.nvml.NvmlSampler` (whatever NVML library pynvml finds: the node's GPUs, or
a simulated fleet an application installed beneath it), :class:`~gpuwatch.agent.host.HostSampler`,
:class:`~gpuwatch.agent.jobs.JobResolver`, :class:`~gpuwatch.agent.xid.XidWatcher`, the probe socket
(:class:`~gpuwatch.agent.probe_socket.ProbeListener`, its spans join each batch), :class:`~gpuwatch.agent.spool.Spool`
with :class:`~gpuwatch.agent.uplink.Uplink` (when a collector is configured) and
:class:`~gpuwatch.agent.recorder.BatchRecorder` (``--record``). ``Agent(config).run(ticks)`` runs in-process
(tests); ``gpuwatch agent`` runs it as a command. The agent knows nothing of the simulator: what differs on a
simulated node comes in through the constructor (a clock, a process-environment reader, more span sources).
"""
from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from gpuwatch import __version__
from gpuwatch.core import events as ev
from gpuwatch.core.events import Event
from gpuwatch.agent.host import HostSampler
from gpuwatch.agent.jobs import JobResolver, read_proc_environ
from gpuwatch.agent.kubelet import PodResourcesClient
from gpuwatch.agent.nvml import GpuDevice, NvmlSampler
from gpuwatch.agent.mig import MigSampler, mig_events
from gpuwatch.agent.owners import OwnerTracker
from gpuwatch.agent.processes import EventPacing, process_events, rollup
from gpuwatch.agent.probe_socket import ProbeListener
from gpuwatch.agent.spool import Spool, SpoolFull
from gpuwatch.agent.uplink import Uplink
from gpuwatch.agent.xid import XidWatcher
from gpuwatch.core.batches import MAX_BATCH_BYTES, BatchBuilder
from gpuwatch.core.errors import UserError
from gpuwatch.core.security import read_token
from gpuwatch.core.settings import AgentSettings
from gpuwatch.v1 import telemetry_pb2 as pb

if TYPE_CHECKING:  # imported only when --record or metrics_listen asks: pandas, pyarrow, prometheus_client
    from gpuwatch.agent.node_metrics import NodeMetrics
    from gpuwatch.agent.recorder import BatchRecorder
    from gpuwatch.core.metrics_http import MetricsServer

log = logging.getLogger(__name__)

SYSTEM_SPOOL = Path("/var/lib/gpuwatch/spool")
# Probe spans per batch, leaving the rest of MAX_BATCH_BYTES to the samples and events cut with them.
SPAN_BYTES_PER_BATCH = MAX_BATCH_BYTES // 2
# How often the final drain looks at stop(): the uplink's wait cannot be woken from here.
DRAIN_POLL_S = 0.2


class Clock(Protocol):
    """The time samples and events are stamped with: the wall clock, or one that runs at another speed."""

    speed: float  # clock seconds per wall-clock second (a recording's sample spacing is interval x speed)

    def __call__(self) -> float:
        """Now, in epoch seconds."""

    def from_wall(self, wall_s: float) -> float:
        """The clock's reading at wall-clock time ``wall_s`` (events are stamped on the wall clock where they arise)."""


class WallClock:
    """The agent's default clock: real time."""

    speed = 1.0

    def __call__(self) -> float:
        return time.time()

    def from_wall(self, wall_s: float) -> float:
        return wall_s


#: Something that yields the spans gathered since its last call, like :meth:`ProbeListener.drain`.
SpanSource = Callable[[], pb.SpanTable]


class HostSource(Protocol):
    """What samples the host metrics each tick (HostSampler, or a simulated host)."""

    def sample(self) -> dict[str, float]: ...


def default_spool_dir() -> Path:
    """/var/lib/gpuwatch/spool when this user may write there, else ~/.cache/gpuwatch/spool."""
    probe = SYSTEM_SPOOL
    while not probe.exists():
        probe = probe.parent
    return SYSTEM_SPOOL if os.access(probe, os.W_OK) else Path.home() / ".cache" / "gpuwatch" / "spool"


@dataclass(frozen=True)
class AgentConfig(AgentSettings):
    """The agent's settings (:class:`~gpuwatch.core.settings.AgentSettings`: deploy/agent.toml, ``GPUWATCH_*``,
    flags; its TLS and token to the collector) and what one run, a test or the demo adds. ``collector`` None
    means record-only (needs ``record``); ``node`` None the hostname; ``spool`` None the default spool."""

    # ---- one run ----
    drain_timeout: float = 600.0  # --ticks mode: how long to wait for the collector at the end
    stop_flush_s: float = 5.0  # service mode: how long to try to send the last batch on SIGTERM
    kmsg_path: str | None = "/dev/kmsg"
    labels: dict[str, str] = field(default_factory=dict)
    record: Path | None = None  # also write every batch into this recording directory

    def __post_init__(self) -> None:
        if self.node is None:
            object.__setattr__(self, "node", socket.gethostname())

    @property
    def node_name(self) -> str:
        """``node``, typed as set: __post_init__ fills in the hostname when it is not given."""
        assert self.node is not None
        return self.node

    @property
    def spool_dir(self) -> Path:
        return Path(self.spool) if self.spool else default_spool_dir()

    @property
    def metrics_token(self) -> str | None:
        """The bearer token scrapers of the node-local endpoint must send (read from ``metrics_token_file``)."""
        return read_token(self.metrics_token_file) if self.metrics_token_file else None


@dataclass
class RunSummary:
    ticks: int
    batches: int
    pending: int  # batches still in the spool (not acknowledged) when the agent stopped


class Agent:
    """One node agent.

    ``clock`` stamps samples and events (default: the wall clock; intervals stay real seconds whatever it
    is); ``environ`` reads a GPU process's environment by PID to name its job (default: /proc/<pid>/environ);
    ``span_sources`` are drained into each batch beside the probe socket's spans; ``host`` samples the host
    metrics (default: psutil's :class:`HostSampler`). A simulated node hands in
    its own (gpuwatch.simulator.node.SimulatedNode, wired by the application that installs it).
    """

    def __init__(self, config: AgentConfig, *, clock: Clock | None = None,
                 environ: Callable[[int], dict[str, str] | None] = read_proc_environ,
                 span_sources: Sequence[SpanSource] = (), host: HostSource | None = None) -> None:
        if config.collector is None and config.record is None:
            raise UserError("nothing to send to: give a collector, a recording (--record), or both")
        self.config = config
        self.clock: Clock = clock if clock is not None else WallClock()
        self.environ = environ
        self.span_sources = list(span_sources)
        if config.nccl_inspector_dir:  # NCCL's inspector plugin: collective spans from jobs without the probe
            from gpuwatch.agent.nccl_inspector import InspectorReader

            self.span_sources.append(InspectorReader(config.nccl_inspector_dir, environ, config.job_label or "").drain)
        self.host = host
        self._stop = threading.Event()
        self._events: list[Event] = []
        self._events_lock = threading.Lock()
        self.spool: Spool | None = None
        self.uplink: Uplink | None = None
        self.probe: ProbeListener | None = None
        self.recorder: BatchRecorder | None = None
        self.metrics: NodeMetrics | None = None
        self.metrics_server: MetricsServer | None = None
        self.owners: OwnerTracker | None = None  # GPU owners (pods, jobs), refreshed on the slow cadence
        self.migs: MigSampler | None = None  # MIG instances, sampled on the slow cadence
        # per-GPU process and MIG events at most every minute or few (on the agent's, maybe simulated, clock)
        self._process_pacing = EventPacing(self.clock)
        self._mig_pacing = EventPacing(self.clock)
        self._local_sequence = itertools.count(1)  # record-only mode has no spool to number batches

    def stop(self) -> None:
        """Ask a running agent to stop after the current tick (safe from signal handlers and threads)."""
        self._stop.set()

    def emit(self, event: Event) -> None:
        """Queue an event for the next batch (called from the XID threads)."""
        with self._events_lock:
            self._events.append(event)

    def run(self, ticks: int | None = None) -> RunSummary:
        """Sample ``ticks`` times (None: until stop()), then flush; raises UserError if data stays unsent."""
        cfg = self.config
        drained = True
        with ExitStack() as stack:
            if cfg.collector is not None:
                self.spool = Spool(cfg.spool_dir, cfg.spool_max_bytes)
            sampler = NvmlSampler(slow_interval=cfg.slow_interval)
            stack.callback(sampler.close)
            devices = sampler.open()
            self.migs = MigSampler(devices, sampler.clock)
            stack.callback(self.migs.close)  # before nvmlShutdown (callbacks run last-first)
            jobs = JobResolver(self.environ, cfg.job_label or "")
            kubelet = PodResourcesClient(cfg.kubelet_socket) if cfg.kubelet_socket else None
            if kubelet is not None:
                stack.callback(kubelet.close)
            self.owners = OwnerTracker({d.index: d.uuid for d in devices}, kubelet, sampler.mig_parents())
            host = self.host if self.host is not None else HostSampler()
            agent_id = self.spool.agent_id if self.spool else f"record-{cfg.node}"
            builder = BatchBuilder(self._identity(sampler), agent_id, [d.info() for d in devices])
            if cfg.record is not None:
                from gpuwatch.agent.recorder import BatchRecorder

                self.recorder = BatchRecorder(cfg.record, resolution_s=cfg.interval * self.clock.speed)
                stack.callback(self.recorder.close)
            if cfg.metrics_listen:
                server = self._serve_metrics(cfg.metrics_listen, devices, sampler.driver_version)
                stack.callback(server.close)
            if cfg.probe_socket:
                self.probe = _open_probe_listener(cfg.probe_socket)
                stack.callback(self.probe.close)
            watcher = XidWatcher(devices, self.emit, kmsg_path=cfg.kmsg_path)
            watcher.start()
            stack.callback(watcher.stop)
            if self.spool is not None and cfg.collector is not None:
                self.uplink = Uplink(self.spool, cfg.collector, channel_security=cfg)
                self.uplink.start()
                stack.callback(self.uplink.stop)
            self.emit(Event(ev.AGENT_START, message=f"gpuwatch agent {__version__} on {cfg.node}, {len(devices)} GPUs",
                            attrs={"agent_version": __version__, "gpus": str(len(devices))}))
            done, batches = self._loop(ticks, sampler, host, jobs, builder)
            self.emit(Event(ev.AGENT_STOP, message=f"stopped after {done} ticks"))
            batches += self._cut(builder)
            if self.spool is not None and self.spool.unreported_drops():
                # Batches dropped while the last one was spooled (a full disk at the very end): one more batch
                # reports them now; if that is dropped too, the spool keeps them for the next start.
                batches += self._cut(builder)
            if self.uplink is not None:
                drained = self._drain(ticks)
        pending = len(self.spool.pending()) if self.spool else 0
        if not drained:
            stopped = "stopped; " if self._stop.is_set() else ""
            message = (f"{stopped}collector {cfg.collector} did not acknowledge {pending} batches "
                       f"({(self.uplink.stats.last_error if self.uplink else None) or 'no answer'}); "
                       f"they are kept in the spool {cfg.spool_dir} "
                       "and sent when the agent starts again")
            if ticks is not None:
                raise UserError(message)
            log.warning("%s", message)
        if self.uplink is not None and self.uplink.stats.rejected:
            stats = self.uplink.stats
            message = (f"collector {cfg.collector} refused {stats.rejected} batches, never to be stored "
                       f"({stats.last_rejected}); they are kept with the reasons in "
                       f"{cfg.spool_dir / 'rejected'}")
            if ticks is not None:  # --ticks promises everything acknowledged: an exit status must not say so
                raise UserError(message)
            log.warning("%s", message)
        return RunSummary(done, batches, pending)

    def _drain(self, ticks: int | None) -> bool:
        """Wait for the collector to acknowledge the spool: up to drain_timeout after --ticks, but a stop()
        (SIGTERM/SIGINT) ends that wait at once; a stopped agent gets stop_flush_s."""
        cfg, uplink, spool = self.config, self.uplink, self.spool
        assert uplink is not None and spool is not None, "run() drains only with an uplink"
        if ticks is None or self._stop.is_set():
            return uplink.wait_drained(cfg.stop_flush_s)
        deadline = time.monotonic() + cfg.drain_timeout
        while not self._stop.is_set() and (remaining := deadline - time.monotonic()) > 0:
            if uplink.wait_drained(min(remaining, DRAIN_POLL_S)):
                return True
            if uplink.stats.fenced:  # another agent holds this id: waiting longer changes nothing
                break
        return not spool.pending()

    def _serve_metrics(self, listen: str, devices: list[GpuDevice], driver_version: str) -> MetricsServer:
        from gpuwatch.agent.node_metrics import NodeMetrics
        from gpuwatch.core.metrics_http import start_metrics_server

        cfg = self.config
        self.metrics = NodeMetrics(cfg.node_name, [d.info() for d in devices], self.spool,
                                   driver_version=driver_version)
        self.metrics_server = server = start_metrics_server(listen, self.metrics.snapshot, cfg.metrics_token,
                                                            insecure=cfg.insecure, names=cfg.metrics_names)
        log.info("node metrics at %s", server.url)
        return server

    def _identity(self, sampler: NvmlSampler) -> pb.NodeIdentity:
        return pb.NodeIdentity(node=self.config.node, agent_version=__version__, driver_version=sampler.driver_version,
                               cuda_version=sampler.cuda_version, labels=dict(self.config.labels))

    def _loop(self, ticks, sampler, host, jobs, builder) -> tuple[int, int]:
        cfg = self.config
        ticks_per_batch = max(1, round(cfg.batch_interval / cfg.interval))
        done = batches = 0
        next_tick = time.monotonic()
        while not self._stop.is_set() and (ticks is None or done < ticks):
            self._tick(sampler, host, jobs, builder)
            done += 1
            if done % ticks_per_batch == 0:
                batches += self._cut(builder)
            if ticks is not None and done >= ticks:
                break
            next_tick = max(next_tick + cfg.interval, time.monotonic())
            self._stop.wait(next_tick - time.monotonic())
        return done, batches

    def _now_ms(self) -> int:
        """Sample time, on the agent's clock."""
        return int(self.clock() * 1000)

    def _event_time(self, event: Event) -> Event:
        """Events are stamped with the wall clock where they arise; on another clock, move them onto it."""
        if isinstance(self.clock, WallClock):
            return event
        return replace(event, ts_ms=int(self.clock.from_wall(event.ts_ms / 1000) * 1000))

    def _tick(self, sampler: NvmlSampler, host: HostSource, jobs: JobResolver, builder: BatchBuilder) -> None:
        ts_ms = self._now_ms()
        tick = sampler.sample()
        if tick.slow:
            procs = sampler.running_processes()
            jobs.refresh({gpu: [p.pid for p in ps] for gpu, ps in procs.items()})
            if self.migs is not None:
                self.migs.refresh()
            if self.owners is not None:
                if self.migs is not None:  # a GPU repartitioned since start: its new instances match too
                    self.owners.mig_parents = {u: inst.gpu_index for u, inst in self.migs.instances.items()}
                for event in self.owners.refresh(jobs.by_gpu):
                    self.emit(event)
            holders = self.owners.holders if self.owners is not None else {}
            uses = {gpu: rollup(ps, holders.get(gpu, []), {p.pid: jobs.job_of_pid(p.pid) for p in ps},
                                jobs.environ_reader) for gpu, ps in procs.items()}
            for event in process_events(uses, self._process_pacing):
                self.emit(event)
            if self.migs is not None:
                device_holders = self.owners.device_holders if self.owners is not None else {}
                for event in mig_events(self.migs.instances, self.migs.sample(), device_holders, self._mig_pacing):
                    self.emit(event)
        for gpu, values in tick.rows.items():
            job = jobs.job(gpu)
            builder.add_gpu_row(gpu, ts_ms, values, job.job_id, job.rank, job.local_rank)
            if self.metrics is not None:
                self.metrics.observe_gpu(gpu, values, job.job_id, job.rank)
                if self.owners is not None:
                    self.metrics.observe_owner(gpu, self.owners.owner(gpu))
        host_values = host.sample()
        builder.add_host_row(ts_ms, host_values)
        if self.metrics is not None:
            self.metrics.observe_host(host_values)
        self._move_events(builder, tick.events)

    def _move_events(self, builder: BatchBuilder, extra: Sequence[Event] = ()) -> None:
        """Put the queued events (and ``extra``) into the batch being built."""
        with self._events_lock:
            pending, self._events = [*self._events, *extra], []
        for e in map(self._event_time, pending):
            if self.metrics is not None and e.kind == ev.XID and e.gpu_index is not None:
                self.metrics.observe_xid(e.gpu_index, e.code)
            builder.add_event(e.kind, e.ts_ms, e.gpu_index, e.code, e.message, e.attrs)

    def _cut(self, builder: BatchBuilder) -> int:
        """Spool (and record) what the builder holds with the spans; returns the number of batches written."""
        dropped = self.spool.take_dropped() if self.spool else None
        if dropped and dropped.batches:
            if self.metrics is not None:
                self.metrics.observe_dropped(dropped.batches)
            # The running totals travel too: if this batch is dropped in turn, the next report covers it.
            builder.add_event(ev.SPOOL_DROPPED, self._now_ms(), code=dropped.batches,
                              message=f"spool full (size bound or disk): {dropped.batches} batches dropped, "
                                      f"{dropped.total_batches} in total",
                              attrs={"bytes": str(dropped.bytes), "dropped_total": str(dropped.total_batches),
                                     "dropped_bytes_total": str(dropped.total_bytes)})
        self._move_events(builder)
        spans = self.probe.drain() if self.probe else pb.SpanTable()
        for source in self.span_sources:
            spans.MergeFrom(source())
        # The agent names the node: a probe's own hostname may differ from --node and would not join its telemetry.
        del spans.node[:]
        spans.node.extend([self.config.node] * len(spans.start_us))
        chunks = span_chunks(spans, SPAN_BYTES_PER_BATCH)
        if not len(builder) and not chunks:
            return 0
        for chunk in (chunks if chunks else [None]):  # the first batch takes the rows and events, later ones only spans
            if chunk is not None:
                builder.add_spans(chunk)
            try:
                sequence = self.spool.next_sequence() if self.spool else next(self._local_sequence)
            except SpoolFull:  # counted as dropped by the spool; sampling goes on
                builder.build(0)
                continue
            self._write(builder.build(sequence))
        return max(1, len(chunks))

    def _write(self, batch: pb.TelemetryBatch) -> None:
        if self.recorder is not None:
            self.recorder.add(batch)
        if self.spool is not None:
            try:
                self.spool.append(batch.sequence, batch.SerializeToString())
            except SpoolFull:  # counted as dropped by the spool; sampling goes on
                return
            if self.uplink is not None:
                self.uplink.notify()


def span_chunks(spans: pb.SpanTable, max_bytes: int) -> list[pb.SpanTable]:
    """``spans`` cut into row ranges of at most about ``max_bytes`` each, so no batch exceeds MAX_BATCH_BYTES."""
    n = len(spans.start_us)
    if not n:
        return []
    size = spans.ByteSize()
    if size <= max_bytes:
        return [spans]
    rows = max(1, n * max_bytes // size)
    columns = [f.name for f in pb.SpanTable.DESCRIPTOR.fields if len(getattr(spans, f.name))]
    return [pb.SpanTable(**{c: getattr(spans, c)[i:i + rows] for c in columns}) for i in range(0, n, rows)]


def _open_probe_listener(path: str) -> ProbeListener:
    try:
        return ProbeListener(path)
    except OSError as exc:  # its message names the socket and the problem
        raise UserError(f"{exc.strerror or exc}; choose another --probe-socket or run with --no-probe-socket") from None
