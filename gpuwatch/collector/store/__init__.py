"""The collector's stores: one interface (:class:`~gpuwatch.collector.store.base.Store`), two engines.

:func:`open_store` turns a ``--store`` URL into a store: a path or ``duckdb:///PATH`` is the embedded
DuckDB file, ``chdb:///DIR`` the in-process ClickHouse engine, ``clickhouse://[user:password@]host:8123/db``
(``clickhouses://`` for HTTPS) a ClickHouse server or cluster.
"""
from __future__ import annotations

import re
from typing import Any

from gpuwatch.collector.store.base import Store
from gpuwatch.core.errors import UserError

CLICKHOUSE_SCHEMES = ("chdb://", "clickhouse://", "clickhouses://")


def open_store(url: str, **options: Any) -> Store:
    """The store ``url`` names, opened with every table created; UserError for a URL it cannot open."""
    if url.startswith(CLICKHOUSE_SCHEMES):
        from gpuwatch.collector.store.clickhouse import ClickHouseStore

        return ClickHouseStore(url, **options)
    if "://" in url and not url.startswith("duckdb://"):
        raise UserError(f"--store {url}: unknown scheme (use a path, duckdb:///PATH, chdb:///DIR or "
                        "clickhouse://[user:password@]host:8123/db)")
    from gpuwatch.collector.store.duckdb import DuckDBStore

    options.pop("clickhouse_cluster", None)
    return DuckDBStore(url.removeprefix("duckdb://"), **options)


def redacted(url: str) -> str:
    """``url`` with any password replaced by ***, for logs and messages."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)
