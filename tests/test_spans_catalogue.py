"""The span catalogue (gpuwatch.core.spans) is the one list of span columns: the generated wire message, the
recording schema and both stores' tables must hold exactly its columns, in its order, with its types."""
import re

from google.protobuf.descriptor import FieldDescriptor

from gpuwatch.collector.store.clickhouse import _ddl
from gpuwatch.collector.store import open_store
from gpuwatch.core.recording import SCHEMAS
from gpuwatch.core.spans import SPAN_COLUMN_NAMES, SPAN_COLUMNS, TYPES, span_arrow_schema
from gpuwatch.v1 import telemetry_pb2 as pb

_PROTO_TYPES = {FieldDescriptor.TYPE_STRING: "string", FieldDescriptor.TYPE_INT32: "int32",
                FieldDescriptor.TYPE_INT64: "int64", FieldDescriptor.TYPE_DOUBLE: "double"}


def test_the_wire_message_matches_the_catalogue():
    fields = pb.SpanTable.DESCRIPTOR.fields
    assert [f.name for f in fields] == list(SPAN_COLUMN_NAMES)
    assert [_PROTO_TYPES.get(f.type) for f in fields] == [c.type for c in SPAN_COLUMNS]
    assert all(f.is_repeated for f in fields)  # columns, one value per span


def test_every_column_has_a_known_type_and_an_unset_value_of_that_type():
    for c in SPAN_COLUMNS:
        assert c.type in TYPES
        assert isinstance(c.unset, str) == c.is_text, c.name


def test_recordings_and_stores_hold_the_catalogue_columns(tmp_path):
    assert SCHEMAS["spans"] == span_arrow_schema()
    store = open_store(str(tmp_path / "s.duckdb"))
    try:
        stored = store.spans()
    finally:
        store.close()
    assert list(stored.columns) == [*SPAN_COLUMN_NAMES, "ts"]
    columns, _ = _ddl(None)["spans"]
    declared = re.findall(r"(?:^|, )(\w+) (?=[A-Z])", columns)  # "name Type" (codecs read "ZSTD(1)")
    assert declared == [*SPAN_COLUMN_NAMES, "ts"]
