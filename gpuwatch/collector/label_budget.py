"""How many distinct label values one agent may create: nodes, GPUs, event kinds and XID codes.

Each of these becomes a key of the store's tables and a label of the collector's /metrics; an agent inventing
a new event kind or GPU index per batch (50,000 distinct event kinds were once acked) grows every scrape and
every query without bound. A real agent has one node, a fixed set of GPUs and a few dozen event kinds, so
each agent id gets a budget of distinct values per label; a batch that would exceed it is refused
(INVALID_ARGUMENT: the agent quarantines it and goes on). Job ids are not budgeted (a node runs new jobs for
ever; /metrics exports the jobs with the most lost time only); their length is bounded by
gpuwatch.core.batches. The budget is kept in memory, for the agents seen most recently, so it bounds what
one collector process accepts.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from gpuwatch.core import events as event_kinds
from gpuwatch.core.batches import BatchError

if TYPE_CHECKING:
    from gpuwatch.core.columnar import ColumnarBatch

#: Distinct values per agent id: node names (a renamed host), GPU indexes, event kinds, XID codes (each a
#: series of gpu_xid_errors_total per GPU; NVIDIA's catalogue has under 200).
BUDGET = {"node": 16, "gpu": 1024, "event kind": 256, "xid code": 512}
_AGENTS_KEPT = 100_000  # agents remembered (least recently seen forgotten first): bounds this module's memory


class LabelBudget:
    """The distinct label values each agent id created so far; :meth:`admit` refuses a batch past the budget."""

    def __init__(self, budget: dict[str, int] | None = None, agents_kept: int = _AGENTS_KEPT) -> None:
        self.budget = dict(BUDGET if budget is None else budget)
        self._agents_kept = agents_kept
        self._seen: OrderedDict[str, dict[str, set]] = OrderedDict()

    def admit(self, batch: ColumnarBatch) -> None:
        """Count ``batch``'s label values to its agent; BatchError (nothing counted) when one label would exceed
        its budget."""
        message = batch.message
        new = {"node": {message.node.node},
               "gpu": {g.index for g in message.gpus} | {s.gpu_index for s in message.samples},
               "event kind": {e.kind for e in message.events},
               "xid code": {e.code for e in message.events if e.kind == event_kinds.XID}}
        seen = self._seen.get(batch.agent_id)
        if seen is None:
            seen = {label: set() for label in self.budget}
        for label, values in new.items():
            total = len(seen[label]) + len(values - seen[label])
            if total > self.budget[label]:
                raise BatchError(f"agent {batch.agent_id} would have {total} distinct {label} values, at most "
                                 f"{self.budget[label]} per agent")
        for label, values in new.items():
            seen[label] |= values
        self._seen[batch.agent_id] = seen
        self._seen.move_to_end(batch.agent_id)
        while len(self._seen) > self._agents_kept:
            self._seen.popitem(last=False)
