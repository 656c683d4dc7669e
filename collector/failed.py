"""Which GPUs have failed: a fatal XID or a lost GPU since the node's agent last started.

A GPU that hit XID 48 or fell off the bus does not heal by itself: it needs a reset or a reboot, and both
restart the node's agent (a reset reloads the driver under it, so the agent reopens NVML and sends
``agent_start``). So a GPU counts as *failed* from its first piece of fatal evidence until the next
``agent_start`` of its node, however long ago the failure was and whatever its last samples say. Scoring,
alerts, ``gpuwatch gpus``, the demo and ``replay --offline`` all read this one answer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuwatch import events as event_kinds
from gpuwatch import xids


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


def failed_gpus(store: Any, until_ms: int | None = None) -> dict[tuple[str, int], Failure]:
    """(node, gpu index) -> :class:`Failure` for every GPU failed at ``until_ms`` (default: now, all events)."""
    frame = store.query_df(f"""
        WITH starts AS (
            SELECT node, max(ts) AS started FROM events
            WHERE kind = '{event_kinds.AGENT_START}' AND ($until IS NULL OR ts <= make_timestamp($until * 1000))
            GROUP BY node),
        fatal AS (
            SELECT node, gpu_index, ts, kind, coalesce(code, 0) AS code FROM events
            WHERE gpu_index >= 0 AND ($until IS NULL OR ts <= make_timestamp($until * 1000))
              AND (kind = '{event_kinds.GPU_LOST}' OR (kind = '{event_kinds.XID}' AND list_contains($fatal, code))))
        SELECT f.node, f.gpu_index, epoch_ms(min(f.ts)) AS since_ms, arg_min(f.kind, f.ts) AS kind,
               arg_min(f.code, f.ts) AS code
        FROM fatal f LEFT JOIN starts s USING (node)
        WHERE s.started IS NULL OR f.ts > s.started
        GROUP BY f.node, f.gpu_index""", {"until": until_ms, "fatal": sorted(xids.FATAL)})
    return {(r.node, int(r.gpu_index)): Failure(r.node, int(r.gpu_index), int(r.since_ms), r.kind, int(r.code))
            for r in frame.itertuples(index=False)}
