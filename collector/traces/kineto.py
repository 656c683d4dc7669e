"""PyTorch profiler (Kineto) traces -> one `RankTimeline` per file.

What is kept of a trace: GPU activities (`kernel`, `gpu_memcpy`, `gpu_memset`), the host launch call of
each (`cuda_runtime`/`cuda_driver` events, joined by `args.correlation`), the `ProfilerStep#N` annotations
(the step of a GPU activity is the step whose annotation holds its launch), and the collective CPU ops
(`nccl:*`, `record_param_comms`) whose time range holds a communication kernel's launch. Events are read
in blocks (see eventstream.py) and reduced to typed arrays as they stream by.

Collective type, in the spec's order: the kernel's `Collective name` arg, the enclosing CPU op, the
kernel name. Process group / seq / bytes come from the kernel args, else from the enclosing
`record_param_comms` op.
"""
from __future__ import annotations

import re
from array import array
from collections.abc import Callable

import numpy as np

from gpuwatch.collector.efficiency.timeline import COLLECTIVE, COMPUTE, MEMCPY, P2P, UNKNOWN, RankTimeline
from gpuwatch.collector.traces.collectives import P2P_TYPES, canonical_type, is_comm_kernel
from gpuwatch.collector.traces.eventstream import EventFilter, TraceEventStream
from gpuwatch.errors import UserError

_GPU_CATS = {"kernel": COMPUTE, "gpu_memcpy": MEMCPY, "gpu_memset": MEMCPY}
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
_STEP_PREFIX, _COMM_OP_PREFIX, _COMM_RECORD_OP = "ProfilerStep#", "nccl:", "record_param_comms"
# The events `_Collected.add` reads; the stream drops the others (most of a trace: CPU ops, flows) unparsed.
_WANTED = EventFilter.of([*_GPU_CATS, *_LAUNCH_CATS], [_STEP_PREFIX, _COMM_OP_PREFIX, _COMM_RECORD_OP])
_COMM = -2  # provisional kind of a communication kernel until its type is resolved
_DTYPE_BYTES = {
    "float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2, "double": 8, "float64": 8,
    "int": 4, "int32": 4, "long": 8, "int64": 8, "short": 2, "int16": 2, "byte": 1, "uint8": 1,
    "char": 1, "int8": 1, "bool": 1,
}
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


class _Interner(dict):
    """String (or key) -> dense int id, in order of first appearance."""

    def id(self, key) -> int:
        found = self.get(key)
        if found is None:
            found = self[key] = len(self)
        return found

    def names(self) -> list:
        return list(self)


class _CommMeta:
    """Collective metadata columns (type, process group, seq, bytes) shared by kernels and CPU ops."""

    def __init__(self, types: _Interner, groups: _Interner) -> None:
        self.types, self.groups = types, groups
        self.type = array("i")
        self.group = array("i")
        self.seq = array("q")
        self.nbytes = array("q")

    def add(self, args: dict, fallback_type: str | None) -> None:
        named = args.get("Collective name")
        ctype = (canonical_type(named) if named else None) or fallback_type
        self.type.append(self.types.id(ctype) if ctype else UNKNOWN)
        group = args.get("Process Group Name")
        self.group.append(self.groups.id(str(group)) if group is not None else UNKNOWN)
        seq = args.get("Seq")
        self.seq.append(int(seq) if isinstance(seq, (int, float)) else UNKNOWN)
        self.nbytes.append(_message_bytes(args))

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "coll_type": np.frombuffer(self.type, dtype=np.int32).copy(),
            "process_group": np.frombuffer(self.group, dtype=np.int32).copy(),
            "seq": np.frombuffer(self.seq, dtype=np.int64).copy(),
            "nbytes": np.frombuffer(self.nbytes, dtype=np.int64).copy(),
        }

    def spread(self, at: array, size: int) -> dict[str, np.ndarray]:
        """The columns for `size` rows, where row `at[i]` holds entry i and every other row is UNKNOWN."""
        rows = np.frombuffer(at, dtype=np.int64)
        columns = {}
        for name, values in self.arrays().items():
            columns[name] = np.full(size, UNKNOWN, dtype=values.dtype)
            columns[name][rows] = values
        return columns


class _Collected:
    """The columns gathered while the trace streams by."""

    def __init__(self) -> None:
        self.types, self.groups, self.threads = _Interner(), _Interner(), _Interner()
        self.gpu_ts, self.gpu_dur, self.gpu_kind = array("d"), array("d"), array("b")
        self.gpu_stream, self.gpu_corr = array("i"), array("q")
        # Communication kernels only (most GPU activities are not): their index and collective metadata.
        self.comm_at = array("q")
        self.comm_meta = _CommMeta(self.types, self.groups)
        self.launch_corr, self.launch_ts, self.launch_thread = array("q"), array("d"), array("i")
        self.step_id, self.step_ts, self.step_end = array("q"), array("d"), array("d")
        self.op_thread, self.op_ts, self.op_end = array("i"), array("d"), array("d")
        self.op_is_nccl = array("b")
        self.op_meta = _CommMeta(self.types, self.groups)
        self.kernel_class: dict[str, tuple[bool, int]] = {}
        self.comm_name_type = array("i")  # per communication kernel: the type its name alone gives

    def add(self, events: list[dict]) -> None:
        for e in events:
            if e.get("ph") != "X":
                continue
            cat = e.get("cat")
            kind = _GPU_CATS.get(cat)
            if kind is not None:
                self._add_gpu(e, kind)
            elif cat in _LAUNCH_CATS:
                corr = e.get("args", {}).get("correlation")
                if isinstance(corr, int):
                    self.launch_corr.append(corr)
                    self.launch_ts.append(e["ts"])
                    self.launch_thread.append(self.threads.id((e.get("pid"), e.get("tid"))))
            else:
                name = e.get("name", "")
                if name.startswith(_STEP_PREFIX):
                    self.step_id.append(int(name[13:]) if name[13:].isdigit() else len(self.step_id))
                    self.step_ts.append(e["ts"])
                    self.step_end.append(e["ts"] + e.get("dur", 0))
                elif name.startswith(_COMM_OP_PREFIX) or name == _COMM_RECORD_OP:
                    self.op_thread.append(self.threads.id((e.get("pid"), e.get("tid"))))
                    self.op_ts.append(e["ts"])
                    self.op_end.append(e["ts"] + e.get("dur", 0))
                    self.op_is_nccl.append(name != _COMM_RECORD_OP)
                    self.op_meta.add(e.get("args", {}), canonical_type(name) if name.startswith(_COMM_OP_PREFIX) else None)

    def _add_gpu(self, e: dict, kind: int) -> None:
        args = e.get("args", {})
        if kind == COMPUTE:
            is_comm, name_type = self._classify(e.get("name", ""))
            if is_comm or "Collective name" in args:
                kind = _COMM
                self.comm_at.append(len(self.gpu_ts))
                self.comm_name_type.append(name_type)
                self.comm_meta.add(args, None)
        self.gpu_ts.append(e["ts"])
        self.gpu_dur.append(e.get("dur", 0))
        self.gpu_kind.append(kind)
        stream = args.get("stream")
        self.gpu_stream.append(stream if isinstance(stream, int) else UNKNOWN)
        corr = args.get("correlation")
        self.gpu_corr.append(corr if isinstance(corr, int) else UNKNOWN)

    def _classify(self, name: str) -> tuple[bool, int]:
        """(is a communication kernel, type id from the name alone), cached per kernel name."""
        known = self.kernel_class.get(name)
        if known is None:
            comm = is_comm_kernel(name)
            type_id = self.types.id(canonical_type(name) or "unknown") if comm else UNKNOWN
            known = self.kernel_class[name] = (comm, type_id)
        return known


def load_kineto(path: str, *, progress: Callable[[int], None] | None = None,
                default_rank: int | None = None) -> RankTimeline:
    """One rank's timeline from a Kineto trace file (plain or .gz).

    The rank comes from `distributedInfo.rank`, else from a `rank<N>` in the file name, else
    `default_rank`; without any of them the file is rejected."""
    stream = TraceEventStream(path, progress=progress, only=_WANTED)
    got = _Collected()
    for events in stream:
        try:
            got.add(events)
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
            # Checked here, not per event in the hot loop: a broken exporter's event, named in one line.
            raise UserError(f"{path}: malformed trace event (missing or mistyped field: "
                            f"{type(exc).__name__} {exc})") from None
    if not got.gpu_ts:
        raise UserError(f"{path}: no GPU activity in the trace (no kernel, gpu_memcpy or gpu_memset events)")
    info = stream.meta.get("distributedInfo") or {}
    rank = _rank_of(path, info, default_rank)
    world = info.get("world_size")
    return _timeline(path, got, rank, int(world) if isinstance(world, int) else None)


def _rank_of(path: str, info: dict, default_rank: int | None) -> int:
    if isinstance(info.get("rank"), int):
        return info["rank"]
    match = _RANK_IN_NAME.search(path.rsplit("/", 1)[-1])
    if match:
        return int(match.group(1))
    if default_rank is not None:
        return default_rank
    raise UserError(f"{path}: rank unknown (no distributedInfo.rank and no rank<N> in the file name)")


def _timeline(path: str, got: _Collected, rank: int, world: int | None) -> RankTimeline:
    start = np.frombuffer(got.gpu_ts, dtype=np.float64)
    end = start + np.frombuffer(got.gpu_dur, dtype=np.float64)
    kind = np.frombuffer(got.gpu_kind, dtype=np.int8).copy()
    meta = got.comm_meta.spread(got.comm_at, len(kind))
    launch, launch_thread = _join_launches(got, np.frombuffer(got.gpu_corr, dtype=np.int64))
    step = _steps_of(got, launch)
    comm = np.flatnonzero(kind == _COMM)
    _resolve_comm(got, comm, launch[comm], launch_thread[comm], meta)
    types = np.array(got.types.names() + [None], dtype=object)
    is_p2p = np.isin(types[meta["coll_type"][comm]], list(P2P_TYPES))
    kind[comm] = np.where(is_p2p, P2P, COLLECTIVE)
    marks = np.column_stack([
        np.frombuffer(got.step_id, dtype=np.int64), np.frombuffer(got.step_ts), np.frombuffer(got.step_end),
    ]) if got.step_id else np.empty((0, 3))
    return RankTimeline.build(
        rank, start.copy(), end, kind, launch_us=launch, step=step,
        stream=np.frombuffer(got.gpu_stream, dtype=np.int32).copy(), **meta,
        coll_types=got.types.names(), process_groups=got.groups.names(),
        world_size=world, source=path, step_marks=marks,
    )


def _join_launches(got: _Collected, corr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Launch time and launching thread of each GPU activity (NaN / -1 where no launch event matches)."""
    launch = np.full(corr.shape, np.nan)
    thread = np.full(corr.shape, UNKNOWN, dtype=np.int32)
    if not got.launch_corr:
        return launch, thread
    keys = np.frombuffer(got.launch_corr, dtype=np.int64)
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    pos = np.clip(np.searchsorted(keys, corr), 0, len(keys) - 1)
    found = (keys[pos] == corr) & (corr >= 0)
    launch[found] = np.frombuffer(got.launch_ts)[order][pos[found]]
    thread[found] = np.frombuffer(got.launch_thread, dtype=np.int32)[order][pos[found]]
    return launch, thread


def _steps_of(got: _Collected, launch: np.ndarray) -> np.ndarray:
    """Step id of each GPU activity: the ProfilerStep annotation holding its launch, else UNKNOWN."""
    step = np.full(launch.shape, UNKNOWN, dtype=np.int64)
    if not got.step_id:
        return step
    starts = np.frombuffer(got.step_ts)
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], np.frombuffer(got.step_end)[order]
    ids = np.frombuffer(got.step_id, dtype=np.int64)[order]
    idx = np.searchsorted(starts, launch, side="right") - 1
    inside = (idx >= 0) & ~np.isnan(launch)
    inside[inside] &= launch[inside] < ends[idx[inside]]
    step[inside] = ids[idx[inside]]
    return step


def _resolve_comm(got: _Collected, comm: np.ndarray, launch: np.ndarray, thread: np.ndarray,
                  meta: dict[str, np.ndarray]) -> None:
    """Fill the type (and missing group/seq/bytes) of communication kernels from their enclosing CPU ops,
    then from the kernel name."""
    ops = got.op_meta.arrays()
    op_thread = np.frombuffer(got.op_thread, dtype=np.int32)
    op_ts, op_end = np.frombuffer(got.op_ts), np.frombuffer(got.op_end)
    is_nccl = np.frombuffer(got.op_is_nccl, dtype=np.int8).astype(bool)
    for mask in (is_nccl, ~is_nccl):  # `nccl:*` ops first, then `record_param_comms`
        cands = np.flatnonzero(mask)
        op = _enclosing(op_thread[cands], op_ts[cands], op_end[cands], thread, launch)
        has = op >= 0
        src = cands[op[has]]
        for column in ("coll_type", "process_group", "seq", "nbytes"):
            target = meta[column][comm]
            known, value = target[has], ops[column][src]
            take = (known == UNKNOWN) & (value != UNKNOWN)
            known[take] = value[take]
            target[has] = known
            meta[column][comm] = target
    types = meta["coll_type"][comm]
    unnamed = types == UNKNOWN
    types[unnamed] = np.frombuffer(got.comm_name_type, dtype=np.int32)[unnamed]
    meta["coll_type"][comm] = types


def _enclosing(op_thread: np.ndarray, op_ts: np.ndarray, op_end: np.ndarray,
               thread: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Index of the latest-starting op on the same thread whose [ts, end] holds time t, else -1."""
    found = np.full(t.shape, -1, dtype=np.int64)
    for th in np.flatnonzero(np.bincount(thread[thread >= 0])):  # each launching thread (dense ids)
        ops = np.flatnonzero(op_thread == th)
        if not len(ops):
            continue
        ops = ops[np.argsort(op_ts[ops], kind="stable")]
        queries = np.flatnonzero((thread == th) & ~np.isnan(t))
        idx = np.searchsorted(op_ts[ops], t[queries], side="right") - 1
        ok = idx >= 0
        ok[ok] &= op_end[ops[idx[ok]]] >= t[queries[ok]]
        found[queries[ok]] = ops[idx[ok]]
    return found


def _message_bytes(args: dict) -> int:
    nelems = max(args.get("In msg nelems") or 0, args.get("Out msg nelems") or 0)
    size = _DTYPE_BYTES.get(str(args.get("dtype", "")).lower())
    return int(nelems) * size if nelems and size else UNKNOWN
