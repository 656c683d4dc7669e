"""Timing of torch.distributed collectives and point-to-point ops by wrapping the module's functions.

`CollectiveRecorder.install()` replaces the functions in `torch.distributed` (and `distributed_c10d`, which
the package re-exports) with thin wrappers; `uninstall()` puts the originals back. Each op launch gets the
next sequence number of its process group, counted like c10d's Flight Recorder: one per launch, separately for
collectives (`collective_seq_id`) and p2p (`p2p_seq_id`); a `batch_isend_irecv` is one launch.

Timing: CPU tensors (gloo) are timed on the host; a synchronous op ends when it returns, an asynchronous one
when its future completes (`get_future().then`) or, for works without a future (gloo send/recv), when the
caller's `wait()` returns. CUDA tensors are timed on the GPU by `cuda_timing.CudaEventTimer`, or left to the
Flight Recorder when that is on (it sees the C++-issued collectives of DDP/FSDP too).
Ops nested inside a wrapped op (batch_isend_irecv calls isend) are not recorded twice.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

from gpuwatch.probe.wire import SpanRow


@dataclass(frozen=True)
class OpSpec:
    kind: str                 # "collective" or "p2p"
    label: str                # row name
    data: tuple[int, str] | None   # (position, keyword) of the tensor(s) this rank contributes
    group: tuple[int, str]
    peer: tuple[int, str] | None = None


def _spec(kind: str, label: str, data: tuple[int, str] | None, group_pos: int,
          peer: tuple[int, str] | None = None) -> OpSpec:
    return OpSpec(kind, label, data, (group_pos, "group"), peer)


OPS: dict[str, OpSpec] = {
    "all_reduce": _spec("collective", "all_reduce", (0, "tensor"), 2),
    "all_gather": _spec("collective", "all_gather", (1, "tensor"), 2),
    "all_gather_into_tensor": _spec("collective", "all_gather_into_tensor", (1, "input_tensor"), 2),
    "reduce_scatter": _spec("collective", "reduce_scatter", (1, "input_list"), 3),
    "reduce_scatter_tensor": _spec("collective", "reduce_scatter_tensor", (1, "input"), 3),
    "broadcast": _spec("collective", "broadcast", (0, "tensor"), 2),
    "reduce": _spec("collective", "reduce", (0, "tensor"), 3),
    "all_to_all": _spec("collective", "all_to_all", (1, "input_tensor_list"), 2),
    "all_to_all_single": _spec("collective", "all_to_all_single", (1, "input"), 4),
    "barrier": _spec("collective", "barrier", None, 0),
    "send": _spec("p2p", "send", (0, "tensor"), 2, (1, "dst")),
    "recv": _spec("p2p", "recv", (0, "tensor"), 2, (1, "src")),
    "isend": _spec("p2p", "send", (0, "tensor"), 2, (1, "dst")),
    "irecv": _spec("p2p", "recv", (0, "tensor"), 2, (1, "src")),
    "batch_isend_irecv": _spec("p2p", "batch_isend_irecv", None, -1),
}
_P2P_LABELS = {"isend": "send", "irecv": "recv", "send": "send", "recv": "recv"}


def _arg(args: tuple, kwargs: dict, where: tuple[int, str], default: Any = None) -> Any:
    position, keyword = where
    if 0 <= position < len(args):
        return args[position]
    return kwargs.get(keyword, default)


def _nbytes(data: Any) -> int:
    if data is None:
        return 0
    if isinstance(data, (list, tuple)):
        return sum(t.numel() * t.element_size() for t in data)
    return data.numel() * data.element_size()


def _first_tensor(data: Any) -> Any:
    if isinstance(data, (list, tuple)):
        return data[0] if data else None
    return data


@dataclass
class Launch:
    """One op launch in flight: what its rows will say, and when it started (host clock)."""

    step: int
    kind: str
    process_group: str
    seq: int
    parts: list[tuple[str, int, int]]   # (name, bytes, peer) per row; a batch_isend_irecv has one per op
    start_ns: int = field(default_factory=time.time_ns)
    device_start: Any = None            # CUDA event when timed on the GPU

    def rows(self, start_us: float, dur_us: float) -> list[SpanRow]:
        return [SpanRow(self.step, self.kind, name, start_us, dur_us, self.process_group, self.seq, nbytes, peer)
                for name, nbytes, peer in self.parts]


class CollectiveRecorder:
    """Wraps torch.distributed ops; completed rows go to `emit`, launches in flight are kept in `inflight`."""

    def __init__(self, emit: Callable[[SpanRow], None], current_step: Callable[[], int],
                 cuda_timer: Any = None, flight_recorder_on: bool = False) -> None:
        import torch.distributed as dist  # only reached from start(), inside a job that uses torch

        self._dist = dist
        self._c10d = dist.distributed_c10d
        self._emit = emit
        self._current_step = current_step
        self._cuda_timer = cuda_timer
        self._flight_recorder_on = flight_recorder_on
        self._wrappers: dict[str, tuple[Callable, Callable]] = {}
        self._patched: list[tuple[Any, str, Any]] = []  # (module, name, torch's function)
        self._tls = threading.local()
        self._seq: dict[tuple[str, str], int] = {}
        self._group_names: dict[int, str] = {}
        self._tokens = itertools.count()
        self.inflight: dict[int, Launch] = {}
        self.errors = 0

    # -- patching -------------------------------------------------------------------------------------------
    def install(self) -> None:
        """Patch both namespaces with one wrapper per function: c10d compares isend/irecv by identity."""
        for name, spec in OPS.items():
            original = getattr(self._c10d, name, None)
            if original is None:
                continue
            wrapper = self._wrap(name, spec, original)
            self._wrappers[name] = (original, wrapper)
            for module in (self._dist, self._c10d):
                if getattr(module, name, None) is original:
                    self._patched.append((module, name, original))
                    setattr(module, name, wrapper)

    def uninstall(self) -> None:
        for module, name, original in self._patched:
            setattr(module, name, original)
        self._patched.clear()

    def _normalize_p2p_ops(self, p2p_ops: list) -> None:
        """P2POps built before start() hold the original isend/irecv; c10d checks `op.op is isend`."""
        for p2p_op in p2p_ops:
            for name in ("isend", "irecv"):
                original, wrapper = self._wrappers.get(name, (None, None))
                if p2p_op.op is original and getattr(self._c10d, name) is wrapper:
                    p2p_op.op = wrapper

    def _wrap(self, op: str, spec: OpSpec, original: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._tls, "busy", False):
                return original(*args, **kwargs)
            launch = self._begin(op, spec, args, kwargs)
            if launch is None:
                return original(*args, **kwargs)
            token = next(self._tokens)
            self.inflight[token] = launch
            self._tls.busy = True
            try:
                result = original(*args, **kwargs)
            except BaseException:
                self.inflight.pop(token, None)
                raise
            finally:
                self._tls.busy = False
            return self._finish(token, launch, result)

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        wrapper.__name__ = original.__name__
        wrapper.__doc__ = original.__doc__
        return wrapper

    # -- launch ---------------------------------------------------------------------------------------------
    def _begin(self, op: str, spec: OpSpec, args: tuple, kwargs: dict) -> Launch | None:
        try:
            if op == "batch_isend_irecv":
                p2p_ops = list(_arg(args, kwargs, (0, "p2p_op_list"), []))
                if not p2p_ops:
                    return None
                self._normalize_p2p_ops(p2p_ops)
                group = p2p_ops[0].group
                data: Any = [o.tensor for o in p2p_ops]
                parts = [(_P2P_LABELS.get(o.op.__name__, "p2p"), _nbytes(o.tensor), o.peer)
                         for o in p2p_ops]
            else:
                group = _arg(args, kwargs, spec.group)
                data = _arg(args, kwargs, spec.data) if spec.data else None
                parts = [(spec.label, _nbytes(data), self._peer(spec, args, kwargs, group))]
            if group is self._c10d.GroupMember.NON_GROUP_MEMBER:
                return None
            tensor = _first_tensor(data)
            on_gpu = tensor is not None and tensor.is_cuda
            if on_gpu and (self._flight_recorder_on or self._cuda_timer is None):
                return None  # the Flight Recorder reports it; without either there is no honest GPU time
            pg_name = self._group_name(group)
            key = (pg_name, spec.kind)
            seq = self._seq.get(key, -1) + 1
            self._seq[key] = seq
            launch = Launch(self._current_step(), spec.kind, pg_name, seq, parts)
            if on_gpu:
                launch.device_start = self._cuda_timer.begin()
            return launch
        except Exception:
            self.errors += 1
            return None

    def _peer(self, spec: OpSpec, args: tuple, kwargs: dict, group: Any) -> int:
        if spec.peer is None:
            return -1
        peer = _arg(args, kwargs, spec.peer)
        if peer is None:
            group_peer = kwargs.get("group_dst" if spec.peer[1] == "dst" else "group_src")
            if group_peer is not None:
                return self._c10d.get_global_rank(group or self._c10d._get_default_group(), group_peer)
            return -1
        return int(peer)

    def _group_name(self, group: Any) -> str:
        if group is None:
            group = self._c10d._get_default_group()
        name = self._group_names.get(id(group))
        if name is None:
            name = self._c10d._get_process_group_name(group)
            self._group_names[id(group)] = name
        return name

    # -- completion -----------------------------------------------------------------------------------------
    def _finish(self, token: int, launch: Launch, result: Any) -> Any:
        try:
            works = self._works(result)
            if launch.device_start is not None:
                self.inflight.pop(token, None)  # GPU completion is learnt at harvest, not on the host
                self._cuda_timer.end(launch, works)
                return result
            if not works:
                if launch.parts[0][0] == "recv" and launch.parts[0][2] == -1 and isinstance(result, int):
                    launch.parts = [("recv", launch.parts[0][1], result)]  # recv from any source
                self._complete(token, launch, time.time_ns())
                return result
            return self._complete_later(token, launch, result, works)
        except Exception:
            self.errors += 1
            self.inflight.pop(token, None)
            return result

    def _works(self, result: Any) -> list:
        work_type = self._dist.Work
        if isinstance(result, work_type):
            return [result]
        if isinstance(result, list) and result and all(isinstance(w, work_type) for w in result):
            return result
        return []

    def _complete(self, token: int, launch: Launch, end_ns: int) -> None:
        if self.inflight.pop(token, None) is None:
            return  # already completed (two paths observed the same work)
        for row in launch.rows(launch.start_ns / 1000.0, (end_ns - launch.start_ns) / 1000.0):
            self._emit(row)

    def _complete_later(self, token: int, launch: Launch, result: Any, works: list) -> Any:
        """Completion of an async op: by future callback when the work has one, else by timing its wait()."""
        if len(works) == len(launch.parts) > 1:
            # gloo's batch_isend_irecv: one work per op; each row completes with its own work
            wrapped = []
            for work, part in zip(works, launch.parts):
                sub = Launch(launch.step, launch.kind, launch.process_group, launch.seq, [part], launch.start_ns)
                sub_token = next(self._tokens)
                self.inflight[sub_token] = sub
                wrapped.append(self._on_done(sub_token, sub, work))
            self.inflight.pop(token, None)
            return wrapped
        last = self._on_done(token, launch, works[-1])
        return last if isinstance(result, self._dist.Work) else result[:-1] + [last]

    def _on_done(self, token: int, launch: Launch, work: Any) -> Any:
        try:
            future = work.get_future()
        except RuntimeError:  # "Work::getFuture not implemented" (gloo send/recv)
            return timed_work_class(self._dist)(work, lambda: self._complete(token, launch, time.time_ns()))

        def done(_: Any) -> None:
            try:
                self._complete(token, launch, time.time_ns())
            except Exception:
                self.errors += 1

        future.then(done)
        return work


_TIMED_WORK: dict[int, type] = {}


def timed_work_class(dist: Any) -> type:
    """A dist.Work that delegates to another and calls `on_done` the first time the op is seen complete.

    Used only for works without a future: the caller's wait() (or a successful is_completed()) is the earliest
    moment the host learns that the op finished."""
    cached = _TIMED_WORK.get(id(dist.Work))
    if cached is not None:
        return cached

    class TimedWork(dist.Work):
        def __init__(self, inner: Any, on_done: Callable[[], None]) -> None:
            super().__init__()
            self._inner = inner
            self._on_done: Callable[[], None] | None = on_done

        def _notify(self) -> None:
            callback, self._on_done = self._on_done, None
            if callback is not None:
                callback()

        def wait(self, *args: Any, **kwargs: Any) -> Any:
            result = self._inner.wait(*args, **kwargs)
            self._notify()
            return result

        def is_completed(self) -> bool:
            completed = self._inner.is_completed()
            if completed:
                self._notify()
            return completed

    def delegate(name: str) -> Callable:
        return lambda self, *args, **kwargs: getattr(self._inner, name)(*args, **kwargs)

    for name in dir(dist.Work):
        if not name.startswith("_") and name not in ("wait", "is_completed") and callable(getattr(dist.Work, name)):
            setattr(TimedWork, name, delegate(name))
    _TIMED_WORK[id(dist.Work)] = TimedWork
    return TimedWork
