"""The event stream's byte-level prefilter: it must only ever drop events the Kineto reader ignores."""
from __future__ import annotations

import json
import os
import threading

import msgspec
import numpy as np
import pytest

from gpuwatch.efficiency.traces import eventstream, kineto
from gpuwatch.efficiency.traces.eventstream import EventFilter, TraceEventStream
from gpuwatch.efficiency.traces.plainstream import PlainEventStream
from gpuwatch.core.errors import UserError

DATA = "/work/shared/data/kineto"
REAL = [os.path.join(DATA, "control_rank3_of8", "rank3.json.gz"),
        os.path.join(DATA, "sampled_2ranks_of128", "rank0.json.gz")]
WANTED = EventFilter.of(["kernel"], ["ProfilerStep#"])


def _all_events(path, only=None):
    return [e for block in TraceEventStream(path, only=only) for e in block]


def _same_timeline(a, b):
    for name in a.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y, err_msg=name)
        else:
            assert x == y, name


@pytest.mark.parametrize("path", REAL)
@pytest.mark.parametrize("block_bytes", [64 << 10, 4 << 20])
def test_filtered_reading_gives_the_same_timeline(path, block_bytes, monkeypatch):
    monkeypatch.setattr(eventstream, "BLOCK_BYTES", block_bytes)
    filtered = kineto.load_kineto(path)
    monkeypatch.setattr(kineto, "_WANTED", None)
    _same_timeline(filtered, kineto.load_kineto(path))


@pytest.mark.parametrize("path", sorted(os.path.join(root, name) for root, _, names in os.walk(DATA)
                                         for name in names if name.endswith(".json.gz")))
def test_the_fast_stream_reads_what_the_plain_reference_reads(path, monkeypatch):
    """The differential test of the byte-level filter: every shared real trace gives the same timeline through
    `TraceEventStream` (blocks, byte-level filtering, read-ahead) as through `PlainEventStream` (the whole
    document parsed, every event handed over)."""
    fast = kineto.load_kineto(path, default_rank=0)
    monkeypatch.setattr(kineto, "TraceEventStream", PlainEventStream)
    plain = kineto.load_kineto(path, default_rank=0)
    # Ids of names, types and groups are given in order of first appearance, which depends on how the events
    # were cut into blocks: compared by what they name.
    for decoded in ("type_names", "group_names", "kernel_names"):
        np.testing.assert_array_equal(getattr(fast, decoded)(), getattr(plain, decoded)(), err_msg=decoded)
    for table in ("coll_types", "process_groups", "names"):
        assert sorted(getattr(fast, table)) == sorted(getattr(plain, table)), table
    for name in fast.__struct_fields__:
        if name not in ("coll_type", "process_group", "name", "coll_types", "process_groups", "names"):
            x, y = getattr(fast, name), getattr(plain, name)
            if isinstance(x, np.ndarray):
                np.testing.assert_array_equal(x, y, err_msg=name)
            else:
                assert x == y, name


def test_filter_drops_cpu_ops_and_flows_unparsed():
    kept = _all_events(REAL[0], kineto._WANTED)
    every = _all_events(REAL[0])
    assert len(kept) < len(every) / 2
    cats = {e.get("cat") for e in kept}
    assert "async_cpu_to_gpu" not in cats
    assert all(e["name"].startswith(("nccl:", "record_param_comms", "ProfilerStep#"))
               for e in kept if e.get("cat") == "cpu_op")


def _write(path, events, indent):
    with open(path, "w") as f:
        json.dump({"schemaVersion": 1, "traceEvents": events}, f, indent=indent)


TRICKY = [
    {"ph": "X", "cat": "kernel", "name": "void k<{lambda()#1}>}, {", "ts": 1, "dur": 2},
    # a CPU op whose args hold a list of objects (a split falls inside it) with "cat" keys of their own
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 2, "dur": 1,
     "args": {"list": [{"cat": "cpu_op"}, {"cat": "cpu_op", "x": "}, {"}]}},
    {"ph": "X", "cat": "cpu_op", "name": "outer", "args": {"cat": "kernel"}, "ts": 3, "dur": 1},
    {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#7", "ts": 0, "dur": 9},
    {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 4, "dur": 1},
    {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 4},
    {"ph": "X", "cat" : "cpu_op", "name": "odd spacing is kept", "ts": 5, "dur": 1},
]


@pytest.mark.parametrize("indent", [None, 2])
def test_split_inside_an_event_never_loses_or_invents_events(tmp_path, indent):
    path = str(tmp_path / "t.json")
    _write(path, TRICKY, indent)
    kept = _all_events(path, WANTED)
    assert all(e in TRICKY for e in kept)

    def needed(e):
        return e.get("cat") == "kernel" or e["name"].startswith("ProfilerStep#")
    assert [e for e in kept if needed(e)] == [e for e in TRICKY if needed(e)] != []


def test_plain_events_are_dropped_before_parsing(tmp_path):
    path = str(tmp_path / "t.json")
    _write(path, [TRICKY[0], TRICKY[3], TRICKY[4], TRICKY[5]] * 3, 2)
    assert [e["name"] for e in _all_events(path, WANTED)] == [TRICKY[0]["name"], "ProfilerStep#7"] * 3


def test_truncated_trace_still_fails_with_the_filter(tmp_path):
    path = str(tmp_path / "t.json")
    _write(path, TRICKY * 50, 2)
    with open(path, "rb+") as f:
        f.truncate(os.path.getsize(path) - 40)
    with pytest.raises(UserError, match="truncated or invalid JSON"):
        _all_events(path, WANTED)


def test_keys_at_the_very_end_of_a_block_are_read_whole():
    wanted = EventFilter.of(["kernel"], ["nccl:"])
    block = b'{"cat":"cpu_op","name":"aten::mm"},{"cat":"cpu_op","name":"nccl:x"},{"name":"aten::add","cat":"kernel"}'
    kept = json.loads(wanted.select(block, b"},{").events)
    assert [e["name"] for e in kept] == ["nccl:x", "aten::add"]
    assert json.loads(wanted.select(block[:-len('"kernel"}')] + b'"cpu_op"}', b"},{").events) == [kept[0]]


@pytest.mark.parametrize("pattern", [b"},{", b'"cat"', b"},\n  {", b"}"])
def test_occurrences_finds_every_match_at_every_alignment(pattern):
    text = b"".join(b"x" * gap + pattern for gap in range(9)) + b"y"
    expected = [i for i in range(len(text)) if text.startswith(pattern, i)]
    assert eventstream.occurrences(np.frombuffer(text, np.uint8), pattern).tolist() == expected
    assert eventstream.occurrences(np.frombuffer(pattern[:-1], np.uint8), pattern).tolist() == []


def test_read_ahead_hands_on_items_and_errors_and_stops_early():
    assert list(eventstream.read_ahead(iter(range(100)), depth=2)) == list(range(100))

    def failing():
        yield 1
        raise ValueError("bad block")
    with pytest.raises(ValueError, match="bad block"):
        list(eventstream.read_ahead(failing()))
    produced = []

    def endless():
        while True:
            produced.append(len(produced))
            yield produced[-1]
    ahead = eventstream.read_ahead(endless(), depth=2)
    assert next(ahead) == 0
    ahead.close()
    assert len(produced) <= 5
    assert not [t for t in threading.enumerate() if t.name == "read-ahead"]


def _kept(selection):
    return None if selection is None else selection.events


def _select_reference(block, separator, wanted):
    """The filter's rule, one piece at a time with plain bytes methods."""
    def droppable(piece, key, prefixes):
        at = piece.find(key)
        if at < 0 or at != piece.rfind(key):
            return False
        rest = piece[at + len(key):]
        value = rest[2:] if rest.startswith(b':"') else rest[3:] if rest.startswith(b': "') else None
        return value is not None and not any(value.startswith(p) for p in prefixes)

    pieces = block.strip()[1:-1].split(separator)
    last = pieces[-1]
    if last.count(b"{") != last.count(b"}") or last.count(b"[") != last.count(b"]"):
        return None  # a cut inside an event: the caller parses the block whole
    kept = [p for p in pieces if not (droppable(p, b'"cat"', wanted.categories)
                                      and droppable(p, b'"name"', wanted.name_prefixes))]
    return b"[{" + separator.join(kept) + b"}]" if kept else b"[]"


@pytest.mark.parametrize("spacing", [(",", ":"), (", ", ": ")])
def test_select_agrees_with_a_piece_by_piece_reading(spacing):
    rng = np.random.default_rng(7)
    pool = TRICKY + [
        {"ph": "X", "cat": "cpu_op", "name": "nccl:all_reduce", "ts": 1, "args": {"Seq": 3}},
        {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "ts": 2},
        {"ph": "X", "cat": "kernel_like", "name": "kernel", "ts": 3},
        {"name": "ProfilerStep#3", "cat": "user_annotation", "ts": 4, "args": {"name": "x"}},
        {"ph": "X", "cat": "cpu_op", "name": "a" * 40, "ts": 5},
    ]
    separator = b"}" + spacing[0].encode() + b"{"
    for _ in range(200):
        events = [pool[i] for i in rng.integers(0, len(pool), rng.integers(1, 12))]
        block = json.dumps(events, separators=spacing).encode()[1:-1]
        selection = WANTED.select(block, separator)
        assert _kept(selection) == _select_reference(block, separator, WANTED), block
        # no head was read: all of it is where watched texts are looked for
        assert selection is None or list(selection.other_ranges()) == [(0, len(block))]


def _select_by_head_reference(block, separator, layout, wanted):
    """The filter's rule with a layout, one piece at a time with plain bytes methods: a piece that starts
    as the layout says is judged by its phase, category and name; any other by the key search."""
    inner = block.strip()[1:-1].split(separator)
    pieces = [b"{" + p + b"}" for p in inner]
    by_keys = json.loads(wanted.select(block, separator).events)  # the key search alone (checked above)

    def verdict(piece):
        """True / False: wanted or not by its head; None: the head does not say."""
        if not piece.startswith(layout.head):
            return None
        rest = piece[len(layout.head):]
        if rest[:1] not in [bytes([p]) for p in wanted.phases] and rest[1:2] == b'"':
            return False
        if rest[:1] not in [bytes([p]) for p in wanted.phases] or not rest[1:].startswith(layout.to_cat):
            return None
        text = rest[1 + len(layout.to_cat):]
        end = text.find(b'"')
        if not 0 < end < 32 or b"\\" in text[:end] or not text[end:].startswith(layout.to_name):
            return None
        category, name = text[:end + 1], text[end + len(layout.to_name):]
        skipped = category in wanted.skip_categories and name[:8] in wanted.skip_heads
        return (category in wanted.categories and not skipped) or name.startswith(wanted.name_prefixes)

    kept = [p for p in pieces if verdict(p) or (verdict(p) is None and json.loads(p) in by_keys)]
    return b"[" + separator[1:-1].join(kept) + b"]"


def test_select_by_event_heads_agrees_with_a_piece_by_piece_reading():
    """Kineto's spelling: phase, category and name first, one event per piece (the separator holds a line
    break). Flows and other phases, runtime calls that launch nothing, and unwanted CPU ops are dropped by
    their heads; events whose heads are spelled otherwise go to the key search."""
    rng = np.random.default_rng(11)
    wanted = kineto._WANTED
    pool = [
        {"ph": "X", "cat": "kernel", "name": "void k<{lambda()#1}>}, {", "ts": 1, "dur": 2, "args": {"stream": 7}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1, "args": {"correlation": 5}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventQuery", "ts": 1, "args": {"correlation": 6}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 1},
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "ts": 1},
        {"ph": "X", "cat": "cpu_op", "name": "nccl:all_reduce", "ts": 1, "args": {"Seq": 3}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 2, "args": {"list": [{"cat": "kernel"}]}},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 4},
        {"ph": "f", "id": 5, "ts": 4, "cat": "ac2g", "name": "ac2g"},
        {"ph": "s", "cat": "kernel", "name": "not complete", "ts": 4},
        {"ph": "M", "name": "process_name", "args": {"name": "python"}},
        {"name": "ProfilerStep#4", "ph": "X", "cat": "user_annotation", "ts": 5},
        {"ph": "X", "cat": "a\"quoted\"category", "name": "ProfilerStep#5", "ts": 6},
        {"ph": "X", "cat": "c" * 40, "name": "aten::add", "ts": 6},
    ]
    for indent in (2, 4):
        text = json.dumps({"traceEvents": pool}, indent=indent).encode()
        spellings = eventstream._SEPARATOR.findall(text)
        separator = max(set(spellings), key=spellings.count)
        layout = eventstream.sniff_layout(text)
        assert layout is not None and layout.head.startswith(b"{\n") and b"\n" in separator
        for _ in range(100):
            events = [pool[i] for i in rng.integers(0, len(pool), rng.integers(1, 12))]
            doc = json.dumps({"traceEvents": events}, indent=indent).encode()
            block = doc[doc.index(b"[") + 1:doc.rindex(b"]")].strip()
            selection = wanted.select(block, separator, layout)
            assert selection.events == _select_by_head_reference(block, separator, layout, wanted), block
            names = [e["name"] for e in json.loads(selection.events)]
            # every event not shown by its head to be complete (flows, other phases, other spellings) is in
            # the range where watched texts are looked for
            ranges = list(selection.other_ranges())
            at = 0
            for piece in [b"{" + p + b"}" for p in block.strip()[1:-1].split(separator)]:
                at = block.index(piece, at)
                looked = any(start <= at and at + len(piece) <= end for start, end in ranges)
                assert looked == (not piece.startswith(layout.head + b"X")), piece  # and no complete event
                at += len(piece)
            assert "cudaEventQuery" not in names and "cudaStreamSynchronize" not in names
            assert {"cudaLaunchKernel", "cuLaunchKernel", "cudaMemcpyAsync", "nccl:all_reduce",
                    "ProfilerStep#3"} & {e["name"] for e in events} <= set(names)


def test_categories_learnt_in_earlier_blocks_judge_later_ones_alike():
    """In Kineto's spelling (phase, category and name on one line), a category met once is named by its first
    16 bytes in later blocks: the same events are kept as when every block is read afresh, including a
    category that extends a wanted one, one too short to be named so (read every time), an escaped one and
    one longer than the window."""
    rng = np.random.default_rng(5)
    wanted = kineto._WANTED
    heads = [("kernel", "gemm"), ("kernels", "gemm"), ("kernel_like", "x"), ("ab", "ProfilerStep#9"),
             ("x", "aten::mm"), ("cuda_runtime", "cudaLaunchKernel"), ("cuda_runtime", "cudaEventRecord"),
             ("cuda_runtime_x", "cudaLaunchKernel"), ("cpu_op", "nccl:all_reduce"), ("cpu_op", "aten::add"),
             ("user_annotation", "ProfilerStep#3"), ("gpu_memcpy", "Memcpy HtoD"), ("c" * 40, "aten::add"),
             ("a\\\"b", "aten::mm"), ("", "ProfilerStep#4"), ("gpu_user_annotation", "x"),
             ("gpu_user_annotatiXkernel", "gemm")]
    pieces = [b'{\n    "ph": "X", "cat": "%s", "name": "%s", "pid": 1, "tid": 2,\n    "ts": 5, "dur": 1\n  }'
              % (c.encode(), n.encode()) for c, n in heads]
    separator = b"},\n  {"
    sniffed = eventstream.sniff_layout(b"[\n  " + b",\n  ".join(pieces * 2))
    assert sniffed is not None and sniffed.to_name == b'", "name": "'
    # the categories of the heads read where the layout was learnt (the escaped one and the 40 c's are not)
    assert set(sniffed.categories) == {c.encode() for c, _ in heads} - {b"", b"a\\\"b", b"c" * 40}
    unsniffed = msgspec.structs.replace(sniffed, categories=())
    for layout in (sniffed, unsniffed):  # a table that starts with those, and one that learns all of them
        table = eventstream.CategoryTable(wanted, layout)
        assert (b"cuda_runtime" in table.texts) == (layout is sniffed)  # before any block
        for _ in range(60):
            block = b",\n  ".join(pieces[i] for i in rng.integers(0, len(pieces), rng.integers(1, 30)))
            learnt = wanted.select(block, separator, layout, table)
            alone = wanted.select(block, separator, unsniffed)  # a table of this block alone
            assert (learnt.events, list(learnt.other_ranges())) == (alone.events, list(alone.other_ranges())), block
            assert learnt.events == _select_by_head_reference(block, separator, layout, wanted), block
        assert {b"kernel", b"kernels", b"kernel_like", b"cuda_runtime", b"cuda_runtime_x",
                b"cpu_op"} <= set(table.texts)
        # under 4 characters, 16 bytes would hold part of the name; over 15, not the closing quote
        assert not {b"ab", b"x", b"", b"gpu_user_annotation"} & set(table.texts)
    layout = sniffed
    # A category is named by all 16 bytes: others that share its first 8 (or all but its last) are not it.
    probes = [b"cuda_run%04d" % i for i in range(300)] + [b"cuda_runtimf", b"kernem", b"cpu_oq"]
    rows = np.frombuffer(b"".join((p + layout.to_name)[:16] for p in probes + [b"cuda_runtime"]), np.uint8)
    slots = table.slots(rows.reshape(-1, 16))
    assert (slots[:-1] == -1).all() and table.texts[slots[-1]] == b"cuda_runtime"
    names = [e["name"] for e in json.loads(wanted.select(b",\n  ".join(pieces), separator, layout, table).events)]
    assert names == ["gemm", "ProfilerStep#9", "cudaLaunchKernel", "nccl:all_reduce", "ProfilerStep#3",
                     "Memcpy HtoD", "ProfilerStep#4"]


def test_a_real_trace_keeps_every_launch_and_drops_other_runtime_calls():
    kept = _all_events(REAL[0], kineto._WANTED)
    every = _all_events(REAL[0])
    runtime = [e["name"] for e in kept if e.get("cat") == "cuda_runtime"]
    assert runtime and not [n for n in runtime if n.startswith(kineto._NOT_LAUNCHES)]
    correlated = {e["args"]["correlation"] for e in every if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")}
    launches = [e for e in every if e.get("cat") == "cuda_runtime" and e["args"].get("correlation") in correlated]
    assert launches and all(e in kept for e in launches)
    assert len(runtime) < 0.5 * sum(e.get("cat") == "cuda_runtime" for e in every)


def test_skip_heads_are_eight_bytes():
    with pytest.raises(ValueError, match="8 bytes"):
        EventFilter.of(["cuda_runtime"], skip=(["cuda_runtime"], ["cudaEvent"]))


def test_events_separated_two_ways_are_judged_by_their_keys(tmp_path):
    """A pretty-printed trace in which two events are joined by `}, {`: a piece may then hold two events,
    and its head says nothing of the second, so the heads are not trusted and no kernel is lost."""
    cpu = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 1}
    kernel = {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 2, "dur": 1, "args": {"stream": 7}}
    pretty = [json.dumps(e, indent=4).replace("\n", "\n  ") for e in (cpu, kernel) * 20]
    pretty[2] = pretty[0] + ", " + pretty[1]  # a CPU op and a kernel joined otherwise: 21 kernels
    path = tmp_path / "t.json"
    path.write_text('{"traceEvents": [\n  ' + ",\n  ".join(pretty) + "\n]}")
    kept = _all_events(str(path), kineto._WANTED)
    assert sum(e["name"] == "gemm" for e in kept) == 21


@pytest.mark.parametrize("indent", [2, None])
def test_the_watch_finds_a_flow_arrow_in_any_block_but_not_inside_an_event_read_by_its_head(tmp_path, indent):
    """Pretty-printed, the watch skips the events whose heads show them complete (most of a trace), so the
    text of a kernel's args is not taken for a flow arrow; compact, it reads every block whole."""
    kernel = {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 1, "dur": 1, "args": {"stream": 7}}
    flow = {"ph": "f", "id": 1, "pid": 0, "tid": 7, "ts": 3, "cat": "ac2g", "name": "ac2g", "bp": "e"}
    named = dict(kernel, args={"stream": 7, "origin": "ac2g"})

    def seen(events):
        path = tmp_path / "t.json"
        _write(path, events, indent)
        stream = TraceEventStream(str(path), only=kineto._WANTED, watch=(b'"ac2g"',), block_bytes=512)
        assert sum(len(block) for block in stream) == sum(e["ph"] == "X" for e in events)
        return stream.seen

    assert seen([kernel] * 150 + [flow] + [kernel] * 50)
    assert not seen([kernel] * 200)
    assert seen([kernel] * 150 + [named] + [kernel] * 50) == (indent is None)


def test_a_filter_without_phases_leaves_every_event_in_the_watched_range():
    """Only a phase the filter names shows, by the head, that an event is not (say) a flow arrow."""
    events = [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1}, {"ph": "f", "cat": "ac2g", "name": "ac2g", "ts": 2},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 3}]
    doc = json.dumps({"traceEvents": events}, indent=2).encode()
    block = doc[doc.index(b"[") + 1:doc.rindex(b"]")].strip()
    spellings = eventstream._SEPARATOR.findall(doc)
    layout = eventstream.sniff_layout(doc)
    assert list(EventFilter.of(["kernel"]).select(block, spellings[0], layout).other_ranges()) == [(0, len(block))]
    [(start, end)] = EventFilter.of(["kernel"], phases="X").select(block, spellings[0], layout).other_ranges()
    assert block[start:end].count(b'"ph"') == 1 and b'"f"' in block[start:end]
