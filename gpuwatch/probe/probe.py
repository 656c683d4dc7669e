"""The probe object: step timing, the collective recorder, and a daemon thread that ships rows to the agent.

The training thread only appends rows to a bounded buffer; encoding and non-blocking sends run on the
daemon thread, which never holds a lock across a syscall. Any exception inside the probe is counted, never
raised into the job.
"""
from __future__ import annotations

import atexit
import bisect
import contextlib
import os
import threading
import time
from collections import deque
from typing import Any
from collections.abc import Iterator

from gpuwatch.probe.buffer import RecordBuffer
from gpuwatch.probe.endpoint import default_endpoint
from gpuwatch.probe.identity import ProbeIdentity, identity_from_environment
from gpuwatch.probe.sender import DatagramSender
from gpuwatch.probe.wire import DEFAULT_MAX_DATAGRAM, SpanRow, encode_datagrams

STEP_HISTORY = 1024  # step starts kept to place late-arriving GPU rows in their step


class Probe:
    def __init__(self, identity: ProbeIdentity, endpoint: str, *, capacity: int = 100_000,
                 flush_interval_s: float = 0.2, stall_report_s: float = 2.0,
                 max_datagram: int = DEFAULT_MAX_DATAGRAM, flight_recorder_interval_s: float = 1.0,
                 profile_every_s: float | None = None, profile_steps: int = 3) -> None:
        self.identity = identity
        self.endpoint = endpoint
        self._header = {"job": identity.job_id, "rank": identity.rank, "ws": identity.world_size,
                        "node": identity.node}
        self._buffer = RecordBuffer(capacity)
        self._sender = DatagramSender(endpoint)
        self._max_datagram = max_datagram
        self._flush_interval_s = flush_interval_s
        self._stall_report_ns = int(stall_report_s * 1e9)
        self._stall_reported: set[int] = set()
        self._steps = 0
        self._step_start_ns = time.time_ns()
        self._step_starts: deque[float] = deque(maxlen=STEP_HISTORY)
        self._step_starts.append(self._step_start_ns / 1000.0)
        self._sent = 0
        self._send_failed = 0
        self._errors = 0
        self._closed = False
        self._recorder: Any = None
        self._cuda_timer: Any = None
        self._flight_recorder: Any = None
        self._fr_interval_ns = int(flight_recorder_interval_s * 1e9)
        self._fr_next_ns = 0
        self._profiler: Any = None
        self._attach_torch(profile_every_s, profile_steps)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flush_loop, name="gpuwatch-probe", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # -- torch ----------------------------------------------------------------------------------------------
    def _attach_torch(self, profile_every_s: float | None, profile_steps: int) -> None:
        """Wrap torch.distributed and pick GPU timing; a job without torch still gets step timing."""
        try:
            import torch
            import torch.distributed as dist
        except ImportError:
            return
        from gpuwatch.probe.collectives import CollectiveRecorder
        from gpuwatch.probe.flight_recorder import FlightRecorders, find_dump_functions, flight_recorder_enabled

        if flight_recorder_enabled(os.environ) and dist.is_available():
            dumps = find_dump_functions(torch._C._distributed_c10d)
            if dumps:
                self._flight_recorder = FlightRecorders.starting_now(dumps)
        if self._flight_recorder is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            from gpuwatch.probe.cuda_timing import CudaEventTimer
            self._cuda_timer = CudaEventTimer(torch)
        if dist.is_available():
            self._recorder = CollectiveRecorder(self._buffer.push, lambda: self._steps, self._cuda_timer,
                                                flight_recorder_on=self._flight_recorder is not None)
            self._recorder.install()
        if profile_every_s is not None:
            from gpuwatch.probe.profiler_window import ProfilerWindow
            self._profiler = ProfilerWindow(torch, profile_every_s, profile_steps)

    # -- steps ----------------------------------------------------------------------------------------------
    def step(self) -> None:
        """Mark the end of a training step (and the start of the next)."""
        if self._closed:
            return
        try:
            self._end_step(time.time_ns())
        except Exception:
            self._errors += 1

    @contextlib.contextmanager
    def step_scope(self) -> Iterator[None]:
        """`with probe.step_scope():` times the body as one step (time between scopes is not a step)."""
        self._step_start_ns = time.time_ns()
        self._step_starts[-1] = self._step_start_ns / 1000.0
        try:
            yield
        finally:
            self.step()

    def _end_step(self, now_ns: int) -> None:
        start_ns, step = self._step_start_ns, self._steps
        self._buffer.push(SpanRow(step, "step", "step", start_ns / 1000.0, (now_ns - start_ns) / 1000.0, "", step,
                                  -1, -1))
        self._steps = step + 1
        self._step_start_ns = now_ns
        self._step_starts.append(now_ns / 1000.0)
        self._harvest_device(now_ns)
        if self._profiler is not None:
            for row in self._profiler.on_step(step, self._step_of):
                self._buffer.push(row)

    def _harvest_device(self, now_ns: int, force: bool = False) -> None:
        if self._cuda_timer is not None:
            for row in self._cuda_timer.harvest():
                self._buffer.push(row._replace(step=self._step_of(row.start_us)))
        if self._flight_recorder is not None and (force or now_ns >= self._fr_next_ns):
            self._fr_next_ns = now_ns + self._fr_interval_ns
            for row in self._flight_recorder.harvest(self._step_of):
                self._buffer.push(row)

    def _step_of(self, time_us: float) -> int:
        """The step that was running at time_us (GPU rows are read after their step ended)."""
        starts = self._step_starts
        index = bisect.bisect_right(starts, time_us) - 1
        return self._steps - (len(starts) - 1 - max(index, 0))

    # -- shipping -------------------------------------------------------------------------------------------
    def _flush_loop(self) -> None:
        while not self._stop.wait(self._flush_interval_s):
            self._flush()

    def _flush(self) -> None:
        try:
            rows = self._buffer.drain() + self._stalled_rows()
            if not rows:
                return
            datagrams = encode_datagrams(self._header, rows, self._max_datagram)
            self._send_failed += len(rows) - sum(count for _, count in datagrams)  # oversized rows
            for datagram, count in datagrams:
                if self._sender.send(datagram):
                    self._sent += count
                else:
                    self._send_failed += count
        except Exception:
            self._errors += 1

    def _stalled_rows(self) -> list[SpanRow]:
        """Ops launched more than stall_report_s ago and still running, once each, with dur_us = -1."""
        if self._recorder is None:
            return []
        now_ns = time.time_ns()
        inflight = list(self._recorder.inflight.items())
        self._stall_reported &= {token for token, _ in inflight}
        rows = []
        for token, launch in inflight:
            if token not in self._stall_reported and now_ns - launch.start_ns > self._stall_report_ns:
                self._stall_reported.add(token)
                rows.extend(launch.rows(launch.start_ns / 1000.0, -1.0))
        return rows

    # -- lifecycle ------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        recorder_errors = self._recorder.errors if self._recorder is not None else 0
        return {
            "steps": self._steps,
            "records": self._buffer.recorded,
            "sent": self._sent,
            "dropped": self._buffer.overflowed + self._send_failed,
            "pending": len(self._buffer),
            "errors": self._errors + recorder_errors,
            "untimed_collectives": self._flight_recorder.untimed if self._flight_recorder is not None else 0,
        }

    def close(self) -> None:
        """Restore torch.distributed, send what is left and an end marker, stop the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        global _active
        if _active is self:
            _active = None
        try:
            atexit.unregister(self.close)
            if self._recorder is not None:
                self._recorder.uninstall()
            self._harvest_device(time.time_ns(), force=True)
            if self._profiler is not None:
                self._profiler.cancel()
            now_us = time.time_ns() / 1000.0
            self._buffer.push(SpanRow(self._steps, "end", "close", now_us, 0.0, "", -1, -1, -1))
        except Exception:
            self._errors += 1
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)
        self._flush()
        self._sender.close()


_active: Probe | None = None


def start(job: str | None = None, endpoint: str | None = None, *, profile_every_s: float | None = None,
          profile_steps: int | None = None, **options: Any) -> Probe:
    """Start the probe in this process (once: a second call returns the running probe).

    job / rank / world size default from TORCHELASTIC_RUN_ID / SLURM_JOB_ID, RANK / SLURM_PROCID, WORLD_SIZE;
    the endpoint from GPUWATCH_PROBE_SOCKET or the default socket path (see endpoint.default_endpoint).
    The profiler window is off unless profile_every_s (or GPUWATCH_PROBE_PROFILE_EVERY_S) is given.
    """
    global _active
    if _active is not None:
        return _active
    env = os.environ
    if profile_every_s is None and env.get("GPUWATCH_PROBE_PROFILE_EVERY_S"):
        profile_every_s = float(env["GPUWATCH_PROBE_PROFILE_EVERY_S"])
    if profile_steps is None:
        profile_steps = int(env.get("GPUWATCH_PROBE_PROFILE_STEPS", "3"))
    _active = Probe(identity_from_environment(job), endpoint or default_endpoint(), profile_every_s=profile_every_s,
                    profile_steps=profile_steps, **options)
    return _active
