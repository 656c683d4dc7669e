"""The SQL that DuckDB and ClickHouse spell differently, so that a query is written once (store/queries.py).

A query names what it means (the epoch milliseconds of a time, the last non-NULL value by time, a time
bound that may be absent) and the engine's :class:`Dialect` spells it: function names, parameter placeholders
(DuckDB ``$name``, ClickHouse ``{name:Type}``) and how an absent bound is passed (DuckDB: NULL, tested in
the query; ClickHouse: a far bound, so the comparison stays a plain range its primary key can use).
"""
from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gpuwatch.core.spans import TEXT_SPAN_COLUMNS

if TYPE_CHECKING:
    import pandas as pd

#: ClickHouse's bounds for an absent time: before any sample, and far in the future (ms).
_CH_NO_LOWER_MS = -1
_CH_NO_UPPER_MS = 2**62 // 1000
_CH_NO_LIMIT = 2**62


def ms_to_datetime(ms: int) -> dt.datetime:
    """Epoch ms as a naive UTC datetime (DuckDB TIMESTAMP has no zone)."""
    return dt.datetime(1970, 1, 1) + dt.timedelta(milliseconds=ms)


class Dialect:
    """The DuckDB spelling; :class:`ClickHouseDialect` overrides what ClickHouse spells otherwise."""

    name = "duckdb"
    #: Appended to a query with outer joins, so that a missing right side reads as NULL (not a default value).
    join_nulls = ""
    #: Appended to a read whose answer rows stored twice cannot change (a newest time, whether any row exists):
    #: ClickHouse then reads without folding them, and answers it from its parts' metadata.
    unfolded = ""

    def param(self, name: str, ch_type: str) -> str:
        """The placeholder of parameter ``name`` (``ch_type``: its ClickHouse type)."""
        return f"${name}"

    def epoch_ms(self, expr: str) -> str:
        return f"epoch_ms({expr})"

    def epoch_us(self, expr: str) -> str:
        return f"epoch_us({expr})"

    def arg_max(self, value: str, by: str) -> str:
        return f"arg_max({value}, {by})"

    def last(self, value: str, by: str) -> str:
        """``value`` at the greatest ``by`` among rows where it is not NULL."""
        return f"arg_max({value}, {by})"

    def nullable(self, expr: str) -> str:
        """``expr`` in a type that holds NULL too (to unite it with NULLs)."""
        return expr

    def int64(self, expr: str) -> str:
        return f"CAST({expr} AS BIGINT)"

    def count_distinct(self, expr: str, where: str | None = None) -> str:
        return f"count(DISTINCT {expr})" + (f" FILTER (WHERE {where})" if where else "")

    def sorted_set(self, expr: str) -> str:
        """The distinct values of ``expr`` in a group, as a sorted list."""
        return f"list_sort(list(DISTINCT {expr}))"

    def contains(self, array: str, value: str) -> str:
        return f"list_contains({array}, {value})"

    def in_list(self, column: str, name: str) -> str:
        """``column`` in the string list parameter ``name`` (None or empty: any); see :meth:`list_value`."""
        return f"(${name} IS NULL OR list_contains(${name}, {column}))"

    def list_value(self, values: Sequence[str] | None) -> Any:
        return list(values) if values else None

    def limit(self, n: int | None) -> Any:
        """The value of a ``LIMIT`` parameter (None or 0: no limit)."""
        return n if n else None

    def text(self, expr: str) -> str:
        """``expr`` (a JSON column) as text."""
        return f"{expr}::VARCHAR"

    def json_text(self, doc: str, key: str) -> str:
        return f"{doc}->>'{key}'"

    def json_int(self, doc: str, key: str) -> str:
        return f"CAST({doc}->>'{key}' AS INTEGER)"

    def json_float(self, doc: str, key: str) -> str:
        return f"CAST({doc}->>'{key}' AS DOUBLE)"

    def json_int_or_null(self, doc: str, key: str) -> str:
        """The integer under ``key`` of a JSON text, NULL where absent or not a number."""
        return f"TRY_CAST({doc}->>'{key}' AS BIGINT)"

    def null_int32(self) -> str:
        """A NULL of a nullable 32-bit integer column."""
        return "NULL::INTEGER"

    def minute(self, expr: str) -> str:
        """The time ``expr`` truncated to its minute."""
        return f"date_trunc('minute', {expr})"

    def at(self, name: str) -> str:
        """The time parameter ``name`` (epoch ms, always given; its value from :meth:`time`)."""
        return f"${name}"

    def since(self, column: str, name: str, *, strict: bool = False) -> str:
        """``column`` after the time parameter ``name`` (epoch ms, None: no bound); see :meth:`time`."""
        return f"(${name} IS NULL OR {column} {'>' if strict else '>='} ${name})"

    def until(self, column: str, name: str) -> str:
        """``column`` at or before the time parameter ``name`` (epoch ms, None: no bound)."""
        return f"(${name} IS NULL OR {column} <= ${name})"

    def span_frame(self, df: pd.DataFrame) -> pd.DataFrame:
        """Span rows as the stores return them: text columns as plain object strings."""
        return df

    def time(self, ms: int | None, *, upper: bool = False) -> Any:
        """The value of a time parameter used by :meth:`since` (``upper`` False) or :meth:`until`."""
        return None if ms is None else ms_to_datetime(ms)


class ClickHouseDialect(Dialect):
    name = "clickhouse"
    join_nulls = " SETTINGS join_use_nulls = 1"
    unfolded = " SETTINGS final = 0"

    def param(self, name: str, ch_type: str) -> str:
        return f"{{{name}:{ch_type}}}"

    def epoch_ms(self, expr: str) -> str:
        return f"toInt64(toUnixTimestamp64Milli({expr}))"

    def epoch_us(self, expr: str) -> str:
        return f"toInt64(toUnixTimestamp64Micro({expr}))"

    def arg_max(self, value: str, by: str) -> str:
        return f"argMax({value}, {by})"

    def last(self, value: str, by: str) -> str:
        return f"argMaxIf({value}, {by}, isNotNull({value}))"

    def nullable(self, expr: str) -> str:
        return f"toNullable({expr})"

    def int64(self, expr: str) -> str:
        return f"toInt64({expr})"

    def count_distinct(self, expr: str, where: str | None = None) -> str:
        return f"toInt64(uniqExactIf({expr}, {where}))" if where else f"toInt64(uniqExact({expr}))"

    def sorted_set(self, expr: str) -> str:
        return f"arraySort(groupUniqArray({expr}))"

    def contains(self, array: str, value: str) -> str:
        return f"has({array}, {value})"

    def in_list(self, column: str, name: str) -> str:
        return f"(empty({{{name}:Array(String)}}) OR has({{{name}:Array(String)}}, {column}))"

    def list_value(self, values: Sequence[str] | None) -> Any:
        return list(values or [])

    def limit(self, n: int | None) -> Any:
        return n or _CH_NO_LIMIT

    def text(self, expr: str) -> str:
        return expr

    def json_text(self, doc: str, key: str) -> str:
        return f"JSONExtractString({doc}, '{key}')"

    def json_int(self, doc: str, key: str) -> str:
        return f"toInt32(JSONExtractInt({doc}, '{key}'))"

    def json_float(self, doc: str, key: str) -> str:
        return f"JSONExtractFloat({doc}, '{key}')"

    def json_int_or_null(self, doc: str, key: str) -> str:
        return f"toInt64OrNull(JSONExtractString({doc}, '{key}'))"

    def null_int32(self) -> str:
        return "CAST(NULL, 'Nullable(Int32)')"

    def minute(self, expr: str) -> str:
        return f"toStartOfMinute({expr})"

    def at(self, name: str) -> str:
        return f"fromUnixTimestamp64Milli({{{name}:Int64}})"

    def since(self, column: str, name: str, *, strict: bool = False) -> str:
        return f"{column} {'>' if strict else '>='} {self.at(name)}"

    def until(self, column: str, name: str) -> str:
        return f"{column} <= {self.at(name)}"

    def span_frame(self, df: pd.DataFrame) -> pd.DataFrame:
        for column in TEXT_SPAN_COLUMNS:
            if column in df.columns:
                df[column] = df[column].astype(object)
        return df

    def time(self, ms: int | None, *, upper: bool = False) -> Any:
        if ms is not None:
            return ms
        return _CH_NO_UPPER_MS if upper else _CH_NO_LOWER_MS


DUCKDB = Dialect()
CLICKHOUSE = ClickHouseDialect()
