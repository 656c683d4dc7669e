"""Collective timing from PyTorch's NCCL Flight Recorder, read in process at step boundaries.

Flight Recorder keeps a ring buffer of every NCCL op the job launched (including the C++-issued collectives
of DDP/FSDP that wrapping torch.distributed cannot see). With TORCH_NCCL_ENABLE_TIMING=1 entries carry
`duration_ms` from CUDA events on the NCCL stream; without it the watchdog's observed start/completion
times are used (coarser, they can lag). Entries are converted once each, identified by `record_id`.

PyTorch keeps one recorder per event type: NCCL's (``_dump_nccl_trace_json``) and the generic one that gloo
writes (``_dump_fr_trace_json``). A CUDA build has both functions, and reading only the generic one sees no NCCL
collective at all, so every recorder found is read. A finished entry is ``retired`` (the watchdog is done with
it) whatever its ``state`` says: an entry retired after its events were freed keeps the state it had when last
queried, and gloo never moves past ``scheduled``. Entries with no timing (gloo, or NCCL without timing and with
no completion seen) are counted, not sent.
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


def find_dump_functions(c10d: Any) -> list[Callable[..., str]]:
    """Every Flight Recorder dump this torch has (NCCL's and the generic one are separate recorders)."""
    return [function for name in DUMP_FUNCTIONS if (function := getattr(c10d, name, None)) is not None]


def entry_finished(entry: Mapping[str, Any]) -> bool:
    return entry.get("state") == "completed" or bool(entry.get("retired"))


def _entry_key(entry: Mapping[str, Any]) -> tuple[Any, ...]:
    """An op's identity across recorders: the same collective read through two dumps is one op."""
    is_p2p = bool(entry.get("is_p2p"))
    return (entry.get("pg_id"), tuple(entry.get("process_group") or ()), is_p2p,
            entry.get("p2p_seq_id" if is_p2p else "collective_seq_id"), entry.get("profiling_name"))


def _entry_bytes(entry: Mapping[str, Any]) -> int:
    total = 0
    for shape, dtype in zip(entry.get("input_sizes") or [], entry.get("input_dtypes") or []):
        count = 1
        for dim in shape:
            count *= dim
        total += count * _DTYPE_BYTES.get(dtype, 0)
    return total if total else -1


def entry_to_row(entry: Mapping[str, Any], step: int) -> SpanRow | None:
    """One finished Flight Recorder entry as a span row; None when it has not finished or has no timing."""
    if not entry_finished(entry):
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
    started = entry.get("time_discovered_started_ns") or entry.get("time_created_ns") or 0
    completed = entry.get("time_discovered_completed_ns")
    if not started:  # no start time: nothing to place on the timeline
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
    """Turns new finished entries of successive dumps into rows, each entry once.

    The ring buffer belongs to the process, not to one probe: a probe closed and started again in the same
    process finds the earlier probe's entries still there. ``after_record_id`` (see :meth:`starting_now`)
    makes a new harvester ignore every entry recorded before it, so those collectives are not sent twice.
    ``untimed`` counts finished entries that carried no timing.
    """

    def __init__(self, dump: Callable[..., str], after_record_id: int = -1) -> None:
        self._dump = dump
        self._after = after_record_id
        self._seen: set[int] = set()
        self.untimed = 0

    @classmethod
    def starting_now(cls, dump: Callable[..., str]) -> FlightRecorderHarvester:
        """A harvester for the entries recorded from now on (the buffer's current entries are an earlier probe's)."""
        ids = [entry.get("record_id", -1) for entry in json.loads(dump(True, False)).get("entries") or []]
        return cls(dump, after_record_id=max(ids, default=-1))

    def harvest(self, step_of: Callable[[float], int],
                already: dict[tuple[Any, ...], None] | None = None) -> list[SpanRow]:
        trace = json.loads(self._dump(True, False))  # includeCollectives, onlyActive
        return self.rows_from_trace(trace, step_of, already)

    def rows_from_trace(self, trace: Mapping[str, Any], step_of: Callable[[float], int],
                        already: dict[tuple[Any, ...], None] | None = None) -> list[SpanRow]:
        """New rows of one dump; ``already`` holds ops another recorder's dump has sent (skipped, then added)."""
        entries = trace.get("entries") or []
        ids = [entry.get("record_id", -1) for entry in entries]
        if ids:
            oldest = min(ids)
            self._seen = {i for i in self._seen if i >= oldest}  # the ring buffer forgot the rest
        rows = []
        for record_id, entry in zip(ids, entries):
            if record_id <= self._after or record_id in self._seen or not entry_finished(entry):
                continue
            self._seen.add(record_id)
            if already is not None:
                key = _entry_key(entry)
                if key in already:
                    continue
                already[key] = None
            started = entry.get("time_discovered_started_ns") or entry.get("time_created_ns") or 0
            row = entry_to_row(entry, step_of(started / 1000.0))
            if row is None:
                self.untimed += 1
            else:
                rows.append(row)
        return rows


class FlightRecorders:
    """Every recorder of the process read together; an op seen through two dumps is sent once."""

    def __init__(self, harvesters: list[FlightRecorderHarvester]) -> None:
        self._harvesters = harvesters
        self._sent: dict[tuple[Any, ...], None] = {}

    @classmethod
    def starting_now(cls, dumps: list[Callable[..., str]]) -> FlightRecorders:
        return cls([FlightRecorderHarvester.starting_now(dump) for dump in dumps])

    @property
    def untimed(self) -> int:
        return sum(harvester.untimed for harvester in self._harvesters)

    def harvest(self, step_of: Callable[[float], int]) -> list[SpanRow]:
        if len(self._harvesters) == 1:
            return self._harvesters[0].harvest(step_of)
        rows = [row for harvester in self._harvesters for row in harvester.harvest(step_of, self._sent)]
        if len(self._sent) > _KEYS_KEPT:
            self._sent = dict.fromkeys(list(self._sent)[-_KEYS_KEPT:])  # oldest first: keys keep insertion order
        return rows


_KEYS_KEPT = 65536  # more than any ring buffer's entries: an op is forgotten only after both dumps forgot it
