"""Which GPUs have failed: a fatal XID or a lost GPU that no reset has cleared yet.

A GPU that hit XID 48 or fell off the bus does not heal by itself: it needs a reset or a reboot. Both reload
the driver, and that leaves two traces gpuwatch already records: the node's agent starts again
(``agent_start``: a reset needs the GPU's users stopped, the agent included), and the GPU's energy counter,
which NVML counts since the driver loaded, starts again from zero. So a GPU counts as *failed* from its
first piece of fatal evidence after the last of those, however old that evidence is and whatever its
samples say. Scoring, alerts, ``gpuwatch gpus``, the demo and ``replay --offline`` all read this one answer.
"""
from __future__ import annotations

from dataclasses import dataclass

from gpuwatch.collector.store.base import EventQueries
from gpuwatch.core import events as event_kinds
from gpuwatch.core import xids


@dataclass(frozen=True)
class Failure:
    node: str
    gpu_index: int
    since_ms: int   # the first fatal evidence after the node's last agent start
    kind: str       # "xid" or "gpu_lost"
    code: int       # the XID (0 for gpu_lost)

    @property
    def reason(self) -> str:
        """One line for a person: what failed and what to do."""
        if self.kind == event_kinds.XID:
            return f"failed: {xids.title(self.code)}; {xids.describe(self.code).action}"
        return f"failed: GPU lost (off the bus, XID 79 class); {xids.describe(79).action}"


class FailureTimeline:
    """The fatal evidence and the resets of a store up to some time, read once, answerable at any time up to it
    (``replay --offline`` asks at every scoring round)."""

    def __init__(self, fatal: list[tuple], resets: dict[tuple[str, int], list[int]],
                 starts: dict[str, list[int]]) -> None:
        self._fatal = fatal  # (node, gpu_index, ts_ms, kind, code), in time order
        self._resets = resets  # (node, gpu_index) -> driver reload times (ms)
        self._starts = starts  # node -> agent start times (ms)

    def at(self, t_ms: int) -> dict[tuple[str, int], Failure]:
        """(node, gpu index) -> :class:`Failure` for every GPU failed at ``t_ms``."""
        out: dict[tuple[str, int], Failure] = {}
        for node, gpu, ts, kind, code in self._fatal:
            if ts > t_ms:
                break
            if (node, gpu) in out:
                continue
            reset = max([r for r in self._resets.get((node, gpu), ()) if r <= t_ms]
                        + [r for r in self._starts.get(node, ()) if r <= t_ms], default=None)
            if reset is None or ts > reset:
                out[(node, gpu)] = Failure(node, gpu, ts, kind, code)
        return out


def failure_timeline(store: EventQueries, until_ms: int | None = None) -> FailureTimeline:
    """Read fatal XIDs and lost GPUs, agent starts, and driver reloads (the energy counter going back) of the
    GPUs with fatal evidence, up to ``until_ms`` (default: everything stored)."""
    fatal = store.fatal_events(sorted(xids.FATAL), until_ms)
    if fatal.empty:
        return FailureTimeline([], {}, {})
    starts = store.event_times(event_kinds.AGENT_START, until_ms)
    # the samples just before the first failure are enough to see a reload after it
    reloads = store.counter_drops("gpu_energy_joules_total",
                                  sorted(set(zip(fatal["node"], fatal["gpu_index"].astype(int)))),
                                  int(fatal["ts_ms"].min()) - 86_400_000, until_ms)
    resets: dict[tuple[str, int], list[int]] = {}
    for node, gpu, ts in zip(reloads["node"], reloads["gpu_index"], reloads["ts_ms"]):
        resets.setdefault((node, int(gpu)), []).append(int(ts))
    node_starts: dict[str, list[int]] = {}
    for node, ts in zip(starts["node"], starts["ts_ms"]):
        node_starts.setdefault(node, []).append(int(ts))
    rows = [(n, int(g), int(t), k, int(c)) for n, g, t, k, c in fatal.itertuples(index=False, name=None)]
    return FailureTimeline(rows, resets, node_starts)


def failed_gpus(store: EventQueries, until_ms: int | None = None) -> dict[tuple[str, int], Failure]:
    """(node, gpu index) -> :class:`Failure` for every GPU failed at ``until_ms`` (default: now, all events)."""
    timeline = failure_timeline(store, until_ms)
    return timeline.at(until_ms if until_ms is not None else 2**62)
