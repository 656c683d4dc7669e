"""Who may hold an Ingest stream: a bound on open streams, idle timeouts, and one live agent per agent id.

An open Ingest stream costs the asyncio server a coroutine and its window of batches, not a thread, but
without a bound a client opening streams without end (buggy or hostile) still grows the collector's memory
and file descriptors. :class:`StreamAdmission` is the server-independent part of that policy: the servicer
asks it to admit a stream (at most ``max_streams`` at once, far above a real fleet's one per agent), to claim
the stream's agent id when a batch names it, and releases the stream when it ends.

An agent id belongs to one running agent. Two agents with the same id (a spool or VM image copied to a
second node) would have the collector take the second one's batches for resends of the first one's and
drop them as duplicates. Each agent process sends a random instance token with its calls
(:data:`gpuwatch.core.batches.INSTANCE_METADATA`); while one instance holds a live stream for an id, a stream of
another instance for that id is refused with ALREADY_EXISTS and a message that says what to do.
The store's duplicate check
catches the case where the two never overlap in time (:class:`gpuwatch.core.errors.AgentIdConflict`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from gpuwatch.core.settings import DEFAULT_STREAM_IDLE_S


class StreamRefused(Exception):
    """A stream the collector will not serve now; ``code`` is the gRPC status name to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def fencing_advice(agent_id: str) -> str:
    """What an operator does about an agent id that two agents use."""
    return (f"agent id {agent_id} is used by two agents (a copied spool directory or VM image): stop the copy and "
            "give it its own identity with `gpuwatch agent --new-agent-id --spool DIR` (its unsent batches are "
            "kept and renumbered); `gpuwatch agent --check` reports it")


@dataclass
class _Holder:
    instance: str
    peer: str
    streams: set[int] = field(default_factory=set)


class StreamAdmission:
    """Thread-safe bookkeeping of open Ingest streams (usable from a thread-pool or an asyncio servicer);
    ``idle_timeout_s`` is how long the servicer lets a stream stay silent before it ends it."""

    def __init__(self, max_streams: int, idle_timeout_s: float = DEFAULT_STREAM_IDLE_S) -> None:
        self.max_streams = max_streams
        self.idle_timeout_s = idle_timeout_s
        self._lock = threading.Lock()
        self._open: set[int] = set()
        self._holders: dict[str, _Holder] = {}
        self._next_id = 0
        self.refused_busy = 0
        self.refused_fenced = 0
        self.idle_closed = 0

    def open_stream(self) -> int:
        """Admit one stream and return its handle; StreamRefused(RESOURCE_EXHAUSTED) when the bound is reached."""
        with self._lock:
            if len(self._open) >= self.max_streams:
                self.refused_busy += 1
                raise StreamRefused("RESOURCE_EXHAUSTED",
                                    f"the collector already serves {self.max_streams} agent streams; retry later")
            self._next_id += 1
            self._open.add(self._next_id)
            return self._next_id

    def claim(self, stream: int, agent_id: str, instance: str, peer: str) -> None:
        """Bind ``agent_id`` to the stream's agent instance; StreamRefused(ALREADY_EXISTS) when another live
        instance holds it. Calls without an instance token (older agents, hand-made clients) are not fenced."""
        if not instance:
            return
        with self._lock:
            holder = self._holders.get(agent_id)
            if holder is not None and holder.instance != instance and holder.streams:
                self.refused_fenced += 1
                raise StreamRefused("ALREADY_EXISTS", f"{fencing_advice(agent_id)}; the other agent is connected "
                                                      f"from {holder.peer}")
            if holder is None or holder.instance != instance:
                holder = self._holders[agent_id] = _Holder(instance, peer)
            holder.streams.add(stream)

    def check_push(self, agent_id: str, instance: str, peer: str) -> None:
        """A single Push is fenced like a stream but holds nothing after it returns."""
        with self._lock:
            holder = self._holders.get(agent_id)
            if instance and holder is not None and holder.instance != instance and holder.streams:
                self.refused_fenced += 1
                raise StreamRefused("ALREADY_EXISTS", f"{fencing_advice(agent_id)}; the other agent is connected "
                                                      f"from {holder.peer}")

    def close_stream(self, stream: int, idle: bool = False) -> None:
        with self._lock:
            self._open.discard(stream)
            self.idle_closed += int(idle)
            for agent_id, holder in list(self._holders.items()):
                holder.streams.discard(stream)
                if not holder.streams:
                    del self._holders[agent_id]

    def open_count(self) -> int:
        with self._lock:
            return len(self._open)
