"""The simulated node's host metrics (the agent's ``host_*`` fields), so a simulated host can be starved of CPU.

A training node's CPUs idle at a fraction of their capacity (data loading and launch threads); a host_cpu
fail-slow (:mod:`gpuwatch.simulator.fail_slow`) saturates them and queues far more runnable tasks than cores.
Deterministic for a node name and the simulated time.
"""
from __future__ import annotations

import random
from collections.abc import Callable

CORES = 128
MEMORY_BYTES = 2 * 2**40
_BUSY_SHARE = 0.30  # a healthy training node's CPU share in use
_SATURATED_SHARE = 0.99
_SATURATED_LOAD_PER_CORE = 3.0


class SimHost:
    """``sample()`` as :class:`gpuwatch.agent.host.HostSampler` answers it, from the simulated clock."""

    def __init__(self, node: str, clock: Callable[[], float], saturated: Callable[[float], bool]) -> None:
        self.clock, self.saturated = clock, saturated
        self._rng = random.Random(f"{node}/host")
        self._net = self._disk = 0.0

    def sample(self) -> dict[str, float]:
        hot = self.saturated(self.clock())
        share = _SATURATED_SHARE if hot else min(0.95, max(0.05, _BUSY_SHARE + self._rng.gauss(0, 0.04)))
        load = CORES * (_SATURATED_LOAD_PER_CORE if hot else share) * (1 + self._rng.gauss(0, 0.03))
        self._net += 1.2e9
        self._disk += 2e8
        return {"host_cpu_utilization_ratio": share, "host_load1": max(0.0, load),
                "host_memory_used_bytes": 0.4 * MEMORY_BYTES, "host_memory_total_bytes": float(MEMORY_BYTES),
                "host_network_rx_bytes_total": self._net, "host_network_tx_bytes_total": self._net,
                "host_disk_read_bytes_total": self._disk, "host_disk_write_bytes_total": self._disk / 4}
