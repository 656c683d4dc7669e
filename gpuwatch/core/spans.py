"""The catalogue of op-level span columns: what the in-process probe records per operation of a rank.

One list that the wire message (``SpanTable`` in proto/gpuwatch/v1/telemetry.proto, generated code, checked
against this list by tests/test_spans_catalogue.py), the batch checks, the recording format, the collector
stores, the live job view and the span-table trace reader all read, so a span column is named, typed and
given its "not set" value exactly once. Columns are parallel arrays of one length; a batch may leave a whole
column empty, which means every row has the column's ``unset`` value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa

#: Column types, as the wire message declares them (proto scalar types).
TYPES = ("string", "int32", "int64", "double")


@dataclass(frozen=True)
class SpanColumn:
    name: str
    type: str  # one of TYPES
    unset: str | int | float  # the value of a row that does not say (a batch left the column empty)
    help: str

    @property
    def is_text(self) -> bool:
        return self.type == "string"


SPAN_COLUMNS: tuple[SpanColumn, ...] = (
    SpanColumn("job_id", "string", "", "Job the rank belongs to (the probe's job label)."),
    SpanColumn("rank", "int32", -1, "Global rank of the process that recorded the span."),
    SpanColumn("step", "int64", -1, "Training step the span belongs to; -1 unknown."),
    SpanColumn("kind", "string", "", 'What ran: "step", "compute", "collective", "p2p", "memcpy", "end", ...'),
    SpanColumn("name", "string", "", 'Operation name: "all_reduce", "send", ...'),
    SpanColumn("start_us", "double", float("nan"), "Start, epoch microseconds."),
    SpanColumn("dur_us", "double", float("nan"), "Duration in microseconds; -1 for an op still running."),
    SpanColumn("process_group", "string", "", "Process group of a collective or p2p op."),
    SpanColumn("seq", "int64", -1, "Sequence number of the op within its process group; -1 unknown."),
    SpanColumn("bytes", "int64", -1, "Bytes the op moved; -1 unknown."),
    SpanColumn("world_size", "int32", -1, "Ranks in the job; -1 unknown."),
    SpanColumn("node", "string", "", "Host the rank runs on."),
    SpanColumn("peer", "int32", -1, "Peer rank of a p2p op; -1 if not p2p."),
)

SPAN_COLUMN_NAMES: tuple[str, ...] = tuple(c.name for c in SPAN_COLUMNS)
TEXT_SPAN_COLUMNS: frozenset[str] = frozenset(c.name for c in SPAN_COLUMNS if c.is_text)
SPAN_UNSET: dict[str, str | int | float] = {c.name: c.unset for c in SPAN_COLUMNS}


def span_arrow_schema() -> pa.Schema:
    """The span columns as an Arrow schema (recordings, the store's inserts). pyarrow is imported here, on
    use: the agent builds span batches without it."""
    import pyarrow as pa

    types = {"string": pa.string(), "int32": pa.int32(), "int64": pa.int64(), "double": pa.float64()}
    return pa.schema([(c.name, types[c.type]) for c in SPAN_COLUMNS])
