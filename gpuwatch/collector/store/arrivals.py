"""Which stored GPU samples are new since a reader's last look, found without scanning the raw tier.

Readers that keep something per GPU up to date (the scorer's catch-up, the latest values) need only what
arrived since they last looked. Arrival is not a sample time (an agent's spool drains hours late, a recording
streams in after other nodes carried the clock past it), so the small ``agents`` table says which nodes sent
batches since the last look, and of those only the samples after the newest the reader saw of them are read:
about one look's worth of samples, however long the raw tier.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Protocol

#: A node counts as heard from when its agent's batch was stored this long before the last look: room for the
#: time between a batch's arrival and its samples becoming readable, and for clock skew between the collectors
#: that share a store.
HEARD_MARGIN_S = 300.0


class HeardNodes(Protocol):
    def nodes_heard_since(self, since_ms: int) -> list[str]: ...


class SampleArrivals:
    """One reader's record of what it has seen: per node, the newest sample time it read."""

    def __init__(self) -> None:
        self._seen_ms: dict[str, int] = {}
        self._looked_ms: int | None = None  # the wall clock (epoch ms) of the last look; None: never looked

    def where(self, store: HeardNodes, floor_ms: int | None = None) -> tuple[int | None, list[str] | None]:
        """(after_ms, nodes): the samples to read now are those after ``after_ms`` (None: any time, never
        before ``floor_ms``) of ``nodes`` (None: every node; the first look reads everything)."""
        asked_ms = int(time.time() * 1000)
        if self._looked_ms is None:
            self._looked_ms = asked_ms
            return floor_ms, None
        heard = store.nodes_heard_since(self._looked_ms - int(HEARD_MARGIN_S * 1000))
        self._looked_ms = asked_ms
        seen = [self._seen_ms.get(node) for node in heard]
        after = None if None in seen else min((t for t in seen if t is not None), default=None)
        if floor_ms is not None:
            after = floor_ms if after is None else max(after, floor_ms)
        return after, heard

    def saw(self, newest: Mapping[tuple[str, int], int], nodes: Sequence[str] | None) -> None:
        """Record a read: ``newest`` sample time per (node, GPU) among the samples read of ``nodes``. A node
        read without samples counts as seen up to the newest sample of any node (it has no GPU samples: there
        is nothing of it to read before that), once any node has samples."""
        for (node, _), t in newest.items():
            self._seen_ms[node] = max(t, self._seen_ms.get(node, t))
        if self._seen_ms and nodes:
            newest_of_all = max(self._seen_ms.values())
            for node in nodes:
                self._seen_ms.setdefault(node, newest_of_all)
