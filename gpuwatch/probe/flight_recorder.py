"""Collective timing from PyTorch's NCCL Flight Recorder, read in process at step boundaries.

Flight Recorder keeps a ring buffer of every NCCL op the job launched (including the C++-issued collectives
of DDP/FSDP that wrapping torch.distributed cannot see). With TORCH_NCCL_ENABLE_TIMING=1 entries carry
`duration_ms` from CUDA events on the NCCL stream; without it the watchdog's observed start/completion
times are used (coarser, they can lag). Entries are converted once each, identified by `record_id`.
"""
from __future__ import annotations

import json
import re
from typing import Any
from collections.abc import Callable, Mapping

from gpuwatch.probe.wire import SpanRow

BUFFER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
DUMP_FUNCTIONS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")
_DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Int": 4, "Long": 8, "Short": 2,
                "Char": 1, "Byte": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1}
_P2P_NAME = re.compile(r"(send|recv)\s+(\d+)\s*(->|<-)\s*(\d+)")


def flight_recorder_enabled(env: Mapping[str, str]) -> bool:
    return any(env.get(name, "").strip().isdigit() and int(env[name]) > 0 for name in BUFFER_ENV)


def find_dump_function(c10d: Any) -> Callable[..., str] | None:
    for name in DUMP_FUNCTIONS:
        function = getattr(c10d, name, None)
        if function is not None:
            return function
    return None


def _entry_bytes(entry: Mapping[str, Any]) -> int:
    total = 0
    for shape, dtype in zip(entry.get("input_sizes") or [], entry.get("input_dtypes") or []):
        count = 1
        for dim in shape:
            count *= dim
        total += count * _DTYPE_BYTES.get(dtype, 0)
    return total if total else -1


def entry_to_row(entry: Mapping[str, Any], step: int) -> SpanRow | None:
    """One completed Flight Recorder entry as a span row; None when it has not completed."""
    if entry.get("state") != "completed":
        return None
    profiling_name = str(entry.get("profiling_name", ""))
    name = profiling_name.split(":", 1)[-1].strip()
    peer = -1
    is_p2p = bool(entry.get("is_p2p"))
    match = _P2P_NAME.search(name)
    if match:
        verb, left, _, right = match.groups()
        name, peer = verb, int(right if verb == "send" else left)
        is_p2p = True
    started = entry.get("time_discovered_started_ns") or entry.get("time_created_ns")
    completed = entry.get("time_discovered_completed_ns")
    if started is None:  # no start time: nothing to place on the timeline
        return None
    if entry.get("duration_ms") is not None:
        dur_us = float(entry["duration_ms"]) * 1000.0
    elif started and completed:
        dur_us = (completed - started) / 1000.0
    else:
        return None
    group = entry.get("process_group") or ["", ""]
    seq = entry.get("p2p_seq_id" if is_p2p else "collective_seq_id", -1)
    return SpanRow(step, "p2p" if is_p2p else "collective", name, started / 1000.0, dur_us,
                   str(group[0]), int(seq), _entry_bytes(entry), peer)


class FlightRecorderHarvester:
    """Turns new completed entries of successive dumps into rows, each entry once.

    The ring buffer belongs to the process, not to one probe: a probe closed and started again in the same
    process finds the earlier probe's entries still there. ``after_record_id`` (see :meth:`starting_now`)
    makes a new harvester ignore every entry recorded before it, so those collectives are not sent twice.
    """

    def __init__(self, dump: Callable[..., str], after_record_id: int = -1) -> None:
        self._dump = dump
        self._after = after_record_id
        self._seen: set[int] = set()

    @classmethod
    def starting_now(cls, dump: Callable[..., str]) -> FlightRecorderHarvester:
        """A harvester for the entries recorded from now on (the buffer's current entries are an earlier probe's)."""
        ids = [entry.get("record_id", -1) for entry in json.loads(dump(True, False)).get("entries") or []]
        return cls(dump, after_record_id=max(ids, default=-1))

    def harvest(self, step_of: Callable[[float], int]) -> list[SpanRow]:
        trace = json.loads(self._dump(True, False))  # includeCollectives, onlyActive
        return self.rows_from_trace(trace, step_of)

    def rows_from_trace(self, trace: Mapping[str, Any], step_of: Callable[[float], int]) -> list[SpanRow]:
        entries = trace.get("entries") or []
        ids = [entry.get("record_id", -1) for entry in entries]
        if ids:
            oldest = min(ids)
            self._seen = {i for i in self._seen if i >= oldest}  # the ring buffer forgot the rest
        rows = []
        for record_id, entry in zip(ids, entries):
            if record_id <= self._after or record_id in self._seen:
                continue
            started = entry.get("time_discovered_started_ns") or entry.get("time_created_ns") or 0
            row = entry_to_row(entry, step_of(started / 1000.0))
            if row is not None:
                self._seen.add(record_id)
                rows.append(row)
        return rows
