"""Names every layer shares: the efficiency breakdown's categories and the rule-based health states.

Declared once here, at the bottom of the layers, so the engine that computes a breakdown, the documents
and reports that show it and the Prometheus series that export it cannot drift apart.
"""
from __future__ import annotations

#: The categories that partition a rank's window (specs/efficiency.md), in the order every output lists
#: them: the ``analyze`` JSON document and table, the reports, the ``category`` label of the metrics.
BREAKDOWN_CATEGORIES: tuple[str, ...] = (
    "compute", "memcpy", "comm_transfer", "comm_wait", "bubble", "small_kernel_overhead", "host_stall", "idle_other",
)

#: A GPU's rule-based health (gpuwatch.models.rules), from good to bad.
OK, WARN, FAIL = "ok", "warn", "fail"
HEALTH_STATES: tuple[str, ...] = (OK, WARN, FAIL)
