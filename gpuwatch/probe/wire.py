"""Datagram encoding between the probe and the agent: compact JSON, stdlib only.

One datagram = {"v": 1, "job": str, "rank": int, "ws": int, "node": str, "rows": [[...], ...]} where each row
lists ROW_FIELDS in order. Rows are packed greedily into datagrams no larger than `max_bytes`.
"""
from __future__ import annotations

import json
from typing import Any, NamedTuple

WIRE_VERSION = 1
DEFAULT_MAX_DATAGRAM = 32 * 1024  # well under Linux's AF_UNIX datagram limit (net.core.wmem_default)


class SpanRow(NamedTuple):
    """One span as the probe records it; the identity columns of SpanTable travel in the datagram header.
    dur_us == -1 marks an op that started `start_us` and had not completed when it was reported."""

    step: int
    kind: str
    name: str
    start_us: float
    dur_us: float
    process_group: str
    seq: int
    bytes: int
    peer: int


ROW_FIELDS = SpanRow._fields
_ROW_TYPES: tuple[type | tuple[type, ...], ...] = (int, str, str, (int, float), (int, float), str, int, int, int)


def _encode(header: dict[str, Any], rows: list) -> bytes:
    return json.dumps({**header, "rows": rows}, separators=(",", ":")).encode()


def encode_datagrams(header: dict[str, Any], rows: list[SpanRow],
                     max_bytes: int = DEFAULT_MAX_DATAGRAM) -> list[tuple[bytes, int]]:
    """(datagram, row count) pairs, each datagram at most max_bytes (a single oversized row is left out)."""
    header = {"v": WIRE_VERSION, **header}
    out: list[tuple[bytes, int]] = []
    pending = [rows]
    while pending:
        chunk = pending.pop()
        if not chunk:
            continue
        data = _encode(header, chunk)
        if len(data) <= max_bytes:
            out.append((data, len(chunk)))
        elif len(chunk) > 1:
            half = len(chunk) // 2
            pending.extend((chunk[half:], chunk[:half]))
    return out


def decode_datagram(data: bytes) -> tuple[dict[str, Any], list[SpanRow]]:
    """Header and rows of one datagram; ValueError naming the problem when it is not a valid probe datagram."""
    try:
        message = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(message, dict) or message.get("v") != WIRE_VERSION:
        raise ValueError(f"not a version-{WIRE_VERSION} probe datagram")
    header = {key: message.get(key) for key in ("job", "rank", "ws", "node")}
    if not (isinstance(header["job"], str) and isinstance(header["node"], str)
            and isinstance(header["rank"], int) and isinstance(header["ws"], int)):
        raise ValueError("header needs job (str), rank (int), ws (int), node (str)")
    raw_rows = message.get("rows")
    if not isinstance(raw_rows, list):
        raise ValueError("rows missing")
    rows = []
    for index, raw in enumerate(raw_rows):
        if not (isinstance(raw, list) and len(raw) == len(ROW_FIELDS)
                and all(isinstance(v, t) and not isinstance(v, bool) for v, t in zip(raw, _ROW_TYPES))):
            raise ValueError(f"row {index} does not match {ROW_FIELDS}")
        rows.append(SpanRow(*raw))
    return header, rows
