"""Once-per-cluster work: a lease in the store decides which of the collectors sharing it runs it.

Several collectors may share one ClickHouse store (agents fail over between them). Ingest and queries run
on all of them, but failure scoring, the jobs monitor and the alerts they raise must run on one, or every
alert would be delivered once per collector. :class:`ClusterLease` is a collector service that takes the
lease ``name`` for ``ttl_s`` seconds and renews it every third of that; the periodic services run their
rounds only while it is held. When the holder dies its lease lapses after at most ``ttl_s``, and another
collector, trying every ``ttl_s / 3``, takes it over once it has been lapsed for ``ttl_s / 3`` (a grace
for a renewal still being stored): with ``ttl_s`` equal to the shortest round interval that is within two
intervals. On taking it over, ``on_acquire`` callbacks run first (the alert hub reloads
the alerts the previous holder left firing, so nothing fires again for the same event).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpuwatch.collector.store.base import Leases

log = logging.getLogger(__name__)

DEFAULT_NAME = "background"


def holder_id(listen: str | None = None) -> str:
    """Who holds a lease: host and listen address when the port is fixed (a restarted collector takes its
    own lease back at once), else host, pid and a random part (unique among collectors of one host)."""
    host = socket.gethostname()
    if listen and not listen.endswith(":0"):
        return f"{host}/{listen}"
    return f"{host}/{os.getpid()}-{uuid.uuid4().hex[:8]}"


class ClusterLease:
    """Collector service holding the lease ``name``; :meth:`held` gates the once-per-cluster rounds."""

    def __init__(self, ttl_s: float, *, name: str = DEFAULT_NAME, holder: str | None = None,
                 on_acquire: Sequence[Callable[[], object]] = ()) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease {name}: ttl must be positive, got {ttl_s}")
        self.name, self.ttl_s = name, ttl_s
        self.holder = holder or holder_id()
        self.on_acquire = list(on_acquire)
        self.acquisitions = 0
        self._store: Leases | None = None
        self._valid_until = 0.0  # monotonic time until which the last successful take is good
        self._held = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{name}", daemon=True)

    def start(self, store: Leases) -> Mapping[str, Any]:
        """Try once now (so a lone collector's first rounds run at once), then keep trying in the background."""
        self._store = store
        self._try()
        self._thread.start()
        return {}

    def held(self) -> bool:
        """Whether this collector holds the lease now (false once a renewal is overdue, before it lapses)."""
        return self._held and time.monotonic() < self._valid_until

    def stop(self, release: bool = True) -> None:
        """Stop renewing; with ``release`` give the lease up so another collector takes over at once."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.ttl_s)
        if release and self._held and self._store is not None:
            try:
                self._store.release_lease(self.name, self.holder)
            except Exception:  # the store may be closing; the lease then lapses on its own
                log.warning("could not release lease %s", self.name, exc_info=True)
        self._held = False

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            self._try()

    def _try(self) -> None:
        started = time.monotonic()
        store = self._store
        assert store is not None, "start() sets the store before the first try"
        try:
            taken = store.take_lease(self.name, self.holder, self.ttl_s)
        except Exception:  # the store is away: stop doing the work, try again next time
            log.warning("lease %s: could not reach the store", self.name, exc_info=True)
            taken = False
        if taken and not self._held:
            for callback in self.on_acquire:
                callback()
            self.acquisitions += 1
            log.info("lease %s taken by %s", self.name, self.holder)
        elif self._held and not taken:
            log.warning("lease %s lost to another collector", self.name)
        self._held = taken
        # counted from before the take: the store's expiry is at least this far away
        self._valid_until = started + self.ttl_s if taken else 0.0
