"""Plain forks of a one-shot process: when one is safe, and a function run in one beside the caller.

`gpuwatch analyze` runs nothing but its analysis, on machines where a core would otherwise idle while one
serial step runs (the what-if of a multi-rank job beside the rest of the breakdown), or while it waits for
workers (reading a share of the trace files beside them). A forked copy starts at
once with everything already loaded: no interpreter to start, no module to import, no timeline to send.
"""
from __future__ import annotations

import os
import pickle
import sys
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

_T = TypeVar("_T")
# Libraries that run threads of their own: a forked child would hold copies of their locks, taken or not.
_THREADED_LIBRARIES = ("grpc", "duckdb", "chdb", "pyarrow")


def forkable() -> bool:
    """Whether a plain fork of this process is safe: on Linux, with no other Python thread running and none
    of the libraries loaded that start threads of their own (a forked child holds copies of their locks)."""
    return (sys.platform == "linux" and threading.active_count() == 1
            and not any(name in sys.modules for name in _THREADED_LIBRARIES))


class Pending(Generic[_T]):
    """`fn(*args)`, computed in a forked child while the caller goes on when `fork` is asked and safe
    (`forkable`), else computed here when asked for. `result()` returns its value or raises its exception,
    as a call would; `cancel()` ends a child whose result is no longer wanted."""

    def __init__(self, fn: Callable[..., _T], *args: object, fork: bool) -> None:
        self._call = (fn, args)
        self._pid = 0
        self._pipe = -1
        if not (fork and forkable()):
            return
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: send the outcome, then leave without the parent's exit handlers
            os.close(read)
            _send(write, fn, args)
            os._exit(0)
        os.close(write)
        self._pid, self._pipe = pid, read

    def result(self) -> _T:
        if not self._pid:
            return self._here()
        with os.fdopen(self._pipe, "rb") as pipe:
            data = pipe.read()
        self._pipe = -1
        os.waitpid(self._pid, 0)
        self._pid = 0
        if not data:  # the child died before sending (killed, out of memory): compute it here
            return self._here()
        ok, value = pickle.loads(data)
        if not ok:
            raise value
        result: _T = value  # what the child's call returned
        return result

    def _here(self) -> _T:
        fn, args = self._call
        return fn(*args)

    def cancel(self) -> None:
        if self._pid:
            import signal  # here: its enums cost 0.5 ms of every `analyze`, and few cancel

            os.kill(self._pid, signal.SIGKILL)  # its work is not wanted: no need to let it finish
            os.close(self._pipe)
            os.waitpid(self._pid, 0)
            self._pid, self._pipe = 0, -1


def _send(fd: int, fn: Callable[..., object], args: tuple[object, ...]) -> None:
    try:
        outcome = (True, fn(*args))
    except BaseException as exc:  # raised again in the parent, as the call would have raised it
        outcome = (False, exc)
    try:
        data = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # an unpicklable value or exception: say what it was
        data = pickle.dumps((False, RuntimeError(f"{fn.__name__} in a forked child: {outcome[1]!r} ({exc})")))
    try:
        with os.fdopen(fd, "wb") as pipe:
            pipe.write(data)
    except OSError:
        pass  # the parent no longer wants it (cancelled)
