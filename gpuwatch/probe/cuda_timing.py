"""GPU-side timing of collectives on CUDA tensors with CUDA events, without synchronising the trainer.

Used when the NCCL Flight Recorder is off. The start event is recorded on the caller's current stream just
before the launch (the NCCL stream waits on that point). The end event is recorded on the current stream
after a synchronous op (which made that stream wait for the collective), or, for an async op, inside the
work future's callback, where PyTorch makes the current stream wait on the NCCL stream: so the event fires
when the collective finishes, and no stream the trainer uses is made to wait on anything new.
Events are read at step boundaries with `Event.query()`, which never blocks; one synchronisation at start()
anchors GPU time to the host's epoch clock.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any

from gpuwatch.probe.wire import SpanRow

MAX_PENDING = 65536


class CudaEventTimer:
    def __init__(self, torch: Any) -> None:
        self._cuda = torch.cuda
        self._anchor = self._new_event()
        self._anchor.record()
        self._cuda.synchronize()
        self._anchor_us = time.time_ns() / 1000.0
        self._pending: deque[tuple[Any, Any]] = deque(maxlen=MAX_PENDING)  # (launch, end event holder)

    def _new_event(self) -> Any:
        return self._cuda.Event(enable_timing=True)

    def begin(self) -> Any:
        event = self._new_event()
        event.record()
        return event

    def end(self, launch: Any, works: list) -> None:
        """Arrange for an end event once the launched op is done on the GPU (see module docstring)."""
        holder: list[Any] = []
        if not works:
            event = self._new_event()
            event.record()
            holder.append(event)
        else:
            def record_end(_: Any) -> None:
                event = self._new_event()
                event.record()  # current stream here waits on the work's NCCL stream
                holder.append(event)

            works[-1].get_future().then(record_end)
        self._pending.append((launch, holder))

    def harvest(self) -> list[SpanRow]:
        """Rows of ops whose events completed, oldest first; stops at the first one still running."""
        rows: list[SpanRow] = []
        while self._pending:
            launch, holder = self._pending[0]
            if not holder or not holder[0].query() or not launch.device_start.query():
                break
            self._pending.popleft()
            start_us = self._anchor_us + self._anchor.elapsed_time(launch.device_start) * 1000.0
            rows.extend(launch.rows(start_us, launch.device_start.elapsed_time(holder[0]) * 1000.0))
        return rows
