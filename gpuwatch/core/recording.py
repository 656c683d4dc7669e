"""The gpuwatch recording format: one directory of Parquet part files plus a JSON manifest.

`gpuwatch simulate` writes it, agents record it, the collector exports it and replay reads it, so telemetry
moves between all of them in one documented shape (docs/recording-format.md). Each table is a folder of
part files that plain pandas reads (``pd.read_parquet(path / "gpu_samples")``); ``gpu_samples`` has exactly
the columns of the collector's ``gpu_samples`` store table, so rows go from one to the other unchanged.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gpuwatch.core.errors import UserError
from gpuwatch.core.fields import GPU_FIELD_NAMES, HOST_FIELD_NAMES
from gpuwatch.core.spans import span_arrow_schema

FORMAT = "gpuwatch-recording"
VERSION = 1
MANIFEST = "manifest.json"

_TS = pa.timestamp("ms", tz="UTC")
_KEY = [("node", pa.string()), ("gpu_index", pa.int32()), ("ts", _TS)]

#: Column schema of every table, in column order.
SCHEMAS: dict[str, pa.Schema] = {
    "gpu_samples": pa.schema(
        _KEY
        + [("job_id", pa.string()), ("rank", pa.int32()), ("local_rank", pa.int32())]
        + [(name, pa.float64()) for name in GPU_FIELD_NAMES]
    ),
    "host_samples": pa.schema([("node", pa.string()), ("ts", _TS)] + [(n, pa.float64()) for n in HOST_FIELD_NAMES]),
    "events": pa.schema(
        _KEY + [("kind", pa.string()), ("code", pa.int64()), ("message", pa.string()), ("attrs", pa.string())]
    ),
    "gpus": pa.schema(
        [
            ("node", pa.string()),
            ("index", pa.int32()),
            ("uuid", pa.string()),
            ("name", pa.string()),
            ("pci_bus_id", pa.string()),
            ("serial", pa.string()),
            ("memory_total_bytes", pa.int64()),
            ("architecture", pa.string()),
            ("gpm_supported", pa.bool_()),
        ]
    ),
    "spans": span_arrow_schema(),
}
TABLES: tuple[str, ...] = tuple(SCHEMAS)
# Columns a writer fills in when a frame leaves them out: measured fields (NaN = not sampled) and optional text.
_OPTIONAL = set(GPU_FIELD_NAMES) | set(HOST_FIELD_NAMES) | {"message", "attrs", "job_id", "rank", "local_rank"}
_DEFAULTS = {"job_id": "", "rank": -1, "local_rank": -1, "message": "", "attrs": "{}"}


def _conform(table: str, df: pd.DataFrame) -> pa.Table:
    """Arrow table in the table's exact schema; names the table and columns that do not fit."""
    schema = SCHEMAS[table]
    unknown = sorted(set(df.columns) - set(schema.names))
    if unknown:
        raise UserError(f"recording table {table!r}: unknown columns {unknown}")
    missing = [n for n in schema.names if n not in df.columns and n not in _OPTIONAL]
    if missing:
        raise UserError(f"recording table {table!r}: missing required columns {missing}")
    arrays = []
    for f in schema:
        if f.name in df.columns:
            col = df[f.name]
            if f.name == "attrs":
                col = col.map(lambda v: v if isinstance(v, str) else json.dumps(v or {}, sort_keys=True))
            if pa.types.is_timestamp(f.type):
                col = _to_utc_ms(col, f"{table}.{f.name}")
        else:
            default = _DEFAULTS.get(f.name, np.nan)
            col = pd.Series([default] * len(df), dtype=object if isinstance(default, str) else None)
        try:
            arrays.append(pa.array(col, type=f.type, from_pandas=True))
        except (pa.ArrowInvalid, pa.ArrowTypeError, ValueError) as exc:
            raise UserError(f"recording table {table!r}: column {f.name!r} is not {f.type}: {exc}") from None
    return pa.Table.from_arrays(arrays, schema=schema)


def conform(table: str, df: pd.DataFrame | None) -> pd.DataFrame:
    """``df`` (None: no rows) in ``table``'s exact schema, as a reader of a recording gets it back: missing
    optional columns filled as a writer fills them, timestamps as UTC; a UserError for rows that do not fit."""
    if df is None or df.empty:
        return SCHEMAS[table].empty_table().to_pandas()
    return _conform(table, df).to_pandas()


def _to_utc_ms(col: pd.Series, where: str) -> pd.Series:
    """Timestamps as UTC; integers are read as epoch milliseconds."""
    if pd.api.types.is_integer_dtype(col):
        return pd.to_datetime(col, unit="ms", utc=True)
    try:
        return pd.to_datetime(col, utc=True)
    except (ValueError, TypeError) as exc:
        raise UserError(f"{where}: not a timestamp: {exc}") from None


def ts_ms(series: pd.Series) -> np.ndarray:
    """Epoch milliseconds (int64) of a recording timestamp column."""
    ms: np.ndarray = pd.to_datetime(series, utc=True).dt.as_unit("ms").astype("int64").to_numpy()
    return ms


class RecordingWriter:
    """Appends part files to a recording directory and keeps its manifest current.

    Reopening an existing recording appends new parts after the existing ones; ``close()`` merges the time
    range and node list into the manifest, so an agent that restarts keeps one recording.
    """

    def __init__(self, path: str | os.PathLike[str], *, source: str, resolution_s: float | None = None,
                 extra: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"recording {self.path}: exists and is not a directory")
        self.path.mkdir(parents=True, exist_ok=True)
        existing = (self.path / MANIFEST).exists()
        self._manifest: dict[str, Any] = _read_manifest(self.path) if existing else {
            "format": FORMAT, "version": VERSION, "resolution_s": resolution_s, "source": source,
            "start_ms": None, "end_ms": None, "nodes": [], "tables": {t: 0 for t in TABLES},
        }
        if extra:
            self._manifest.setdefault("extra", {}).update(extra)
        self._nodes = set(self._manifest["nodes"])

    def append(self, table: str, df: pd.DataFrame) -> Path | None:
        """Write one part file of ``table``; returns its path (None for an empty frame)."""
        if table not in SCHEMAS:
            raise UserError(f"recording: unknown table {table!r} (tables: {', '.join(TABLES)})")
        if df.empty:
            return None
        arrow = _conform(table, df)
        folder = self.path / table
        folder.mkdir(exist_ok=True)
        n = self._manifest["tables"].get(table, 0)
        part = folder / f"part-{n:05d}.parquet"
        pq.write_table(arrow, part, compression="zstd")
        self._manifest["tables"][table] = n + 1
        if "node" in df.columns:  # spans may have no node (NULL or ""): not a node of the recording
            self._nodes.update(n for n in df["node"].dropna().astype(str).unique() if n)
        if "ts" in arrow.column_names:
            ms = arrow.column("ts").cast(pa.int64())
            lo, hi = pc.min(ms).as_py(), pc.max(ms).as_py()
            m = self._manifest
            m["start_ms"] = lo if m["start_ms"] is None else min(m["start_ms"], lo)
            m["end_ms"] = hi if m["end_ms"] is None else max(m["end_ms"], hi)
        return part

    def close(self) -> None:
        """Write the manifest atomically (a reader never sees a half-written one)."""
        self._manifest["nodes"] = sorted(self._nodes)
        tmp = self.path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(self._manifest, indent=2, sort_keys=True))
        tmp.replace(self.path / MANIFEST)

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Recording:
    """A recording opened for reading; tables come back as DataFrames in the documented schema."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest

    def parts(self, table: str) -> list[Path]:
        if table not in SCHEMAS:
            raise UserError(f"recording {self.path}: unknown table {table!r} (tables: {', '.join(TABLES)})")
        return sorted((self.path / table).glob("part-*.parquet"))

    def table(self, name: str, columns: Sequence[str] | None = None, filters: Any = None) -> pd.DataFrame:
        """The whole table (or the named columns, rows matching pyarrow ``filters``) as one DataFrame."""
        parts = self.parts(name)
        schema = SCHEMAS[name]
        if columns is not None:
            unknown = [c for c in columns if c not in schema.names]
            if unknown:
                raise UserError(f"recording {self.path}: table {name!r} has no columns {unknown}")
            schema = pa.schema([schema.field(c) for c in columns])
        if not parts:
            return schema.empty_table().to_pandas()
        return pq.read_table(parts, columns=list(schema.names), filters=filters, schema=SCHEMAS[name]).to_pandas()

    def iter_parts(self, name: str, columns: Sequence[str] | None = None) -> Iterator[pd.DataFrame]:
        """One DataFrame per part file, for tables too large to hold at once."""
        for part in self.parts(name):
            yield pq.read_table(part, columns=list(columns) if columns else None).to_pandas()


def _read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST
    if not file.is_file():
        raise UserError(f"{path}: not a gpuwatch recording (no {MANIFEST})")
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{file}: unreadable manifest: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(f"{file}: not a gpuwatch recording manifest (format is not {FORMAT!r})")
    version = manifest.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise UserError(f"{path}: recording version {version!r} is newer than this gpuwatch reads ({VERSION}); "
                        "upgrade gpuwatch")
    return manifest


def open_recording(path: str | os.PathLike[str]) -> Recording:
    """Open a recording directory; a clear UserError if it is not one or is from a newer gpuwatch."""
    p = Path(path)
    if p.is_file():
        raise UserError(f"{p} is a file, not a recording directory")
    if not p.is_dir():
        raise UserError(f"{p}: not a gpuwatch recording (no such directory)")
    return Recording(p, _read_manifest(p))


def check_new_recording(out: Path) -> None:
    """Refuse to write over anything: a recording is written into a new or empty directory."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out}: already exists and is not an empty directory; write the recording to a new one")


@contextlib.contextmanager
def new_recording(out: Path, *, source: str, extra: dict[str, Any]) -> Iterator[RecordingWriter]:
    """A writer for a new recording at ``out`` that removes it again if writing fails, so a failed import
    or export never leaves a recording that looks complete."""
    check_new_recording(out)
    try:
        with RecordingWriter(out, source=source, extra=extra) as writer:
            yield writer
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
