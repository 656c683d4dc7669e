"""The gpuwatch recording format: one directory of Parquet part files plus a JSON manifest.

`gpuwatch simulate` writes it, agents record it, the collector exports it and replay reads it, so telemetry
moves between all of them in one documented shape (docs/recording-format.md). Each table is a folder of
part files that plain pandas reads (``pd.read_parquet(path / "gpu_samples")``); ``gpu_samples`` has exactly
the columns of the collector's ``gpu_samples`` store table, so rows go from one to the other unchanged.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
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
_PART = re.compile(r"part-(\d+)\.parquet")

log = logging.getLogger(__name__)

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
    range and node list into the manifest, so an agent that restarts keeps one recording. A part is written
    under a hidden temporary name and renamed into place, and never over an existing part: a writer killed
    mid-way leaves whole parts only, and the next writer (or reader) counts in the parts its manifest lacks.
    """

    def __init__(self, path: str | os.PathLike[str], *, source: str, resolution_s: float | None = None,
                 extra: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"recording {self.path}: exists and is not a directory")
        self.path.mkdir(parents=True, exist_ok=True)
        existing = (self.path / MANIFEST).exists()
        self._manifest: dict[str, Any] = (_read_manifest(self.path) if existing
                                          else _new_manifest(source, resolution_s))
        for leftover in self.path.glob("*/.part-*.tmp"):  # a part being written when a writer was killed
            leftover.unlink(missing_ok=True)
        self._manifest, unlisted = _count_in_unlisted_parts(self.path, self._manifest)
        if unlisted:
            log.warning("recording %s: %d part files were not in %s (its last writer was stopped); continuing "
                        "after them", self.path, unlisted, MANIFEST)
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
        while (part := folder / f"part-{n:05d}.parquet").exists():  # never over a part (another writer's)
            n += 1
        tmp = folder / f".{part.name}.tmp"  # hidden: pandas and pyarrow skip it when reading the folder
        pq.write_table(arrow, tmp, compression="zstd")
        tmp.replace(part)
        self._manifest["tables"][table] = n + 1
        _note_rows(self._manifest, self._nodes, arrow)
        return part

    def write_manifest(self) -> None:
        """Write the manifest atomically (a reader never sees a half-written one); a writer that runs for long
        (an agent's) calls it as it goes, so a crash leaves a recording that lists what was written."""
        self._manifest["nodes"] = sorted(self._nodes)
        tmp = self.path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(self._manifest, indent=2, sort_keys=True))
        tmp.replace(self.path / MANIFEST)

    def close(self) -> None:
        """Write the manifest."""
        self.write_manifest()

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _new_manifest(source: str | None, resolution_s: float | None) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "resolution_s": resolution_s, "source": source,
            "start_ms": None, "end_ms": None, "nodes": [], "tables": {t: 0 for t in TABLES}}


def _note_rows(manifest: dict[str, Any], nodes: set[str], arrow: pa.Table) -> None:
    """Widen the manifest's time range, and ``nodes``, by a part's rows."""
    if "node" in arrow.column_names:  # spans may have no node (NULL or ""): not a node of the recording
        nodes.update(n for n in pc.unique(arrow.column("node")).to_pylist() if n)
    if "ts" in arrow.column_names and arrow.num_rows:
        ms = arrow.column("ts").cast(pa.int64())
        lo, hi = pc.min(ms).as_py(), pc.max(ms).as_py()
        if lo is not None:
            manifest["start_ms"] = lo if manifest["start_ms"] is None else min(manifest["start_ms"], lo)
            manifest["end_ms"] = hi if manifest["end_ms"] is None else max(manifest["end_ms"], hi)


def _part_numbers(path: Path, table: str) -> list[int]:
    return sorted(int(m.group(1)) for p in (path / table).glob("part-*.parquet") if (m := _PART.fullmatch(p.name)))


def _count_in_unlisted_parts(path: Path, manifest: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The manifest with the parts its writer wrote after it last wrote the manifest (it was killed): their
    numbers, nodes and time range; and how many such parts there were."""
    manifest = {**manifest, "tables": dict(manifest.get("tables") or {})}
    nodes = set(manifest.get("nodes") or [])
    found = 0
    for table in TABLES:
        listed = int(manifest["tables"].get(table, 0))
        unlisted = [n for n in _part_numbers(path, table) if n >= listed]
        for n in unlisted:
            part = path / table / f"part-{n:05d}.parquet"
            columns = [c for c in ("node", "ts") if c in SCHEMAS[table].names]
            _note_rows(manifest, nodes, _read_parts(path, [part], columns=columns))
        if unlisted:
            manifest["tables"][table] = unlisted[-1] + 1
            found += len(unlisted)
    manifest["nodes"] = sorted(nodes)
    return manifest, found


def _read_parts(path: Path, parts: list[Path], **kwargs: Any) -> pa.Table:
    """``pq.read_table(parts, **kwargs)``; a part that is empty or not Parquet is a UserError naming it."""
    try:
        return pq.read_table(parts if len(parts) > 1 else parts[0], **kwargs)
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(path, parts, exc) from None


def _unreadable(path: Path, parts: list[Path], exc: Exception) -> UserError:
    for part in parts:
        try:
            pq.ParquetFile(part)
        except (pa.ArrowException, OSError) as part_exc:
            exc = part_exc
            size = part.stat().st_size if part.exists() else 0
            what = "is empty (0 bytes)" if size == 0 else f"is not a readable Parquet file ({exc})"
            return UserError(f"recording {path}: part {part.relative_to(path)} {what}; move it away to read the "
                             "rest of the recording")
    return UserError(f"recording {path}: cannot read {len(parts)} part files: {exc}")


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
        return _read_parts(self.path, parts, columns=list(schema.names), filters=filters,
                           schema=SCHEMAS[name]).to_pandas()

    def iter_parts(self, name: str, columns: Sequence[str] | None = None) -> Iterator[pd.DataFrame]:
        """One DataFrame per part file, for tables too large to hold at once."""
        for part in self.parts(name):
            yield _read_parts(self.path, [part], columns=list(columns) if columns else None).to_pandas()

    def rows(self, name: str) -> int:
        """The number of rows of a table, from its parts' footers."""
        try:
            return sum(pq.ParquetFile(part).metadata.num_rows for part in self.parts(name))
        except (pa.ArrowException, OSError) as exc:
            raise _unreadable(self.path, self.parts(name), exc) from None


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
    """Open a recording directory; a clear UserError if it is not one, is from a newer gpuwatch, or lacks part
    files its manifest lists. A recording whose writer was killed before it wrote (or last updated) the
    manifest is read from its part files, with a warning."""
    p = Path(path)
    if p.is_file():
        raise UserError(f"{p} is a file, not a recording directory")
    if not p.is_dir():
        raise UserError(f"{p}: not a gpuwatch recording (no such directory)")
    listed = (p / MANIFEST).exists() or not any(_part_numbers(p, t) for t in TABLES)
    manifest, unlisted = _count_in_unlisted_parts(p, _read_manifest(p) if listed else _new_manifest(None, None))
    if not listed:
        log.warning("recording %s: no %s (its writer was stopped before writing it); reading its %d part files",
                    p, MANIFEST, unlisted)
    elif unlisted:
        log.warning("recording %s: %d part files are not in %s (its writer was stopped before adding them); "
                    "reading them too", p, unlisted, MANIFEST)
    _check_listed_parts(p, manifest)
    return Recording(p, manifest)


def _check_listed_parts(path: Path, manifest: dict[str, Any]) -> None:
    """UserError naming the tables whose part files the manifest lists and the directory lacks."""
    missing = []
    for table, listed in (manifest.get("tables") or {}).items():
        if table in SCHEMAS and int(listed) > 0:
            lacking = int(listed) - len([n for n in _part_numbers(path, table) if n < int(listed)])
            if lacking:
                missing.append(f"{table}/ lacks {lacking} of its {listed} part files")
    if missing:
        raise UserError(f"recording {path}: {'; '.join(missing)} (listed in {MANIFEST}; removed or moved away?)")


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
