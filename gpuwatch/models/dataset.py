"""Training/evaluation data from a recording directory or a collector DuckDB store: features, faults, labels.

Both sources hold ``gpu_samples`` and ``events`` with the same columns (gpuwatch/core/recording.py), so the rest
of the model code never asks where data came from. Large sources are read a few nodes at a time (the
per-GPU features only need one GPU's history); job-peer features are added once over all rows.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from gpuwatch.core.errors import UserError
from gpuwatch.models.faults import FAULT_COLUMNS, PRECURSOR_COUNTERS, PRECURSOR_FLAGS, fault_events
from gpuwatch.models.features import DEFAULT_STEP_S, SAMPLE_COLUMNS, add_peer_features, gpu_window_features
from gpuwatch.models.history import with_history
from gpuwatch.models.labels import DEFAULT_HORIZON_S, DEFAULT_WARNING_S, label
from gpuwatch.core.progress import Progress
from gpuwatch.core.recording import open_recording

NODES_PER_CHUNK = 8
_COLUMNS = ["node", "gpu_index", "ts", "job_id"] + sorted(
    set(SAMPLE_COLUMNS) | set(FAULT_COLUMNS) | set(PRECURSOR_COUNTERS) | set(PRECURSOR_FLAGS))
_EVENT_COLUMNS = ["node", "gpu_index", "ts", "kind", "code"]


@dataclass
class Source:
    """Where telemetry comes from; ``fingerprint`` tells whether a model was trained on this same data."""

    path: Path
    nodes: list[str]
    start_ms: int
    end_ms: int
    fingerprint: str

    def chunks(self) -> Iterator[tuple[list[str], pd.DataFrame, pd.DataFrame]]:
        """(nodes, their samples, their events) for a few nodes at a time."""
        for i in range(0, len(self.nodes), NODES_PER_CHUNK):
            nodes = self.nodes[i:i + NODES_PER_CHUNK]
            yield (nodes, *self._read(nodes))

    def _read(self, nodes: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
        raise NotImplementedError

    def has_telemetry(self) -> bool:
        """Whether any sample holds a value of a field the features read (a fault log converted to a
        recording holds none: its samples only mark when each GPU was in service)."""
        raise NotImplementedError


class RecordingSource(Source):
    def has_telemetry(self) -> bool:
        """From the Parquet footers' null counts: no sample is read."""
        for part in open_recording(self.path).parts("gpu_samples"):
            meta = pq.ParquetFile(part).metadata
            names = [meta.schema.column(i).name for i in range(meta.num_columns)]
            wanted = [i for i, n in enumerate(names) if n in SAMPLE_COLUMNS]
            for rg in range(meta.num_row_groups):
                group = meta.row_group(rg)
                for i in wanted:
                    stats = group.column(i).statistics
                    if stats is None or not stats.has_null_count or stats.null_count < group.num_rows:
                        return True
        return False

    def _read(self, nodes: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
        rec = open_recording(self.path)
        where = [("node", "in", nodes)]
        return rec.table("gpu_samples", _COLUMNS, where), rec.table("events", _EVENT_COLUMNS, where)


class DuckDBSource(Source):
    def has_telemetry(self) -> bool:
        import duckdb

        with duckdb.connect(str(self.path), read_only=True) as con:
            cols = [r[0] for r in con.execute("SELECT column_name FROM information_schema.columns "
                                              "WHERE table_name = 'gpu_samples'").fetchall()]
            present = [c for c in SAMPLE_COLUMNS if c in cols]
            if not present:
                return False
            where = " OR ".join(f'"{c}" IS NOT NULL' for c in present)
            return con.execute(f"SELECT 1 FROM gpu_samples WHERE {where} LIMIT 1").fetchone() is not None


    def _read(self, nodes: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
        import duckdb

        with duckdb.connect(str(self.path), read_only=True) as con:
            marks = ",".join("?" * len(nodes))
            samples, events = (
                con.sql(f"SELECT {', '.join(cols)} FROM {table} WHERE node IN ({marks})", params=nodes)
                .to_arrow_table().to_pandas()
                for table, cols in (("gpu_samples", _COLUMNS), ("events", _EVENT_COLUMNS)))
        return samples, events


def open_source(path: str | Path) -> Source:
    """A recording directory or a ``.duckdb`` store file; a UserError naming the path otherwise."""
    p = Path(path)
    if p.is_dir():
        rec = open_recording(p)
        m = rec.manifest
        if m.get("start_ms") is None:
            raise UserError(f"{p}: recording holds no samples")
        digest = hashlib.sha256(repr(sorted(m.items())).encode()).hexdigest()[:16]
        return RecordingSource(p, list(m["nodes"]), int(m["start_ms"]), int(m["end_ms"]), digest)
    if p.is_file():
        return _duckdb_source(p)
    raise UserError(f"{p}: no such recording directory or DuckDB store")


#: A DuckDB database file carries this magic after its 8-byte header checksum.
_DUCKDB_MAGIC = (8, b"DUCK")


def _is_duckdb_file(p: Path) -> bool:
    offset, magic = _DUCKDB_MAGIC
    try:
        with p.open("rb") as f:
            f.seek(offset)
            return f.read(len(magic)) == magic
    except OSError:
        return False


def _duckdb_source(p: Path) -> DuckDBSource:
    """A store file; anything that is not a DuckDB file is named as such, not by DuckDB's confusing error."""
    import duckdb

    if not _is_duckdb_file(p):
        raise UserError(f"{p}: neither a recording directory nor a collector .duckdb store")
    try:
        with duckdb.connect(str(p), read_only=True) as con:
            nodes = [r[0] for r in con.execute("SELECT DISTINCT node FROM gpu_samples ORDER BY node").fetchall()]
            row = con.execute("SELECT epoch_ms(min(ts)), epoch_ms(max(ts)), count(*) FROM gpu_samples").fetchone()
            assert row is not None, "an aggregate query returns one row"
            lo, hi, n = row
    except duckdb.Error as exc:
        raise UserError(f"{p}: not a gpuwatch DuckDB store with gpu_samples and events tables: {exc}") from None
    if not n:
        raise UserError(f"{p}: store holds no GPU samples")
    digest = hashlib.sha256(f"{p.resolve()}:{lo}:{hi}:{n}".encode()).hexdigest()[:16]
    return DuckDBSource(p, nodes, int(lo), int(hi), digest)


@dataclass
class Dataset:
    """Labelled feature rows of a source and its fault episodes."""

    rows: pd.DataFrame
    episodes: pd.DataFrame
    source: Source
    horizon_s: float
    warning_s: float
    step_s: int
    #: Feature input fields the source never recorded, left always empty, or held constant.
    uninformative_fields: dict[str, str] | None = None


def build_dataset(path: str | Path, *, horizon_s: float = DEFAULT_HORIZON_S,
                  warning_s: float = DEFAULT_WARNING_S, step_s: int = DEFAULT_STEP_S, quiet: bool = False) -> Dataset:
    """Features of every GPU every ``step_s``, with labels for faults within ``horizon_s``; progress by node
    on a terminal unless ``quiet``."""
    src = open_source(path)
    parts, episodes, stats = [], [], []
    with Progress("features", total=len(src.nodes), unit="nodes", quiet=quiet) as progress:
        for nodes, samples, events in src.chunks():
            parts.append(with_history(gpu_window_features(samples, events, step_s=step_s), events))
            episodes.append(fault_events(events, samples))
            stats.append(samples[list(SAMPLE_COLUMNS)].agg(["count", "min", "max"]))
            progress.advance(len(nodes))
    feats = add_peer_features(pd.concat(parts, ignore_index=True))
    eps = pd.concat(episodes, ignore_index=True) if episodes else pd.DataFrame()
    rows = label(feats, eps, horizon_s=horizon_s, warning_s=warning_s, data_end_ms=src.end_ms)
    return Dataset(rows, eps, src, horizon_s, warning_s, step_s, _uninformative(stats))


def _uninformative(stats: list[pd.DataFrame]) -> dict[str, str]:
    """Field -> 'never recorded' or 'constant', from per-chunk count/min/max."""
    if not stats:
        return {}
    count = sum(s.loc["count"] for s in stats)
    lo = pd.concat([s.loc["min"] for s in stats], axis=1).min(axis=1)
    hi = pd.concat([s.loc["max"] for s in stats], axis=1).max(axis=1)
    out = {c: "never recorded" for c in count.index if count[c] == 0}
    out.update({c: f"constant {lo[c]:g}" for c in count.index if count[c] > 0 and lo[c] == hi[c]})
    return dict(sorted(out.items()))
