"""Building and checking columnar telemetry batches (gpuwatch.v1.TelemetryBatch).

The agent, the replay tool and the benchmarks build batches with :class:`BatchBuilder`; the collector
checks every batch it receives with :func:`validate` before storing it, so both sides agree on one
definition of a well-formed batch.
"""
from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

import numpy as np

from gpuwatch.core import fields
from gpuwatch.core.spans import SPAN_COLUMN_NAMES
from gpuwatch.v1 import telemetry_pb2 as pb

SCHEMA_VERSION = pb.SCHEMA_VERSION_1
# A batch larger than this is refused by the collector (gRPC max receive size), so builders split before it.
MAX_BATCH_BYTES = 16 * 1024 * 1024

NAN = math.nan

#: gRPC metadata key of an agent's Ingest calls: a random token per agent process, so the collector can tell
#: a restarted agent (one instance at a time) from two running agents sharing one agent id.
INSTANCE_METADATA = "gpuwatch-instance"

# Bounds every stored value must fit. The store keeps GPU indexes and ranks as 32-bit and sequences and memory
# sizes as signed 64-bit integers (as queries read them), and timestamps as calendar times (years 1-9999): a
# batch outside them would pass the wire format and then fail in the store, so it is refused at the door.
MAX_SEQUENCE = MAX_INT64 = 2**63 - 1
MAX_GPU_INDEX = 2**31 - 1
# Times a calendar can hold, whatever the window: 1970-01-01 to 9999-12-31 (ms).
EARLIEST_MS, LATEST_MS = 0, 253_402_300_799_999
DAY_MS = 86_400_000
# Text bounds. A name the collector keys, groups or labels by (agent id, node, GPU uuid, job id, event kind,
# label and attribute keys, span kinds and process groups) longer than MAX_NAME_CHARS is refused: it becomes a
# Prometheus label or a table key, so one 2 MiB job id made every /metrics scrape hundreds of MB. Free text
# (event messages, attribute and label values, GPU model and span names) is cut to MAX_TEXT_CHARS instead.
MAX_NAME_CHARS = 256
MAX_TEXT_CHARS = 4096
MAX_PAIRS = 64  # node labels, and attributes per event
# GPUs one batch may describe or sample: a node has 8-16 (72 in a rack-scale NVLink domain; MIG instances are
# not GPUs here); 100,000 declared GPUs slowed `latest` past its deadline.
MAX_GPUS_PER_BATCH = 1024


class BatchError(ValueError):
    """A batch that breaks the wire contract; the message names the part that is wrong."""


class BatchBuilder:
    """Accumulates rows per GPU and host, then emits one columnar batch.

    Values missing at a tick (a slow-tier field between slow samples, an unsupported field) are NaN.
    """

    def __init__(self, node: pb.NodeIdentity, agent_id: str, gpus: Sequence[pb.GpuInfo] = ()) -> None:
        self.node = node
        self.agent_id = agent_id
        self.gpus = list(gpus)
        self._reset()

    def _reset(self) -> None:
        self._gpu_rows: dict[int, _GpuRows] = {}
        self._gpu_blocks: list[pb.GpuSamples] = []
        self._host: dict[str, list[int]] = {"ts_ms": []}
        self._host_cols: dict[str, list[float]] = {}
        self._host_block: dict[str, Sequence[float]] = {}  # columns given whole (add_host_block)
        self._events: list[pb.Event] = []
        self._spans: pb.SpanTable | None = None

    def __len__(self) -> int:
        """Number of rows (GPU and host) and events held."""
        return (sum(len(r["ts_ms"]) for r in self._gpu_rows.values()) + sum(len(b.ts_ms) for b in self._gpu_blocks)
                + len(self._host["ts_ms"]) + len(self._events))

    def add_gpu_row(
        self,
        gpu_index: int,
        ts_ms: int,
        values: Mapping[str, float],
        job_id: str = "",
        rank: int = -1,
        local_rank: int = -1,
    ) -> None:
        rows = self._gpu_rows.setdefault(
            gpu_index, {"ts_ms": [], "job_id": [], "rank": [], "local_rank": [], "cols": {}}
        )
        n = len(rows["ts_ms"])
        rows["ts_ms"].append(int(ts_ms))
        rows["job_id"].append(job_id)
        rows["rank"].append(int(rank))
        rows["local_rank"].append(int(local_rank))
        _append_values(rows["cols"], n, values)

    def add_gpu_block(self, gpu_index: int, ts_ms: Sequence[int], columns: Mapping[str, Sequence[float]],
                      job_id: Sequence[str], rank: Sequence[int], local_rank: Sequence[int]) -> None:
        """Many rows of one GPU at once, already columnar (replaying recordings): every sequence has one entry
        per timestamp, NaN where a field was not sampled. Do not mix with :meth:`add_gpu_row` for one GPU."""
        if gpu_index in self._gpu_rows:
            raise ValueError(f"GPU {gpu_index}: rows already added to this batch")
        block = pb.GpuSamples(gpu_index=gpu_index, ts_ms=ts_ms, job_id=job_id, rank=rank, local_rank=local_rank)
        block.MergeFromString(encoded_columns(_GPU_COLUMNS_FIELD, columns))
        self._gpu_blocks.append(block)

    def add_host_block(self, ts_ms: Sequence[int], columns: Mapping[str, Sequence[float]]) -> None:
        """Many host rows at once, already columnar (replaying recordings): every column has one entry per
        timestamp, NaN where a field was not sampled. Do not mix with :meth:`add_host_row` in one batch."""
        if self._host["ts_ms"]:
            raise ValueError("host rows already added to this batch")
        self._host["ts_ms"] = [int(t) for t in ts_ms]
        self._host_block = dict(columns)

    def add_host_row(self, ts_ms: int, values: Mapping[str, float]) -> None:
        n = len(self._host["ts_ms"])
        self._host["ts_ms"].append(int(ts_ms))
        _append_values(self._host_cols, n, values)

    def add_event(
        self,
        kind: str,
        ts_ms: int,
        gpu_index: int = -1,
        code: int = 0,
        message: str = "",
        attrs: Mapping[str, str] | None = None,
    ) -> None:
        self._events.append(
            pb.Event(ts_ms=int(ts_ms), gpu_index=gpu_index, kind=kind, code=code, message=message, attrs=attrs or {})
        )

    def add_spans(self, spans: pb.SpanTable) -> None:
        if self._spans is None:
            self._spans = pb.SpanTable()
        self._spans.MergeFrom(spans)

    def build(self, sequence: int, created_ms: int | None = None) -> pb.TelemetryBatch:
        """Emit the batch and reset the builder."""
        batch = pb.TelemetryBatch(
            schema_version=SCHEMA_VERSION,
            agent_id=self.agent_id,
            sequence=sequence,
            node=self.node,
            gpus=self.gpus,
            created_ms=created_ms if created_ms is not None else int(time.time() * 1000),
        )
        for gpu_index in sorted(self._gpu_rows):
            rows = self._gpu_rows[gpu_index]
            n = len(rows["ts_ms"])
            batch.samples.append(
                pb.GpuSamples(
                    gpu_index=gpu_index,
                    ts_ms=rows["ts_ms"],
                    job_id=rows["job_id"],
                    rank=rows["rank"],
                    local_rank=rows["local_rank"],
                    columns=[pb.Column(field=k, values=_padded(v, n)) for k, v in rows["cols"].items()],
                )
            )
        batch.samples.extend(sorted(self._gpu_blocks, key=lambda block: block.gpu_index))
        n_host = len(self._host["ts_ms"])
        if n_host:
            batch.host.ts_ms.extend(self._host["ts_ms"])
            batch.host.MergeFromString(encoded_columns(
                _HOST_COLUMNS_FIELD,
                {name: _padded(values, n_host) for name, values in (self._host_block or self._host_cols).items()}))
        batch.events.extend(self._events)
        if self._spans is not None:
            batch.spans.CopyFrom(self._spans)
        self._reset()
        return batch


class _GpuRows(TypedDict):
    """One GPU's rows added one at a time (add_gpu_row), column by column."""

    ts_ms: list[int]
    job_id: list[str]
    rank: list[int]
    local_rank: list[int]
    cols: dict[str, list[float]]


def _append_values(cols: dict[str, list[float]], row: int, values: Mapping[str, float]) -> None:
    for name, value in values.items():
        col = cols.get(name)
        if col is None:
            col = cols[name] = [NAN] * row
        elif len(col) < row:
            col.extend([NAN] * (row - len(col)))
        col.append(float(value))


def _padded(col: Sequence[float], n: int) -> Sequence[float]:
    return list(col) + [NAN] * (n - len(col)) if len(col) < n else col


_GPU_COLUMNS_FIELD = pb.GpuSamples.DESCRIPTOR.fields_by_name["columns"].number
_HOST_COLUMNS_FIELD = pb.HostSamples.DESCRIPTOR.fields_by_name["columns"].number
_COLUMN_FIELD = pb.Column.DESCRIPTOR.fields_by_name["field"].number
_VALUES_FIELD = pb.Column.DESCRIPTOR.fields_by_name["values"].number
_LENGTH_DELIMITED = 2
_PACKED_HEADS: dict[int, bytes] = {}
_COLUMN_HEADS: dict[tuple[int, str, int], bytes] = {}
_MAX_CACHED = 4096  # distinct value counts and names seen; a peer inventing new ones cannot grow memory


def encoded_columns(field_number: int, columns: Mapping[str, Sequence[float]]) -> bytes:
    """``columns`` (field name -> values) as the wire bytes of the repeated Column field ``field_number`` of the
    message holding them, exactly as protobuf's serializers write them: merging these bytes into that message
    adds the columns. Values are copied as packed float64 bytes, not one Python float at a time, and the
    bytes before each column's values are kept per (field, name, count): replaying a recording builds tens of
    thousands of columns a second, where creating Column messages one by one cost most of the replay."""
    parts: list[bytes] = []
    for name, values in columns.items():
        data = np.asarray(values, dtype="<f8").tobytes()
        key = (field_number, name, len(data) // 8)
        head = _COLUMN_HEADS.get(key)
        if head is None:
            if len(_COLUMN_HEADS) >= _MAX_CACHED:
                _COLUMN_HEADS.clear()
            encoded = name.encode()
            column_head = _tag(_COLUMN_FIELD) + _varint(len(encoded)) + encoded + packed_head(key[2])
            head = _COLUMN_HEADS[key] = (_tag(field_number) + _varint(len(column_head) + len(data))
                                         + column_head)
        parts += (head, data)
    return b"".join(parts)


def packed_head(n: int) -> bytes:
    """The wire bytes before ``n`` packed doubles in a Column (tag of ``values`` and byte length; nothing for
    none: protobuf writes no empty field), as protobuf's serializers write them."""
    head = _PACKED_HEADS.get(n)
    if head is None:
        if len(_PACKED_HEADS) >= _MAX_CACHED:
            _PACKED_HEADS.clear()
        head = _PACKED_HEADS[n] = _tag(_VALUES_FIELD) + _varint(8 * n) if n else b""
    return head


def _tag(field_number: int) -> bytes:
    return _varint(field_number << 3 | _LENGTH_DELIMITED)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


# Field-name membership is checked for every column of every batch: sets, not the catalogue's tuples.
_GPU_FIELD_SET = frozenset(fields.GPU_FIELD_NAMES)
_HOST_FIELD_SET = frozenset(fields.HOST_FIELD_NAMES)



@dataclass(frozen=True)
class TimeWindow:
    """Sample and event times a collector accepts: from ``past_days`` before its clock to ``future_days`` after.

    Wide by default (the collector command's settings): replayed recordings and simulated fleets carry old or
    accelerated times; what matters is that a wrong clock cannot store times far from everything else.
    """

    past_days: float = 3650.0
    future_days: float = 30.0

    def bounds_ms(self, now_ms: int | None = None) -> tuple[int, int]:
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        return (max(EARLIEST_MS, now_ms - int(self.past_days * DAY_MS)),
                min(LATEST_MS, now_ms + int(self.future_days * DAY_MS)))


def validate(batch: pb.TelemetryBatch, window: TimeWindow | None = None, now_ms: int | None = None) -> None:
    """Raise :class:`BatchError` naming the first thing wrong with ``batch``; return None if well-formed.

    Well-formed means storable: every index, sequence and time is within what the store keeps (times from
    1970 to 9999), and, given a ``window``, times lie within it around ``now_ms`` (default: this clock).
    """
    validate_envelope(batch, window, now_ms)
    for s in batch.samples:
        _check_columns(f"samples for GPU {s.gpu_index}", s.columns, len(s.ts_ms), _GPU_FIELD_SET)
    _check_columns("host samples", batch.host.columns, len(batch.host.ts_ms), _HOST_FIELD_SET)


def validate_envelope(batch: pb.TelemetryBatch, window: TimeWindow | None = None, now_ms: int | None = None
                      ) -> np.ndarray | None:
    """Everything :func:`validate` checks except the sample columns (field names, value counts): the bounds
    of indexes, sequences and times included. Returns every sample time (each GPU block's in order, then the
    host's) as one int64 array, read once for the check so that the collector need not read them again;
    None when the batch has no samples.

    Split out for the collector, which checks the columns while it copies them out of the batch's bytes
    (gpuwatch.core.columnar); it reads only attributes that the collector's view of a batch shares.
    """
    if batch.schema_version != SCHEMA_VERSION:
        raise BatchError(f"schema_version {batch.schema_version} is not supported "
                         f"(this collector reads {SCHEMA_VERSION})")
    if not batch.agent_id:
        raise BatchError("agent_id is empty")
    if not 1 <= batch.sequence <= MAX_SEQUENCE:
        raise BatchError(f"sequence {batch.sequence} is out of range (1..{MAX_SEQUENCE})")
    if not batch.node.node:
        raise BatchError("node.node (the node name) is empty")
    _check_names(batch)
    earliest, latest = window.bounds_ms(now_ms) if window is not None else (EARLIEST_MS, LATEST_MS)
    for g in batch.gpus:
        if g.index > MAX_GPU_INDEX:
            raise BatchError(f"gpus: GPU index {g.index} is out of range (0..{MAX_GPU_INDEX})")
        if g.memory_total_bytes > MAX_INT64:
            raise BatchError(f"gpus: GPU {g.index} memory_total_bytes {g.memory_total_bytes} is out of range "
                             f"(0..{MAX_INT64})")
    known_gpus = {g.index for g in batch.gpus}
    seen: set[int] = set()
    for s in batch.samples:  # the collector checks every block of every batch: the names are built on failure only
        index, n = s.gpu_index, len(s.ts_ms)
        if (index > MAX_GPU_INDEX or (known_gpus and index not in known_gpus) or index in seen
                or len(s.job_id) not in (0, n) or len(s.rank) not in (0, n) or len(s.local_rank) not in (0, n)):
            _block_error(s, known_gpus, seen)
        seen.add(index)
    sample_times = _check_sample_times(batch, earliest, latest)
    for e in batch.events:
        if not e.kind:
            raise BatchError("an event has an empty kind")
        if e.gpu_index < -1:
            raise BatchError(f"event {e.kind!r}: gpu_index {e.gpu_index} is neither a GPU nor -1 (node-wide)")
    _check_times("events", [e.ts_ms for e in batch.events], earliest, latest)
    if not batch.HasField("spans"):  # most batches carry none: skip reading its thirteen columns
        return sample_times
    spans = batch.spans
    lengths = {name: len(getattr(spans, name)) for name in SPAN_COLUMN_NAMES}
    n_spans = lengths["start_us"]
    bad = [name for name, n in lengths.items() if n not in (0, n_spans)]
    if bad:
        raise BatchError(f"spans: columns {', '.join(bad)} do not have {n_spans} entries like start_us")
    if n_spans:
        import numpy as np  # here, not at the top: the agent builds batches and never loads numpy for it

        start_us = np.asarray(batch.spans.start_us, dtype=np.float64)
        dur_us = np.asarray(batch.spans.dur_us, dtype=np.float64)
        if not (np.isfinite(start_us).all() and np.isfinite(dur_us).all()):
            raise BatchError("spans: start_us and dur_us must be finite numbers")
        _check_times("spans", [int(start_us.min() // 1000), int(start_us.max() // 1000)], earliest, latest)
    return sample_times


def _check_names(batch: pb.TelemetryBatch) -> None:
    """Refuse names over MAX_NAME_CHARS, more than MAX_PAIRS labels or attributes, more than MAX_GPUS_PER_BATCH
    GPUs (the counts first: they bound the work below). The samples' job ids (one per row: reading them here
    cost more than the rest of the checks) are checked where the store's writer reads them anyway
    (:func:`check_name_lengths`)."""
    if len(batch.gpus) > MAX_GPUS_PER_BATCH or len(batch.samples) > MAX_GPUS_PER_BATCH:
        raise BatchError(f"{max(len(batch.gpus), len(batch.samples))} GPUs in one batch: at most "
                         f"{MAX_GPUS_PER_BATCH} per node")
    if len(batch.node.labels) > MAX_PAIRS:
        raise BatchError(f"node.labels: {len(batch.node.labels)} labels, at most {MAX_PAIRS}")
    # what is named only on failure: the collector checks every batch, most hold a few dozen short names
    groups: list[tuple[str | pb.Event, Sequence[str] | Mapping[str, str]]] = [
        ("agent_id", (batch.agent_id,)), ("node.node", (batch.node.node,)), ("node.labels keys", batch.node.labels),
        ("gpus uuid", [g.uuid for g in batch.gpus]), ("event kind", [e.kind for e in batch.events])]
    for e in batch.events:
        if e.attrs:
            if len(e.attrs) > MAX_PAIRS:
                raise BatchError(f"event {e.kind[:MAX_NAME_CHARS]!r}: {len(e.attrs)} attributes, at most {MAX_PAIRS}")
            groups.append((e, e.attrs))
    if batch.HasField("spans"):
        spans = batch.spans
        groups += [(f"spans {name}", getattr(spans, name)) for name in ("job_id", "kind", "process_group", "node")]
    for where, names in groups:
        longest = max(map(len, names), default=0)
        if longest > MAX_NAME_CHARS:
            check_name_lengths(where if isinstance(where, str) else
                               f"event {where.kind[:MAX_NAME_CHARS]!r} attribute keys", longest)


def check_name_lengths(where: str, lengths_max: int | None) -> None:
    """BatchError when the longest of a column of names (``lengths_max`` characters) is over MAX_NAME_CHARS."""
    if lengths_max is not None and lengths_max > MAX_NAME_CHARS:
        raise BatchError(f"{where}: a name of {lengths_max} characters (at most {MAX_NAME_CHARS})")


def cut_free_text(batch: pb.TelemetryBatch) -> None:
    """Cut free text (event messages, attribute and label values, GPU model and span names) to MAX_TEXT_CHARS
    in place, so a runaway message is kept in part rather than refusing the batch's telemetry with it."""
    def cut(text: str) -> str:
        return text[:MAX_TEXT_CHARS - 1] + "…"

    for e in batch.events:
        if len(e.message) > MAX_TEXT_CHARS:
            e.message = cut(e.message)
        for key in [k for k, v in e.attrs.items() if len(v) > MAX_TEXT_CHARS]:
            e.attrs[key] = cut(e.attrs[key])
    for key in [k for k, v in batch.node.labels.items() if len(v) > MAX_TEXT_CHARS]:
        batch.node.labels[key] = cut(batch.node.labels[key])
    for g in batch.gpus:
        if len(g.name) > MAX_TEXT_CHARS:
            g.name = cut(g.name)
    if batch.HasField("spans") and max(map(len, batch.spans.name), default=0) > MAX_TEXT_CHARS:
        batch.spans.name[:] = [cut(n) if len(n) > MAX_TEXT_CHARS else n for n in batch.spans.name]


def _block_error(s: pb.GpuSamples, known_gpus: set[int], seen: set[int]) -> None:
    """Raise the BatchError that names what is wrong with the sample block ``s``."""
    where = f"samples for GPU {s.gpu_index}"
    if s.gpu_index > MAX_GPU_INDEX:
        raise BatchError(f"{where}: GPU index is out of range (0..{MAX_GPU_INDEX})")
    if known_gpus and s.gpu_index not in known_gpus:
        raise BatchError(f"{where}: GPU index not in the batch's gpus inventory")
    if s.gpu_index in seen:
        raise BatchError(f"{where}: GPU appears twice")
    n = len(s.ts_ms)
    for name, col in (("job_id", s.job_id), ("rank", s.rank), ("local_rank", s.local_rank)):
        if len(col) not in (0, n):
            raise BatchError(f"{where}: {name} has {len(col)} entries for {n} timestamps")


def _check_sample_times(batch: pb.TelemetryBatch, earliest: int, latest: int) -> np.ndarray | None:
    """Every sample time in bounds: one vectorised pass over all of them, per block only to name a culprit.
    Returns them (GPU blocks, then host) as one int64 array, None when there are none."""
    samples = batch.samples
    blocks = [s.ts_ms for s in samples] + [batch.host.ts_ms]
    total = sum(map(len, blocks))
    if not total:
        return None
    import numpy as np  # here, not at the top: the agent builds batches and never loads numpy for it

    every = np.fromiter(itertools.chain.from_iterable(blocks), np.int64, total)
    if every.min() < earliest or every.max() > latest:  # name the block (only now: most batches are fine)
        names = [f"samples for GPU {s.gpu_index}" for s in samples] + ["host samples"]
        for where, ts in zip(names, blocks):
            _check_times(where, ts, earliest, latest)
    return every


def _check_times(where: str, ts_ms: Sequence[int], earliest: int, latest: int) -> None:
    if not len(ts_ms):
        return
    low, high = min(ts_ms), max(ts_ms)
    bad = low if low < earliest else high if high > latest else None
    if bad is not None:
        raise BatchError(f"{where}: timestamp {bad} ms is outside the accepted times "
                         f"{_iso(earliest)} .. {_iso(latest)}")


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms // 1000))


def _check_columns(where: str, columns: Iterable[pb.Column], n: int, allowed: frozenset[str]) -> None:
    names: set[str] = set()
    for col in columns:
        if col.field not in allowed:
            raise BatchError(f"{where}: unknown field {col.field!r}")
        if col.field in names:
            raise BatchError(f"{where}: field {col.field!r} appears twice")
        names.add(col.field)
        if len(col.values) != n:
            raise BatchError(f"{where}: field {col.field!r} has {len(col.values)} values for {n} timestamps")
