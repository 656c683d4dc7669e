"""`load_paths()`: files or folders of Kineto traces and/or span tables -> rank timelines."""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpuwatch.efficiency.forking import forkable
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
               workers: int | None = None, fork: bool = False) -> list[RankTimeline]:
    """Rank timelines from Kineto JSON (plain/gz) and CSV/Parquet span tables; `progress(file, bytes)`
    is called as large files are read (it must be a module-level function to be used from workers).

    Several files are read by up to `workers` processes at once (default: one per CPU): parsing is
    CPU-bound Python, and a rank's timeline is a few arrays, cheap to send back. Workers come from a fork
    server, not a plain fork: the caller may be a collector or a test with gRPC threads running, and a
    forked copy of those crashes. A caller that runs nothing else (the `analyze` command) passes `fork=True`:
    then, where a plain fork is safe (`forking.forkable`), the workers are forked copies of it that start at once
    with what it has imported, instead of waiting for a fork server to start an interpreter and import the
    reader (half a second of a 2-rank set on a busy 2-core machine). One file is read in this process: no
    worker, and the process-pool modules are not even imported."""
    files = expand_paths(paths)
    default_rank = 0 if len(files) == 1 else None
    jobs = [(path, functools.partial(progress, path) if progress else None) for path in files]
    workers = min(len(files), workers or os.cpu_count() or 1)
    if workers <= 1:
        return [tl for path, report in jobs for tl in load_file(path, progress=report, default_rank=default_rank)]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if fork and forkable():
        context = multiprocessing.get_context("fork")
    else:
        context = multiprocessing.get_context("forkserver")
        # The server imports the reader once; each worker forked from it starts with it (else every worker
        # imports numpy and the reader on its first file).
        context.set_forkserver_preload(["gpuwatch.efficiency.traces.kineto"])
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        loaded = pool.map(functools.partial(_load_one, default_rank=default_rank), jobs)
        return [tl for found in loaded for tl in found]


def _load_one(job: tuple[str, Callable[[int], None] | None], default_rank: int | None) -> list[RankTimeline]:
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
