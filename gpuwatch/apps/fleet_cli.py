"""`gpuwatch fleet DATA`: a fleet reliability report from a recording, an imported fault log or a store.

DATA is a recording directory (telemetry, or a fault log from `gpuwatch import --format faults`), a collector
DuckDB store file or a store URL (``chdb:///DIR``, ``clickhouse://...``). Nodes are read a group at a time;
fault episodes are models/faults.py's from telemetry plus the log's ``fault`` events; the statistics are
models/reliability.py's (docs/failure-model.md §1 defines them).
"""
from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from gpuwatch.apps.commandline import result_command
from gpuwatch.core import events as event_kinds
from gpuwatch.core.errors import UserError
from gpuwatch.core.progress import Progress
from gpuwatch.core.recording import MANIFEST, open_recording
from gpuwatch.models import reliability
from gpuwatch.models.faults import FAULT_COLUMNS, fault_events

NODES_PER_READ = 64
_SAMPLE_COLUMNS = ["node", "gpu_index", "ts", *FAULT_COLUMNS]
_EVENT_COLUMNS = ["node", "gpu_index", "ts", "kind", "code", "message", "attrs"]


def fleet_data(data: str, quiet: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(fault episodes, exposure per GPU) of DATA, read a group of nodes at a time."""
    episodes, exposure = [], []
    chunks = _chunks(data)
    total = next(chunks)
    with Progress("fleet", total=total, unit="nodes", quiet=quiet) as progress:
        for n_nodes, samples, events in chunks:  # type: ignore[misc]
            exposure.append(reliability.exposure_of(samples))
            logged = events["kind"] == event_kinds.FAULT
            episodes.append(reliability.logged_episodes(events[logged]))
            if len(samples) and (~logged).any():
                episodes.append(reliability.telemetry_episodes(fault_events(events[~logged], samples)))
            progress.advance(n_nodes)
    eps = [e for e in episodes if len(e)]
    return (pd.concat(eps, ignore_index=True) if eps else pd.DataFrame(columns=reliability.EPISODE_COLUMNS),
            pd.concat(exposure, ignore_index=True) if exposure else pd.DataFrame(columns=reliability.EXPOSURE_COLUMNS))


def _chunks(data: str) -> Iterator[Any]:
    """First the number of nodes, then (nodes in the group, their samples, their events) per group."""
    path = Path(data)
    if path.is_dir() and (path / MANIFEST).is_file():
        rec = open_recording(path)
        nodes = list(rec.manifest.get("nodes") or [])
        yield len(nodes)
        for i in range(0, len(nodes), NODES_PER_READ):
            group = nodes[i:i + NODES_PER_READ]
            where = [("node", "in", group)]
            yield (len(group), rec.table("gpu_samples", _SAMPLE_COLUMNS, where),
                   rec.table("events", _EVENT_COLUMNS, where))
        return
    store = _open_store(data)
    try:
        events = pd.DataFrame(store.events(),
                              columns=["node", "gpu_index", "ts_ms", "kind", "code", "message", "attrs"])
        events["ts"] = pd.to_datetime(events.pop("ts_ms"), unit="ms", utc=True)
        nodes = sorted({g["node"] for g in store.gpus()} | set(events["node"]))
        yield len(nodes)
        for i in range(0, len(nodes), NODES_PER_READ):
            group = nodes[i:i + NODES_PER_READ]
            samples = store.gpu_samples(nodes=group, columns=[*FAULT_COLUMNS])
            yield len(group), samples, events[events["node"].isin(group)]
    finally:
        store.close()


def _open_store(data: str) -> Any:
    """A collector store named by a DuckDB file or a store URL; a UserError for anything else."""
    from gpuwatch.collector.store import CLICKHOUSE_SCHEMES, open_store

    if data.startswith(CLICKHOUSE_SCHEMES):
        folder = data.split("://", 1)[1]
        if data.startswith("chdb://") and not Path(folder).is_dir():
            raise UserError(f"{data}: no such chdb store directory")
        return open_store(data)
    path = Path(data)
    if path.is_dir():
        raise UserError(f"{data}: not a recording (no {MANIFEST}) and not a store")
    if not path.is_file():
        raise UserError(f"{data}: no such recording directory or store")
    with path.open("rb") as f:
        f.seek(8)
        if f.read(4) != b"DUCK":
            raise UserError(f"{data}: neither a recording directory nor a collector .duckdb store")
    return open_store(str(path))


def fleet_report(data: str, quiet: bool = True, confidence: float = 0.95) -> dict[str, Any]:
    """The report of :func:`reliability.fleet_report` on DATA, with where it came from."""
    episodes, exposure = fleet_data(data, quiet)
    if not len(exposure):
        raise UserError(f"{data}: no GPU samples, so no exposure to count faults against")
    return {"data": data, **reliability.fleet_report(episodes, exposure, confidence)}


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("data", help="recording directory (telemetry or an imported fault log), collector .duckdb store "
                   "or store URL (chdb:///DIR)")
    p.add_argument("--confidence", type=float, default=0.95, help="level of the rate intervals (default 0.95)")


def _run(args: argparse.Namespace) -> dict[str, Any]:
    if not 0 < args.confidence < 1:
        raise UserError(f"--confidence must be between 0 and 1, got {args.confidence}")
    return fleet_report(args.data, quiet=args.quiet, confidence=args.confidence)


def as_text(r: dict[str, Any]) -> str:
    """The report for a person: exposure, rates, kinds, repairs, repeats, lemons."""
    ci = r["rate_ci"]
    lines = [f"{r['data']}: {r['nodes']} nodes, {r['gpus']} GPUs, {r['exposure_gpu_days']:,} GPU-days "
             f"({r['exposure_gpu_hours']:,} GPU-hours)",
             f"GPU faults: {r['episodes']}, {_num(r['rate_per_1000_gpu_days'])} per 1,000 GPU-days "
             f"({int(r['confidence'] * 100)} % CI {_num(ci[0])}-{_num(ci[1])}; Titan 0.149, StepFun 0.142)",
             f"all causes: {r['all_causes']['episodes']}, {_num(r['all_causes']['rate_per_1000_gpu_days'])} per "
             "1,000 GPU-days", "", f"{'kind':<28} {'GPU':>3} {'episodes':>8} {'per 1,000 GPU-days':>19} "
             f"{'CI':>17} {'median repair':>14}"]
    for kind, row in r["by_kind"].items():
        rep = row["repair"]
        lines.append(f"{kind:<28} {'yes' if row['gpu'] else 'no':>3} {row['episodes']:>8} "
                     f"{_num(row['rate_per_1000_gpu_days']):>19} {_num(row['ci'][0]) + '-' + _num(row['ci'][1]):>17} "
                     f"{(_num(rep['median_h']) + ' h') if rep.get('known') else '-':>14}")
    rep = r["repair"]
    if rep.get("known"):
        lines += ["", f"GPU fault repairs ({rep['known']} with an end): median {_num(rep['median_h'])} h, "
                  f"p75 {_num(rep['p75_h'])} h, p90 {_num(rep['p90_h'])} h"]
    h = r["repeat_hazard"]
    lines += ["", f"repeats per {h['unit']}: another GPU fault within 7 days of a return {_pct(h['within_7d'])} "
              f"(of {h['returns_7d']}) vs {_pct(h['base'])} in any 7 days; within 30 days {_pct(h['within_30d'])} vs "
              f"{_pct(h['base_30d'])}; {h['units_with_2_or_more']} {h['unit']}s with 2+ faults where Poisson expects "
              f"{_num(h['expected_with_2_or_more'])}"]
    lines += ["", f"lemons ({len(r['lemons'])}):" if r["lemons"] else "lemons: none"]
    for lemon in r["lemons"]:
        where = lemon["node"] + (f" GPU {lemon['gpu_index']}" if lemon["gpu_index"] is not None else "")
        lines.append(f"  {where}: {lemon['episodes']} {lemon['causes']} faults where {_num(lemon['expected'])} "
                     "expected, "
                     f"p {lemon['p_value']:.2g} (Holm); {', '.join(f'{k} {v}' for k, v in lemon['kinds'].items())}")
    return "\n".join(lines) + "\n"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


FLEET = result_command(_arguments, _run, as_text)
