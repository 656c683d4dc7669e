"""Op-level span tables (CSV, Parquet, or the probe's `SpanTable` rows) -> one `RankTimeline` per rank.

Columns are those of the span catalogue (gpuwatch.core.spans, the `SpanTable` message): rank, kind, start_us
and dur_us are required; the others are optional, and a missing one reads as its "unset" value.
Kinds: compute, memcpy (memset counts as memcpy), collective, p2p, step.

The in-process probe times on the host: it writes one `step` row per step and rank plus its
`collective`/`p2p` rows, and no compute rows. For a rank with step rows and no compute rows, compute is
the step intervals minus that rank's communication intervals.
"""
from __future__ import annotations

import io

import numpy as np
import pandas as pd

from gpuwatch.efficiency.timeline import COLLECTIVE, COMPUTE, MEMCPY, P2P, UNKNOWN, RankTimeline
from gpuwatch.efficiency.traces.collectives import canonical_type
from gpuwatch.efficiency.traces.eventstream import TraceContent
from gpuwatch.core.errors import UserError
from gpuwatch.core.spans import SPAN_UNSET

REQUIRED = ("rank", "kind", "start_us", "dur_us")
_KINDS = {"compute": COMPUTE, "memcpy": MEMCPY, "memset": MEMCPY, "collective": COLLECTIVE, "p2p": P2P, "step": -1}
_DEFAULTS = {name: unset for name, unset in SPAN_UNSET.items() if name not in REQUIRED}


def read_span_table(path: str, content: TraceContent | None = None) -> pd.DataFrame:
    """A span table file, or its `content` named `path`, as a DataFrame (Parquet by extension, else CSV)."""
    source = path if content is None else io.BytesIO(content) if isinstance(content, bytes) else content
    try:
        if path.endswith((".parquet", ".pq")):
            return pd.read_parquet(source)
        return pd.read_csv(source)
    except (OSError, ValueError, pd.errors.ParserError) as exc:
        raise UserError(f"{path}: cannot read the span table ({exc})") from None


def timelines_from_spans(df: pd.DataFrame, source: str = "span table") -> list[RankTimeline]:
    """One timeline per rank of a span table (see the module doc for the columns and the step rule)."""
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise UserError(f"{source}: missing column(s) {', '.join(missing)} (need {', '.join(REQUIRED)})")
    df = df.assign(**{c: v for c, v in _DEFAULTS.items() if c not in df.columns})
    kinds = df["kind"].astype(str).str.lower()
    unknown = sorted(set(kinds) - set(_KINDS))
    if unknown:
        raise UserError(f"{source}: unknown kind(s) {', '.join(unknown)} (expected {', '.join(_KINDS)})")
    for column in ("rank", "start_us", "dur_us"):
        if not pd.api.types.is_numeric_dtype(df[column]) or df[column].isna().any():
            raise UserError(f"{source}: column {column} must be numeric with no empty cells")
    if (df["dur_us"] < 0).any():
        raise UserError(f"{source}: negative dur_us in {int((df['dur_us'] < 0).sum())} row(s)")
    jobs = sorted({str(j) for j in df["job_id"].fillna("") if str(j)})
    if len(jobs) > 1:
        raise UserError(f"{source}: rows of different jobs ({', '.join(jobs)}); analyse one job at a time")
    df = df.assign(kind=kinds.map(_KINDS))
    timelines = [_rank_timeline(int(rank), rows, source, jobs[0] if jobs else None)
                 for rank, rows in df.groupby("rank", sort=True)]
    if not any(len(tl) for tl in timelines):
        raise UserError(f"{source}: no activity rows (only step rows and nothing to subtract from)")
    return timelines


def _rank_timeline(rank: int, rows: pd.DataFrame, source: str, job: str | None) -> RankTimeline:
    steps = rows[rows["kind"] == -1]
    acts = rows[rows["kind"] != -1]
    step_start = steps["start_us"].to_numpy(np.float64)
    step_end = step_start + steps["dur_us"].to_numpy(np.float64)
    step_ids = steps["step"].to_numpy(np.int64)
    kind = acts["kind"].to_numpy(np.int8)
    start = acts["start_us"].to_numpy(np.float64)
    end = start + acts["dur_us"].to_numpy(np.float64)
    step = acts["step"].fillna(UNKNOWN).to_numpy(np.int64)
    comm = (kind == COLLECTIVE) | (kind == P2P)
    types = [canonical_type(str(n)) or "unknown" for n in acts["name"].fillna("")]
    type_names = sorted(set(t for t, c in zip(types, comm) if c))
    coll_type = np.where(comm, [type_names.index(t) if c else UNKNOWN for t, c in zip(types, comm)], UNKNOWN)
    groups = acts["process_group"].fillna("").astype(str).to_numpy(object)
    group_names = sorted(set(groups[groups != ""]))
    process_group = np.array([group_names.index(g) if g else UNKNOWN for g in groups], dtype=np.int32)
    seq = acts["seq"].fillna(UNKNOWN).to_numpy(np.int64)
    nbytes = acts["bytes"].fillna(UNKNOWN).to_numpy(np.int64)
    op_names = acts["name"].fillna("").astype(str).tolist()

    if len(step_start) and not (kind == COMPUTE).any():
        c_start, c_end = _subtract(step_start, step_end, start[comm], end[comm])
        kind = np.concatenate([kind, np.full(len(c_start), COMPUTE, np.int8)])
        start, end = np.concatenate([start, c_start]), np.concatenate([end, c_end])
        step = np.concatenate([step, np.full(len(c_start), UNKNOWN)])
        pad = {"coll_type": coll_type, "process_group": process_group, "seq": seq, "nbytes": nbytes}
        coll_type, process_group, seq, nbytes = (np.concatenate([v, np.full(len(c_start), UNKNOWN)])
                                                 for v in pad.values())
        op_names += [""] * len(c_start)
    if len(step_start):
        step = np.where(step == UNKNOWN, _step_at(start, step_start, step_end, step_ids), step)
    op_names = _derived_names(op_names, kind, start, step)
    names = sorted(set(op_names))
    name_id = {n: i for i, n in enumerate(names)}
    world = int(rows["world_size"].max()) if rows["world_size"].notna().any() else int(SPAN_UNSET["world_size"])
    marks = np.column_stack([step_ids, step_start, step_end]) if len(step_start) else np.empty((0, 3))
    return RankTimeline.build(
        rank, start, end, kind, step=step, coll_type=coll_type, process_group=process_group, seq=seq,
        nbytes=nbytes, coll_types=type_names, process_groups=group_names, world_size=world if world > 0 else None,
        name=np.array([name_id[n] for n in op_names], dtype=np.int32) if op_names else None, names=names,
        job_id=job, source=f"{source} rank {rank}", step_marks=marks,
    )


def _derived_names(names: list[str], kind: np.ndarray, start: np.ndarray, step: np.ndarray) -> list[str]:
    """Unnamed compute (the probe's step time between its collectives) is named by its place in the step
    ("compute part k"), so the what-if compares each part of a step with the same part on other ranks
    and steps rather than with every other part."""
    out = list(names)
    unnamed = [i for i, n in enumerate(names) if not n and kind[i] == COMPUTE]
    seen: dict[int, int] = {}
    for i in sorted(unnamed, key=lambda i: (step[i], start[i])):
        k = seen.get(int(step[i]), 0)
        seen[int(step[i])] = k + 1
        out[i] = f"compute part {k}"
    return out


def _step_at(t: np.ndarray, step_start: np.ndarray, step_end: np.ndarray, step_ids: np.ndarray) -> np.ndarray:
    """Step id whose [start, end) holds each time t, else UNKNOWN."""
    order = np.argsort(step_start, kind="stable")
    starts, ends, ids = step_start[order], step_end[order], step_ids[order]
    idx = np.searchsorted(starts, t, side="right") - 1
    ok = idx >= 0
    ok[ok] &= t[ok] < ends[idx[ok]]
    return np.where(ok, ids[np.maximum(idx, 0)], UNKNOWN)


def _subtract(a_start: np.ndarray, a_end: np.ndarray, b_start: np.ndarray, b_end: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """Intervals A minus the union of intervals B; pieces stay cut at every A boundary (so at step ends)."""
    points = np.concatenate([a_start, a_end, b_start, b_end])
    a_delta = np.concatenate([np.ones(len(a_start)), -np.ones(len(a_end)), np.zeros(2 * len(b_start))])
    b_delta = np.concatenate([np.zeros(2 * len(a_start)), np.ones(len(b_start)), -np.ones(len(b_end))])
    order = np.argsort(points, kind="stable")
    pos = points[order]
    inside = (np.cumsum(a_delta[order]) > 0) & (np.cumsum(b_delta[order]) <= 0)
    inside = inside[:-1] & (np.diff(pos) > 0)
    return pos[:-1][inside], pos[1:][inside]
