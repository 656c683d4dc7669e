"""A bounded record buffer shared by the training thread (and completion callbacks) and the flush thread.

When full, the newest row is dropped and counted: a stalled agent never makes the trainer wait or grow memory.
The lock only guards a length check, an append and counters; nothing blocking ever runs under it.
"""
from __future__ import annotations

import threading
from collections import deque

from gpuwatch.probe.wire import SpanRow


class RecordBuffer:
    def __init__(self, capacity: int) -> None:
        self._rows: deque[SpanRow] = deque()
        self._capacity = capacity
        self._lock = threading.Lock()
        self.recorded = 0
        self.overflowed = 0

    def push(self, row: SpanRow) -> None:
        with self._lock:
            self.recorded += 1
            if len(self._rows) >= self._capacity:
                self.overflowed += 1
            else:
                self._rows.append(row)

    def drain(self) -> list[SpanRow]:
        with self._lock:
            rows = list(self._rows)
            self._rows.clear()
        return rows

    def __len__(self) -> int:
        return len(self._rows)
