"""`gpuwatch import`: CSV/Parquet telemetry people already have, turned into a gpuwatch recording.

Two shapes are read (docs/replay.md documents the columns):

* **wide** — one row per GPU and time: ``node``, ``gpu_index``, ``ts`` and a column per field, named as
  gpuwatch names it (gpuwatch units) or as dcgm-exporter does (converted by :data:`DCGM_METRICS`),
  optionally ``job_id``/``rank``/``local_rank``;
* **long** — one value per row, as a dcgm-exporter history exported from Prometheus: a time, a node
  (``Hostname``/``instance``), ``gpu``, a metric name (``__name__``/``metric``) and ``value``. DCGM
  metric names are mapped to gpuwatch fields with unit conversion by :data:`DCGM_METRICS`, the one mapping
  table; ``DCGM_FI_DEV_XID_ERRORS`` (the last XID seen) becomes an ``xid`` event each time it changes.

Metrics and columns gpuwatch has no field for are counted and reported, never fatal; a row without a
node, GPU or time is skipped and counted. A missing required column is an error naming the file.
"""
from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from gpuwatch.core import events as event_kinds
from gpuwatch.core.dcgm_names import RENAMED_4_9
from gpuwatch.core.errors import UserError
from gpuwatch.core.fields import GPU_FIELD_NAMES
from gpuwatch.core.progress import Progress
from gpuwatch.core.recording import check_new_recording, new_recording

FORMATS = ("auto", "wide", "long")
SOURCE = "gpuwatch import"
CHUNK_ROWS = 250_000
PART_ROWS = 1_000_000
MIB = 2**20

#: DCGM field (dcgm-exporter metric name) -> (gpuwatch field, factor from DCGM's unit to gpuwatch's).
DCGM_METRICS: dict[str, tuple[str, float]] = {
    "DCGM_FI_DEV_GPU_UTIL": ("gpu_utilization_ratio", 0.01),  # %
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("gpu_memory_utilization_ratio", 0.01),  # %
    "DCGM_FI_DEV_FB_USED": ("gpu_memory_used_bytes", MIB),  # MiB
    "DCGM_FI_DEV_FB_TOTAL": ("gpu_memory_total_bytes", MIB),  # MiB
    "DCGM_FI_DEV_GPU_TEMP": ("gpu_temperature_celsius", 1.0),
    "DCGM_FI_DEV_MEMORY_TEMP": ("gpu_memory_temperature_celsius", 1.0),
    "DCGM_FI_DEV_POWER_USAGE": ("gpu_power_watts", 1.0),
    "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": ("gpu_power_limit_watts", 1.0),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": ("gpu_energy_joules_total", 1e-3),  # mJ
    "DCGM_FI_DEV_SM_CLOCK": ("gpu_sm_clock_hertz", 1e6),  # MHz
    "DCGM_FI_DEV_MEM_CLOCK": ("gpu_memory_clock_hertz", 1e6),  # MHz
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": ("gpu_clock_event_reasons", 1.0),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": ("gpu_clock_event_reasons", 1.0),
    "DCGM_FI_DEV_POWER_VIOLATION": ("gpu_throttle_power_seconds_total", 1e-6),  # µs
    "DCGM_FI_DEV_THERMAL_VIOLATION": ("gpu_throttle_thermal_seconds_total", 1e-6),  # µs
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("gpu_pcie_replay_total", 1.0),
    "DCGM_FI_DEV_PCIE_LINK_GEN": ("gpu_pcie_link_gen", 1.0),
    "DCGM_FI_DEV_PCIE_LINK_WIDTH": ("gpu_pcie_link_width", 1.0),
    "DCGM_FI_DEV_PCIE_MAX_LINK_GEN": ("gpu_pcie_link_gen_max", 1.0),
    "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH": ("gpu_pcie_link_width_max", 1.0),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": ("gpu_ecc_sbe_volatile_total", 1.0),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": ("gpu_ecc_dbe_volatile_total", 1.0),
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": ("gpu_ecc_sbe_aggregate_total", 1.0),
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": ("gpu_ecc_dbe_aggregate_total", 1.0),
    "DCGM_FI_DEV_RETIRED_SBE": ("gpu_retired_pages_sbe", 1.0),
    "DCGM_FI_DEV_RETIRED_DBE": ("gpu_retired_pages_dbe", 1.0),
    "DCGM_FI_DEV_RETIRED_PENDING": ("gpu_retired_pages_pending", 1.0),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": ("gpu_remapped_rows_correctable", 1.0),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": ("gpu_remapped_rows_uncorrectable", 1.0),
    "DCGM_FI_DEV_ROW_REMAP_PENDING": ("gpu_remapped_rows_pending", 1.0),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": ("gpu_remapped_rows_failure", 1.0),
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": ("gpu_nvlink_crc_flit_errors_total", 1.0),
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": ("gpu_nvlink_crc_data_errors_total", 1.0),
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": ("gpu_nvlink_replay_errors_total", 1.0),
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": ("gpu_nvlink_recovery_errors_total", 1.0),
    "DCGM_FI_PROF_SM_ACTIVE": ("gpu_sm_active_ratio", 1.0),
    "DCGM_FI_PROF_SM_OCCUPANCY": ("gpu_sm_occupancy_ratio", 1.0),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": ("gpu_tensor_active_ratio", 1.0),
    "DCGM_FI_PROF_DRAM_ACTIVE": ("gpu_dram_bandwidth_utilization_ratio", 1.0),
    "DCGM_FI_PROF_PCIE_TX_BYTES": ("gpu_pcie_tx_bytes_per_second", 1.0),  # bytes/s
    "DCGM_FI_PROF_PCIE_RX_BYTES": ("gpu_pcie_rx_bytes_per_second", 1.0),
    "DCGM_FI_PROF_NVLINK_TX_BYTES": ("gpu_nvlink_tx_bytes_per_second", 1.0),
    "DCGM_FI_PROF_NVLINK_RX_BYTES": ("gpu_nvlink_rx_bytes_per_second", 1.0),
    # gpuwatch's own field names pass through unchanged (a long export of data already in gpuwatch units)
    **{name: (name, 1.0) for name in GPU_FIELD_NAMES},
}
XID_METRIC = "DCGM_FI_DEV_XID_ERRORS"
# dcgm-exporter 4.9's names of the same fields, in its base units (--metrics-names dcgm's table); its last-XID
# gauge becomes events as the old one does
DCGM_METRICS.update({new: (DCGM_METRICS[old][0], DCGM_METRICS[old][1] if scale is None else 1.0 / scale)
                     for old, (new, scale, _) in RENAMED_4_9.items() if old in DCGM_METRICS})
DCGM_METRICS[RENAMED_4_9[XID_METRIC][0]] = (XID_METRIC, 1.0)

# Column names looked for, in order, when no --*-column names one.
NODE_COLUMNS = ("node", "Hostname", "hostname", "host", "instance")
GPU_COLUMNS = ("gpu_index", "gpu", "GPU")
TIME_COLUMNS = ("ts", "timestamp", "time", "Time")
METRIC_COLUMNS = ("__name__", "metric", "name")
VALUE_COLUMNS = ("value", "Value")
UUID_COLUMNS = ("UUID", "uuid")
MODEL_COLUMNS = ("modelName", "model_name")
_WIDE_EXTRAS = ("job_id", "rank", "local_rank")
_EPOCH_MS_MIN = 10**11  # numeric times below this are epoch seconds (10**11 s is the year 5138)


@dataclass(frozen=True)
class Columns:
    """Column names chosen by the user (None: look for the usual names)."""

    node: str | None = None
    gpu: str | None = None
    time: str | None = None


@dataclass
class _Report:
    rows_read: int = 0
    skipped_rows: int = 0
    bad_values: int = 0

    def __post_init__(self) -> None:
        self.unknown_metrics: Counter[str] = Counter()
        self.ignored_columns: set[str] = set()
        self.formats: dict[str, str] = {}


def import_files(files: Sequence[str | os.PathLike], out: str | os.PathLike, *, fmt: str = "auto",
                 columns: Columns = Columns(), quiet: bool = False) -> dict[str, Any]:
    """Read every file (CSV, CSV.gz or Parquet) and write one recording to ``out`` (new or empty).

    Returns what was read and written, with the unknown metrics and ignored columns counted.
    """
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    out = Path(out)
    check_new_recording(out)
    report = _Report()
    wide: list[pd.DataFrame] = []
    long: list[pd.DataFrame] = []
    inventory: list[pd.DataFrame] = []
    for path in map(Path, files):
        for chunk in _read_chunks(path, quiet):
            shape = _detect(path, chunk, fmt)
            report.formats[str(path)] = shape
            report.rows_read += len(chunk)
            keys = _keys(path, chunk, columns, report)
            inventory.append(_inventory_rows(chunk, keys))
            (wide if shape == "wide" else long).append(
                _wide_rows(path, chunk, keys, report) if shape == "wide" else _long_rows(path, chunk, keys, report))
    samples, events = _samples_and_events(wide, long)
    gpus = _gpus(pd.concat(inventory, ignore_index=True), samples)
    _write(out, samples, events, gpus, report, files)
    return {"out": str(out), "formats": report.formats, "rows_read": report.rows_read,
            "gpu_samples": len(samples), "events": len(events), "nodes": int(samples["node"].nunique()),
            "gpus": len(gpus), "skipped_rows": report.skipped_rows, "bad_values": report.bad_values,
            "unknown_metrics": dict(report.unknown_metrics.most_common()),
            "ignored_columns": sorted(report.ignored_columns)}


# ------------------------------------------------------------------------------------------ reading
def _read_chunks(path: Path, quiet: bool) -> Iterator[pd.DataFrame]:
    """The file in chunks of rows, with progress for large files; a UserError naming the file otherwise."""
    name = path.name.lower()
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    try:
        if name.endswith((".parquet", ".pq")):
            pf = pq.ParquetFile(path)
            with Progress(f"import {path.name}", total=pf.metadata.num_rows, quiet=quiet) as progress:
                for batch in pf.iter_batches(batch_size=CHUNK_ROWS):
                    progress.advance(batch.num_rows)
                    yield batch.to_pandas()
        elif name.endswith((".csv", ".csv.gz")):
            with Progress(f"import {path.name}", quiet=quiet) as progress, \
                    pd.read_csv(path, chunksize=CHUNK_ROWS, low_memory=False) as reader:
                for chunk in reader:
                    progress.advance(len(chunk))
                    yield chunk
        else:
            raise UserError(f"{path}: unknown file type (expected .csv, .csv.gz, .parquet or .pq)")
    except (OSError, ValueError, pd.errors.ParserError) as exc:
        raise UserError(f"{path}: cannot read: {str(exc).splitlines()[0]}") from None


def _detect(path: Path, chunk: pd.DataFrame, fmt: str) -> str:
    is_long = _find(chunk, METRIC_COLUMNS) is not None and _find(chunk, VALUE_COLUMNS) is not None
    if fmt == "auto":
        return "long" if is_long else "wide"
    if fmt == "long" and not is_long:
        raise UserError(f"{path}: --format long needs a metric column ({'/'.join(METRIC_COLUMNS)}) and a value "
                        f"column ({'/'.join(VALUE_COLUMNS)})")
    return fmt


@dataclass(frozen=True)
class _Keys:
    node: pd.Series
    gpu: pd.Series
    ts: pd.Series  # epoch ms, NaN where missing
    valid: np.ndarray


def _keys(path: Path, chunk: pd.DataFrame, columns: Columns, report: _Report) -> _Keys:
    """Node, GPU index and time of every row; rows missing one are marked invalid and counted."""
    node_col = _required(path, chunk, columns.node, NODE_COLUMNS, "node", "--node-column")
    gpu_col = _required(path, chunk, columns.gpu, GPU_COLUMNS, "GPU index", "--gpu-column")
    time_col = _required(path, chunk, columns.time, TIME_COLUMNS, "time", "--time-column")
    node = chunk[node_col].astype("string")
    if node_col == "instance":  # Prometheus target "host:9400" -> "host"
        node = node.str.replace(r":\d+$", "", regex=True)
    gpu = pd.to_numeric(chunk[gpu_col], errors="coerce")
    ts = epoch_ms(path, time_col, chunk[time_col])
    valid = (node.notna() & (node != "") & gpu.notna() & (gpu >= 0) & ts.notna()).to_numpy()
    report.skipped_rows += int((~valid).sum())
    return _Keys(node, gpu, ts, valid)


def _required(path: Path, chunk: pd.DataFrame, chosen: str | None, names: Sequence[str], what: str,
              flag: str) -> str:
    if chosen is not None:
        if chosen not in chunk.columns:
            raise UserError(f"{path}: no column {chosen!r} ({flag}); columns are {', '.join(map(str, chunk.columns))}")
        return chosen
    found = _find(chunk, names)
    if found is None:
        raise UserError(f"{path}: no {what} column (looked for {', '.join(names)}); name it with {flag}")
    return found


def _find(chunk: pd.DataFrame, names: Sequence[str]) -> str | None:
    return next((n for n in names if n in chunk.columns), None)


def epoch_ms(path: Path, column: str, values: pd.Series) -> pd.Series:
    """Times as epoch ms (float, NaN where empty): numbers are epoch seconds or ms, text is ISO 8601 (UTC
    when it has no zone)."""
    if pd.api.types.is_numeric_dtype(values):
        numbers = values.astype(float)
        return numbers.where(numbers.abs() >= _EPOCH_MS_MIN, numbers * 1000).round()
    try:
        parsed = pd.to_datetime(values, utc=True, format="ISO8601")
    except (ValueError, TypeError) as exc:
        raise UserError(f"{path}: column {column!r} holds a value that is not a time: "
                        f"{str(exc).splitlines()[0]}") from None
    ms = parsed.astype("datetime64[ms, UTC]").astype("int64").astype(float)
    return ms.where(parsed.notna())


# --------------------------------------------------------------------------------------- shaping
def _wide_rows(path: Path, chunk: pd.DataFrame, keys: _Keys, report: _Report) -> pd.DataFrame:
    """gpuwatch field columns as they are, dcgm-exporter columns through :data:`DCGM_METRICS` (the XID column
    stays ``XID_METRIC`` and becomes events later); two columns of one field: the first non-empty value wins."""
    known = [c for c in chunk.columns if c in DCGM_METRICS or c == XID_METRIC]
    extras = [c for c in _WIDE_EXTRAS if c in chunk.columns]
    used = {keys.node.name, keys.gpu.name, keys.ts.name, *known, *extras, *UUID_COLUMNS, *MODEL_COLUMNS}
    report.ignored_columns.update(str(c) for c in chunk.columns if c not in used)
    raw = chunk[known].reset_index(drop=True)
    numeric = raw.apply(pd.to_numeric, errors="coerce")
    report.bad_values += int((numeric.isna() & raw.notna()).to_numpy().sum())
    values = pd.DataFrame(index=numeric.index)
    for column in known:
        field, factor = DCGM_METRICS.get(column, (XID_METRIC, 1.0))
        converted = numeric[column] * factor
        values[field] = values[field].combine_first(converted) if field in values else converted
    frame = pd.concat([_key_frame(keys), values, chunk[extras].reset_index(drop=True)], axis=1)
    return frame[keys.valid]


def _long_rows(path: Path, chunk: pd.DataFrame, keys: _Keys, report: _Report) -> pd.DataFrame:
    """Rows (node, gpu_index, ts, field, value) in gpuwatch units; XID rows keep field ``XID_METRIC``."""
    metric = chunk[_find(chunk, METRIC_COLUMNS)].astype("string").reset_index(drop=True)
    raw = chunk[_find(chunk, VALUE_COLUMNS)].reset_index(drop=True)
    value = pd.to_numeric(raw, errors="coerce")
    report.bad_values += int((value.isna() & raw.notna()).sum())
    mapped = metric.map(lambda m: DCGM_METRICS.get(m, (XID_METRIC, 1.0) if m == XID_METRIC else None))
    known = mapped.notna().to_numpy() & keys.valid
    unknown = ~mapped.notna().to_numpy() & keys.valid
    report.unknown_metrics.update(metric[unknown].value_counts().to_dict())
    fields = mapped[known]
    frame = _key_frame(keys)[known]
    return frame.assign(field=[f for f, _ in fields], value=value[known].to_numpy() * [s for _, s in fields])


def _key_frame(keys: _Keys) -> pd.DataFrame:
    return pd.DataFrame({"node": keys.node.to_numpy(dtype=object), "gpu_index": keys.gpu.to_numpy(),
                         "ts": keys.ts.to_numpy()})


def _inventory_rows(chunk: pd.DataFrame, keys: _Keys) -> pd.DataFrame:
    """Distinct (node, GPU, UUID, model) seen, for the recording's gpus table."""
    frame = _key_frame(keys).drop(columns="ts")
    uuid, model = _find(chunk, UUID_COLUMNS), _find(chunk, MODEL_COLUMNS)
    frame["uuid"] = chunk[uuid].astype("string").to_numpy() if uuid else ""
    frame["name"] = chunk[model].astype("string").to_numpy() if model else ""
    return frame[keys.valid].astype({"gpu_index": "int64"}).drop_duplicates()


def _samples_and_events(wide: list[pd.DataFrame], long: list[pd.DataFrame]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One wide gpu_samples frame (last value wins per GPU, time and field) and the XID events."""
    key = ["node", "gpu_index", "ts"]
    parts = [w.drop(columns=XID_METRIC, errors="ignore") for w in wide if len(w)]
    long = long + [w[[*key, XID_METRIC]].rename(columns={XID_METRIC: "value"}).assign(field=XID_METRIC)
                   for w in wide if len(w) and XID_METRIC in w]
    narrow = pd.concat(long, ignore_index=True) if long else pd.DataFrame(columns=[*key, "field", "value"])
    xid = narrow[narrow["field"] == XID_METRIC]
    values = narrow[narrow["field"] != XID_METRIC]
    if len(values):
        pivot = values.groupby([*key, "field"], sort=False)["value"].last().unstack("field").reset_index()
        parts.append(pivot)
    samples = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=key)
    samples = samples.drop_duplicates(key, keep="last").sort_values(key, kind="stable").reset_index(drop=True)
    samples[["gpu_index", "ts"]] = samples[["gpu_index", "ts"]].astype("int64")
    return samples, _xid_events(xid)


def _xid_events(rows: pd.DataFrame) -> pd.DataFrame:
    """An ``xid`` event whenever a GPU's last-XID value changes to a non-zero code (from 0 at the start)."""
    rows = rows.dropna(subset=["value"]).sort_values(["node", "gpu_index", "ts"], kind="stable")
    previous = rows.groupby(["node", "gpu_index"])["value"].shift(fill_value=0)
    hits = rows[(rows["value"] != previous) & (rows["value"] != 0)]
    return pd.DataFrame({"node": hits["node"], "gpu_index": hits["gpu_index"].astype("int64"),
                         "ts": hits["ts"].astype("int64"), "kind": event_kinds.XID,
                         "code": hits["value"].astype("int64"), "message": "imported from " + XID_METRIC})


def _gpus(seen: pd.DataFrame, samples: pd.DataFrame) -> pd.DataFrame:
    """One inventory row per sampled GPU, with the UUID and model name when the input had them."""
    sampled = samples[["node", "gpu_index"]].drop_duplicates()
    seen = seen.fillna("").sort_values(["uuid", "name"]).drop_duplicates(["node", "gpu_index"], keep="last")
    gpus = sampled.merge(seen, on=["node", "gpu_index"], how="left").fillna("")
    unknown = {"pci_bus_id": None, "serial": None, "memory_total_bytes": None, "architecture": None,
               "gpm_supported": None}
    return gpus.rename(columns={"gpu_index": "index"}).assign(**unknown)


def _write(out: Path, samples: pd.DataFrame, events: pd.DataFrame, gpus: pd.DataFrame, report: _Report,
           files: Sequence[str | os.PathLike]) -> None:
    if samples.empty:
        raise UserError(f"no GPU samples found in {', '.join(map(str, files))} "
                        f"({report.rows_read} rows read, {report.skipped_rows} without node/GPU/time, "
                        f"unknown metrics: {dict(report.unknown_metrics) or 'none'})")
    extra = {"import": {"files": [str(Path(f).resolve()) for f in files],
                        "sizes": [Path(f).stat().st_size for f in files], "formats": report.formats}}
    with new_recording(out, source=SOURCE, extra=extra) as writer:
        writer.append("gpus", gpus)
        for rows in _node_parts(samples):
            writer.append("gpu_samples", rows)
        for rows in _node_parts(events):
            writer.append("events", rows)


def _node_parts(frame: pd.DataFrame) -> Iterator[pd.DataFrame]:
    """``frame`` sorted by node in parts of about ``PART_ROWS`` rows, a node never split across parts: readers
    that want a few nodes skip the rest by the parts' node statistics, and a fleet of many small nodes is a
    few files, not one per node (one per node made 18,687 files, and 2.5 min, of a 79,833-row import)."""
    if frame.empty:
        return
    frame = frame.sort_values(["node", "gpu_index", "ts"], kind="stable").reset_index(drop=True)
    node = frame["node"].to_numpy()
    first_of_node = np.flatnonzero(np.r_[True, node[1:] != node[:-1]])
    start = 0
    for cut in first_of_node[1:]:
        if cut - start >= PART_ROWS:
            yield frame.iloc[start:cut]
            start = cut
    yield frame.iloc[start:]
