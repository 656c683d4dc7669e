"""A telemetry batch's bytes -> a checked batch with its sample values as numpy matrices, in one pass.

The collector decodes every batch it receives; at thousands of agents that is the hottest Python code in
the process. Reading a batch through ``pb.TelemetryBatch`` costs one Python object per column (8 GPUs x
46 fields), once to check it and again to copy its values. Instead the bytes are parsed as
``TelemetryBatchView`` (gpuwatch/v1/ingest_view.proto: the same wire format with each Column left as its
bytes), and the field names and packed doubles are sliced out of those bytes in bulk: a column encoded as
protobuf serializers write it (name, then the packed values) is ``0a <len> name 12 <varint 8n> <8n bytes>``.
Any other valid encoding (unpacked doubles, fields out of order, unknown fields) takes the plain
protobuf path, so every well-formed batch is read, only more slowly. The rules are gpuwatch.core.batches'
:func:`validate`, with the same error messages.

An agent sends the same shape of batch again and again (the same GPUs, fields and ticks), so once a shape
(rows per block, and the length of every column) has been read and checked column by column, it is kept as a
:class:`_Plan`: which bytes of the columns, joined, must equal those seen then (tags, names, lengths) and
which bytes are the values. A later batch of that shape is then read with one comparison and one gather over
all its columns at once, and falls back to the column-by-column path if a single checked byte differs.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from gpuwatch.core import fields
from gpuwatch.core.batches import BatchError, TimeWindow, cut_free_text, packed_head, validate, validate_envelope
from gpuwatch.v1 import ingest_view_pb2 as view
from gpuwatch.v1 import telemetry_pb2 as pb

_GPU_FIELDS = fields.GPU_FIELD_NAMES
_HOST_FIELDS = fields.HOST_FIELD_NAMES


@dataclass(frozen=True, eq=False)
class ColumnarBatch:
    """A validated batch: ``message`` for everything but the values, which are in the two matrices, and the
    sample times, which validation read once (so the store's writer never reads them from the message).

    ``gpu_values`` has one row per GPU sample (the samples' ``ts_ms`` in order) and one column per
    gpuwatch.core.fields GPU field; ``host_values`` likewise for host samples. NaN: not sent, or not a finite
    number (±inf is not a reading: it is stored as missing, so queries and ``--json`` never print it).
    ``sample_ts``: the time (epoch ms) of every GPU sample row, then of every host sample row.
    """

    message: view.TelemetryBatchView | pb.TelemetryBatch
    gpu_values: np.ndarray
    host_values: np.ndarray
    sample_ts: np.ndarray

    @property
    def agent_id(self) -> str:
        return self.message.agent_id

    @property
    def sequence(self) -> int:
        return self.message.sequence

    @property
    def gpu_ts(self) -> np.ndarray:
        """The time (epoch ms) of every GPU sample row, in ``gpu_values`` order."""
        return self.sample_ts[:len(self.gpu_values)]

    @property
    def host_ts(self) -> np.ndarray:
        """The time (epoch ms) of every host sample row, in ``host_values`` order."""
        return self.sample_ts[len(self.gpu_values):]

    @cached_property
    def fingerprint(self) -> str:
        """Node, row and event counts and the first and last sample time: the same for a resend (or a rebuild
        of the same data), different for another agent's batch under the same (agent id, sequence). Kept once
        computed: the writer's duplicate check and its ``ingested`` row both need it."""
        message, sample_ts = self.message, self.sample_ts
        rows, host_rows = len(self.gpu_values), len(self.host_values)
        # the first and last time of the sample blocks, 0 for an empty block and for no host samples (the
        # fingerprint's definition since it was first stored: it must not change), the first event and span
        times = [int(sample_ts.min()), int(sample_ts.max())] if len(sample_ts) else []
        if not host_rows or 0 in [len(s.ts_ms) for s in message.samples]:
            times.append(0)
        times += [min((e.ts_ms for e in message.events), default=0), min(message.spans.start_us, default=0)]
        return (f"{message.node.node}|{rows}|{host_rows}|{len(message.events)}|"
                f"{len(message.spans.start_us)}|{min(times)}|{max(times)}")


class _Layouts:
    """Column order -> positions in the field catalogue, learnt once per distinct order (agents repeat theirs)."""

    _MAX = 4096  # distinct orders kept; a client inventing new ones cannot grow memory without bound

    def __init__(self, names: Sequence[str]) -> None:
        self._index = {name.encode(): i for i, name in enumerate(names)}
        self._known: dict[tuple[bytes, ...], np.ndarray | None] = {}

    def positions(self, heads: tuple[bytes, ...], where: str) -> np.ndarray | None:
        """Catalogue positions of the columns whose encoded heads (``0a <len> name``) are ``heads``;
        None when a head is not in the canonical form; BatchError for an unknown or repeated field."""
        if heads in self._known:
            return self._known[heads]
        if len(self._known) >= self._MAX:
            self._known.clear()
        positions = np.empty(len(heads), np.intp)
        seen: set[bytes] = set()
        for i, head in enumerate(heads):
            if head[:1] != b"\x0a" or head[1] >= 0x80 or len(head) != 2 + head[1]:
                self._known[heads] = None  # not canonical: the protobuf path reads (and checks) it
                return None
            name = head[2:]
            if name not in self._index:
                raise BatchError(f"{where}: unknown field {name.decode('utf-8', 'replace')!r}")
            if name in seen:
                raise BatchError(f"{where}: field {name.decode('utf-8', 'replace')!r} appears twice")
            seen.add(name)
            positions[i] = self._index[name]
        self._known[heads] = positions
        return positions


_GPU_LAYOUTS = _Layouts(_GPU_FIELDS)
_HOST_LAYOUTS = _Layouts(_HOST_FIELDS)


def _fill(out: np.ndarray, row: int, columns: Sequence[bytes], n: int, layouts: _Layouts, where: str
          ) -> np.ndarray | None:
    """Write one block's columns into ``out[row:row + n]`` and return their catalogue positions; None when
    they are not in the canonical form."""
    if not columns:
        return np.empty(0, np.intp)
    try:
        heads = tuple([c[:2 + c[1]] for c in columns])
    except IndexError:  # a column shorter than two bytes
        return None
    positions = layouts.positions(heads, where)
    if positions is None:
        return None
    head = packed_head(n)
    width = len(head) + 8 * n
    body = b"".join([c[2 + c[1]:] for c in columns])
    if len(body) != width * len(columns):
        return None  # a column with another number of values (or another encoding): the slow path says which
    cells = np.frombuffer(body, np.uint8).reshape(len(columns), width)
    if head and not (cells[:, :len(head)] == np.frombuffer(head, np.uint8)).all():
        return None
    values = cells[:, len(head):].copy().view("<f8")  # (columns, n)
    out[row:row + n, positions] = values.T
    return positions


def _finite(values: np.ndarray) -> np.ndarray:
    """``values`` with ±inf replaced by NaN (in place, one pass over the whole matrix)."""
    values[np.isinf(values)] = np.nan
    return values


class _Plan:
    """How to read every batch of one shape: the checked bytes of its joined columns and where its values go."""

    def __init__(self, blocks: Sequence[Sequence[bytes]], rows: Sequence[int], positions: Sequence[np.ndarray]
                 ) -> None:
        """``blocks``: the columns of each GPU block then of the host block, as read by the checked path;
        ``rows``: each block's row count; ``positions``: each block's catalogue position per column."""
        check: list[np.ndarray] = []
        starts: list[np.ndarray] = []
        gpu_cells: list[np.ndarray] = []
        host_cells: list[np.ndarray] = []
        offset, gpu_row = 0, 0
        last = len(blocks) - 1
        for b, (columns, n, where) in enumerate(zip(blocks, rows, positions)):
            prefix = len(packed_head(n))
            for column, position in zip(columns, where):
                data_at = offset + 2 + column[1] + prefix
                check.append(np.arange(offset, data_at))
                starts.append(data_at + 8 * np.arange(n))
                if b == last:
                    host_cells.append(np.arange(n) * len(_HOST_FIELDS) + position)
                else:
                    gpu_cells.append((gpu_row + np.arange(n)) * len(_GPU_FIELDS) + position)
                offset += len(column)
            if b != last:
                gpu_row += n
        self.length = offset
        check_at = np.concatenate(check) if check else np.empty(0, np.intp)
        # the checked bytes as they must be, and 0xff at exactly those positions: a batch of this shape has
        # ((bytes ^ expected) & checked) all zero, one pass over the joined columns with no gather
        self.checked = np.zeros(offset, np.uint8)
        self.checked[check_at] = 0xFF
        self.expected = np.frombuffer(b"".join(itertools.chain.from_iterable(blocks)), np.uint8) & self.checked
        value_starts = np.concatenate(starts) if starts else np.empty(0, np.intp)
        self.value_bytes = (value_starts[:, None] + np.arange(8)).ravel()
        self.gpu_cells = np.concatenate(gpu_cells) if gpu_cells else np.empty(0, np.intp)
        self.host_cells = np.concatenate(host_cells) if host_cells else np.empty(0, np.intp)
        self.gpu_shape = (gpu_row, len(_GPU_FIELDS))
        self.host_shape = (rows[-1], len(_HOST_FIELDS))

    def read(self, joined: bytes) -> tuple[np.ndarray, np.ndarray] | None:
        """The GPU and host value matrices (NaN where not sent), or None when ``joined`` is not of this shape."""
        raw = np.frombuffer(joined, np.uint8)
        if len(raw) != self.length or ((raw ^ self.expected) & self.checked).any():
            return None
        values = raw[self.value_bytes].view("<f8")
        gpu = np.full(self.gpu_shape[0] * self.gpu_shape[1], np.nan)
        gpu[self.gpu_cells] = values[:len(self.gpu_cells)]
        host = np.full(self.host_shape[0] * self.host_shape[1], np.nan)
        host[self.host_cells] = values[len(self.gpu_cells):]
        return gpu.reshape(self.gpu_shape), host.reshape(self.host_shape)


_Shape = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # rows, columns per block, values per column


class _Plans:
    """Plans by batch shape; bounded, so a client inventing new shapes cannot grow memory without bound."""

    _MAX = 1024

    def __init__(self) -> None:
        self._plans: dict[_Shape, _Plan] = {}

    def get(self, shape: _Shape) -> _Plan | None:
        return self._plans.get(shape)

    def learn(self, shape: _Shape, plan: _Plan) -> None:
        if len(self._plans) >= self._MAX:
            self._plans.clear()
        self._plans[shape] = plan


_PLANS = _Plans()


def decode(raw: bytes, window: TimeWindow | None = None) -> ColumnarBatch:
    """Parse and check one batch's bytes (times within ``window`` when given). Raises google.protobuf
    DecodeError (not a TelemetryBatch) or BatchError (breaks the contract of gpuwatch.core.batches.validate)."""
    batch = view.TelemetryBatchView.FromString(raw)
    times = _times(validate_envelope(batch, window))
    cut_free_text(batch)
    samples = batch.samples
    rows = [len(s.ts_ms) for s in samples] + [len(batch.host.ts_ms)]
    blocks = [s.columns[:] for s in samples] + [batch.host.columns[:]]  # a slice: one list, made in C
    columns = list(itertools.chain.from_iterable(blocks))
    shape = (tuple(rows), tuple(map(len, blocks)), tuple(map(len, columns)))
    plan = _PLANS.get(shape)
    if plan is not None:
        values = plan.read(b"".join(columns))
        if values is not None:
            return ColumnarBatch(batch, _finite(values[0]), _finite(values[1]), times)
    gpu_values = np.full((sum(rows[:-1]), len(_GPU_FIELDS)), np.nan)
    positions = []
    row = 0
    for s, n in zip(samples, rows):
        where = _fill(gpu_values, row, s.columns, n, _GPU_LAYOUTS, f"samples for GPU {s.gpu_index}")
        if where is None:
            return from_message(pb.TelemetryBatch.FromString(raw), window)
        positions.append(where)
        row += n
    host_values = np.full((rows[-1], len(_HOST_FIELDS)), np.nan)
    where = _fill(host_values, 0, batch.host.columns, rows[-1], _HOST_LAYOUTS, "host samples")
    if where is None:
        return from_message(pb.TelemetryBatch.FromString(raw), window)
    positions.append(where)
    _PLANS.learn(shape, _Plan(blocks, rows, positions))
    return ColumnarBatch(batch, _finite(gpu_values), _finite(host_values), times)


def from_message(batch: pb.TelemetryBatch, window: TimeWindow | None = None) -> ColumnarBatch:
    """Check a batch message and copy its values column by column (tools and tests that hold messages,
    and batches whose columns are not in the canonical encoding)."""
    validate(batch, window)
    cut_free_text(batch)
    counts = [len(s.ts_ms) for s in batch.samples]
    times = np.fromiter(itertools.chain(*[s.ts_ms for s in batch.samples], batch.host.ts_ms), np.int64)
    gpu_values = np.full((sum(counts), len(_GPU_FIELDS)), np.nan)
    gpu_index = {name: i for i, name in enumerate(_GPU_FIELDS)}
    row = 0
    for s, n in zip(batch.samples, counts):
        for c in s.columns:
            gpu_values[row:row + n, gpu_index[c.field]] = c.values
        row += n
    host_values = np.full((len(batch.host.ts_ms), len(_HOST_FIELDS)), np.nan)
    host_index = {name: i for i, name in enumerate(_HOST_FIELDS)}
    for c in batch.host.columns:
        host_values[:, host_index[c.field]] = c.values
    return ColumnarBatch(batch, _finite(gpu_values), _finite(host_values), times)


def _times(sample_times: np.ndarray | None) -> np.ndarray:
    """The sample times validation returned, as an (empty) array also for a batch without samples."""
    return np.empty(0, np.int64) if sample_times is None else sample_times
