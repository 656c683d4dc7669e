"""GPU ownership intervals as a table of their own, maintained from the ``gpu_owner`` events like the rollups.

The events stay the truth: agents send a ``gpu_owner`` event when a GPU's owner changes and re-announce every
owner each GPU_OWNER_REANNOUNCE_S. The ``owner_intervals`` table (node, gpu_index, from_ms, to_ms, last_ms and
the owner columns) folds them: one row per owner's hold of a GPU, ``to_ms`` the next row's ``from_ms`` (NULL:
still held), ``last_ms`` its newest announcement. Announcements more than :data:`LOOKBACK_MS` apart start a new
row even for the same owner (a silent agent says nothing of the time in between), which is what lets a reader
of any window take the rows whose ``last_ms`` is within LOOKBACK_MS before it and get exactly what folding the
window's events gives.

Ingest stays append-only; the writer notes the oldest ``gpu_owner`` event each committed group brings
(:class:`PendingOwners`) and the maintenance refolds from there (:func:`refold`): the latest row of each GPU
before that time, the events from LOOKBACK_MS before it (which decide whether that row continues) and every
event after it. Rows from that time on are replaced (DuckDB: deleted and inserted in one transaction;
ClickHouse: a ReplacingMergeTree versioned by the server's clock, rows that no longer exist replaced by
``is_deleted`` ones, read with ``final``), so late, out-of-order and resent events converge to the same rows.
The ``owners`` row of ``tier_state`` records the time after the newest event folded; readers refold the events
from it (or from the oldest not yet maintained, in this process) on the fly, so answers never wait for the
maintenance.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import pandas as pd

from gpuwatch.collector.store.rollups import STATE_TABLE
from gpuwatch.core import events as ev
from gpuwatch.core.columnar import ColumnarBatch

if TYPE_CHECKING:
    import duckdb

TABLE = "owner_intervals"
#: The ``tier_state`` row holding the time after the newest event folded into the table.
MARK = "owners"
OWNER_KEYS = ("namespace", "pod", "container", "job_id", "rank", "user")
#: What makes an owner: a change of any of these starts a new interval.
SAME = ("uuid", *OWNER_KEYS)
#: Readers of a window look back this far for the announcement in force at its start.
LOOKBACK_MS = int(2 * ev.GPU_OWNER_REANNOUNCE_S * 1000)
ROW_COLUMNS = ["node", "gpu_index", "from_ms", "to_ms", "last_ms", *SAME]
#: Reads events of one kind: (kind, attribute keys, since_ms) -> node, gpu_index, ts_ms and the keys as text.
EventReader = Callable[[str, Sequence[str], int | None], pd.DataFrame]


class OwnerTable(Protocol):
    """One engine's access to the table (DuckDB or ClickHouse)."""

    def mark(self) -> int | None:
        """Just after the newest event folded into the table; None before the first maintenance."""
        ...

    def rows(self, before_ms: int | None, since_last_ms: int | None) -> pd.DataFrame:
        """Rows starting before ``before_ms`` (None: all) whose last announcement is at ``since_last_ms`` or
        later (None: all), and each GPU's latest row before ``before_ms`` whatever its last announcement."""
        ...


class PendingOwners:
    """The oldest ``gpu_owner`` event committed since the table was last maintained (writer thread writes,
    readers read ``low``)."""

    def __init__(self) -> None:
        self.low: int | None = None
        # the first maintenance after opening refolds from the mark: events stored before a restart, not folded
        self.opened = True

    def note(self, batches: Sequence[ColumnarBatch]) -> None:
        """Noted before the group commits: a refold over events that then failed to land is harmless."""
        times = [e.ts_ms for b in batches for e in b.message.events if e.kind == ev.GPU_OWNER]
        if times:
            self.low = min(times) if self.low is None else min(self.low, min(times))

    def start(self, mark: int | None) -> int | None:
        """Where the table stops being current: the oldest pending event or the mark (None: never built)."""
        if mark is None:
            return None
        return mark if self.low is None else min(mark, self.low)

    def done(self, low: int | None) -> None:
        """After a maintenance that started from ``low``: clear what it covered (nothing newer came meanwhile:
        the writer thread both notes and maintains)."""
        if self.low == low:
            self.low = None
        self.opened = False


def refold(prev: pd.DataFrame, events: pd.DataFrame, start_ms: int | None) -> pd.DataFrame:
    """The rows from ``start_ms`` on (``ROW_COLUMNS``), plus the latest row before it of every GPU with events,
    brought up to date: ``prev`` holds those latest rows, ``events`` every ``gpu_owner`` event from LOOKBACK_MS
    before ``start_ms`` (None: all events, no ``prev``)."""
    if events.empty:
        return pd.DataFrame(columns=ROW_COLUMNS)
    e = events.rename(columns={"ts_ms": "from_ms"}).astype({"gpu_index": np.int64, "from_ms": np.int64})
    e = e.assign(last_ms=e["from_ms"], _seed=1, to_ms=None)
    seeds = prev.iloc[0:0]
    if start_ms is not None and len(prev):
        touched = pd.MultiIndex.from_frame(e[["node", "gpu_index"]].drop_duplicates())
        seeds = prev[pd.MultiIndex.from_frame(prev[["node", "gpu_index"]].astype({"gpu_index": np.int64}))
                     .isin(touched)]
    seeds = seeds.assign(_seed=0).astype({"gpu_index": np.int64, "from_ms": np.int64, "last_ms": np.int64})
    # the look-back's events before a seed row belong to the rows before it, which stay as they are
    began = e.merge(seeds[["node", "gpu_index", "from_ms"]].rename(columns={"from_ms": "_began"}),
                    on=["node", "gpu_index"], how="left")["_began"].to_numpy()
    e = e[~(e["from_ms"].to_numpy() < began)]
    # a seed row stands at its last announcement: the events that continue it are within LOOKBACK_MS of that
    df = pd.concat([seeds[[*ROW_COLUMNS, "_seed"]], e[[*ROW_COLUMNS, "_seed"]]], ignore_index=True)
    df = df.sort_values(["node", "gpu_index", "_seed", "last_ms"], kind="stable").reset_index(drop=True)
    for key in ("node", *SAME):
        df[key] = df[key].fillna("").astype(str).astype(object)
    gpu_same = df[["node", "gpu_index"]].eq(df[["node", "gpu_index"]].shift()).all(axis=1).to_numpy(bool)
    owner_same = df[list(SAME)].eq(df[list(SAME)].shift()).all(axis=1).to_numpy(bool)
    last = df["last_ms"].to_numpy(np.int64)
    close = np.concatenate([[False], np.diff(last) <= LOOKBACK_MS])
    group = np.cumsum(~(gpu_same & owner_same & close))
    out = df.groupby(group, sort=False).agg(
        node=("node", "first"), gpu_index=("gpu_index", "first"), from_ms=("from_ms", "first"),
        last_ms=("last_ms", "max"), **{k: (k, "first") for k in SAME}).reset_index(drop=True)
    following = out.groupby(["node", "gpu_index"], sort=False)["from_ms"].shift(-1)
    out["to_ms"] = following.astype(object).where(following.notna(), None)
    return out[ROW_COLUMNS]


def spliced(before: pd.DataFrame, folded: pd.DataFrame) -> pd.DataFrame:
    """``before`` (rows starting before the refold) with the rows ``folded`` brings in their place."""
    if before.empty:
        return folded
    key = ["node", "gpu_index", "from_ms"]
    before = before.astype({"gpu_index": np.int64, "from_ms": np.int64})
    replaced = pd.MultiIndex.from_frame(before[key]).isin(pd.MultiIndex.from_frame(folded[key]))
    parts = [p for p in (before[~replaced], folded) if len(p)]
    return pd.concat(parts, ignore_index=True)[ROW_COLUMNS] if parts else folded


def intervals(table: OwnerTable, events: EventReader, pending: PendingOwners,
              since_ms: int | None) -> pd.DataFrame:
    """node, gpu_index, from_ms, to_ms (None: open), uuid and the owner columns of the intervals holding any
    time from ``since_ms`` (None: all), in time order: the table's rows, with the events it has not folded yet
    refolded on top. A GPU's first row starts when its owner took it (not at the window's look-back)."""
    look = None if since_ms is None else max(0, int(since_ms) - LOOKBACK_MS)
    before, rows, _ = _refolded(table, events, pending.start(table.mark()), look)
    return merged(spliced(before, rows), look)


def _refolded(table: OwnerTable, events: EventReader, start_ms: int | None,
              since_last_ms: int | None) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The table's rows before ``start_ms`` (``table.rows``), the rows :func:`refold` makes from there and the
    events it read; with no ``start_ms`` (a table never built), no rows and the events from ``since_last_ms``
    (None: all) folded."""
    if start_ms is None:
        found = events(ev.GPU_OWNER, SAME, since_last_ms or None)
        return pd.DataFrame(columns=ROW_COLUMNS), refold(pd.DataFrame(columns=ROW_COLUMNS), found, None), found
    before = table.rows(start_ms, since_last_ms)
    latest = before.sort_values("from_ms", kind="stable").groupby(["node", "gpu_index"]).tail(1)
    found = events(ev.GPU_OWNER, SAME, max(0, start_ms - LOOKBACK_MS) or None)
    return before, refold(latest, found, start_ms), found


def merged(rows: pd.DataFrame, since_last_ms: int | None) -> pd.DataFrame:
    """The intervals a reader of the window from ``since_last_ms`` (plus LOOKBACK_MS) sees: rows announced
    since then, consecutive rows of one owner (split by a silence the window does not reach) joined."""
    columns = ["node", "gpu_index", "from_ms", "to_ms", *SAME]
    if since_last_ms is not None:
        rows = rows[rows["last_ms"].astype(np.int64) >= since_last_ms]
    if rows.empty:
        return pd.DataFrame(columns=columns)
    df = rows.astype({"gpu_index": int, "from_ms": np.int64}).sort_values(
        ["node", "gpu_index", "from_ms"], kind="stable").reset_index(drop=True)
    same = ["node", "gpu_index", *SAME]
    df = df[df[same].ne(df[same].shift()).any(axis=1)].reset_index(drop=True)
    following = df.groupby(["node", "gpu_index"])["from_ms"].shift(-1)
    df["to_ms"] = following.astype(object).where(following.notna(), None)
    df["rank"] = pd.to_numeric(df["rank"], errors="coerce").fillna(-1).astype(int)
    return df[columns]


def maintain(table: OwnerTable, events: EventReader, pending: PendingOwners, floor_ms: int | None,
             replace: Callable[[int | None, pd.DataFrame, int], None]) -> None:
    """Refold the table from the oldest pending event (or the mark) and have ``replace(start, rows, mark)``
    store the rows in place of those from ``start`` on and of the same keys (writer thread)."""
    low, mark = pending.low, table.mark()
    if low is None and mark is not None and not pending.opened:
        return  # nothing new since the last refold
    start = pending.start(mark)
    if start is not None and floor_ms is not None:  # older events are past retention: their rows are final
        start = max(start, floor_ms)
    _, rows, found = _refolded(table, events, start, start)  # each GPU's latest row before start seeds it
    after = int(found["ts_ms"].max()) + 1 if len(found) else None  # the table holds every event before it
    if after is not None or mark is None:
        replace(start, rows, max(m for m in (mark, after, 0) if m is not None))
    pending.done(low)


def _select(quote: str) -> str:
    return ", ".join(f"{quote}{c}{quote}" for c in ROW_COLUMNS)


_DUCK_COLUMNS, _CH_COLUMNS = _select('"'), _select("`")


def _open_as_none(rows: pd.DataFrame) -> pd.DataFrame:
    """``to_ms`` as ints and None (an open interval), as :func:`refold` writes it."""
    to = [None if pd.isna(v) else int(v) for v in rows["to_ms"]]
    return rows.assign(to_ms=pd.Series(to, index=rows.index, dtype=object))


# ---- DuckDB ------------------------------------------------------------------------------------------------
def duckdb_ddl() -> list[str]:
    owners = ", ".join(f'"{k}" VARCHAR NOT NULL' for k in SAME)
    return [f"""CREATE TABLE IF NOT EXISTS {TABLE} (
    node VARCHAR NOT NULL, gpu_index INTEGER NOT NULL, from_ms BIGINT NOT NULL, to_ms BIGINT, last_ms BIGINT NOT NULL,
    {owners})"""]  # keyed by (node, gpu_index, from_ms), kept by duckdb_replace: DuckDB rejects a key deleted and
    # inserted again in one transaction


class DuckDBOwners:
    """Reads through the store's cursors (``query``), writes on the writer's connection."""

    def __init__(self, query: Callable[[str, dict[str, Any]], pd.DataFrame]) -> None:
        self._query = query

    def mark(self) -> int | None:
        df = self._query(f"SELECT cutoff_ms FROM {STATE_TABLE} WHERE name = $name", {"name": MARK})
        return None if df.empty else int(df["cutoff_ms"].iloc[0])

    def rows(self, before_ms: int | None, since_last_ms: int | None) -> pd.DataFrame:
        return _open_as_none(self._query(f"""
            SELECT {_DUCK_COLUMNS} FROM {TABLE}
            WHERE ($before IS NULL OR from_ms < $before) AND ($since IS NULL OR last_ms >= $since)
            UNION
            SELECT {_DUCK_COLUMNS} FROM {TABLE} WHERE from_ms < $before
            QUALIFY row_number() OVER (PARTITION BY node, gpu_index ORDER BY from_ms DESC) = 1""",
                           {"before": before_ms, "since": since_last_ms}))


def duckdb_replace(con: duckdb.DuckDBPyConnection, start_ms: int | None, rows: pd.DataFrame, mark: int) -> None:
    """Replace the rows from ``start_ms`` (None: all) and those of ``rows``' keys by ``rows``, and record the
    mark, in one transaction."""
    con.register("_owner_rows", rows.astype({"to_ms": "Int64"}))
    try:
        con.begin()
        try:
            con.execute(f"DELETE FROM {TABLE} WHERE $start IS NULL OR from_ms >= $start", {"start": start_ms})
            con.execute(f"""DELETE FROM {TABLE} AS t USING _owner_rows AS n
                WHERE t.node = n.node AND t.gpu_index = n.gpu_index AND t.from_ms = n.from_ms""")
            con.execute(f"INSERT INTO {TABLE} BY NAME SELECT {_DUCK_COLUMNS} FROM _owner_rows")
            con.execute(f"INSERT OR REPLACE INTO {STATE_TABLE} VALUES ($name, $mark)", {"name": MARK, "mark": mark})
            con.commit()
        except BaseException:
            con.rollback()
            raise
    finally:
        con.unregister("_owner_rows")


def duckdb_expire(con: duckdb.DuckDBPyConnection, before_ms: int) -> int:
    """Delete the intervals that ended before ``before_ms``; return how many."""
    return int(con.execute(f"DELETE FROM {TABLE} WHERE to_ms < ?", [before_ms]).fetchall()[0][0])


# ---- ClickHouse ----------------------------------------------------------------------------------------------
def clickhouse_ddl() -> dict[str, tuple[str, str]]:
    """The table in clickhouse.py's ``_ddl`` form: a refolded row replaces the older one (by ``built_ns``, the
    server's clock), a row the refold no longer has is replaced by an ``is_deleted`` one."""
    owners = ", ".join(f"`{k}` LowCardinality(String)" for k in SAME)
    return {TABLE: (f"""node LowCardinality(String), gpu_index Int32, from_ms Int64, to_ms Nullable(Int64),
    last_ms Int64, {owners}, built_ns Int64, is_deleted UInt8""",
                    "Replacing{engine}(built_ns, is_deleted) ORDER BY (node, gpu_index, from_ms)")}


class ClickHouseOwners:
    """Reads with the store's ``final = 1`` queries."""

    def __init__(self, query: Callable[[str, dict[str, Any]], pd.DataFrame]) -> None:
        self._query = query

    def mark(self) -> int | None:
        df = self._query(f"SELECT max(cutoff_ms) AS c, count() AS n FROM {STATE_TABLE} WHERE name = {{name:String}}",
                         {"name": MARK})
        return int(df["c"].iloc[0]) if int(df["n"].iloc[0]) else None

    def rows(self, before_ms: int | None, since_last_ms: int | None) -> pd.DataFrame:
        before = before_ms if before_ms is not None else 2**62
        df = self._query(f"""
            SELECT {_CH_COLUMNS} FROM {TABLE}
            WHERE from_ms < {{before:Int64}} AND last_ms >= {{since:Int64}}
            UNION DISTINCT
            SELECT {_CH_COLUMNS} FROM (SELECT * FROM {TABLE} WHERE from_ms < {{before:Int64}}
                                        ORDER BY from_ms DESC LIMIT 1 BY node, gpu_index)""",
                         {"before": before, "since": since_last_ms if since_last_ms is not None else -2**62})
        return _open_as_none(df)


def clickhouse_replace(query: Callable[[str, dict[str, Any]], pd.DataFrame],
                       insert: Callable[[str, pd.DataFrame], None], start_ms: int | None, rows: pd.DataFrame,
                       mark: int) -> None:
    """Insert ``rows`` and deleted rows for those from ``start_ms`` on that ``rows`` no longer has, one version
    (the server's clock now); then the mark."""
    version = int(query("SELECT toUnixTimestamp64Nano(now64(9)) AS v", {})["v"].iloc[0])
    old = query(f"SELECT node, gpu_index, from_ms FROM {TABLE} WHERE from_ms >= {{start:Int64}}",
                {"start": start_ms if start_ms is not None else -2**62})
    key = ["node", "gpu_index", "from_ms"]
    kept = rows.astype({"gpu_index": np.int64, "from_ms": np.int64})
    if len(old):
        old = old.astype({"gpu_index": np.int64, "from_ms": np.int64})
        gone = old[~pd.MultiIndex.from_frame(old[key]).isin(pd.MultiIndex.from_frame(kept[key]))]
    else:
        gone = old
    deleted = gone.assign(to_ms=None, last_ms=gone["from_ms"], **{k: "" for k in SAME}, is_deleted=1)
    out = pd.concat([p for p in (kept.assign(is_deleted=0), deleted) if len(p)] or [kept.assign(is_deleted=0)],
                    ignore_index=True)
    if len(out):
        out = out.assign(built_ns=version).astype({"gpu_index": np.int32, "from_ms": np.int64, "last_ms": np.int64,
                                                   "to_ms": "Int64", "is_deleted": np.uint8})
        insert(TABLE, out[[*ROW_COLUMNS, "built_ns", "is_deleted"]])
    insert(STATE_TABLE, pd.DataFrame({"name": [MARK], "cutoff_ms": [mark]}))


def clickhouse_expire(query: Callable[[str, dict[str, Any]], pd.DataFrame],
                      command: Callable[[str, dict[str, Any]], Any], target: str, before_ms: int) -> int:
    """Delete the intervals that ended before ``before_ms`` (``target``: the table, or its local tables on a
    cluster); return how many."""
    where, params = "to_ms < {before:Int64}", {"before": before_ms}
    found = int(query(f"SELECT count() AS n FROM {TABLE} WHERE {where}", params)["n"].iloc[0])
    if found:
        command(f"DELETE FROM {target} WHERE {where}", params)
    return found
