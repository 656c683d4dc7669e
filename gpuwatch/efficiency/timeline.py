"""The compact per-rank timeline: the boundary between trace loaders and the efficiency engine.

One `RankTimeline` holds every GPU activity of one rank as parallel numpy arrays (no per-event Python
objects), so a trace of millions of kernels stays a few tens of bytes per event. Loaders (Kineto JSON,
span tables, the in-process probe) build it; `gpuwatch.efficiency.analyze` consumes it.
"""
from __future__ import annotations

import io
from typing import Any

import msgspec
import numpy as np
from numpy.typing import DTypeLike

# Activity kinds (spec "Kinds"): communication splits into collective and point-to-point.
COMPUTE, MEMCPY, COLLECTIVE, P2P = 0, 1, 2, 3
KIND_NAMES = ("compute", "memcpy", "collective", "p2p")

UNKNOWN = -1  # integer "not known" for step, seq, bytes, peer, collective type and process group


class RankTimeline(msgspec.Struct):
    """GPU activities of one rank, each `[start_us, end_us)`, with optional launch/step/collective metadata.

    `coll_type` indexes `coll_types` (canonical names such as "all_reduce", "send"), `process_group`
    indexes `process_groups`; both are `UNKNOWN` for non-communication activities or when unknown.
    `launch_us` is the start of the host call that launched the activity (NaN when unknown).
    `step_marks` holds the host-side step annotations `(step, start_us, end_us)` when the source had them.
    `name` indexes `names` (kernel or op names, for top-kernel tables, Perfetto slices and the what-if's
    "same op" across ranks); `correlation` is the profiler's launch correlation id (UNKNOWN if none).
    `group_ranks` maps a process group name to its member ranks where the source lists them, and
    `trace_meta` keeps a few descriptive top-level keys of the source (device, versions) for reports.
    """

    rank: int
    start_us: np.ndarray
    end_us: np.ndarray
    kind: np.ndarray
    launch_us: np.ndarray
    step: np.ndarray
    coll_type: np.ndarray
    process_group: np.ndarray
    seq: np.ndarray
    nbytes: np.ndarray
    stream: np.ndarray
    name: np.ndarray
    correlation: np.ndarray
    coll_types: list[str] = msgspec.field(default_factory=list)
    process_groups: list[str] = msgspec.field(default_factory=list)
    world_size: int | None = None
    job_id: str | None = None
    source: str = ""
    step_marks: np.ndarray = msgspec.field(default_factory=lambda: np.empty((0, 3)))
    names: list[str] = msgspec.field(default_factory=list)
    group_ranks: dict[str, list[int]] = msgspec.field(default_factory=dict)
    events_sampled: bool | None = False
    trace_meta: dict[str, Any] = msgspec.field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.start_us.shape[0])

    @classmethod
    def build(
        cls,
        rank: int,
        start_us: np.ndarray,
        end_us: np.ndarray,
        kind: np.ndarray,
        *,
        launch_us: np.ndarray | None = None,
        step: np.ndarray | None = None,
        coll_type: np.ndarray | None = None,
        process_group: np.ndarray | None = None,
        seq: np.ndarray | None = None,
        nbytes: np.ndarray | None = None,
        stream: np.ndarray | None = None,
        name: np.ndarray | None = None,
        correlation: np.ndarray | None = None,
        **meta: Any,
    ) -> RankTimeline:
        """Build a timeline from whatever columns are known, filling the others with "unknown"."""
        n = len(start_us)

        def column(values: np.ndarray | None, dtype: DTypeLike, fill: float) -> np.ndarray:
            if values is None:
                return np.full(n, fill, dtype=dtype)
            return np.asarray(values, dtype=dtype)

        return cls(
            rank=int(rank),
            start_us=column(start_us, np.float64, 0.0),
            end_us=column(end_us, np.float64, 0.0),
            kind=column(kind, np.int8, COMPUTE),
            launch_us=column(launch_us, np.float64, np.nan),
            step=column(step, np.int64, UNKNOWN),
            coll_type=column(coll_type, np.int32, UNKNOWN),
            process_group=column(process_group, np.int32, UNKNOWN),
            seq=column(seq, np.int64, UNKNOWN),
            nbytes=column(nbytes, np.int64, UNKNOWN),
            stream=column(stream, np.int32, UNKNOWN),
            name=column(name, np.int32, UNKNOWN),
            correlation=column(correlation, np.int64, UNKNOWN),
            **meta,
        )

    def select(self, mask: np.ndarray) -> RankTimeline:
        """The same rank restricted to the activities where `mask` is true (e.g. one window or step range)."""
        arrays = {name: getattr(self, name)[mask] for name in _ACTIVITY_COLUMNS}
        meta = {name: getattr(self, name) for name in _META_FIELDS}
        return RankTimeline(step_marks=self.step_marks, **meta, **arrays)

    def to_bytes(self) -> bytes:
        """The timeline as a compressed .npz (arrays plus a JSON header, no pickle): for the collector to
        keep a job's ranks and re-analyse them when another rank arrives."""
        header = {name: getattr(self, name) for name in _META_FIELDS}
        buffer = io.BytesIO()
        np.savez_compressed(
            buffer, header=np.frombuffer(msgspec.json.encode(header), np.uint8), step_marks=self.step_marks,
            **{name: getattr(self, name) for name in _ACTIVITY_COLUMNS},
        )
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> RankTimeline:
        """The timeline that `to_bytes` wrote (columns added since then read as unknown)."""
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            header = msgspec.json.decode(arrays["header"].tobytes())
            n = len(arrays["start_us"])
            columns: dict[str, Any] = {
                name: arrays[name] if name in arrays.files else np.full(n, UNKNOWN, _DTYPES[name])
                for name in _ACTIVITY_COLUMNS}
            return cls(step_marks=arrays["step_marks"], **header, **columns)

    def type_names(self) -> np.ndarray:
        """Collective type name per activity ("" where none), for matching across ranks."""
        table = np.array(list(self.coll_types) + [""], dtype=object)
        names: np.ndarray = table[self.coll_type]
        return names

    def kernel_names(self) -> np.ndarray:
        """Kernel (or op) name per activity ("" where unknown)."""
        table = np.array(list(self.names) + [""], dtype=object)
        names: np.ndarray = table[self.name]
        return names

    def group_names(self) -> np.ndarray:
        """Process group name per activity ("" where unknown)."""
        table = np.array(list(self.process_groups) + [""], dtype=object)
        names: np.ndarray = table[self.process_group]
        return names


_META_FIELDS = ("rank", "coll_types", "process_groups", "world_size", "job_id", "source", "names", "group_ranks",
                "events_sampled", "trace_meta")
_ACTIVITY_COLUMNS = (
    "start_us", "end_us", "kind", "launch_us", "step", "coll_type", "process_group", "seq", "nbytes", "stream",
    "name", "correlation",
)
_DTYPES = {"name": np.int32, "correlation": np.int64}
