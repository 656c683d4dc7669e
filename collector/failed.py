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
        WITH fatal AS (
            SELECT node, gpu_index, ts, kind, coalesce(code, 0) AS code FROM events
            WHERE gpu_index >= 0 AND ($until IS NULL OR ts <= make_timestamp($until * 1000))
              AND (kind = '{event_kinds.GPU_LOST}' OR (kind = '{event_kinds.XID}' AND list_contains($fatal, code)))),
        starts AS (
            SELECT node, max(ts) AS started FROM events
            WHERE kind = '{event_kinds.AGENT_START}' AND ($until IS NULL OR ts <= make_timestamp($until * 1000))
            GROUP BY node),
        energy AS (
            SELECT s.node, s.gpu_index, s.ts, s.gpu_energy_joules_total AS joules,
                   lag(s.gpu_energy_joules_total) OVER (PARTITION BY s.node, s.gpu_index ORDER BY s.ts) AS before
            FROM gpu_samples s SEMI JOIN fatal f ON s.node = f.node AND s.gpu_index = f.gpu_index
            WHERE s.ts >= (SELECT min(ts) FROM fatal) - INTERVAL 1 DAY  -- the samples just before the failure too
              AND ($until IS NULL OR s.ts <= make_timestamp($until * 1000))),
        reloads AS (SELECT node, gpu_index, max(ts) AS reloaded FROM energy WHERE joules < before GROUP BY ALL)
        SELECT f.node, f.gpu_index, epoch_ms(min(f.ts)) AS since_ms, arg_min(f.kind, f.ts) AS kind,
               arg_min(f.code, f.ts) AS code
        FROM fatal f LEFT JOIN starts s USING (node) LEFT JOIN reloads r USING (node, gpu_index)
        WHERE (s.started IS NULL OR f.ts > s.started) AND (r.reloaded IS NULL OR f.ts > r.reloaded)
        GROUP BY f.node, f.gpu_index""", {"until": until_ms, "fatal": sorted(xids.FATAL)})
    return {(r.node, int(r.gpu_index)): Failure(r.node, int(r.gpu_index), int(r.since_ms), r.kind, int(r.code))
            for r in frame.itertuples(index=False)}
