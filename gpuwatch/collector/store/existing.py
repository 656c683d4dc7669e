"""Opening a store that must already exist, for commands that read one (``gpuwatch export``).

:func:`~gpuwatch.collector.store.open_store` creates what it does not find, as a collector should; a reader
given a wrong path must instead say so, leave the path as it was, and name a store that a running collector
holds, in one line for either engine.
"""
from __future__ import annotations

import fcntl
from pathlib import Path
from typing import Any

from gpuwatch.collector.store import open_store, redacted
from gpuwatch.collector.store.base import Store
from gpuwatch.core.errors import UserError

#: What each engine says when another process holds the store (DuckDB's file lock, chdb's status file).
_HELD = ("could not set lock on file", "another server instance in same directory is already running")


def open_existing(url: str, **options: Any) -> Store:
    """The gpuwatch store at ``url`` (a DuckDB file, ``duckdb:///PATH``, ``chdb:///DIR`` or a ClickHouse
    server), opened only once it is known to be one; UserError (one line) when it is missing, held by a
    running collector, or something else."""
    if url.startswith("chdb://"):
        _check_chdb(Path(url.removeprefix("chdb://")), url)
    elif "://" not in url or url.startswith("duckdb://"):
        _check_duckdb(Path(url.removeprefix("duckdb://")))
    try:
        return open_store(url, **options)
    except UserError as exc:
        if any(held in str(exc).lower() for held in _HELD):
            raise _in_use(redacted(url)) from None
        raise


def _in_use(name: str) -> UserError:
    return UserError(f"{name}: the store is in use (a running collector holds its lock); stop the collector or "
                     "export a copy of the store")


def _check_chdb(folder: Path, url: str) -> None:
    from gpuwatch.collector.store.clickhouse import DEFAULT_DATABASE

    if not folder.is_dir():
        raise UserError(f"{url}: no such chdb store directory")
    if not (folder / "metadata" / f"{DEFAULT_DATABASE}.sql").is_file():
        raise UserError(f"{url}: not a gpuwatch collector store (no {DEFAULT_DATABASE} database in the directory)")
    # the engine holds an exclusive flock on its status file while it runs: asked here, the engine (which
    # would print its own error to stderr before failing) is not started on a held directory
    status = folder / "status"
    if status.is_file():
        with status.open("rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _in_use(url) from None
            fcntl.flock(f, fcntl.LOCK_UN)


def _check_duckdb(path: Path) -> None:
    """A DuckDB file holding the store's tables, looked at read-only (a foreign database is left unchanged)."""
    import duckdb

    if not path.is_file():
        raise UserError(f"{path}: no such collector store file")
    try:
        con = duckdb.connect(str(path), read_only=True)
    except duckdb.IOException as exc:
        if "lock" in str(exc).lower():
            raise _in_use(str(path)) from None
        raise UserError(f"{path}: cannot open the store: {_first_line(exc)}") from None
    except duckdb.Error as exc:
        raise UserError(f"{path}: not a DuckDB database: {_first_line(exc)}") from None
    try:
        found = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    finally:
        con.close()
    missing = {"gpu_samples", "host_samples", "events", "spans", "gpus"} - found
    if missing:
        raise UserError(f"{path}: not a gpuwatch collector store (no table {', '.join(sorted(missing))})")


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
