"""`load_paths()`: files or folders of Kineto traces and/or span tables -> rank timelines."""
from __future__ import annotations

import os
from collections.abc import Callable

from gpuwatch.collector.efficiency.timeline import RankTimeline
from gpuwatch.errors import UserError

_TRACE_ENDINGS = (".json", ".json.gz")
_SPAN_ENDINGS = (".csv", ".parquet", ".pq")


def expand_paths(paths: list[str]) -> list[str]:
    """Files as given, and each folder's trace and span-table files (sorted)."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(_TRACE_ENDINGS + _SPAN_ENDINGS))
            if not found:
                raise UserError(f"{path}: folder holds no .json, .json.gz, .csv or .parquet files")
            files.extend(found)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise UserError(f"{path}: no such file or folder")
    return files


def load_paths(paths: list[str], *, progress: Callable[[str, int], None] | None = None) -> list[RankTimeline]:
    """Rank timelines from Kineto JSON (plain/gz) and CSV/Parquet span tables; `progress(file, bytes)`
    is called as large files are read."""
    files = expand_paths(paths)
    timelines: list[RankTimeline] = []
    for path in files:
        if path.endswith(_SPAN_ENDINGS):
            from gpuwatch.collector.traces.spans import read_span_table, timelines_from_spans

            timelines.extend(timelines_from_spans(read_span_table(path), source=path))
        else:
            from gpuwatch.collector.traces.kineto import load_kineto

            report = (lambda n, p=path: progress(p, n)) if progress else None
            timelines.append(load_kineto(path, progress=report, default_rank=0 if len(files) == 1 else None))
    return timelines
