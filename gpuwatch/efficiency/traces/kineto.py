"""PyTorch profiler (Kineto) traces -> one `RankTimeline` per file.

What is kept of a trace: GPU activities, the host launch call of each (joined by `args.correlation`), the
`ProfilerStep#N` annotations (the step of a GPU activity is the step whose annotation holds its launch),
and the collective CPU ops (`nccl:*`, `hccl:*`, `record_param_comms`) whose time range holds a
communication kernel's launch. Events are read in blocks (see eventstream.py) and reduced to typed arrays
as they stream by.

Every Kineto spelling HolisticTraceAnalysis reads is read: current categories (`kernel`, `gpu_memcpy`,
`gpu_memset`; launches `cuda_runtime`, `cuda_driver`), the old ones (`Kernel`, `Memcpy`, `Memset`;
launches `Runtime`; their `async_gpu` flow arrows repeat the correlation the args already carry), ROCm
traces (same categories) and MTIA traces (`mtia_ccp_events`: `dma*` is memory, `event_wait` /
`event_record` are synchronisation markers and not work; launches `mtia_runtime`). Synchronisation events
(`cuda_sync`) are never GPU work.

Collective type, in the spec's order: the kernel's `Collective name` arg, the enclosing CPU op, the
kernel name. Point-to-point needs evidence: a `SendRecv` kernel typed by its name alone (no args, no
enclosing op: e.g. already running when profiling began) takes the type the trace gives every other
kernel of that name, when that is one type (NCCL runs all-to-all as `SendRecv`), and is otherwise
communication of unknown type, never a pipeline bubble. Process group / seq / bytes / group members come
from the kernel args, else from the enclosing `record_param_comms` op.
"""
from __future__ import annotations

import re
from array import array
from collections.abc import Callable
from typing import Any, cast

import msgspec
import numpy as np

from gpuwatch.efficiency.arrays import distinct
from gpuwatch.efficiency.timeline import COLLECTIVE, COMPUTE, MEMCPY, P2P, UNKNOWN, RankTimeline
from gpuwatch.efficiency.traces.collectives import P2P_TYPES, canonical_type, is_comm_kernel
from gpuwatch.efficiency.traces.eventstream import EventFilter, TraceContent, TraceEventStream
from gpuwatch.core.errors import UserError

_BY_NAME = -3  # an MTIA device event: its kind follows from its name (see `_mtia_kind`)
_GPU_CATS = {"kernel": COMPUTE, "gpu_memcpy": MEMCPY, "gpu_memset": MEMCPY,
             "Kernel": COMPUTE, "Memcpy": MEMCPY, "Memset": MEMCPY, "mtia_ccp_events": _BY_NAME}
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver", "Runtime", "mtia_runtime"}
_MTIA_SYNC = ("event_wait", "event_record")
_STEP_PREFIX, _COMM_OP_PREFIXES, _COMM_RECORD_OP = "ProfilerStep#", ("nccl:", "hccl:"), "record_param_comms"
# The events `_Collected.add` reads; the stream drops the others (most of a trace: CPU ops, flows) unparsed.
# Runtime calls that never launch GPU work (a third of a trace's runtime events: nothing correlates with
# them), by the first 8 characters of their names: `cudaEven`t*, `cudaOccu`pancy*, `cudaFunc`{Get,Set}*,
# `cudaStre`am* (Query, Synchronize, WaitEvent, GetCaptureInfo, ...), `cudaDevi`ce*, `cudaGetD`evice*,
# `cudaSetD`evice, `cudaGetL`astError, `cudaPeek`AtLastError, `cudaPoin`terGetAttributes, and HIP's alike.
# None of them starts a kernel, copy or set: those go through cudaLaunch*, cuLaunch*, cudaMemcpy*,
# cudaMemset*, cudaGraphLaunch and their HIP names.
_NOT_LAUNCHES = ("cudaEven", "cudaOccu", "cudaFunc", "cudaStre", "cudaDevi", "cudaGetD", "cudaSetD", "cudaGetL",
                 "cudaPeek", "cudaPoin", "hipEvent", "hipOccup", "hipFuncG", "hipFuncS", "hipStrea", "hipDevic",
                 "hipGetDe", "hipSetDe", "hipGetLa", "hipPeekA", "hipPoint")
_WANTED = EventFilter.of([*_GPU_CATS, *_LAUNCH_CATS], [_STEP_PREFIX, *_COMM_OP_PREFIXES, _COMM_RECORD_OP],
                         phases="X", skip=(_LAUNCH_CATS, _NOT_LAUNCHES))
_COMM = -2  # provisional kind of a communication kernel until its type is resolved


class _Args(msgspec.Struct, gc=False):
    """The args `_Collected` reads; the decoder skips the others (an op's input shapes, types, strides: most
    of a trace's bytes) without making objects of them. Values are untyped: the reader checks them."""

    correlation: Any = None
    stream: Any = None
    collective: Any = msgspec.field(default=None, name="Collective name")
    group: Any = msgspec.field(default=None, name="Process Group Name")
    group_ranks: Any = msgspec.field(default=None, name="Process Group Ranks")
    seq: Any = msgspec.field(default=None, name="Seq")
    in_nelems: Any = msgspec.field(default=None, name="In msg nelems")
    out_nelems: Any = msgspec.field(default=None, name="Out msg nelems")
    dtype: Any = None


class _Event(msgspec.Struct, gc=False):
    """The keys of a trace event that `_Collected` reads (defaults as for a missing key; `ts` has none)."""

    ph: Any = None
    cat: Any = None
    name: Any = ""
    pid: Any = None
    tid: Any = None
    ts: Any = None
    dur: Any = 0
    args: _Args | None = None


_NO_ARGS = _Args()
# 2.6x the speed of parsing the same bytes to dicts and reading those (85 MB rank: 37 vs 95 ms).
_DECODER = msgspec.json.Decoder(list[_Event])
# The flow arrows the profiler draws from each launch to its GPU work (category names over the versions).
_LAUNCH_FLOWS = (b'"ac2g"', b'"async_cpu_to_gpu"', b'"async_gpu"')
# Top-level trace keys worth showing in a report (the rest is bulky or private).
_META_KEYS = ("schemaVersion", "displayTimeUnit", "deviceProperties", "distributedInfo", "cuda_runtime_version",
              "cuda_driver_version", "hip_runtime_version", "cupti_version", "nccl_version", "record_shapes")
_DTYPE_BYTES = {
    "float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2, "double": 8, "float64": 8,
    "int": 4, "int32": 4, "long": 8, "int64": 8, "short": 2, "int16": 2, "byte": 1, "uint8": 1,
    "char": 1, "int8": 1, "bool": 1,
}
_RANK_IN_NAME = r"(?i)rank[-_]?(\d+)"  # compiled when first used (re caches it): a trace names its rank


class _Interner(dict[Any, int]):
    """String (or key) -> dense int id, in order of first appearance."""

    def id(self, key: Any) -> int:
        found = self.get(key)
        if found is None:
            found = self[key] = len(self)
        return found

    def names(self) -> list[Any]:
        return list(self)


class _CommMeta:
    """Collective metadata columns (type, process group, seq, bytes) shared by kernels and CPU ops."""

    def __init__(self, types: _Interner, groups: _Interner, group_ranks: dict[str, list[int]]) -> None:
        self.types, self.groups, self.group_ranks = types, groups, group_ranks
        self.type = array("i")
        self.group = array("i")
        self.seq = array("q")
        self.nbytes = array("q")

    def add(self, args: _Args, fallback_type: str | None) -> None:
        named = args.collective
        ctype = (canonical_type(named) if named else None) or fallback_type
        self.type.append(self.types.id(ctype) if ctype else UNKNOWN)
        group = args.group
        self.group.append(self.groups.id(str(group)) if group is not None else UNKNOWN)
        members = args.group_ranks
        if group is not None and members is not None and str(group) not in self.group_ranks:
            self.group_ranks[str(group)] = _rank_list(members)
        seq = args.seq
        self.seq.append(int(seq) if isinstance(seq, (int, float)) else UNKNOWN)
        self.nbytes.append(_message_bytes(args))

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "coll_type": np.frombuffer(self.type, dtype=np.int32).copy(),
            "process_group": np.frombuffer(self.group, dtype=np.int32).copy(),
            "seq": np.frombuffer(self.seq, dtype=np.int64).copy(),
            "nbytes": np.frombuffer(self.nbytes, dtype=np.int64).copy(),
        }

    def spread(self, at: array[int], size: int) -> dict[str, np.ndarray]:
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
        self.names = _Interner()
        self.group_ranks: dict[str, list[int]] = {}
        self.gpu_ts, self.gpu_dur, self.gpu_kind = array("d"), array("d"), array("b")
        self.gpu_stream, self.gpu_corr, self.gpu_name = array("i"), array("q"), array("i")
        # Communication kernels only (most GPU activities are not): their index and collective metadata.
        self.comm_at = array("q")
        self.comm_meta = _CommMeta(self.types, self.groups, self.group_ranks)
        self.launch_corr, self.launch_ts, self.launch_thread = array("q"), array("d"), array("i")
        self.step_id, self.step_ts, self.step_end = array("q"), array("d"), array("d")
        self.op_thread, self.op_ts, self.op_end = array("i"), array("d"), array("d")
        self.op_is_nccl = array("b")
        self.op_meta = _CommMeta(self.types, self.groups, self.group_ranks)
        self.kernel_class: dict[str, tuple[bool, int]] = {}
        self.comm_name_type = array("i")  # per communication kernel: the type its name alone gives

    def add(self, events: list[_Event]) -> None:
        """Append a block of events. The bulk (GPU activities and launches) is split off and read column
        by column with comprehensions, which run far faster than one Python branchy loop per event."""
        complete = [e for e in events if e.ph == "X"]
        gpu = [e for e in complete if e.cat in _GPU_CATS]
        launches = [e for e in complete if e.cat in _LAUNCH_CATS]
        if gpu:
            self._add_gpu(gpu)
        if launches:
            self._add_launches(launches)
        if len(gpu) + len(launches) < len(complete):
            for e in complete:
                if e.cat not in _GPU_CATS and e.cat not in _LAUNCH_CATS:
                    self._add_other(e)

    def _add_launches(self, launches: list[_Event]) -> None:
        corr = [(e.args or _NO_ARGS).correlation for e in launches]
        kept = [(c, e) for c, e in zip(corr, launches) if type(c) is int]
        threads = self.threads
        self.launch_corr.fromlist([c for c, _ in kept])
        self.launch_ts.fromlist([e.ts for _, e in kept])
        self.launch_thread.fromlist([threads.setdefault((e.pid, e.tid), len(threads)) for _, e in kept])

    def _add_other(self, e: _Event) -> None:
        """Step annotations and collective CPU ops (few per trace)."""
        name = e.name
        if name.startswith(_STEP_PREFIX):
            self.step_id.append(int(name[13:]) if name[13:].isdigit() else len(self.step_id))
            self.step_ts.append(e.ts)
            self.step_end.append(e.ts + e.dur)
        elif name.startswith(_COMM_OP_PREFIXES) or name == _COMM_RECORD_OP:
            self.op_thread.append(self.threads.id((e.pid, e.tid)))
            self.op_ts.append(e.ts)
            self.op_end.append(e.ts + e.dur)
            is_op = name != _COMM_RECORD_OP
            self.op_is_nccl.append(is_op)
            self.op_meta.add(e.args or _NO_ARGS, canonical_type(name) if is_op else None)

    def _add_gpu(self, gpu: list[_Event]) -> None:
        names = [e.name for e in gpu]
        kinds = [self._kind(_GPU_CATS[e.cat], n) for e, n in zip(gpu, names)]
        if None in kinds:  # MTIA synchronisation markers: not work
            kept = [i for i, k in enumerate(kinds) if k is not None]
            gpu, names, kinds = [gpu[i] for i in kept], [names[i] for i in kept], [kinds[i] for i in kept]
        args = [e.args or _NO_ARGS for e in gpu]
        base = len(self.gpu_ts)
        # Communication kernels (by name, or a compute kernel with collective args): few, read one by one.
        comm = [i for i, (k, a) in enumerate(zip(kinds, args))
                if k == _COMM or (k == COMPUTE and a.collective is not None)]
        for i in comm:
            kinds[i] = _COMM
            self.comm_at.append(base + i)
            self.comm_name_type.append(self._classify(names[i])[1])
            self.comm_meta.add(args[i], None)
        interned = self.names
        self.gpu_ts.fromlist([e.ts for e in gpu])
        self.gpu_dur.fromlist([e.dur for e in gpu])
        self.gpu_kind.fromlist(cast("list[int]", kinds))  # None kinds were dropped above
        self.gpu_name.fromlist([interned.setdefault(n, len(interned)) for n in names])
        streams = [a.stream for a in args]
        self.gpu_stream.fromlist([s if type(s) is int else UNKNOWN for s in streams])
        corrs = [a.correlation for a in args]
        self.gpu_corr.fromlist([c if type(c) is int else UNKNOWN for c in corrs])

    def _kind(self, kind: int | None, name: str) -> int | None:
        """The provisional kind of a GPU activity: MTIA events by name, communication kernels by name."""
        if kind == _BY_NAME:
            kind = _mtia_kind(name)
        if kind == COMPUTE and self._classify(name)[0]:
            return _COMM
        return kind

    def _classify(self, name: str) -> tuple[bool, int]:
        """(is a communication kernel, type id from the name alone), cached per kernel name."""
        known = self.kernel_class.get(name)
        if known is None:
            comm = is_comm_kernel(name)
            type_id = self.types.id(canonical_type(name) or "unknown") if comm else UNKNOWN
            known = self.kernel_class[name] = (comm, type_id)
        return known


def _what_is_wrong(events: list[Any], exc: Exception) -> str:
    """The first mistyped field among `events`, in JSON's words (on the error path only: the hot loop checks
    nothing); else the exception's own message."""
    for event in events:
        for key, kind in (("ts", "a number"), ("dur", "a number"), ("name", "a string")):
            value = getattr(event, key)
            if isinstance(value, str) if kind == "a string" else (
                    isinstance(value, (int, float)) and not isinstance(value, bool)):
                continue
            got = "missing or null" if value is None else f"{msgspec.json.encode(value).decode()[:40]}, not {kind}"
            cat, name = (msgspec.json.encode(v).decode()[:60] for v in (event.cat, event.name))
            return f"{key!r} is {got}, in an event of category {cat} named {name}"
    return f"missing or mistyped field: {exc}"


def load_kineto(path: str, *, progress: Callable[[int], None] | None = None,
                default_rank: int | None = None, content: TraceContent | None = None) -> RankTimeline:
    """One rank's timeline from a Kineto trace file (plain or .gz), or from its `content` named `path`.

    The rank comes from `distributedInfo.rank`, else from a `rank<N>` in the file name, else
    `default_rank`; without any of them the file is rejected."""
    stream = TraceEventStream(path, progress=progress, only=_WANTED, watch=_LAUNCH_FLOWS, content=content,
                              decoder=_DECODER)
    got = _Collected()
    for events in stream:
        try:
            got.add(events)
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
            # Checked here, not per event in the hot loop: a broken exporter's event, named in one line.
            raise UserError(f"{path}: malformed trace event ({_what_is_wrong(events, exc)})") from None
    if not got.gpu_ts:
        raise UserError(f"{path}: no GPU activity in the trace (no kernel, memcpy or memset events of any "
                        f"Kineto spelling: {', '.join(sorted(_GPU_CATS))})")
    info = stream.meta.get("distributedInfo") or {}
    rank = _rank_of(path, info, default_rank)
    world = info.get("world_size")
    tl = _timeline(path, got, rank, int(world) if isinstance(world, int) else None)
    tl.trace_meta = _described(stream.meta)
    tl.events_sampled = _sampled(path, stream.meta, tl, stream.seen)
    return tl


def _mtia_kind(name: str) -> int | None:
    """Kind of an MTIA device event by its name; None for synchronisation markers (not work)."""
    if name.startswith(_MTIA_SYNC):
        return None
    return MEMCPY if name.startswith("dma") else COMPUTE


def _described(meta: dict[str, Any]) -> dict[str, Any]:
    """The descriptive top-level keys of a trace, device properties reduced to the device names."""
    out = {k: meta[k] for k in _META_KEYS if k in meta and k != "deviceProperties"}
    devices = meta.get("deviceProperties")
    if isinstance(devices, list):
        out["devices"] = sorted({str(d.get("name")) for d in devices if isinstance(d, dict) and d.get("name")})
    info = out.get("distributedInfo")
    if isinstance(info, dict):  # the member list of every group can be thousands of ranks long
        out["distributedInfo"] = {k: v for k, v in info.items() if k in ("backend", "rank", "world_size")}
    return out


def _sampled(path: str, meta: dict[str, Any], tl: RankTimeline, flow_arrows: bool) -> bool | None:
    """Whether the trace holds only a sample of its events. True when its path or metadata says so, or
    when its GPU work has launch records but the trace has none of the launch flow arrows the profiler
    always writes with them (a trace filtered after profiling); None (unknown) when some GPU activities
    have a correlation id but no launch record (a partial recording); else False."""
    said = " ".join([path, str(meta.get("traceName", "")), str(meta.get("sampling", ""))])
    if "sampl" in said.lower() or (not flow_arrows and not np.isnan(tl.launch_us).all()):
        return True
    orphans = (tl.correlation >= 0) & np.isnan(tl.launch_us)
    return None if orphans.any() else False


def _rank_list(members: Any) -> list[int]:
    """`Process Group Ranks` as a list of ints (the profiler writes a list or its string form)."""
    if isinstance(members, str):
        members = [m for m in re.split(r"[^0-9]+", members) if m]
    try:
        return [int(m) for m in members]
    except (TypeError, ValueError):
        return []


def _rank_of(path: str, info: dict[str, Any], default_rank: int | None) -> int:
    if isinstance(info.get("rank"), int):
        rank: int = info["rank"]
        return rank
    match = re.search(_RANK_IN_NAME, path.rsplit("/", 1)[-1])
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
    names = np.frombuffer(got.gpu_name, dtype=np.int32)
    _resolve_comm(got, comm, launch[comm], launch_thread[comm], meta, names[comm])
    types = np.array(got.types.names() + [None], dtype=object)
    is_p2p = np.isin(types[meta["coll_type"][comm]], list(P2P_TYPES))
    kind[comm] = np.where(is_p2p, P2P, COLLECTIVE)
    marks = np.column_stack([
        np.frombuffer(got.step_id, dtype=np.int64), np.frombuffer(got.step_ts), np.frombuffer(got.step_end),
    ]) if got.step_id else np.empty((0, 3))
    return RankTimeline.build(
        rank, start.copy(), end, kind, launch_us=launch, step=step,
        stream=np.frombuffer(got.gpu_stream, dtype=np.int32).copy(), **meta,
        name=names.copy(), correlation=np.frombuffer(got.gpu_corr, dtype=np.int64).copy(),
        coll_types=got.types.names(), process_groups=got.groups.names(), names=got.names.names(),
        group_ranks=dict(got.group_ranks), world_size=world, source=path, step_marks=marks,
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
                  meta: dict[str, np.ndarray], kernel_name: np.ndarray) -> None:
    """Fill the type (and missing group/seq/bytes) of communication kernels from their enclosing CPU ops,
    then from the kernel name (point-to-point only with evidence: see the module doc)."""
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
    by_name = np.frombuffer(got.comm_name_type, dtype=np.int32).copy()
    p2p_ids = [got.types[t] for t in P2P_TYPES if t in got.types]
    named_p2p = np.isin(by_name, p2p_ids) if p2p_ids else np.zeros(len(by_name), bool)
    for at in np.flatnonzero(unnamed & named_p2p):  # a name alone is no evidence of p2p
        seen = distinct(types[~unnamed & (kernel_name == kernel_name[at])])
        by_name[at] = seen[0] if len(seen) == 1 else got.types.id("unknown")
    types[unnamed] = by_name[unnamed]
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


def _message_bytes(args: _Args) -> int:
    nelems = max(args.in_nelems or 0, args.out_nelems or 0)
    size = _DTYPE_BYTES.get(str(args.dtype or "").lower())
    return int(nelems) * size if nelems and size else UNKNOWN
