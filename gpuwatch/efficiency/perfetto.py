"""The analysed job as a Chrome trace (opens in Perfetto): one process per rank, with one track per
category (the classified partition) and one track per GPU stream holding every activity as a slice named
after its kernel, with its kind, collective metadata, launch, correlation, step and wait as args."""
from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from gpuwatch.efficiency.partition import CATEGORIES, Partition
from gpuwatch.efficiency.result import Analysis
from gpuwatch.efficiency.timeline import KIND_NAMES, UNKNOWN, RankTimeline

_STREAM_TID = 100  # stream tracks follow the category tracks


def perfetto_trace(analysis: Analysis) -> bytes:
    """Chrome-trace JSON of what `analyze(..., keep_segments=True)` kept."""
    if analysis.partitions is None or analysis.timelines is None:
        raise ValueError("perfetto_trace needs analyze(..., keep_segments=True)")
    events: list[dict[str, Any]] = []
    for entry, part, tl in zip(analysis.ranks, analysis.partitions, analysis.timelines):
        events.extend(_category_events(entry.rank, part))
        events.extend(_activity_events(tl))
    return orjson.dumps({"traceEvents": events, "displayTimeUnit": "ms"})


def _category_events(rank: int, part: Partition) -> list[dict[str, Any]]:
    events = [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}]
    events += [
        {"ph": "M", "name": "thread_name", "pid": rank, "tid": i, "args": {"name": name}}
        for i, name in enumerate(CATEGORIES)
    ]
    assert part.segments is not None, "partitioned without keep_segments"
    starts, ends, cats = part.segments
    base = part.origin_us
    events += [
        {"ph": "X", "name": CATEGORIES[c], "cat": CATEGORIES[c], "pid": rank, "tid": int(c),
         "ts": base + s / 1000.0, "dur": (e - s) / 1000.0}
        for s, e, c in zip(starts.tolist(), ends.tolist(), cats.tolist())
    ]
    return events


def _activity_events(tl: RankTimeline) -> list[dict[str, Any]]:
    streams = np.unique(tl.stream)
    tid_of = {int(s): _STREAM_TID + i for i, s in enumerate(streams)}
    events = [{"ph": "M", "name": "thread_name", "pid": tl.rank, "tid": tid,
               "args": {"name": f"stream {s}" if s != UNKNOWN else "stream ?"}} for s, tid in tid_of.items()]
    names, types, groups = tl.kernel_names(), tl.type_names(), tl.group_names()
    columns = zip(tl.start_us.tolist(), tl.end_us.tolist(), tl.kind.tolist(), tl.stream.tolist(), names,
                  types, groups, tl.seq.tolist(), tl.nbytes.tolist(), tl.launch_us.tolist(),
                  tl.correlation.tolist(), tl.step.tolist())
    for start, end, kind, stream, name, ctype, group, seq, nbytes, launch, corr, step in columns:
        args = {"kind": KIND_NAMES[kind], "stream": stream}
        if ctype:
            args["collective"] = ctype
        if group:
            args["process_group"] = group
        for key, value in (("seq", seq), ("bytes", nbytes), ("correlation", corr), ("step", step)):
            if value != UNKNOWN:
                args[key] = value
        if launch == launch:  # not NaN
            args["launch_us"] = launch
        events.append({"ph": "X", "name": name or KIND_NAMES[kind], "cat": f"gpu_{KIND_NAMES[kind]}", "pid": tl.rank,
                       "tid": tid_of[stream], "ts": start, "dur": end - start, "args": args})
    return events
