"""The classified timeline as a Chrome trace (opens in Perfetto): one process per rank, one track per category."""
from __future__ import annotations

import orjson

from gpuwatch.collector.efficiency.partition import CATEGORIES, Partition


def perfetto_trace(doc: dict) -> bytes:
    """Chrome-trace JSON of the segments kept by `analyze(..., keep_segments=True)`."""
    events: list[dict] = []
    for entry, part in zip(doc["ranks"], doc["_partitions"]):
        events.extend(_rank_events(entry["rank"], part))
    return orjson.dumps({"traceEvents": events, "displayTimeUnit": "ms"})


def _rank_events(rank: int, part: Partition) -> list[dict]:
    events = [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}]
    events += [
        {"ph": "M", "name": "thread_name", "pid": rank, "tid": i, "args": {"name": name}}
        for i, name in enumerate(CATEGORIES)
    ]
    starts, ends, cats = part.segments
    base = part.origin_us
    events += [
        {"ph": "X", "name": CATEGORIES[c], "cat": CATEGORIES[c], "pid": rank, "tid": int(c),
         "ts": base + s / 1000.0, "dur": (e - s) / 1000.0}
        for s, e, c in zip(starts.tolist(), ends.tolist(), cats.tolist())
    ]
    return events
