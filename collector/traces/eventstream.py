"""Read a Chrome-trace JSON file (plain or gzip) as a stream of event chunks, in bounded memory.

Profiler traces reach gigabytes; parsing one whole document builds millions of dicts at once (the memory
wall HolisticTraceAnalysis hits). Here the `traceEvents` array is cut into blocks at an element boundary
and each block is parsed with orjson on its own, so only one block of dicts is alive at a time.

A cut candidate is a `}` followed by `,` (or by the closing `]`). A cut inside a nested object or a
string cannot make `[` + block + `]` valid JSON, so a block that parses is exactly a run of whole events;
a block that does not parse is retried with an earlier candidate or grown with the next read.
"""
from __future__ import annotations

import gzip
import re
import zlib
from collections.abc import Callable, Iterator
from typing import BinaryIO

import orjson

from gpuwatch.errors import UserError

BLOCK_BYTES = 4 << 20
_ARRAY_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_HEAD_LIMIT = 256 << 20
_CUT_TRIES = 64


class TraceEventStream:
    """Iterate over lists of event dicts; after the iteration `meta` holds the other top-level keys."""

    def __init__(self, path: str, *, block_bytes: int = BLOCK_BYTES,
                 progress: Callable[[int], None] | None = None) -> None:
        self.path = path
        self.block_bytes = block_bytes
        self.progress = progress
        self.meta: dict = {}
        self.bytes_read = 0

    def __iter__(self) -> Iterator[list[dict]]:
        try:
            with _open(self.path) as f:
                yield from self._events(f)
        except (OSError, EOFError, zlib.error) as exc:
            raise UserError(f"{self.path}: cannot read the trace ({exc})") from None

    def _read(self, f: BinaryIO) -> bytes:
        data = f.read(self.block_bytes)
        self.bytes_read += len(data)
        if self.progress is not None and data:
            self.progress(self.bytes_read)
        return data

    def _events(self, f: BinaryIO) -> Iterator[list[dict]]:
        data, start = self._find_array(f)
        pending = data[start:]
        while True:
            block = self._read(f)
            if not block:
                break
            pending += block
            events, pending = self._cut(pending)
            if events:
                yield events
        events, tail = self._finish(pending)
        if events:
            yield events
        self.meta.update(_parse_tail(self.path, tail))

    def _find_array(self, f: BinaryIO) -> tuple[bytes, int]:
        """Read until the start of the events array; parse the keys before it into `meta`."""
        data = b""
        while True:
            block = self._read(f)
            data += block
            stripped = data.lstrip()
            if stripped.startswith(b"["):  # the bare "JSON Array Format" of Chrome traces
                return data, len(data) - len(stripped) + 1
            match = _ARRAY_KEY.search(data)
            if match:
                self.meta.update(_parse_head(self.path, data[: match.start()]))
                return data, match.end()
            if not block or len(data) > _HEAD_LIMIT:
                raise UserError(f"{self.path}: not a Chrome/Kineto trace (no traceEvents array found)")

    def _cut(self, pending: bytes) -> tuple[list[dict], bytes]:
        """Parse the longest run of whole events at the front of `pending`; return it and the rest."""
        end = len(pending)
        for _ in range(_CUT_TRIES):
            cut = pending.rfind(b"}", 0, end)
            if cut < 0:
                break
            after = pending[cut + 1: cut + 65].lstrip()
            end = cut
            if not after.startswith(b","):
                continue
            try:
                events = orjson.loads(b"[" + pending[: cut + 1] + b"]")
            except orjson.JSONDecodeError:
                continue
            rest = pending[cut + 1:].lstrip()
            return events, rest[1:]
        return [], pending

    def _finish(self, pending: bytes) -> tuple[list[dict], bytes]:
        """At end of file: the rest of the events up to the array's `]`, and what follows it."""
        stripped = pending.lstrip()
        if stripped.startswith(b"]"):
            return [], stripped[1:]
        for match in re.finditer(rb"\}\s*\]", pending):
            try:
                events = orjson.loads(b"[" + pending[: match.start() + 1] + b"]")
            except orjson.JSONDecodeError:
                continue
            return events, pending[match.end():]
        raise UserError(
            f"{self.path}: truncated or invalid JSON: the traceEvents array does not end "
            f"(read {self.bytes_read} bytes)"
        )


def _open(path: str) -> BinaryIO:
    with open(path, "rb") as probe:
        magic = probe.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


def _parse_head(path: str, head: bytes) -> dict:
    text = head.rstrip().rstrip(b",")
    try:
        return orjson.loads(text + b"}") if text.strip() != b"{" else {}
    except orjson.JSONDecodeError:
        raise UserError(f"{path}: invalid JSON before the traceEvents array") from None


def _parse_tail(path: str, tail: bytes) -> dict:
    text = tail.strip()
    if text in (b"", b"}"):
        return {}
    if not text.startswith(b","):
        raise UserError(f"{path}: invalid JSON after the traceEvents array")
    try:
        meta = orjson.loads(b"{" + text[1:])
    except orjson.JSONDecodeError:
        raise UserError(f"{path}: truncated or invalid JSON after the traceEvents array") from None
    return meta if isinstance(meta, dict) else {}
