"""An optional short torch.profiler window every few minutes, reduced on the spot to span rows.

Off by default. When due, a few training steps are profiled; at the end of the window the raw events are
reduced to compact rows (kinds compute / memcpy / collective / p2p with start and duration, the SpanTable
schema) and the raw trace is discarded: never ship a Kineto trace from every rank.
GPU activities are used when present; a CPU-only job (no GPU events) gets its top-level CPU ops instead.
"""
from __future__ import annotations

import time
from typing import Any
from collections.abc import Callable

from gpuwatch.probe.wire import SpanRow

MAX_ROWS = 20_000    # per window; the rest is dropped (and counted)
MAX_NAME = 80
_COMM_MARKERS = ("nccl", "c10d::", "gloo:", "record_param_comms")


def classify(name: str, on_device: bool) -> str:
    """Span kind of a profiler event by its name."""
    lower = name.lower()
    if any(marker in lower for marker in _COMM_MARKERS):
        point_to_point = ("send" in lower or "recv" in lower) and "sendrecv" not in lower
        return "p2p" if point_to_point else "collective"
    if on_device and ("memcpy" in lower or "memset" in lower):
        return "memcpy"
    return "compute"


def reduce_events(events: list[Any], step_of: Callable[[float], int]) -> tuple[list[SpanRow], int]:
    """Rows from KinetoEvents (device activities, else top-level CPU ops) and how many were left out."""
    device = [e for e in events if str(e.device_type()) != "DeviceType.CPU"]
    chosen = device if device else _top_level_cpu(events)
    rows = []
    for event in sorted(chosen, key=lambda e: e.start_ns())[:MAX_ROWS]:
        start_us = event.start_ns() / 1000.0
        rows.append(SpanRow(step_of(start_us), classify(event.name(), bool(device)), event.name()[:MAX_NAME],
                            start_us, event.duration_ns() / 1000.0, "", -1, -1, -1))
    return rows, max(len(chosen) - MAX_ROWS, 0)


def _top_level_cpu(events: list[Any]) -> list[Any]:
    """CPU ops not nested inside another op of the same thread (their time already counts in the parent)."""
    out = []
    end_by_thread: dict[int, int] = {}
    for event in sorted((e for e in events if not e.is_async()), key=lambda e: (e.start_ns(), -e.duration_ns())):
        thread = event.start_thread_id()
        if event.start_ns() >= end_by_thread.get(thread, 0):
            out.append(event)
            end_by_thread[thread] = event.start_ns() + event.duration_ns()
    return out


class ProfilerWindow:
    def __init__(self, torch: Any, every_s: float, steps: int) -> None:
        self._profiler_module = torch.profiler
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._activities = activities
        self._every_s = every_s
        self._steps = max(1, steps)
        self._next_due = time.monotonic() + every_s
        self._active: Any = None
        self._left = 0
        self.windows = 0
        self.left_out = 0

    def on_step(self, step: int, step_of: Callable[[float], int]) -> list[SpanRow]:
        """Called at each step boundary: opens a window when due, closes and reduces it after `steps` steps."""
        if self._active is None:
            if time.monotonic() >= self._next_due:
                self._active = self._profiler_module.profile(activities=self._activities)
                self._active.__enter__()
                self._left = self._steps
            return []
        self._left -= 1
        if self._left > 0:
            return []
        profiler, self._active = self._active, None
        profiler.__exit__(None, None, None)
        self._next_due = time.monotonic() + self._every_s
        self.windows += 1
        rows, left_out = reduce_events(profiler.profiler.kineto_results.events(), step_of)
        self.left_out += left_out
        return rows

    def cancel(self) -> None:
        if self._active is not None:
            self._active.__exit__(None, None, None)
            self._active = None
