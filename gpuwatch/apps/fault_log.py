"""`gpuwatch import --format faults`: an operator's fault log turned into a recording `fleet`, `advise` and
`score` read.

A fault log is a list of faults: node, optionally the GPU, a time, a kind (words) or an XID, optionally the
fault's class (GPU, NIC, power, ...) and the repair end, as CSV, Parquet, JSON (a list of objects; nested
objects are flattened, ``fault_type.Class`` reads as a class column) or JSON lines. Start and end may also be
separate rows with an event type (``fault_start``/``fault_end``, ``start``/``end``); an end closes the oldest
open fault of the same node, GPU and kind.

Each fault becomes an event of kind ``fault`` (code = XID or 0, message = the log's words, attrs: kind, gpu,
class, end_ms). A log does not say which GPUs ran fault-free, so exposure is defined here, not guessed:
``--nodes`` servers (default: those in the log) x ``--gpus-per-node`` GPUs x the period (``--start`` to
``--end``, default the first to the last time in the log). The recording carries one empty sample per GPU at
the period's start and end, so every reader measures that same exposure (first to last sample per GPU).
"""
from __future__ import annotations

import json
import os
from collections import Counter, defaultdict, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from gpuwatch.core import events as event_kinds
from gpuwatch.core.errors import UserError
from gpuwatch.core.recording import check_new_recording, new_recording
from gpuwatch.models.reliability import classify_fault
from gpuwatch.apps.importer import epoch_ms

SOURCE = "gpuwatch import --format faults"
TIME_UNITS = ("auto", "days", "hours", "seconds", "ms")
_UNIT_MS = {"days": 86_400_000, "hours": 3_600_000, "seconds": 1000, "ms": 1}
#: Numbers below this are offsets from --start, not epoch times (1e8 s is March 1973).
_RELATIVE_MAX = 1e8
DEFAULT_ORIGIN = "2000-01-01T00:00:00Z"

# Columns looked for, by their name or the last part of a flattened name, case-insensitive.
_NODE = ("node", "node_id", "nodename", "node_name", "hostname", "host", "server", "instance", "machine")
_GPU = ("gpu_index", "gpu", "gpu_id", "gpu_idx", "device", "minor_number")
_TIME = ("ts", "time", "timestamp", "start", "start_time", "start_ts", "event_time", "fault_time", "begin",
         "failed_at")
_END = ("end", "end_time", "end_ts", "repaired", "repaired_at", "repair_time", "recovered", "resolved",
        "fault_end_time")
_EVENT_TYPE = ("event_type", "event", "phase")
_XID = ("xid", "xid_code")
_TEXT = ("desc", "description", "kind", "fault", "fault_kind", "fault_type", "fault_desc", "failure",
         "failure_type", "error_type", "reason", "cause", "error", "symptom", "message", "type")
_CLASS = ("class", "fault_class", "category", "component", "subsystem")
_LEVEL = ("level", "severity")
_ENDS = {"fault_end", "end", "repaired", "recovered", "resolved", "stop", "closed"}


def import_fault_log(files: Sequence[str | os.PathLike], out: str | os.PathLike, *, gpus_per_node: int = 8,
                     nodes: int | None = None, start: str | None = None, end: str | None = None,
                     days: float | None = None, time_unit: str = "auto", node_column: str | None = None,
                     gpu_column: str | None = None, time_column: str | None = None) -> dict[str, Any]:
    """Read the fault log(s) and write a recording to ``out``; returns what was read and the exposure."""
    if gpus_per_node <= 0:
        raise UserError(f"--gpus-per-node must be positive, got {gpus_per_node}")
    if time_unit not in TIME_UNITS:
        raise UserError(f"--time-unit {time_unit!r}: expected one of {', '.join(TIME_UNITS)}")
    out = Path(out)
    check_new_recording(out)
    origin_ms = _parse_time_flag("--start", start) if start else None
    faults: list[pd.DataFrame] = []
    unmatched = skipped = 0
    units = set()
    for path in map(Path, files):
        table = _read(path)
        rows, unit, n_unmatched, n_skipped = _faults(path, table, origin_ms, time_unit,
                                                     node_column, gpu_column, time_column)
        faults.append(rows)
        units.add(unit)
        unmatched += n_unmatched
        skipped += n_skipped
    log = pd.concat(faults, ignore_index=True).sort_values(["start_ms", "node"], kind="stable")
    if log.empty:
        raise UserError(f"no faults found in {', '.join(map(str, files))} ({skipped} rows without node or time)")
    relative = units - {"epoch"}
    first = int(origin_ms) if origin_ms is not None else (
        _parse_time_flag("--start", DEFAULT_ORIGIN) if relative else int(log["start_ms"].min()))
    last_seen = int(np.nanmax(np.r_[log["start_ms"].to_numpy(float), log["end_ms"].to_numpy(float)]))
    if end and days is not None:
        raise UserError("--end and --days: give one of them")
    last = _parse_time_flag("--end", end) if end else (first + int(days * 86_400_000) if days is not None
                                                       else last_seen)
    if last <= first:
        raise UserError(f"the period is empty ({_iso(first)} .. {_iso(last)}): give its end with --end or --days")
    if int(log["start_ms"].min()) < first or int(log["start_ms"].max()) > last:
        raise UserError(f"faults from {_iso(int(log['start_ms'].min()))} to {_iso(int(log['start_ms'].max()))} "
                        f"fall outside the period {_iso(first)} .. {_iso(last)} (--start/--end/--days)")
    listed = sorted(log["node"].unique())
    n_nodes = len(listed) if nodes is None else nodes
    if n_nodes < len(listed):
        raise UserError(f"--nodes {nodes}: the log names {len(listed)} nodes")
    too_high = log[log["gpu_index"] >= gpus_per_node]
    if len(too_high):
        row = too_high.iloc[0]
        raise UserError(f"{row['node']}: GPU index {int(row['gpu_index'])} with --gpus-per-node {gpus_per_node}")
    all_nodes = listed + [f"unlisted-{i:05d}" for i in range(1, n_nodes - len(listed) + 1)]
    _write(out, log, all_nodes, gpus_per_node, first, last, files, {
        "nodes": n_nodes, "nodes_in_log": len(listed), "gpus_per_node": gpus_per_node, "start_ms": first,
        "end_ms": last, "time_units": sorted(units),
        "exposure": "nodes x GPUs per node x period (servers without a fault are in the log's fleet too)"})
    gpu = log["gpu"].to_numpy(bool)
    period_days = (last - first) / 86_400_000
    return {"out": str(out), "format": "faults", "faults": len(log), "gpu_faults": int(gpu.sum()),
            "nodes": n_nodes, "nodes_in_log": len(listed), "gpus_per_node": gpus_per_node,
            "gpus": n_nodes * gpus_per_node, "start": _iso(first), "end": _iso(last),
            "period_days": round(period_days, 3), "exposure_gpu_days": round(n_nodes * gpus_per_node * period_days, 1),
            "times": "days since --start" if relative and time_unit == "auto" else sorted(units),
            "faults_with_gpu": int((log["gpu_index"] >= 0).sum()), "faults_with_end": int(log["end_ms"].notna().sum()),
            "unmatched_ends": unmatched, "skipped_rows": skipped,
            "by_kind": dict(Counter(log["kind"]).most_common())}


# ------------------------------------------------------------------------------------------ reading
def _read(path: Path) -> pd.DataFrame:
    """The log as a flat table; a UserError naming the file when it cannot be read."""
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    name = path.name.lower()
    try:
        if name.endswith((".parquet", ".pq")):
            return pd.read_parquet(path)
        if name.endswith((".csv", ".csv.gz")):
            return pd.read_csv(path, low_memory=False)
        if name.endswith((".jsonl", ".ndjson", ".jsonl.gz")):
            return pd.json_normalize([json.loads(line) for line in _lines(path) if line.strip()])
        if name.endswith((".json", ".json.gz")):
            doc = json.loads("".join(_lines(path)))
            if isinstance(doc, dict):  # {"faults": [...]} or {"events": [...]}
                doc = next((v for v in doc.values() if isinstance(v, list)), None)
            if not isinstance(doc, list):
                raise UserError(f"{path}: expected a JSON list of faults")
            return pd.json_normalize(doc)
    except (OSError, ValueError, pd.errors.ParserError) as exc:
        raise UserError(f"{path}: cannot read: {str(exc).splitlines()[0]}") from None
    raise UserError(f"{path}: unknown file type (expected .csv, .csv.gz, .parquet, .json or .jsonl)")


def _lines(path: Path) -> list[str]:
    import gzip

    opener: Any = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.readlines()


def _column(table: pd.DataFrame, chosen: str | None, names: Sequence[str], path: Path, flag: str) -> str | None:
    """The column ``chosen`` names, else the first whose name (or last dotted part) is one of ``names``."""
    if chosen is not None:
        if chosen not in table.columns:
            raise UserError(f"{path}: no column {chosen!r} ({flag}); columns are {', '.join(map(str, table.columns))}")
        return chosen
    by_name = {str(c).lower(): c for c in table.columns}
    by_tail = {str(c).lower().rsplit(".", 1)[-1]: c for c in table.columns}
    for n in names:
        if n in by_name:
            return str(by_name[n])
    for n in names:
        if n in by_tail:
            return str(by_tail[n])
    return None


def _times(path: Path, column: str, values: pd.Series, origin_ms: int | None, unit: str) -> tuple[np.ndarray, str]:
    """Epoch ms (NaN where empty) and how they were read: 'epoch', or the unit of offsets from --start."""
    numbers = pd.to_numeric(values, errors="coerce")
    if values.notna().sum() and numbers.notna().sum() == values.notna().sum():
        finite = numbers.dropna().abs()
        # a unit given means offsets from --start; left to itself, only numbers too small for epoch times are
        relative = unit != "auto" or (bool(len(finite)) and float(finite.max()) < _RELATIVE_MAX)
        if relative:
            scale = _UNIT_MS["days" if unit == "auto" else unit]
            base = origin_ms if origin_ms is not None else _parse_time_flag("--start", DEFAULT_ORIGIN)
            return (base + numbers.to_numpy(float) * scale), ("days" if unit == "auto" else unit)
        ms = numbers.where(numbers.abs() >= 1e11, numbers * 1000)  # epoch seconds or ms
        return ms.to_numpy(float), "epoch"
    return epoch_ms(path, column, values).to_numpy(float), "epoch"


def _faults(path: Path, table: pd.DataFrame, origin_ms: int | None, unit: str, node_column: str | None,
            gpu_column: str | None, time_column: str | None) -> tuple[pd.DataFrame, str, int, int]:
    """(faults: node, gpu_index, start_ms, end_ms, code, text, class, level, kind, gpu; time reading; unmatched
    ends; rows skipped)."""
    node_c = _column(table, node_column, _NODE, path, "--node-column")
    time_c = _column(table, time_column, _TIME, path, "--time-column")
    if node_c is None or time_c is None:
        missing = "node" if node_c is None else "time"
        raise UserError(f"{path}: no {missing} column (looked for {', '.join(_NODE if node_c is None else _TIME)}); "
                        f"name it with --{missing}-column")
    gpu_c = _column(table, gpu_column, _GPU, path, "--gpu-column")
    end_c, type_c, xid_c = (_column(table, None, n, path, "") for n in (_END, _EVENT_TYPE, _XID))
    text_c, class_c, level_c = (_column(table, None, n, path, "") for n in (_TEXT, _CLASS, _LEVEL))
    if text_c is None and xid_c is None:
        raise UserError(f"{path}: no kind or XID column (looked for {', '.join(_TEXT + _XID)})")
    start, unit_read = _times(path, time_c, table[time_c], origin_ms, unit)
    stop = _times(path, end_c, table[end_c], origin_ms, unit)[0] if end_c else np.full(len(table), np.nan)
    node = table[node_c].astype("string").str.strip()
    gpu = pd.to_numeric(table[gpu_c], errors="coerce") if gpu_c else pd.Series(np.nan, index=table.index)
    xid = pd.to_numeric(table[xid_c], errors="coerce") if xid_c else pd.Series(np.nan, index=table.index)

    def text(c: str | None) -> list[str]:
        return ["" if v is None or v != v else str(v) for v in table[c]] if c else [""] * len(table)

    words, classes, levels = text(text_c), text(class_c), text(level_c)
    kinds = [str(v).strip().lower() for v in table[type_c]] if type_c else [""] * len(table)
    valid = (node.notna() & (node != "")).to_numpy() & ~np.isnan(start)
    rows: list[dict[str, Any]] = []
    open_faults: dict[tuple, deque[int]] = defaultdict(deque)
    unmatched = 0
    for i in np.argsort(np.where(valid, start, np.inf), kind="stable"):
        if not valid[i]:
            continue
        g = int(gpu.iat[i]) if gpu.iat[i] == gpu.iat[i] and gpu.iat[i] >= 0 else -1
        x = int(xid.iat[i]) if xid.iat[i] == xid.iat[i] else None
        key = (node.iat[i], g, words[i], classes[i], x)
        if kinds[i] in _ENDS:
            if open_faults[key]:
                rows[open_faults[key].popleft()]["end_ms"] = float(start[i])
            else:
                unmatched += 1
            continue
        kind, is_gpu = classify_fault(words[i], x, classes[i] or None)
        open_faults[key].append(len(rows))
        rows.append({"node": str(node.iat[i]), "gpu_index": g, "start_ms": float(start[i]), "end_ms": float(stop[i]),
                     "code": x or 0, "text": words[i], "class": classes[i], "level": levels[i], "kind": kind,
                     "gpu": is_gpu})
    frame = pd.DataFrame(rows, columns=["node", "gpu_index", "start_ms", "end_ms", "code", "text", "class", "level",
                                        "kind", "gpu"])
    return frame, unit_read, unmatched, int((~valid).sum())


# ------------------------------------------------------------------------------------------ writing
def _write(out: Path, log: pd.DataFrame, nodes: list[str], gpus_per_node: int, first: int, last: int,
           files: Sequence[str | os.PathLike], fleet: dict[str, Any]) -> None:
    """Events of kind ``fault``, the inventory, and an empty sample per GPU at the period's start and end."""
    attrs = [json.dumps({"kind": kind, "gpu": "true" if gpu else "false", "class": cls, "level": level,
                         **({"end_ms": str(int(stop))} if stop == stop else {})})
             for kind, gpu, cls, level, stop in zip(log["kind"], log["gpu"], log["class"], log["level"], log["end_ms"])]
    events = pd.DataFrame({"node": log["node"].to_numpy(), "gpu_index": log["gpu_index"].astype("int32").to_numpy(),
                           "ts": pd.to_datetime(log["start_ms"].astype("int64"), unit="ms", utc=True).to_numpy(),
                           "kind": event_kinds.FAULT, "code": log["code"].astype("int64").to_numpy(),
                           "message": log["text"].to_numpy(), "attrs": attrs})
    node_col = np.repeat(np.asarray(nodes, dtype=object), gpus_per_node)
    index = np.tile(np.arange(gpus_per_node, dtype=np.int32), len(nodes))
    gpus = pd.DataFrame({"node": node_col, "index": index, "uuid": "", "name": "", "pci_bus_id": None, "serial": None,
                         "memory_total_bytes": None, "architecture": None, "gpm_supported": None})
    samples = pd.DataFrame({"node": np.concatenate([node_col, node_col]), "gpu_index": np.concatenate([index, index]),
                            "ts": pd.to_datetime(np.repeat([first, last], len(node_col)), unit="ms", utc=True)})
    extra = {"import": {"files": [str(Path(f).resolve()) for f in files], "format": "faults"}, "fault_log": fleet}
    with new_recording(out, source=SOURCE, extra=extra) as writer:
        writer.append("gpus", gpus)
        writer.append("gpu_samples", samples.sort_values(["node", "gpu_index", "ts"], kind="stable"))
        writer.append("events", events.sort_values(["node", "ts"], kind="stable"))


def _parse_time_flag(flag: str, text: str) -> int:
    """Epoch ms of an ISO 8601 date or time (UTC when it has no zone)."""
    try:
        stamp = pd.Timestamp(text)
        stamp = stamp.tz_localize("UTC") if stamp.tzinfo is None else stamp.tz_convert("UTC")
        return int(stamp.value // 1_000_000)
    except (ValueError, TypeError):
        raise UserError(f"{flag} {text!r}: not a date or time (ISO 8601, e.g. 2024-03-30)") from None


def _iso(ms: int) -> str:
    return pd.Timestamp(ms, unit="ms", tz="UTC").strftime("%Y-%m-%dT%H:%M:%SZ")
