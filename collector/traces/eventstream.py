"""Read a Chrome-trace JSON file (plain or gzip) as a stream of event chunks, in bounded memory.

Profiler traces reach gigabytes; parsing one whole document builds millions of dicts at once (the memory
wall HolisticTraceAnalysis hits). Here the `traceEvents` array is cut into blocks at an element boundary
and each block is parsed with orjson on its own, so only one block of dicts is alive at a time.

A cut candidate is a `}` followed by `,` (or by the closing `]`). A cut inside a nested object or a
string cannot make `[` + block + `]` valid JSON, so a block that parses is exactly a run of whole events;
a block that does not parse is retried with an earlier candidate or grown with the next read.

Most of a profiler trace is events a reader does not need (CPU ops, flow arrows). With an `EventFilter`,
each block is split at the separator between events and the pieces whose category and name the filter
does not want are dropped as bytes, before any parsing: only the rest becomes dicts. A piece is dropped
only when it holds exactly one `"cat"` and one `"name"` key, so a split that fell inside an event (a nested
list of objects, a string) either keeps the piece or leaves text that does not parse, and then the block
is parsed whole.
"""
from __future__ import annotations

import gzip
import itertools
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import orjson

from gpuwatch.errors import UserError

BLOCK_BYTES = 4 << 20
_ARRAY_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_HEAD_LIMIT = 256 << 20
_CUT_TRIES = 64
# How the writer separated events (`},\n  {` for Kineto), learnt from the most common spelling early on.
_SEPARATOR = re.compile(rb"\}\s*,\s*\{")
_SNIFF_BYTES = 1 << 16


@dataclass(frozen=True)
class EventFilter:
    """Which events a reader needs: those whose `cat` is one of `categories`, and those whose `name` starts
    with one of `name_prefixes`. A filter may keep more than that (the reader still checks each event).

    `select` decides for all events of a block at once, with numpy over the positions of the `"cat"` and
    `"name"` keys, so that dropping an event costs no Python call of its own."""

    categories: tuple[bytes, ...]
    name_prefixes: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, categories: Iterable[str], name_prefixes: Iterable[str] = ()) -> "EventFilter":
        return cls(tuple(c.encode() + b'"' for c in categories), tuple(n.encode() for n in name_prefixes))

    def select(self, block: bytes, separator: bytes) -> bytes | None:
        """`[...]` of the wanted events of a block of whole events (`{...}` `separator` `{...}` ...); None
        when the block plainly does not end with a whole event (its last piece is unbalanced)."""
        body = block.strip()[1:-1]
        pieces = body.split(separator)
        if not _balanced(pieces[-1]):
            return None
        lengths = np.fromiter(map(len, pieces), np.int64, len(pieces)) + len(separator)
        starts = np.concatenate(([0], np.cumsum(lengths[:-1])))
        data = np.frombuffer(body, np.uint8)
        drop = _droppable(data, *_only_key(pieces, starts, b'"cat"'), self.categories)
        drop &= _droppable(data, *_only_key(pieces, starts, b'"name"'), self.name_prefixes)
        kept = list(itertools.compress(pieces, (~drop).tolist()))
        return b"[{" + separator.join(kept) + b"}]" if kept else b"[]"


def _only_key(pieces: list[bytes], starts: np.ndarray, key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Per piece: the offset in the block just after `key`, and whether the key occurs exactly once."""
    count = len(pieces)
    first = np.fromiter(map(bytes.find, pieces, itertools.repeat(key, count)), np.int64, count)
    last = np.fromiter(map(bytes.rfind, pieces, itertools.repeat(key, count)), np.int64, count)
    return starts + first + len(key), (first >= 0) & (first == last)


def _droppable(data: np.ndarray, after_key: np.ndarray, once: np.ndarray, prefixes: tuple[bytes, ...]) -> np.ndarray:
    """Per piece: true when its only key is followed by a string (`: "` or `:"`) that starts with none of
    `prefixes`. A piece without the key, with it twice, or spelled otherwise is not droppable."""
    drop = np.zeros(len(once), dtype=bool)
    rows = np.flatnonzero(once)
    if not prefixes:
        drop[rows] = True
        return drop
    last = len(data) - 1
    at = after_key[rows]
    byte = lambda offset: data[np.minimum(at + offset, last)]  # noqa: E731
    colon = byte(0) == ord(":")
    tight, spaced = colon & (byte(1) == ord('"')), colon & (byte(1) == ord(" ")) & (byte(2) == ord('"'))
    width = max(map(len, prefixes))
    window = data[np.minimum(np.where(tight, at + 2, at + 3)[:, None] + np.arange(width), last)]
    matched = np.zeros(len(rows), dtype=bool)
    for prefix in prefixes:
        matched |= (window[:, : len(prefix)] == np.frombuffer(prefix, np.uint8)).all(axis=1)
    drop[rows] = (tight | spaced) & ~matched
    return drop


def _balanced(text: bytes) -> bool:
    """As many closing as opening braces and brackets: necessary for whole events."""
    return text.count(b"{") == text.count(b"}") and text.count(b"[") == text.count(b"]")


class TraceEventStream:
    """Iterate over lists of event dicts; after the iteration `meta` holds the other top-level keys.

    With `only`, the lists hold at least the events the filter wants (others are mostly dropped unparsed)."""

    def __init__(self, path: str, *, block_bytes: int | None = None,
                 progress: Callable[[int], None] | None = None, only: EventFilter | None = None) -> None:
        self.path = path
        self.block_bytes = block_bytes or BLOCK_BYTES
        self.progress = progress
        self.only = only
        self.meta: dict = {}
        self.bytes_read = 0
        self._separator = b"},{"

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
        spellings = _SEPARATOR.findall(pending[:_SNIFF_BYTES])
        if spellings:
            self._separator = max(set(spellings), key=spellings.count)
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
            events = self._parse(pending[: cut + 1])
            if events is None:
                continue
            rest = pending[cut + 1:].lstrip()
            return events, rest[1:]
        return [], pending

    def _parse(self, block: bytes) -> list[dict] | None:
        """The events of a run of whole events (with a filter: the wanted ones); None if it is not one."""
        starts_an_object = block[:64].lstrip()[:1] == b"{"
        selected = self.only.select(block, self._separator) if self.only and starts_an_object else None
        if selected is not None:
            try:
                return orjson.loads(selected)
            except orjson.JSONDecodeError:
                pass  # a piece was misjudged: parse the block whole, which also checks the cut
        try:
            return orjson.loads(b"[" + block + b"]")
        except orjson.JSONDecodeError:
            return None

    def _finish(self, pending: bytes) -> tuple[list[dict], bytes]:
        """At end of file: the rest of the events up to the array's `]`, and what follows it."""
        stripped = pending.lstrip()
        if stripped.startswith(b"]"):
            return [], stripped[1:]
        for match in re.finditer(rb"\}\s*\]", pending):
            events = self._parse(pending[: match.start() + 1])
            if events is not None:
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
