"""Read a Chrome-trace JSON file (plain or gzip) as a stream of event chunks, in bounded memory.

Profiler traces reach gigabytes; parsing one whole document builds millions of dicts at once (the memory
wall HolisticTraceAnalysis hits). Here the `traceEvents` array is cut into blocks at an element boundary
and each block is parsed on its own (msgspec), so only one block of events is alive at a time. A reader
that knows which keys it needs passes a typed decoder (`msgspec.json.Decoder(list[SomeStruct])`): then the
events are small structs of those keys alone, and the rest of each event (most of it: an op's argument
shapes and types) is skipped by the decoder without becoming Python objects.

A cut candidate is a `}` followed by `,` (or by the closing `]`). A cut inside a nested object or a
string cannot make `[` + block + `]` valid JSON, so a block that parses is exactly a run of whole events;
a block that does not parse is retried with an earlier candidate or grown with the next read.

Most of a profiler trace is events a reader does not need (CPU ops, flow arrows). With an `EventFilter`,
each block is split at the separator between events and the pieces whose category and name the filter
does not want are dropped as bytes, before any parsing: only the rest becomes dicts. A piece is dropped
only when it holds exactly one `"cat"` and one `"name"` key, so a split that fell inside an event (a nested
list of objects, a string) either keeps the piece or leaves text that does not parse, and then the block
is parsed whole. Separators and keys are found with numpy over the whole block (no piece is copied), and
the blocks are read and decompressed one ahead in a background thread (`read_ahead`). Decompression is
ISA-L's (`isal`): gzip-compatible, 2-5x faster than zlib on profiler traces, a fifth of the whole read.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import io
import re
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, BinaryIO, NamedTuple, TypeVar, overload

import msgspec
import numpy as np
from isal import igzip, isal_zlib

from gpuwatch.core.errors import UserError

_T = TypeVar("_T")
_END = object()
_PLAIN = msgspec.json.Decoder()  # JSON as dicts and lists
_BLOCK_INDEX = r"\$\[\d+\]\.?"  # patterns for error messages are compiled when first used (re caches them)
BLOCK_BYTES = 1 << 20
#: A trace given in memory (an upload) instead of a path: its bytes, or a seekable binary file.
TraceContent = bytes | BinaryIO
_ARRAY_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_HEAD_LIMIT = 256 << 20
_CUT_TRIES = 64
# How the writer separated events (`},\n  {` for Kineto), learnt from the most common spelling early on.
_SEPARATOR = re.compile(rb"\}\s*,\s*\{")
_SNIFF_BYTES = 1 << 16
_LFS_POINTER = b"version https://git-lfs.github.com/spec/"  # what a repository holds of a file kept in LFS
# PyTorch's execution trace (`ExecutionTraceObserver`), often saved beside the profiler's trace: a graph of ops.
# (Compiled when first used: compiling the patterns of error messages cost 0.3 ms of every run.)
_EXECUTION_TRACE = rb'^\s*\{\s*"schema"\s*:\s*"[^"]*"[^\[]*"nodes"\s*:\s*\['


class Layout(msgspec.Struct, frozen=True):
    """How a writer spells the head of an event, learnt from the trace (`sniff_layout`): `head` up to the
    phase letter (`{` ... `"ph": "`), `to_cat` from after the letter to the category's text (`", "cat": "`),
    `to_name` from the category's closing quote to the name's text (`", "name": "`). Kineto writes every
    event's phase, category and name first, in that order: where those bytes are found at a piece's start,
    they are that event's own keys, read with a few fixed-width gathers instead of searches of the block.
    `categories`: those of the heads seen where the layout was learnt (a `CategoryTable` starts with them)."""

    head: bytes
    to_cat: bytes
    to_name: bytes
    categories: tuple[bytes, ...] = ()


_LAYOUT = re.compile(rb'(\{\s*"ph"\s*:\s*")X("\s*,\s*"cat"\s*:\s*")([^"\\]{1,32})("\s*,\s*"name"\s*:\s*")')
_TEXT_WIDTH = 32  # bytes read of a category (a longer one is read by the key search)


def sniff_layout(text: bytes | memoryview) -> Layout | None:
    """The most common spelling of event heads in `text` (the start of a trace), with the categories of those
    heads; None if no event there starts with its phase, category and name."""
    found = _LAYOUT.findall(text)
    if not found:
        return None
    spellings = [(head, to_cat, to_name) for head, to_cat, _, to_name in found]
    return Layout(*max(set(spellings), key=spellings.count), tuple(sorted({f[2] for f in found})))


class Selection(NamedTuple):
    """What `EventFilter.select` keeps of a block, and where the rest of it is."""

    events: bytes  # `[...]` of the wanted events (and maybe a few more)
    starts: np.ndarray  # the block's pieces: from each one's `{`
    ends: np.ndarray  # to just past its `}`
    # Per piece: not judged, by its head, to be an event of a wanted phase (every piece where no head was
    # read): where a text of other events may be.
    others: np.ndarray

    def other_ranges(self) -> Iterator[tuple[int, int]]:
        """The byte ranges of the runs of `others` pieces, worked out when first asked for (a reader that
        has seen what it watches for asks no more): a watched text is searched for in these alone (flow
        arrows between CPU ops and kernels: the first launch arrow of ns_resolution_rank0 is 5.4 MB in)."""
        yield from zip(*_runs(self.starts, self.ends, self.others))


class EventFilter(msgspec.Struct, frozen=True):
    """Which events a reader needs: those whose `cat` is one of `categories` (unless their category is one
    of `skip_categories` and their name begins with one of the 8-byte `skip_heads`), and those whose `name`
    starts with one of `name_prefixes`; with `phases`, only events whose `ph` is one of those letters. A
    filter may keep more than that (the reader still checks each event). `skip_heads` are compared as one
    machine word each, so that a long list of them costs one `np.isin`; only events read by their head
    (see `Layout`) are skipped.

    `select` decides for all events of a block at once, with numpy over the byte offsets of the separators
    and of the keys, so that dropping an event costs no Python call and no copy."""

    categories: tuple[bytes, ...]
    name_prefixes: tuple[bytes, ...] = ()
    phases: bytes = b""
    skip_categories: tuple[bytes, ...] = ()
    skip_heads: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, categories: Iterable[str], name_prefixes: Iterable[str] = (), *, phases: str = "",
           skip: tuple[Iterable[str], Iterable[str]] = ((), ())) -> EventFilter:
        """With `skip=(categories, heads)`: events of those categories whose names begin with one of those
        heads (8 characters each) are not wanted."""
        heads = tuple(n.encode() for n in skip[1])
        if any(len(h) != 8 for h in heads):
            raise ValueError(f"skip heads must be 8 bytes long: {heads}")
        return cls(tuple(c.encode() + b'"' for c in categories), tuple(n.encode() for n in name_prefixes),
                   phases.encode(), tuple(c.encode() + b'"' for c in skip[0]), heads)

    def select(self, block: bytes | memoryview, separator: bytes, layout: Layout | None = None,
               categories: CategoryTable | None = None) -> Selection | None:
        """The wanted events of a block of whole events (`{...}` `separator` `{...}` ...); None when the block
        plainly does not end with a whole event (its last piece is unbalanced). With a `layout`, pieces that
        start as it says are judged by their head alone, and the keys are searched for only if some piece
        does not; `categories` (of this filter and layout) are those met in earlier blocks of the trace."""
        data = np.frombuffer(block, np.uint8)
        first, end = _trimmed(block)
        cuts = occurrences(data[first:end], separator) + first
        starts = np.concatenate(([first], cuts + len(separator) - 1))  # each piece from its `{`
        ends = np.concatenate((cuts + 1, [end]))                        # to its `}`
        if not _balanced(bytes(block[starts[-1]:end])):
            return None
        if layout is None:
            kept = ~self._droppable_by_keys(data, starts)
            others = np.ones(len(starts), bool)
        else:
            table = categories if categories is not None else CategoryTable(self, layout)
            known, drop, of_wanted_phase = self._by_layout(data, starts, layout, table)
            kept = ~(drop if known.all() else np.where(known, drop, self._droppable_by_keys(data, starts)))
            others = ~of_wanted_phase
        if not kept.any():
            return Selection(b"[]", starts, ends, others)
        # Runs of consecutive kept pieces are copied as they are (braces and separators included).
        view = memoryview(block)
        return Selection(b"[" + separator[1:-1].join([view[a:b] for a, b in zip(*_runs(starts, ends, kept))]) + b"]",
                         starts, ends, others)

    def _droppable_by_keys(self, data: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Per piece: holds exactly one `"cat"` and one `"name"` key, neither of them wanted."""
        drop = _droppable(data, *_only_key(data, starts, b'"cat"'), self.categories)
        after_name, one_name = _only_key(data, starts, b'"name"')
        return _droppable(data, after_name, one_name & drop, self.name_prefixes)

    def _by_layout(self, data: np.ndarray, starts: np.ndarray, layout: Layout,
                   table: CategoryTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per piece: whether it starts as `layout` says (so that its head decides), and if so whether it is
        unwanted; and whether its head shows a phase the filter names. Every byte from the `{` to the name's text is
        compared, so the keys read are the event's own (a nested object cannot come first); a piece that
        starts otherwise is left to the key search. A category met before (in `table`) is named by its first
        16 bytes; the end of a new one is searched for, and `table` learns it."""
        head, to_cat, to_name = layout.head, layout.to_cat, layout.to_name
        at_cat = len(head) + 1 + len(to_cat)
        window = _bytes_at(data, starts, at_cat + _KEY_BYTES)
        phase = window[:, len(head)]
        framed = _rows_equal(window, 0, head)
        wanted_phase = np.ones(len(starts), bool) if not self.phases else np.zeros(len(starts), bool)
        for letter in self.phases:
            wanted_phase |= phase == letter
        other_phase = framed & ~wanted_phase & (window[:, len(head) + 1] == ord('"'))
        headed = framed & wanted_phase & _rows_equal(window, len(head) + 1, to_cat)
        category = window[:, at_cat:]
        slot = table.slots(category)
        length, wanted, skip = table.length[slot], table.wanted[slot], table.skip[slot]
        closed = slot >= 0
        new = np.flatnonzero(headed & ~closed)
        if len(new):  # categories not met before: each ends at its first quote (a backslash first: an escape)
            rows = _bytes_at(data, starts[new] + at_cat,
                             max(_TEXT_WIDTH, _words(self.categories, self.skip_categories)))
            stops = (rows[:, :_TEXT_WIDTH] == ord('"')) | (rows[:, :_TEXT_WIDTH] == ord("\\"))
            length[new] = new_length = stops.argmax(1)
            closed[new] = new_closed = rows[np.arange(len(new)), new_length] == ord('"')
            wanted[new] = _starts_with_any(rows, self.categories)
            skip[new] = _starts_with_any(rows, self.skip_categories)
            table.learn(rows[new_closed, :_TEXT_WIDTH], new_length[new_closed])
        after = _bytes_at(data, starts + at_cat + length, len(to_name) + _words(self.name_prefixes, self.skip_heads))
        known = headed & closed & _rows_equal(after, 0, to_name)
        name = after[:, len(to_name):]
        skipped = skip & _one_of(np.ascontiguousarray(name[:, :8]).view(np.uint64)[:, 0],
                                 _sorted_words(self.skip_heads))
        wanted = (wanted & ~skipped) | _starts_with_any(name, self.name_prefixes)
        # Shown by its head to be of a wanted phase (so not, say, a flow arrow); without phases, none is.
        of_wanted_phase = framed & wanted_phase if self.phases else np.zeros(len(starts), bool)
        return known | other_phase, other_phase | (known & ~wanted), of_wanted_phase


_KEY_BYTES = 16  # a category is named by this many bytes from its first character
_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplying by it mixes a word's bytes into the higher ones
# Row n: the mask of a 16-byte key's first n bytes, as its two words.
_FIRST_BYTES = np.frombuffer(b"".join(bytes([255] * n + [0] * (_KEY_BYTES - n)) for n in range(_KEY_BYTES + 1)),
                             np.uint64).reshape(-1, 2)


class CategoryTable:
    """The categories met so far in one trace, for `EventFilter.select` with a layout. Each is named by the 16
    bytes from its first character in a head of that layout: for a category of 4 to 15 characters, all of
    it, its closing quote (a category holds none) and the start of the layout's `to_name`, so that the 16
    bytes of any piece are those only where its category is this one. One sorted search then names the
    category of every piece of a block, with its length and whether the filter wants or skips it; finding
    where each category ends and comparing it with each wanted one took half of the judging (ns_resolution:
    select 25.8 -> 21.6 ms). A trace has a few tens of categories, most of them in its first 64 KB, where the
    layout is learnt: the table starts with those. A category not met before, or not nameable so, is read as
    before and, where it can be, learnt."""

    def __init__(self, only: EventFilter, layout: Layout) -> None:
        self.only, self.to_name = only, layout.to_name
        # Those seen where the layout was learnt: else every piece of the first block is new, and read the
        # slow way (the filter of ns_resolution_rank0 26.9 -> 24.4 ms in a fresh process).
        self.texts: list[bytes] = [text for text in layout.categories if self._nameable(len(text))]
        self._update()

    @overload
    def _nameable(self, length: int) -> bool: ...
    @overload
    def _nameable(self, length: np.ndarray) -> np.ndarray: ...
    def _nameable(self, length: int | np.ndarray) -> bool | np.ndarray:
        """Whether a category of `length` is named by 16 bytes: its closing quote within them, and not so
        short that they reach past the start of the name's text."""
        return (length >= _KEY_BYTES - len(self.to_name)) & (length < _KEY_BYTES)

    def slots(self, category: np.ndarray) -> np.ndarray:
        """Per row of `category` (text from a category's first character, at least 16 bytes): the slot of its
        category in `length`, `wanted` and `skip`, or -1 where it is not one met before."""
        if not self.texts:
            return np.full(len(category), -1)
        keys = np.ascontiguousarray(category[:, :_KEY_BYTES]).view(np.uint64)
        at = np.minimum(np.searchsorted(self._mixed, _mixed(keys)), len(self._mixed) - 1)
        found = (self._keys[at, 0] == keys[:, 0]) & (self._keys[at, 1] == keys[:, 1])
        return np.where(found, self._slot[at], -1)

    def learn(self, texts: np.ndarray, lengths: np.ndarray) -> None:
        """Add the categories in `texts` (rows from a category's first character, each category `lengths`
        long and closed by a quote) that 16 bytes can name and that were not met before."""
        named = self._nameable(lengths)
        if not named.any():
            return
        texts, lengths = texts[named], lengths[named]
        # One row of each category (a block has a few; the first block's every piece is new): the rows cut to
        # their category (zeros after it, all within 16 bytes) as one mixed word each, deduplicated by a sort
        # of words (sorting the rows as opaque values took 0.8 ms a block). Two categories of one word (about
        # never): the second stays unlearnt, read by the search for its end as a category not met before.
        cut = np.ascontiguousarray(texts[:, :_KEY_BYTES]).view(np.uint64) & _FIRST_BYTES[lengths]
        _, first = np.unique(_mixed(cut), return_index=True)
        added = {texts[i, :lengths[i]].tobytes() for i in first.tolist()} - set(self.texts)
        if added:
            self.texts += sorted(added)
            self._update()

    def _update(self) -> None:
        keyed = [(text + self.to_name)[:_KEY_BYTES] for text in self.texts]
        keys = np.frombuffer(b"".join(keyed), np.uint64).reshape(-1, 2)
        mixed = _mixed(keys)
        order = np.argsort(mixed, kind="stable")
        # Two keys of one mixed value (about never): the second is not found, and is read as not met.
        first = np.ones(len(order), bool)
        first[1:] = mixed[order][1:] != mixed[order][:-1]
        order = order[first]
        self._mixed, self._keys, self._slot = mixed[order], keys[order], order
        quoted = [text + b'"' for text in self.texts]
        # Per slot, and a last one for "not met" (slot -1).
        self.length = np.array([len(t) for t in self.texts] + [0], np.int64)
        self.wanted = np.array([t.startswith(self.only.categories) for t in quoted] + [False])
        self.skip = np.array([t.startswith(self.only.skip_categories) for t in quoted] + [False])


def _mixed(keys: np.ndarray) -> np.ndarray:
    """One 64-bit value per two-word key, for a sorted search (two keys may share one)."""
    return keys[:, 0] ^ (keys[:, 1] * _MIX)


def occurrences(data: np.ndarray, pattern: bytes) -> np.ndarray:
    """Sorted start offsets of every occurrence of `pattern` in `data`, overlapping ones included (as
    `bytes.rfind` would see them; a separator cannot overlap itself). A pattern that starts with a brace
    (an event separator: braces are a few bytes per event) is found by its first byte in one pass; otherwise
    its first bytes are compared as one machine word at each alignment (a quote or a letter is too common
    to start from): each pass reads the buffer once, in numpy."""
    if pattern[:1] in (b"{", b"}"):
        found = np.flatnonzero(data[:max(0, len(data) - len(pattern) + 1)] == pattern[0])
        for k in range(1, len(pattern)):
            found = found[data[found + k] == pattern[k]]
        return found
    width = next(w for w in (4, 2, 1) if w <= len(pattern))
    word = np.frombuffer(pattern[:width], f"u{width}")[0]
    size = len(data) - len(pattern) + 1
    if size <= 0:
        return np.empty(0, np.int64)
    hits = []
    for align in range(width):
        words = data[align: align + (len(data) - align) // width * width].view(f"u{width}")
        hits.append(np.flatnonzero(words == word) * width + align)
    found = np.sort(np.concatenate(hits))
    found = found[found < size]
    for k in range(width, len(pattern)):
        found = found[data[found + k] == pattern[k]]
    return found


def _runs(starts: np.ndarray, ends: np.ndarray, pieces: np.ndarray) -> tuple[list[int], list[int]]:
    """The runs of consecutive `pieces` (a mask of the pieces from `starts` to `ends`): where each begins
    and ends."""
    before, after = np.concatenate(([False], pieces[:-1])), np.concatenate((pieces[1:], [False]))
    return starts[pieces & ~before].tolist(), ends[pieces & ~after].tolist()


def _trimmed(block: bytes | memoryview) -> tuple[int, int]:
    """Offsets of the first and just past the last non-blank byte of a block (blank as `bytes.strip`)."""
    head, tail = bytes(block[:64]), bytes(block[-64:])
    return len(head) - len(head.lstrip()), len(block) - len(tail) + len(tail.rstrip())


def _only_key(data: np.ndarray, starts: np.ndarray, key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Per piece (pieces begin at `starts`): the offset just after `key`, and whether it occurs exactly once."""
    at = occurrences(data, key)
    piece = np.searchsorted(starts, at, side="right") - 1
    inside = piece >= 0
    at, piece = at[inside], piece[inside]
    after = np.zeros(len(starts), np.int64)
    after[piece] = at + len(key)  # read only where the key occurs once
    return after, np.bincount(piece, minlength=len(starts)) == 1


def _droppable(data: np.ndarray, after_key: np.ndarray, once: np.ndarray, prefixes: tuple[bytes, ...]) -> np.ndarray:
    """Per piece: true when `once` (its key occurs once, and the caller has no other reason to keep it) and
    the key is followed by a string (`: "` or `:"`) that starts with none of `prefixes`. A piece without
    the key, with it twice, or spelled otherwise is not droppable."""
    drop = np.zeros(len(once), dtype=bool)
    rows = np.flatnonzero(once)
    if not prefixes:
        drop[rows] = True
        return drop
    width = _words(prefixes)
    text = _bytes_at(data, after_key[rows], 3 + width)
    colon = text[:, 0] == ord(":")
    tight = colon & (text[:, 1] == ord('"'))
    spaced = colon & (text[:, 1] == ord(" ")) & (text[:, 2] == ord('"'))
    value = np.where(tight[:, None], text[:, 2:2 + width], text[:, 3:3 + width])
    drop[rows] = (tight | spaced) & ~_starts_with_any(value, prefixes)
    return drop


def _rows_equal(rows: np.ndarray, at: int, text: bytes) -> np.ndarray:
    """Per row of a 2-D byte array: whether its bytes from `at` are `text` (compared as one opaque value
    per row, 3x faster than a byte-wise comparison reduced along the row)."""
    equal: np.ndarray = rows[:, at:at + len(text)].view(f"V{len(text)}")[:, 0] == np.void(text)
    return equal


def _words(*prefix_lists: tuple[bytes, ...]) -> int:
    """Bytes to read to compare a text with the longest of the prefixes (whole 8-byte words)."""
    return 8 * max([(len(p) + 7) // 8 for prefixes in prefix_lists for p in prefixes] or [1])


def _starts_with_any(text: np.ndarray, prefixes: tuple[bytes, ...]) -> np.ndarray:
    """Per row of `text` (one text per row, at least `_words(prefixes)` bytes wide): whether it starts
    with one of `prefixes`, compared 8 bytes a word."""
    matched = np.zeros(len(text), dtype=bool)
    if not prefixes:
        return matched
    words = np.ascontiguousarray(text[:, :_words(prefixes)]).view(np.uint64)
    for prefix in _word_chunks(prefixes):
        found = np.ones(len(text), dtype=bool)
        for column, (mask, want) in enumerate(prefix):
            found &= (words[:, column] & mask) == want
        matched |= found
    return matched


@functools.lru_cache
def _word_chunks(prefixes: tuple[bytes, ...]) -> list[list[tuple[np.uint64, np.uint64]]]:
    """Each prefix as 8-byte words (machine byte order) with the mask of the bytes it sets: a text starts
    with the prefix when, word by word, `text & mask == word`."""
    def word(chunk: bytes) -> np.uint64:
        value: np.uint64 = np.frombuffer(chunk.ljust(8, b"\0"), np.uint64)[0]
        return value

    return [[(word(b"\xff" * len(prefix[i:i + 8])), word(prefix[i:i + 8])) for i in range(0, len(prefix), 8)]
            for prefix in prefixes]


@functools.lru_cache
def _sorted_words(heads: tuple[bytes, ...]) -> np.ndarray:
    """8-byte `heads` as sorted machine words, for `_one_of`."""
    return np.sort(np.frombuffer(b"".join(heads), np.uint64))


def _one_of(words: np.ndarray, sorted_words: np.ndarray) -> np.ndarray:
    """Per word: whether it is one of `sorted_words` (a binary search each: `np.isin` sorts both sides on
    every call, and imports numpy.ma on its first)."""
    if not len(sorted_words):
        return np.zeros(len(words), bool)
    at = np.minimum(np.searchsorted(sorted_words, words), len(sorted_words) - 1)
    found: np.ndarray = sorted_words[at] == words
    return found


def _bytes_at(data: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """`width` bytes from each offset in `at`, one row each; bytes past the end of `data` read as 0."""
    if len(data) < width:
        data = np.concatenate((data, np.zeros(width - len(data), np.uint8)))
    windows = np.lib.stride_tricks.as_strided(data, (len(data) - width + 1, width), (1, 1), writeable=False)
    out: np.ndarray = windows[np.minimum(at, len(windows) - 1)]
    for row in np.flatnonzero(at >= len(windows)):  # the few offsets within `width` of the end
        tail = data[at[row]:]
        out[row] = 0
        out[row, :len(tail)] = tail
    return out


def _balanced(text: bytes) -> bool:
    """As many closing as opening braces and brackets: necessary for whole events."""
    return text.count(b"{") == text.count(b"}") and text.count(b"[") == text.count(b"]")


class TraceEventStream:
    """Iterate over lists of events (dicts, or what `decoder` makes of them); after the iteration `meta` holds
    the other top-level keys.

    With `only`, the lists hold at least the events the filter wants (others are mostly dropped unparsed).
    An event the `decoder`'s type does not fit (a mistyped key) is a UserError naming it."""

    def __init__(self, path: str, *, block_bytes: int | None = None,
                 progress: Callable[[int], None] | None = None, only: EventFilter | None = None,
                 watch: tuple[bytes, ...] = (), content: TraceContent | None = None,
                 decoder: msgspec.json.Decoder[Any] | None = None) -> None:
        self.path = path  # the file read, else the name of `content` in messages
        self.content = content
        self.decoder = decoder or _PLAIN
        # Whether any of `watch` occurs in the events (a check for events the filter drops, such as flow
        # arrows), except in those a filter judged by their heads to be of a wanted phase: that skips most of
        # a Kineto trace, whose flow arrows follow its CPU ops (a third to a half of the file; 11 ms of a
        # 35 MB trace). One regular expression reads a block once for all patterns, and the search stops at
        # the first hit (counting every pattern's occurrences took a quarter of the whole read's time).
        self.watch = re.compile(b"|".join(map(re.escape, watch))) if watch else None
        self.seen = False
        self.block_bytes = block_bytes or BLOCK_BYTES
        self.progress = progress
        self.only = only
        self.meta: dict[str, Any] = {}
        self.bytes_read = 0
        self._separator = b"},{"
        self._layout: Layout | None = None
        self._categories: CategoryTable | None = None
        self._bare = False  # the file is the bare JSON Array Format, not an object with traceEvents

    def __iter__(self) -> Iterator[list[Any]]:
        try:
            with _opened(self.path, self.content) as f:
                blocks = read_ahead(iter(functools.partial(f.read, self.block_bytes), b""))
                try:
                    yield from self._events(blocks)
                finally:
                    blocks.close()
        except (OSError, EOFError, isal_zlib.error) as exc:  # type: ignore[misc]  # isal's stub: error an instance
            raise UserError(f"{self.path}: cannot read the trace ({exc})") from None

    def _read(self, blocks: Iterator[bytes]) -> bytes:
        data = next(blocks, b"")
        self.bytes_read += len(data)
        if self.progress is not None and data:
            self.progress(self.bytes_read)
        return data

    def _events(self, blocks: Iterator[bytes]) -> Iterator[list[Any]]:
        pending: bytes | memoryview = self._find_array(blocks)
        spellings = _SEPARATOR.findall(pending[:_SNIFF_BYTES])
        if spellings:
            self._separator = max(set(spellings), key=spellings.count)
        # Heads are trusted only where the events are separated one way, with a line break: a JSON string
        # cannot hold one, and a pretty printer indents nested objects deeper, so every piece is a whole
        # event. A compact separator (`},{`) also occurs inside strings and nested lists, and a piece may
        # be a fragment; a writer that separates some events otherwise may put two events in one piece.
        one_spelling = len(set(spellings)) == 1 and b"\n" in self._separator
        self._layout = sniff_layout(pending[:_SNIFF_BYTES]) if one_spelling else None
        self._categories = CategoryTable(self.only, self._layout) if self.only and self._layout else None
        while True:
            block = self._read(blocks)
            if not block:
                break
            pending = b"".join((pending, block))  # the first time, `pending` is a view of the first block
            events, pending = self._cut(pending)
            if events:
                yield events
        events, tail = self._finish(bytes(pending))
        if events:
            yield events
        self.meta.update(_parse_tail(self.path, tail))

    def _find_array(self, blocks: Iterator[bytes]) -> memoryview:
        """Read until the start of the events array; parse the keys before it into `meta`. Returns a view of
        what was read after the array's `[` (the head is freed once the events after it are copied out with
        the next block: copying them here, alone, cost 1 ms of a fresh process's first block)."""
        data = b""
        while True:
            block = self._read(blocks)
            data += block
            stripped = data.lstrip()
            if stripped.startswith(b"["):  # the bare "JSON Array Format" of Chrome traces
                self._bare = True
                return memoryview(stripped)[1:]
            match = _ARRAY_KEY.search(data)
            if match:
                self.meta.update(_parse_head(self.path, data[: match.start()]))
                return memoryview(data)[match.end():]
            if not block and not data.strip():  # e.g. a writer that died before writing
                raise UserError(f"{self.path}: empty file, not a trace")
            if data.startswith(_LFS_POINTER):
                raise UserError(f"{self.path}: a Git LFS pointer, not the trace itself (fetch it: git lfs pull)")
            if not block or len(data) > _HEAD_LIMIT:
                if re.search(_EXECUTION_TRACE, data[:4096]):
                    raise UserError(f"{self.path}: a PyTorch execution trace (a graph of ops without GPU times), not "
                                    "a profiler trace: give the profiler's Kineto trace of the same run")
                raise UserError(f"{self.path}: not a Chrome/Kineto trace (no traceEvents array found)")

    def _cut(self, pending: bytes) -> tuple[list[Any], bytes]:
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
            events = self._parse(memoryview(pending)[: cut + 1])
            if events is None:
                continue
            rest = pending[cut + 1:].lstrip()
            return events, rest[1:]
        return [], pending

    def _parse(self, block: bytes | memoryview) -> list[Any] | None:
        """The events of a run of whole events (with a filter: the wanted ones); None if it is not one."""
        starts_an_object = bytes(block[:64]).lstrip()[:1] == b"{"
        selection = (self.only.select(block, self._separator, self._layout, self._categories)
                     if self.only and starts_an_object else None)
        if selection is not None:
            try:
                events: list[Any] = self.decoder.decode(selection.events)
            except msgspec.DecodeError:
                pass  # a piece was misjudged: parse the block whole, which also checks the cut
            else:
                self._look(block, selection.other_ranges())
                return events
        try:
            events = self.decoder.decode(b"[" + block + b"]")  # list[Any], as declared above
        except msgspec.ValidationError as exc:
            # Decoding goes from the block's start, which is an event boundary: what it read is real events.
            # The message names the key (`$[12].args` -> `args`: the index counts within the block only).
            raise UserError(f"{self.path}: malformed trace event ({re.sub(_BLOCK_INDEX, '', str(exc))})") from None
        except msgspec.DecodeError:
            return None
        self._look(block, [(0, len(block))])
        return events

    def _look(self, block: bytes | memoryview, ranges: Iterable[tuple[int, int]]) -> None:
        """Note whether a watched text occurs in one of the byte `ranges` of `block` (a block of events
        parsed: each is looked at once), until one is seen."""
        if self.watch is None or self.seen:
            return
        search = self.watch.search
        self.seen = any(start < end and search(block, start, end) is not None for start, end in ranges)

    def _finish(self, pending: bytes) -> tuple[list[Any], bytes]:
        """At end of file: the rest of the events up to the array's `]`, and what follows it."""
        stripped = pending.lstrip()
        if stripped.startswith(b"]"):
            return [], stripped[1:]
        for match in re.finditer(rb"\}\s*\]", pending):
            events = self._parse(pending[: match.start() + 1])
            if events is not None:
                return events, pending[match.end():]
        if self._bare:  # the Trace Event Format lets this form end without its `]` (a writer that was stopped)
            rest = pending.rstrip().rstrip(b",")
            events = self._parse(rest) if rest.strip() else []
            if events is not None:
                return events, b""
        array = "the array of events" if self._bare else "the traceEvents array"
        raise UserError(
            f"{self.path}: truncated or invalid JSON: {array} does not end (read {self.bytes_read} bytes)"
        )


def read_ahead(items: Iterator[_T], depth: int = 2) -> Generator[_T, None, None]:
    """The items of `items`, produced up to `depth` ahead in a background thread, so that producing them
    (reading, decompressing: ISA-L releases the GIL) overlaps the caller's work on the previous ones. An
    exception in the producer is raised in the caller; closing the generator stops the producer. (A deque and
    two semaphores, not a `queue.Queue`: the queue module and heapq cost 1 ms to import, for this alone.)"""
    handed: collections.deque[tuple[Any, BaseException | None]] = collections.deque()
    waiting = threading.Semaphore(0)  # entries in `handed`
    room = threading.Semaphore(depth)  # places for more
    stop = threading.Event()

    def hand(entry: tuple[Any, BaseException | None]) -> None:
        handed.append(entry)
        waiting.release()

    def produce() -> None:
        try:
            for item in items:
                room.acquire()
                if stop.is_set():
                    break
                hand((item, None))
            else:
                hand((_END, None))
        except BaseException as exc:  # handed to the caller, raised there
            hand((_END, exc))
        finally:
            if isinstance(items, Generator):
                items.close()  # its files are closed in the thread that used them

    worker = threading.Thread(target=produce, name="read-ahead", daemon=True)
    worker.start()
    try:
        while True:
            waiting.acquire()
            item, error = handed.popleft()
            room.release()
            if error is not None:
                raise error
            if item is _END:
                return
            yield item
    finally:
        stop.set()
        room.release()  # a producer waiting for room wakes, sees `stop` and ends
        worker.join()


@contextlib.contextmanager
def _opened(path: str, content: TraceContent | None) -> Iterator[BinaryIO | igzip.IGzipFile]:
    """The trace's bytes, gunzipped (ISA-L) when they begin with the gzip magic: the file at `path`, else
    `content` (bytes, or a seekable binary file that the caller closes)."""
    with contextlib.ExitStack() as stack:
        if content is None:
            f: BinaryIO = stack.enter_context(open(path, "rb"))
        else:
            f = io.BytesIO(content) if isinstance(content, bytes) else content
        magic = f.read(2)
        f.seek(-len(magic), io.SEEK_CUR)
        yield stack.enter_context(igzip.IGzipFile(fileobj=f, mode="rb")) if magic == b"\x1f\x8b" else f


def _parse_head(path: str, head: bytes) -> dict[str, Any]:
    text = head.rstrip().rstrip(b",")
    try:
        return _PLAIN.decode(text + b"}") if text.strip() != b"{" else {}
    except msgspec.DecodeError:
        raise UserError(f"{path}: invalid JSON before the traceEvents array") from None


def _parse_tail(path: str, tail: bytes) -> dict[str, Any]:
    text = tail.strip()
    if text in (b"", b"}"):
        return {}
    if not text.startswith(b","):
        raise UserError(f"{path}: invalid JSON after the traceEvents array")
    try:
        meta = _PLAIN.decode(b"{" + text[1:])
    except msgspec.DecodeError:
        raise UserError(f"{path}: truncated or invalid JSON after the traceEvents array") from None
    return meta if isinstance(meta, dict) else {}
