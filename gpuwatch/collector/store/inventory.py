"""Which GPU inventory entries a group of batches must write: at thousands of agents, upserting every
entry in every group costs more than the samples, so an entry is written when it is new or changed and
otherwise once per refresh interval (which keeps ``gpus.last_seen`` to within that interval)."""
from __future__ import annotations

import time
from collections.abc import Sequence

from gpuwatch.core.columnar import ColumnarBatch
from gpuwatch.v1 import telemetry_pb2 as pb

#: Seconds after which an unchanged inventory entry is written again (its gpus.last_seen refreshed).
INVENTORY_REFRESH_S = 60.0


class InventoryCache:
    """(node, GPU index) -> the entry as last written and when (writer thread only)."""

    def __init__(self) -> None:
        self._written: dict[tuple[str, int], tuple[bytes, float]] = {}

    def to_write(self, batches: Sequence[ColumnarBatch]) -> dict[tuple[str, int], tuple[bytes, pb.GpuInfo]]:
        """The newest entry per (node, GPU) of the group that is new, changed or due for refresh."""
        latest = {(b.message.node.node, g.index): g for b in batches for g in b.message.gpus}
        stale = time.monotonic() - INVENTORY_REFRESH_S
        out = {}
        for key, gpu in latest.items():
            entry = gpu.SerializeToString()
            known = self._written.get(key)
            if known is None or known[0] != entry or known[1] < stale:
                out[key] = (entry, gpu)
        return out

    def written(self, entries: dict[tuple[str, int], tuple[bytes, pb.GpuInfo]]) -> None:
        """Record ``entries`` (from :meth:`to_write`) as committed."""
        now = time.monotonic()
        self._written.update({key: (entry, now) for key, (entry, _) in entries.items()})
