"""The reference for `eventstream.TraceEventStream`: a trace read the plain way, whole, every event parsed.

The fast stream cuts the events array into blocks, drops unwanted events as bytes before parsing (by
sniffed heads, a category table, eight-byte name heads) and reads ahead in a thread; all of that must change
nothing a reader sees. This reader has none of it: it decompresses the file, parses the whole document and
hands over every event, so a reader (kineto.py) fed by either must build the same timeline. The differential
test (tests/test_traces_eventstream.py) holds them to that on every shared real trace. It needs memory for the
whole document: a check, not a way to read large traces.
"""
from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from gpuwatch.core.errors import UserError
from gpuwatch.efficiency.traces.eventstream import EventFilter, TraceContent


class PlainEventStream:
    """`TraceEventStream`'s interface (iterate for lists of events, then `meta` and `seen`), read plainly:
    `only` is ignored (every event is handed over; the reader checks each), `seen` is whether any of `watch`
    occurs anywhere in the events."""

    def __init__(self, path: str, *, progress: Callable[[int], None] | None = None, only: EventFilter | None = None,
                 watch: tuple[bytes, ...] = (), content: TraceContent | None = None,
                 decoder: msgspec.json.Decoder[Any] | None = None) -> None:
        self.path, self.content, self.progress, self.watch = path, content, progress, watch
        self.type: Any = decoder.type if decoder is not None else list
        self.meta: dict[str, Any] = {}
        self.seen = False

    def __iter__(self) -> Iterator[list[Any]]:
        if self.content is None:
            with open(self.path, "rb") as f:
                data = f.read()
        else:
            data = self.content if isinstance(self.content, bytes) else self.content.read()
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
        if self.progress is not None:
            self.progress(len(data))
        try:
            doc = json.loads(data)
        except ValueError as exc:
            raise UserError(f"{self.path}: not valid JSON ({exc})") from None
        events = doc if isinstance(doc, list) else doc.pop("traceEvents", None)
        if not isinstance(events, list):
            raise UserError(f"{self.path}: not a Chrome/Kineto trace (no traceEvents array found)")
        self.meta = doc if isinstance(doc, dict) else {}
        text = json.dumps(events)
        self.seen = any(re.search(re.escape(w.decode()), text) for w in self.watch)
        yield msgspec.convert(events, self.type)
