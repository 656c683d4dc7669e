"""The collector's live view of training jobs from probe span rows: per-job summaries and hang detection.

Pure functions over a span DataFrame with the span catalogue's columns (gpuwatch.core.spans; :data:`COLUMNS`
are those read here). Probe conventions used here: a row with
dur_us == -1 is an op that was still running when the probe reported it; kind "end" marks a rank whose
probe closed (the job finished there, it is not hanging).
"""
from __future__ import annotations

import pandas as pd

from gpuwatch.efficiency.engine import analyze
from gpuwatch.efficiency.timeline import RankTimeline
from gpuwatch.efficiency.traces.spans import timelines_from_spans
from gpuwatch.core.errors import UserError

COLUMNS = ("job_id", "rank", "step", "kind", "name", "start_us", "dur_us", "process_group", "seq", "node")
PROGRESS_KINDS = ("step", "collective", "p2p")
ENGINE_KINDS = ("step", "collective", "p2p", "compute", "memcpy")
RUNNING = -1.0


def _checked(spans: pd.DataFrame) -> pd.DataFrame:
    missing = [c for c in COLUMNS if c not in spans.columns]
    if missing:
        raise UserError(f"span rows: missing column(s) {', '.join(missing)}")
    return spans.assign(end_us=spans["start_us"] + spans["dur_us"].clip(lower=0))


def job_summaries(spans: pd.DataFrame, now_us: float, window_s: float = 300.0, lost: bool = True) -> list[dict]:
    """One summary per job: ranks, nodes, steps, step rate and time over the last `window_s`, lost fraction
    (None with ``lost=False``: the engine's analysis is the costly part, and the jobs monitor has it already)."""
    spans = _checked(spans)
    return [_summary(str(job), rows, now_us, window_s, lost) for job, rows in spans.groupby("job_id", sort=True)]


def _summary(job_id: str, rows: pd.DataFrame, now_us: float, window_s: float, lost: bool) -> dict:
    steps = rows[(rows["kind"] == "step") & (rows["dur_us"] >= 0)]
    recent = rows[rows["end_us"] >= now_us - window_s * 1e6]
    recent_steps = recent[recent["kind"] == "step"]
    rates = [len(r) / ((r["end_us"].max() - r["start_us"].min()) / 1e6)
             for _, r in recent_steps.groupby("rank") if len(r) and r["end_us"].max() > r["start_us"].min()]
    last_step_us = float(steps["end_us"].max()) if len(steps) else None
    world = rows["world_size"].max() if "world_size" in rows else None
    return {
        "job_id": job_id,
        "ranks": int(rows["rank"].nunique()),
        "nodes": sorted(str(n) for n in rows["node"].unique()),
        "world_size": int(world) if world is not None and pd.notna(world) else None,
        "steps": int(steps["step"].max()) + 1 if len(steps) else 0,
        "step_rate": float(pd.Series(rates).median()) if rates else None,
        "step_time_s": float(recent_steps["dur_us"].median()) / 1e6 if len(recent_steps) else None,
        "last_step_us": last_step_us,
        # never negative: "now" can trail the newest span (an agent's clock ahead of the collector's)
        "last_step_age_s": max(0.0, (now_us - last_step_us) / 1e6) if last_step_us is not None else None,
        "finished": _finished_ranks(rows) >= set(rows["rank"].unique()),
        "lost_fraction": _lost_fraction(recent, job_id) if lost else None,
    }


def probe_timelines(rows: pd.DataFrame, source: str) -> list[RankTimeline] | None:
    """Engine timelines from probe span rows: finished spans of the kinds the engine reads.

    Running (-1) and "end" rows are probe bookkeeping, and a stored world size of -1 means "not sent".
    None when the rows hold no activity beyond step marks (nothing to analyse yet).
    """
    usable = rows[rows["kind"].isin(ENGINE_KINDS) & (rows["dur_us"] >= 0)]
    if not (usable["kind"] != "step").any():
        return None
    usable = usable.drop(columns=["end_us"], errors="ignore")
    if "world_size" in usable.columns:
        usable = usable.assign(world_size=usable["world_size"].where(usable["world_size"] > 0))
    return timelines_from_spans(usable, source=source)


def _lost_fraction(rows: pd.DataFrame, job_id: str) -> float | None:
    """Share of the recent window that was not compute, from the efficiency engine; None without activity."""
    try:
        timelines = probe_timelines(rows, source=f"job {job_id}")
        if timelines is None:
            return None
        job = analyze(timelines).job
    except UserError:
        return None
    return job.lost_us / job.window_us if job.window_us else None


def _finished_ranks(rows: pd.DataFrame) -> set:
    return set(rows.loc[rows["kind"] == "end", "rank"].unique())


def detect_hangs(spans: pd.DataFrame, now_us: float, threshold_s: float) -> list[dict]:
    """Jobs with ranks that completed no step or op for more than `threshold_s`, with who is stuck where.

    Per process group, ranks whose last completed collective seq is behind their peers' are stuck in the
    next one (the culprits); when all are level, ranks that are waiting in the next collective point at the
    ones that never arrived (the culprits)."""
    spans = _checked(spans)
    return [hang for job, rows in spans.groupby("job_id", sort=True)
            if (hang := _job_hang(str(job), rows, now_us, threshold_s)) is not None]


def _job_hang(job_id: str, rows: pd.DataFrame, now_us: float, threshold_s: float) -> dict | None:
    done = rows[rows["kind"].isin(PROGRESS_KINDS) & (rows["dur_us"] >= 0)]
    progress = done.groupby("rank")["end_us"].max().reindex(sorted(rows["rank"].unique()), fill_value=float("-inf"))
    active = progress.drop(index=list(_finished_ranks(rows)), errors="ignore")
    stalled = active[now_us - active > threshold_s * 1e6]
    if stalled.empty:
        return None
    nodes = rows.groupby("rank")["node"].last()
    running = _still_running(rows, done).sort_values("start_us").groupby("rank").last()
    stuck: dict[int, dict] = {}
    culprits: set[int] = set()
    collectives = done[done["kind"] == "collective"]
    for group, group_rows in collectives.groupby("process_group"):
        last = group_rows.groupby("rank")["seq"].max()
        head = int(last.max())
        behind = last[last < head]
        for rank, seq in behind.items():
            nxt = group_rows[group_rows["seq"] == seq + 1]
            stuck[int(rank)] = _entry(rank, nodes, "behind", group, int(seq) + 1,
                                      str(nxt["name"].iloc[0]) if len(nxt) else "", None)
            culprits.add(int(rank))
        if behind.empty:
            waiting = running[(running["kind"] == "collective") & (running["process_group"] == group)
                              & (running["seq"] == head + 1)]
            if len(waiting):
                absent = [int(r) for r in last.index if r not in waiting.index and r in active.index]
                culprits.update(absent)
                for rank in absent:
                    stuck[rank] = _entry(rank, nodes, "absent", group, head + 1, str(waiting["name"].iloc[0]), None)
    for rank, op in running.iterrows():
        if int(rank) in stalled.index and int(rank) not in stuck:
            stuck[int(rank)] = _entry(rank, nodes, "waiting", op["process_group"], int(op["seq"]), str(op["name"]),
                                      float(op["start_us"]),
                                      int(op["peer"]) if "peer" in op and op["peer"] >= 0 else None)
    if not culprits:  # ranks waiting on a p2p peer that is not itself waiting in an op
        culprits = {e["peer"] for e in stuck.values() if e["peer"] is not None and e["peer"] not in stuck}
    for rank in stalled.index:
        stuck.setdefault(int(rank), _entry(rank, nodes, "silent", "", -1, "", None))
    return {
        "job_id": job_id,
        "stalled_s": float((now_us - stalled.max()) / 1e6) if stalled.max() > float("-inf") else None,
        "stalled_ranks": sorted(int(r) for r in stalled.index),
        "stuck": [stuck[r] for r in sorted(stuck)],
        "culprits": sorted(culprits),
        "summary": _summary_line(job_id, stuck, culprits),
    }


def _still_running(rows: pd.DataFrame, done: pd.DataFrame) -> pd.DataFrame:
    """Rows reported as running whose op has not been reported completed since."""
    key = ["rank", "kind", "process_group", "seq"]
    running = rows[rows["dur_us"] == RUNNING]
    completed = running.merge(done[key].drop_duplicates(), on=key, how="left", indicator=True)["_merge"] == "both"
    return running[~completed.to_numpy()]


def _entry(rank, nodes: pd.Series, state: str, group, seq: int, op: str, since_us: float | None,
           peer: int | None = None) -> dict:
    return {"rank": int(rank), "node": str(nodes.get(rank, "")), "state": state, "op": op,
            "process_group": str(group), "seq": seq, "since_us": since_us, "peer": peer}


def _summary_line(job_id: str, stuck: dict[int, dict], culprits: set[int]) -> str:
    where = {(e["op"], e["process_group"], e["seq"]) for r, e in stuck.items() if r in culprits and e["op"]}
    ops = ", ".join(f"{op} (pg {pg}, seq {seq})" for op, pg, seq in sorted(where))
    if culprits:
        return (f"job {job_id}: rank(s) {', '.join(map(str, sorted(culprits)))} hold the job"
                + (f" at {ops}" if ops else ""))
    return f"job {job_id}: rank(s) {', '.join(map(str, sorted(stuck)))} stopped making progress"
