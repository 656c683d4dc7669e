"""A round of work every N seconds on a background thread: how the scorer and the jobs monitor run.

A round that raises is logged and the next one still runs, so one bad input (a job whose spans the engine
cannot read, a GPU with odd values) never stops scoring or monitoring for the rest of the fleet.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

#: The store role a service's rounds read and write (gpuwatch.collector.store.base).
StoreT = TypeVar("StoreT")


class Periodic:
    """Calls ``fn()`` now and then every ``interval_s`` until :meth:`stop`."""

    def __init__(self, name: str, interval_s: float, fn: Callable[[], object]) -> None:
        if interval_s <= 0:
            raise ValueError(f"{name}: interval must be positive, got {interval_s}")
        self.name = name
        self.interval_s = interval_s
        self._fn = fn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called (a long round checks this between units of work)."""
        return self._stop.is_set()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop after the round in progress (waits up to ``timeout_s`` for it)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._fn()
            except Exception:
                log.exception("%s: round failed; next round in %g s", self.name, self.interval_s)
            self._stop.wait(self.interval_s)


class PeriodicService(Generic[StoreT]):
    """A collector service whose work is one round every ``interval_s`` over the store (see server.Service).

    Subclasses implement :meth:`run_round`; :meth:`bind` lets tests and replay drive rounds themselves.
    """

    name = "periodic-service"

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._store: StoreT | None = None
        self._periodic: Periodic | None = None
        #: Rounds run only while this says so (a :class:`~gpuwatch.collector.lease.ClusterLease`'s ``held``,
        #: so that of several collectors sharing a store one does the work); None: always.
        self.gate: Callable[[], bool] | None = None
        self._lifecycle = threading.Lock()
        self._stopped = False

    def bind(self, store: StoreT) -> None:
        """Use ``store`` without the periodic thread."""
        self._store = store

    @property
    def bound_store(self) -> StoreT:
        """The store rounds work on (:meth:`bind` or :meth:`start` sets it)."""
        if self._store is None:
            raise RuntimeError(f"{self.name}: no store bound yet")
        return self._store

    def start(self, store: StoreT) -> Mapping[str, Any]:
        self.bind(store)
        self.begin_rounds()
        return self.handlers()

    def begin_rounds(self) -> None:
        """Start the periodic thread (a subclass that must first get ready calls this itself, later)."""
        with self._lifecycle:
            if not self._stopped and self._periodic is None:
                self._periodic = Periodic(self.name, self.interval_s, self._gated_round)
                self._periodic.start()

    def stop(self) -> None:
        with self._lifecycle:
            self._stopped = True
        if self._periodic is not None:
            self._periodic.stop()

    @property
    def stopping(self) -> bool:
        """Whether the service is being stopped (rounds end early, between units of work)."""
        return self._periodic is not None and self._periodic.stopping

    def _gated_round(self) -> object:
        return self.run_round() if self.gate is None or self.gate() else None

    def handlers(self) -> Mapping[str, Any]:
        """Query methods this service answers."""
        return {}

    def run_round(self) -> object:
        raise NotImplementedError
