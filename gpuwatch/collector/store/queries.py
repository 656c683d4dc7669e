"""The store's read queries written once, for both engines: the SQL text here, the spelling in each engine's
:class:`~gpuwatch.collector.store.dialect.Dialect`.

An engine mixes :class:`SqlQueries` in and provides ``query_df`` (run a read, answer a DataFrame) and its
``dialect``. Queries whose shape differs between the engines beyond spelling (joins that need ClickHouse's
``join_use_nulls``, tiered reads, the writes) stay in the engine modules.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import pandas as pd

from gpuwatch.collector.store import rollups
from gpuwatch.collector.store.dialect import Dialect
from gpuwatch.collector.store.latest_values import LatestValues
from gpuwatch.core import events as event_kinds
from gpuwatch.core import fields
from gpuwatch.core.errors import NotFound, UserError

#: The event kinds gpuwatch defines; a kind neither among them nor ever stored is a typo.
KNOWN_EVENT_KINDS = frozenset(v for k, v in vars(event_kinds).items() if k.isupper() and isinstance(v, str))

_FATAL = f"""(kind = '{event_kinds.GPU_LOST}' OR (kind = '{event_kinds.XID}' AND {{contains}}))"""


class SqlQueries:
    """The read queries both engines answer with the same SQL, spelled by ``dialect``."""

    dialect: ClassVar[Dialect]
    latest_values: LatestValues  # the engine's, made when it opens

    def query_df(self, sql: str, params: dict[str, Any] | None = None) -> pd.DataFrame:
        raise NotImplementedError

    def _raw_cutoff_ms(self) -> int | None:
        """Where raw GPU samples begin (epoch ms) once older ones were rolled up and expired; None: all raw."""
        raise NotImplementedError

    def _records(self, sql: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Rows as plain dicts with None (not NaN) for SQL NULL, ready for JSON and protobuf."""
        df = self.query_df(sql, params)
        return df.astype(object).where(df.notna(), None).to_dict("records")

    # ---- inventory -------------------------------------------------------------------------------------
    def nodes(self) -> list[dict[str, Any]]:
        """Per node: GPUs in the inventory, gpu_samples rows, last batch time (ms), agent and its last sequence."""
        d = self.dialect
        return self._records(f"""
            WITH s AS (SELECT node, count(*) AS samples FROM gpu_samples GROUP BY node),
                 g AS (SELECT node, count(*) AS gpus FROM gpus GROUP BY node)
            SELECT a.node AS node, {d.int64('coalesce(g.gpus, 0)')} AS gpus,
                   {d.int64('coalesce(s.samples, 0)')} AS samples, {d.epoch_ms('max(a.last_seen)')} AS last_seen_ms,
                   {d.arg_max('a.agent_id', 'a.last_seen')} AS agent_id,
                   {d.int64(d.arg_max('a.last_sequence', 'a.last_seen'))} AS last_sequence
            FROM agents AS a LEFT JOIN g ON g.node = a.node LEFT JOIN s ON s.node = a.node
            GROUP BY a.node, g.gpus, s.samples ORDER BY a.node{d.join_nulls}""")

    def gpus(self, node: str | None = None) -> list[dict[str, Any]]:
        """Inventory rows with their sample count, last sample time (ms) and the job owning the last sample."""
        d = self.dialect
        node_param = d.param("node", "Nullable(String)")
        return self._records(f"""
            WITH s AS (SELECT node, gpu_index, count(*) AS samples, {d.epoch_ms('max(ts)')} AS last_sample_ms,
                              {d.arg_max('job_id', 'ts')} AS job_id, {d.arg_max('rank', 'ts')} AS rank
                       FROM gpu_samples WHERE {node_param} IS NULL OR node = {node_param} GROUP BY node, gpu_index)
            SELECT g.node AS node, g."index" AS "index", g.uuid AS uuid, g.name AS name, g.pci_bus_id AS pci_bus_id,
                   g.serial AS serial, {d.int64('g.memory_total_bytes')} AS memory_total_bytes,
                   g.architecture AS architecture, g.gpm_supported AS gpm_supported,
                   {d.epoch_ms('g.first_seen')} AS first_seen_ms, {d.epoch_ms('g.last_seen')} AS last_seen_ms,
                   {d.int64('coalesce(s.samples, 0)')} AS samples, s.last_sample_ms AS last_sample_ms,
                   s.job_id AS job_id, s.rank AS rank
            FROM gpus AS g LEFT JOIN s ON s.node = g.node AND s.gpu_index = g."index"
            WHERE {node_param} IS NULL OR g.node = {node_param} ORDER BY g.node, g."index"{d.join_nulls}""",
            {"node": node})

    def gpu_identities(self) -> dict[tuple[str, int], dict[str, str]]:
        """Each inventoried GPU's ``uuid`` and ``name`` ("" if unknown) by (node, index), from the inventory
        alone: unlike :meth:`gpus`, no sample is read."""
        d = self.dialect
        df = self.query_df(f'''SELECT node, "index" AS gpu_index, {d.arg_max("uuid", "last_seen")} AS uuid,
                                      {d.arg_max("name", "last_seen")} AS name FROM gpus GROUP BY node, "index"''')
        return {(str(n), int(i)): {"uuid": u if isinstance(u, str) else "", "name": m if isinstance(m, str) else ""}
                for n, i, u, m in zip(df["node"], df["gpu_index"], df["uuid"], df["name"])}

    def nodes_heard_since(self, since_ms: int) -> list[str]:
        """The nodes whose agent's latest batch was stored at or after ``since_ms`` (epoch ms, the storing
        collector's wall clock)."""
        d = self.dialect
        df = self.query_df(f"SELECT DISTINCT node FROM agents WHERE {d.since('last_seen', 'since')} ORDER BY node",
                           {"since": d.time(since_ms)})
        return [str(n) for n in df["node"]]

    def agent_health(self) -> list[dict[str, Any]]:
        """Per node: batches its agent dropped from a full spool (``spool_dropped`` events) and last batch (ms)."""
        d = self.dialect
        reported = f"coalesce({d.json_int_or_null('attrs', 'dropped_total')}, 0)"
        return self._records(f"""
            WITH dropped AS (SELECT node, {d.int64(f'greatest(sum(coalesce(code, 0)), max({reported}))')} AS n
                             FROM events WHERE kind = '{event_kinds.SPOOL_DROPPED}' GROUP BY node)
            SELECT a.node AS node, {d.int64('coalesce(max(dropped.n), 0)')} AS spool_dropped,
                   {d.epoch_ms('max(a.last_seen)')} AS last_seen_ms
            FROM agents AS a LEFT JOIN dropped ON dropped.node = a.node
            GROUP BY a.node ORDER BY a.node{d.join_nulls}""")

    def latest(self, node: str | None = None, gpu_index: int | None = None) -> list[dict[str, Any]]:
        """Per GPU: the time of its last sample, the job and rank of its newest samples, and the last non-NULL
        value of every field (None if never)."""
        return [row for row in self.latest_values.rows(self)
                if (node is None or row["node"] == node) and (gpu_index is None or row["gpu_index"] == gpu_index)]

    def latest_since(self, after_ms: int | None, nodes: Sequence[str] | None) -> list[dict[str, Any]]:
        """:meth:`latest` of the samples after ``after_ms`` (None: all) of ``nodes`` (None: every node) alone."""
        if nodes is not None and not nodes:
            return []
        d = self.dialect
        values = ", ".join(f"{d.last(name, 'ts')} AS {name}" for name in fields.GPU_FIELD_NAMES)
        return self._records(f"""
            SELECT node, gpu_index, {d.epoch_ms('max(ts)')} AS ts_ms, {d.arg_max('job_id', 'ts')} AS job_id,
                   {d.arg_max('rank', 'ts')} AS rank, {values} FROM gpu_samples
            WHERE {d.since('ts', 'after', strict=True)} AND {d.in_list('node', 'nodes')}
            GROUP BY node, gpu_index ORDER BY node, gpu_index""",
            {"after": d.time(after_ms), "nodes": d.list_value(nodes)})

    def _check_gpu(self, node: str, gpu_index: int | None = None) -> None:
        """NotFound naming a node (or GPU) the store has never heard of, so an empty answer is never a typo."""
        d = self.dialect
        known = self._records(f"""
            SELECT gpu_index FROM (SELECT node, {d.nullable('"index"')} AS gpu_index FROM gpus UNION ALL
                                   SELECT DISTINCT node, {d.nullable('gpu_index')} FROM gpu_samples UNION ALL
                                   SELECT node, NULL FROM agents) WHERE node = {d.param('node', 'String')}""",
            {"node": node})
        if not known:
            raise NotFound(f"unknown node {node!r}; `gpuwatch nodes` lists the known ones")
        if gpu_index is not None and gpu_index not in {r["gpu_index"] for r in known}:
            raise NotFound(f"node {node!r} has no GPU {gpu_index}; `gpuwatch gpus --node {node}` lists its GPUs")

    # ---- events ----------------------------------------------------------------------------------------
    def events(self, node: str | None = None, kind: str | None = None, since_ms: int | None = None,
               limit: int | None = None) -> list[dict[str, Any]]:
        """Events newest first, with attrs as a dict and ts as epoch ms."""
        d = self.dialect
        node_param, kind_param = d.param("node", "Nullable(String)"), d.param("kind", "Nullable(String)")
        rows = self._records(f"""
            SELECT node, gpu_index, {d.epoch_ms('ts')} AS ts_ms, kind, code, message, attrs FROM events
            WHERE ({node_param} IS NULL OR node = {node_param}) AND ({kind_param} IS NULL OR kind = {kind_param})
              AND {d.since('ts', 'since')}
            ORDER BY ts DESC LIMIT {d.param('limit', 'UInt64')}""",
            {"node": node, "kind": kind, "since": d.time(since_ms), "limit": d.limit(limit)})
        if not rows:
            self._check_event_filters(node, kind)
        for row in rows:
            row["attrs"] = json.loads(row["attrs"]) if row["attrs"] else {}
        return rows

    def _check_event_filters(self, node: str | None, kind: str | None) -> None:
        """NotFound for an unknown node, UserError for a kind neither defined nor ever stored (a typo)."""
        if node is not None:
            self._check_gpu(node)
        if kind is not None and kind not in KNOWN_EVENT_KINDS and not self._records(
                f"SELECT 1 FROM events WHERE kind = {self.dialect.param('kind', 'String')} LIMIT 1", {"kind": kind}):
            raise UserError(f"event kind {kind!r} is not one of the known kinds: "
                            f"{', '.join(sorted(KNOWN_EVENT_KINDS))}")

    def xid_counts(self) -> list[dict[str, Any]]:
        """XID events stored per node, GPU and code."""
        return self._records(f"""
            SELECT node, gpu_index, code, count(*) AS n FROM events WHERE kind = '{event_kinds.XID}'
            GROUP BY node, gpu_index, code ORDER BY node, gpu_index, code""")

    def event_counts_by_node(self) -> dict[str, int]:
        """Events stored per node."""
        return {r["node"]: int(r["n"]) for r in self._records("SELECT node, count(*) AS n FROM events GROUP BY node")}

    def event_rows(self, kinds: Sequence[str], since_ms: int | None = None,
                   until_ms: int | None = None) -> pd.DataFrame:
        """Events of ``kinds`` after ``since_ms`` up to ``until_ms``: node, gpu_index, ts, kind, code."""
        d = self.dialect
        return self.query_df(f"""
            SELECT node, gpu_index, ts, kind, code FROM events
            WHERE {d.contains(d.param('kinds', 'Array(String)'), 'kind')} AND {d.since('ts', 'since', strict=True)}
              AND {d.until('ts', 'until')}""",
            {"kinds": list(kinds), "since": d.time(since_ms), "until": d.time(until_ms, upper=True)})

    def event_attrs(self, kind: str, keys: Sequence[str], since_ms: int | None = None,
                    until_ms: int | None = None) -> pd.DataFrame:
        """Events of ``kind`` from ``since_ms`` up to ``until_ms``, oldest first: node, gpu_index, ts_ms and the
        attribute ``keys`` as text ("" where absent), read in SQL (no row-by-row JSON in Python)."""
        d = self.dialect
        picked = "".join(f", coalesce({d.json_text('attrs', k)}, '') AS \"{k}\"" for k in attr_keys(keys))
        return self.query_df(f"""
            SELECT node, gpu_index, {d.epoch_ms('ts')} AS ts_ms{picked} FROM events
            WHERE kind = {d.param('kind', 'String')} AND {d.since('ts', 'since')} AND {d.until('ts', 'until')}
            ORDER BY ts, node, gpu_index""",
            {"kind": kind, "since": d.time(since_ms), "until": d.time(until_ms, upper=True)})

    def first_failures(self, fatal_xids: Sequence[int]) -> pd.DataFrame:
        """Per GPU that failed (lost, or a fatal XID): node, gpu_index and the first failure (failed_ms)."""
        d = self.dialect
        fatal = _FATAL.format(contains=d.contains(d.param("fatal", "Array(Int64)"), "code"))
        return self.query_df(f"""
            SELECT node, gpu_index, {d.epoch_ms('min(ts)')} AS failed_ms FROM events
            WHERE gpu_index >= 0 AND {fatal}
            GROUP BY node, gpu_index ORDER BY node, gpu_index""", {"fatal": sorted(int(c) for c in fatal_xids)})

    def fatal_events(self, fatal_xids: Sequence[int], until_ms: int | None = None) -> pd.DataFrame:
        """Lost GPUs and fatal XIDs up to ``until_ms``, oldest first: node, gpu_index, ts_ms, kind, code (0 if none)."""
        d = self.dialect
        fatal = _FATAL.format(contains=d.contains(d.param("fatal", "Array(Int64)"), "code"))
        return self.query_df(f"""
            SELECT node, gpu_index, {d.epoch_ms('ts')} AS ts_ms, kind, coalesce(code, 0) AS code FROM events
            WHERE gpu_index >= 0 AND {d.until('ts', 'until')} AND {fatal}
            ORDER BY ts""", {"until": d.time(until_ms, upper=True), "fatal": sorted(int(c) for c in fatal_xids)})

    def event_times(self, kind: str, until_ms: int | None = None) -> pd.DataFrame:
        """When each node logged events of ``kind`` up to ``until_ms``: node, ts_ms."""
        d = self.dialect
        return self.query_df(f"""
            SELECT node, {d.epoch_ms('ts')} AS ts_ms FROM events
            WHERE kind = {d.param('kind', 'String')} AND {d.until('ts', 'until')}""",
            {"kind": kind, "until": d.time(until_ms, upper=True)})

    def stopped_agents(self) -> pd.DataFrame:
        """Nodes whose agent's last lifecycle event is a stop: node, stopped_us (epoch µs)."""
        d = self.dialect
        return self.query_df(f"""
            SELECT node, {d.epoch_us('max(ts)')} AS stopped_us FROM events
            WHERE kind IN ('{event_kinds.AGENT_START}', '{event_kinds.AGENT_STOP}') GROUP BY node
            HAVING {d.arg_max('kind', 'ts')} = '{event_kinds.AGENT_STOP}'""")

    # ---- samples ---------------------------------------------------------------------------------------
    def gpu_samples(self, since_ms: int | None = None, until_ms: int | None = None,
                    nodes: Sequence[str] | None = None, columns: Sequence[str] | None = None) -> pd.DataFrame:
        """Wide GPU samples (identity columns plus ``columns``, default all fields) ordered by node, GPU, ts."""
        check_fields(columns or ())
        d = self.dialect
        wanted = ", ".join(columns if columns is not None else fields.GPU_FIELD_NAMES)
        return self.query_df(f"""
            SELECT node, gpu_index, ts, job_id, rank, local_rank{', ' + wanted if wanted else ''} FROM gpu_samples
            WHERE {d.since('ts', 'since')} AND {d.until('ts', 'until')} AND {d.in_list('node', 'nodes')}
            ORDER BY node, gpu_index, ts""",
            {"since": d.time(since_ms), "until": d.time(until_ms, upper=True), "nodes": d.list_value(nodes)})

    def tiered_gpu_samples(self, since_ms: int | None = None, until_ms: int | None = None,
                           nodes: Sequence[str] | None = None) -> pd.DataFrame:
        """:meth:`gpu_samples` across the tiers: each minute before the raw cutoff as one row from its rollup
        (at its newest sample's time, no local rank), raw rows from the cutoff on; ``rolled_up`` says which."""
        d = self.dialect
        cutoff = self._raw_cutoff_ms()
        rolled = pd.DataFrame()
        if cutoff is not None and (since_ms is None or since_ms < cutoff):
            rolled = self.query_df(f"""
                SELECT node, gpu_index, ts, job_id, rank, {d.null_int32()} AS local_rank{rollups.sample_columns()}
                FROM {rollups.ROLLUP_TABLE} WHERE minute < {d.at('cutoff')} AND {d.since('ts', 'since')}
                  AND {d.until('ts', 'until')} AND {d.in_list('node', 'nodes')}
                ORDER BY node, gpu_index, ts""",
                {"cutoff": d.time(cutoff), "since": d.time(since_ms), "until": d.time(until_ms, upper=True),
                 "nodes": d.list_value(nodes)})
            since_ms = cutoff if since_ms is None else max(since_ms, cutoff)
        return rollups.join_samples(rolled, self.gpu_samples(since_ms, until_ms, nodes))

    def series(self, node: str, gpu_index: int, field: str, since_ms: int | None = None,
               until_ms: int | None = None, limit: int | None = None) -> pd.DataFrame:
        """One GPU field over time (columns ts_ms, value, resolution_s), oldest first; with ``limit``, the
        newest rows. Before the raw cutoff the points are per-minute rollups (resolution_s 60)."""
        check_fields([field])
        d = self.dialect
        gpu = f"node = {d.param('node', 'String')} AND gpu_index = {d.param('gpu', 'Int32')}"
        cutoff = self._raw_cutoff_ms()
        rolled = pd.DataFrame({"ts_ms": [], "value": []})
        if cutoff is not None and (since_ms is None or since_ms < cutoff):
            value = rollups.column(field, rollups.series_stat(field))
            rolled = self.query_df(f"""
                SELECT {d.epoch_ms('minute')} AS ts_ms, {value} AS value FROM {rollups.ROLLUP_TABLE}
                WHERE {gpu} AND {value} IS NOT NULL AND {d.since('minute', 'since')} AND minute < {d.at('cutoff')}
                  AND {d.until('minute', 'until')} ORDER BY minute""",
                {"node": node, "gpu": gpu_index, "since": d.time(since_ms), "until": d.time(until_ms, upper=True),
                 "cutoff": d.time(cutoff)})
            since_ms = cutoff if since_ms is None else max(since_ms, cutoff)
        df = self.query_df(f"""
            SELECT {d.epoch_ms('ts')} AS ts_ms, {field} AS value FROM gpu_samples
            WHERE {gpu} AND {field} IS NOT NULL AND {d.since('ts', 'since')} AND {d.until('ts', 'until')}
            ORDER BY ts DESC LIMIT {d.param('limit', 'UInt64')}""",
            {"node": node, "gpu": gpu_index, "since": d.time(since_ms), "until": d.time(until_ms, upper=True),
             "limit": d.limit(limit)})
        if df.empty and rolled.empty:
            self._check_gpu(node, gpu_index)
        return rollups.join_series(rolled, df.iloc[::-1].reset_index(drop=True), limit)

    def gpu_minutes(self, since_ms: int, until_ms: int, *, last: Sequence[str], means: Sequence[str],
                    mins: Sequence[str], maxs: Sequence[str]) -> pd.DataFrame:
        """Every GPU's samples per minute between the two times: node, gpu_index, minute, ts (last sample),
        job_id and rank of the last sample, then the last value of ``last``, the mean of ``means``, the
        minimum of ``mins`` and the maximum of ``maxs`` (each under its own name)."""
        check_fields([*last, *means, *mins, *maxs])
        d = self.dialect
        cutoff = self._raw_cutoff_ms()
        if cutoff is not None and since_ms < cutoff:  # minutes whose raw rows expired: their rollups
            rolled = self.query_df(f"""
                SELECT node, gpu_index, minute, ts, job_id, rank{rollups.minute_columns(last, means, mins, maxs)}
                FROM {rollups.ROLLUP_TABLE}
                WHERE minute >= {d.at('since')} AND minute < {d.at('cutoff')} AND ts <= {d.at('until')}""",
                {"since": d.time(rollups.floor_minute(since_ms)), "cutoff": d.time(cutoff),
                 "until": d.time(until_ms)})
            raw = self.gpu_minutes(max(since_ms, cutoff), until_ms, last=last, means=means, mins=mins, maxs=maxs)
            both = pd.concat([p for p in (rolled, raw) if len(p)] or [raw], ignore_index=True)
            return both.sort_values(["node", "gpu_index", "ts"], kind="stable").reset_index(drop=True)
        values = "".join(f", {v}" for v in [f"{d.last(c, 'ts')} AS {c}" for c in last]
                         + [f"avg({c}) AS {c}" for c in means] + [f"min({c}) AS {c}" for c in mins]
                         + [f"max({c}) AS {c}" for c in maxs])
        # the newest sample's time is aliased apart from ts, which the GROUP BY would otherwise take for it
        return self.query_df(f"""
            SELECT node, gpu_index, {d.minute('ts')} AS minute, max(ts) AS newest,
                   {d.arg_max('job_id', 'ts')} AS job_id, {d.arg_max('rank', 'ts')} AS rank{values}
            FROM gpu_samples AS g WHERE g.ts >= {d.at('since')} AND g.ts <= {d.at('until')}
            GROUP BY node, gpu_index, minute ORDER BY node, gpu_index, newest""",
            {"since": d.time(since_ms), "until": d.time(until_ms)}).rename(columns={"newest": "ts"})

    def host_samples(self, since_ms: int | None = None, nodes: Sequence[str] | None = None) -> pd.DataFrame:
        """Host samples (node, ts and every host field) ordered by node and ts."""
        d = self.dialect
        return self.query_df(f"""
            SELECT node, ts, {', '.join(fields.HOST_FIELD_NAMES)} FROM host_samples
            WHERE {d.since('ts', 'since')} AND {d.in_list('node', 'nodes')}
            ORDER BY node, ts""", {"since": d.time(since_ms), "nodes": d.list_value(nodes)})

    def newest_samples(self, after_ms: int | None = None, nodes: Sequence[str] | None = None
                       ) -> dict[tuple[str, int], int]:
        """Each GPU's newest sample time (epoch ms) by (node, GPU index), reading only the samples after
        ``after_ms`` (None: all) of ``nodes`` (None: every node); a GPU without such samples is left out."""
        if nodes is not None and not nodes:
            return {}
        d = self.dialect
        df = self.query_df(f"""
            SELECT node, gpu_index, {d.epoch_ms('max(ts)')} AS t FROM gpu_samples
            WHERE {d.since('ts', 'after', strict=True)} AND {d.in_list('node', 'nodes')}
            GROUP BY node, gpu_index""", {"after": d.time(after_ms), "nodes": d.list_value(nodes)})
        return {(str(n), int(i)): int(t) for n, i, t in zip(df["node"], df["gpu_index"], df["t"])}

    def newest_sample_ms(self) -> int | None:
        """The time of the newest stored GPU sample (epoch ms), None before the first."""
        d = self.dialect
        df = self.query_df(f"SELECT {d.epoch_ms('max(ts)')} AS t, count(*) AS n FROM gpu_samples{d.unfolded}")
        return int(df["t"].iloc[0]) if int(df["n"].iloc[0]) else None

    def sample_jobs(self) -> list[dict[str, Any]]:
        """Jobs named on GPU samples: their nodes (sorted list), GPUs, ranks, first and last sample (ms)."""
        d = self.dialect
        return self._records(f"""
            SELECT job_id, {d.sorted_set('node')} AS nodes, {d.count_distinct('(node, gpu_index)')} AS gpus,
                   {d.count_distinct('rank', 'rank >= 0')} AS ranks, {d.epoch_ms('min(ts)')} AS first_seen_ms,
                   {d.epoch_ms('max(ts)')} AS last_seen_ms
            FROM gpu_samples WHERE job_id IS NOT NULL AND job_id <> '' GROUP BY job_id ORDER BY job_id""")

    # ---- jobs ------------------------------------------------------------------------------------------
    def spans(self, job_id: str | None = None, since_us: float | None = None) -> pd.DataFrame:
        """Op-level spans (the SpanTable columns plus ingest ts) ordered by job, rank, start."""
        d = self.dialect
        job, since = d.param("job", "Nullable(String)"), d.param("since", "Nullable(Float64)")
        return d.span_frame(self.query_df(f"""
            SELECT * FROM spans WHERE ({job} IS NULL OR job_id = {job}) AND ({since} IS NULL OR start_us >= {since})
            ORDER BY job_id, rank, start_us""", {"job": job_id, "since": since_us}))

    def recent_spans(self, window_s: float, job_id: str | None = None,
                     kinds: Sequence[str] | None = None) -> pd.DataFrame:
        """Spans (of ``kinds``, default all) within ``window_s`` of their job's newest span (the job's own
        clock), like :meth:`spans`."""
        d = self.dialect
        job = d.param("job", "Nullable(String)")
        return d.span_frame(self.query_df(f"""
            SELECT s.* FROM spans AS s INNER JOIN (
                SELECT job_id, max(start_us) AS newest FROM spans
                WHERE {job} IS NULL OR job_id = {job} GROUP BY job_id) AS j
              ON s.job_id = j.job_id
            WHERE s.start_us + greatest(s.dur_us, 0) >= j.newest - {d.param('window', 'Float64')}
              AND {d.in_list('s.kind', 'kinds')}
            ORDER BY s.job_id, s.rank, s.start_us""",
            {"job": job_id, "window": window_s * 1e6, "kinds": d.list_value(kinds)}))

    def span_job_ids(self) -> list[str]:
        """Jobs with step marks or raw spans, sorted."""
        return self.query_df("""
            SELECT DISTINCT job_id FROM (SELECT job_id FROM job_steps UNION ALL SELECT job_id FROM spans)
            WHERE job_id <> '' ORDER BY job_id""")["job_id"].tolist()

    def step_breakdown_totals(self, job_id: str) -> pd.DataFrame:
        """The job's per-step efficiency summed per category: category, us, steps (distinct), ranks."""
        d = self.dialect
        return self.query_df(f"""
            SELECT category, sum(us) AS us, {d.count_distinct('step')} AS steps, {d.count_distinct('rank')} AS ranks
            FROM step_breakdowns WHERE job_id = {d.param('job', 'String')} GROUP BY category ORDER BY category""",
            {"job": job_id})

    # ---- breakdowns ------------------------------------------------------------------------------------
    def traced_jobs(self) -> list[dict[str, Any]]:
        """Jobs with submitted traces: job_id, ranks, submitted_ms (the last submission)."""
        return self._records(f"""
            SELECT job_id, count(*) AS ranks, {self.dialect.epoch_ms('max(submitted_at)')} AS submitted_ms
            FROM job_timelines GROUP BY job_id ORDER BY job_id""")

    def breakdown_doc(self, job_id: str, source: str) -> str | None:
        """The last breakdown document (JSON text) stored for the job from ``source``, or None."""
        d = self.dialect
        df = self.query_df(f"""
            SELECT doc FROM breakdown_docs WHERE job_id = {d.param('job', 'String')}
              AND source = {d.param('source', 'String')}""", {"job": job_id, "source": source})
        return str(df["doc"].iloc[0]) if len(df) else None

    def breakdown_rows(self, job_id: str, source: str | None = None) -> pd.DataFrame:
        """The job's stored breakdown rows: source, rank, step, category, us, ordered."""
        d = self.dialect
        source_param = d.param("source", "Nullable(String)")
        return self.query_df(f"""
            SELECT source, rank, step, category, us FROM breakdowns WHERE job_id = {d.param('job', 'String')}
              AND ({source_param} IS NULL OR source = {source_param})
            ORDER BY source, rank, step NULLS FIRST, category""", {"job": job_id, "source": source})

    # ---- alerts ----------------------------------------------------------------------------------------
    def firing_alerts(self) -> pd.DataFrame:
        """Alerts persisted as firing: alertname, subject, updated_ms, doc (JSON text)."""
        d = self.dialect
        return self.query_df(f"""
            SELECT alertname, subject, {d.epoch_ms('updated_at')} AS updated_ms, {d.text('doc')} AS doc FROM alerts
            WHERE status = 'firing'""")

    def alert_docs(self, include_resolved: bool) -> list[str]:
        """Alert documents (JSON text): firing ones, newest first, then resolved ones with ``include_resolved``."""
        d = self.dialect
        return self.query_df(f"""
            SELECT {d.text('doc')} AS doc FROM alerts WHERE status = 'firing' OR {d.param('all', 'Bool')}
            ORDER BY status = 'firing' DESC, starts_at DESC""", {"all": bool(include_resolved)})["doc"].tolist()

    def alert_starts(self, alertname: str) -> pd.DataFrame:
        """Every ``alertname`` alert: node, gpu_index, starts_ms, peak_risk (from its document), oldest first."""
        d = self.dialect
        return self.query_df(f"""
            SELECT {d.json_text('doc', 'node')} AS node, {d.json_int('doc', 'gpu_index')} AS gpu_index,
                   {d.epoch_ms('starts_at')} AS starts_ms, {d.json_float('doc', 'peak_risk')} AS peak_risk
            FROM alerts WHERE alertname = {d.param('name', 'String')} ORDER BY starts_at""", {"name": alertname})


def check_fields(names: Iterable[str]) -> None:
    """UserError naming the GPU fields among ``names`` that the catalogue does not have (a typo)."""
    unknown = [name for name in names if name not in fields.GPU_FIELD_NAMES]
    if unknown:
        raise UserError(f"unknown GPU field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                        "fields are listed in gpuwatch.core.fields")


def attr_keys(keys: Sequence[str]) -> list[str]:
    """Attribute names safe to write into a query (the callers' own constants; checked all the same)."""
    bad = [k for k in keys if not k.replace("_", "").isalnum()]
    if bad:
        raise ValueError(f"event attribute names {bad}: letters, digits and _ only")
    return list(keys)
