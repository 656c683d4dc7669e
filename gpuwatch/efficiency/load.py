"""`load_paths()`: files or folders of Kineto traces and/or span tables -> rank timelines."""
from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from gpuwatch.efficiency.timeline import RankTimeline
from gpuwatch.core.errors import UserError

if TYPE_CHECKING:
    from gpuwatch.efficiency.traces.eventstream import TraceContent

TRACE_ENDINGS = (".json", ".json.gz")
SPAN_ENDINGS = (".csv", ".parquet", ".pq")


def expand_paths(paths: list[str]) -> list[str]:
    """Files as given, and each folder's trace and span-table files (sorted)."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(TRACE_ENDINGS + SPAN_ENDINGS))
            if not found:
                raise UserError(f"{path}: folder holds no .json, .json.gz, .csv or .parquet files")
            files.extend(found)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise UserError(f"{path}: no such file or folder")
    return files


def load_paths(paths: list[str], *, progress: Callable[[str, int], None] | None = None,
               map_files: Callable[..., Iterable[list[RankTimeline]]] = map) -> list[RankTimeline]:
    """Rank timelines from Kineto JSON (plain/gz) and CSV/Parquet span tables, in the order of the files;
    `progress(file, bytes)` is called as large files are read.

    The files are read one after another in this process. A caller that wants them read in parallel passes
    its executor's `map` as `map_files` (the `analyze` command: a process pool); then `progress` must be a
    module-level function, as the reading function and its arguments go to the workers."""
    files = expand_paths(paths)
    read = functools.partial(_load_one, default_rank=0 if len(files) == 1 else None)
    jobs = [(path, functools.partial(progress, path) if progress else None) for path in files]
    return [tl for found in map_files(read, jobs) for tl in found]


_Job = tuple[str, Callable[[int], None] | None]  # a file and its progress report


def _load_one(job: _Job, default_rank: int | None) -> list[RankTimeline]:
    path, report = job
    return load_file(path, progress=report, default_rank=default_rank)


def load_file(path: str, *, progress: Callable[[int], None] | None = None,
              default_rank: int | None = None, content: TraceContent | None = None) -> list[RankTimeline]:
    """The rank timelines of one file: a span table (by extension: every rank in it) or a Kineto trace (one
    rank: `default_rank` when the trace does not say which). With `content` (an upload: bytes or a seekable
    binary file) that is read instead, and `path` only names it. Loaders are imported on use, so a Kineto run
    never imports pandas."""
    if path.endswith(SPAN_ENDINGS):
        from gpuwatch.efficiency.traces.spans import read_span_table, timelines_from_spans

        return timelines_from_spans(read_span_table(path, content), source=path)
    from gpuwatch.efficiency.traces.kineto import load_kineto

    return [load_kineto(path, progress=progress, default_rank=default_rank, content=content)]
