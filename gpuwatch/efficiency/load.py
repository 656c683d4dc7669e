"""`load_paths()`: files or folders of Kineto traces and/or span tables -> rank timelines."""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpuwatch.efficiency.forking import Pending, forkable
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
    then, where a plain fork is safe (`forking.forkable`), see `_load_in_forks`. One file is read in this
    process: no worker, and the process-pool modules are not even imported."""
    files = expand_paths(paths)
    default_rank = 0 if len(files) == 1 else None
    jobs: list[_Job] = [(path, functools.partial(progress, path) if progress else None) for path in files]
    workers = min(len(files), workers or os.cpu_count() or 1)
    if workers <= 1:
        return [tl for path, report in jobs for tl in load_file(path, progress=report, default_rank=default_rank)]
    if fork and forkable():
        return _load_in_forks(jobs, workers, default_rank)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("forkserver")
    # The server imports the reader once; each worker forked from it starts with it (else every worker
    # imports numpy and the reader on its first file).
    context.set_forkserver_preload(["gpuwatch.efficiency.traces.kineto"])
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        loaded = pool.map(functools.partial(_load_one, default_rank=default_rank), jobs)
        return [tl for found in loaded for tl in found]


_Job = tuple[str, Callable[[int], None] | None]  # a file and its progress report


def _load_in_forks(jobs: list[_Job], workers: int, default_rank: int | None) -> list[RankTimeline]:
    """The files shared out among this process and `workers - 1` plain forked copies of it, by size (the
    largest first, each to the least loaded share). A copy starts at once with what this process has
    imported, and this process, which would otherwise wait, reads a share itself. A process pool cost the
    8-rank set 30 ms to start its workers (importing it, its threads and queues) and 3-7 ms between
    files, a tenth of the load."""
    shares: list[list[int]] = [[] for _ in range(workers)]
    loads = [0] * workers
    sizes = [_size(path) for path, _ in jobs]
    for index in sorted(range(len(jobs)), key=lambda i: -sizes[i]):
        least = loads.index(min(loads))
        shares[least].append(index)
        loads[least] += sizes[index]
    copies = [Pending(_load_share, [(i, jobs[i]) for i in share], default_rank, fork=True)
              for share in shares[1:] if share]
    try:
        loaded = _load_share([(i, jobs[i]) for i in shares[0]], default_rank)
        for copy in copies:
            loaded.update(copy.result())
    finally:
        for copy in copies:
            copy.cancel()  # after an error here: the copies' work is no longer wanted
    return [tl for index in range(len(jobs)) for tl in loaded[index]]


def _load_share(share: list[tuple[int, _Job]], default_rank: int | None) -> dict[int, list[RankTimeline]]:
    return {index: _load_one(job, default_rank) for index, job in share}


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0  # its reader says what is wrong


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
