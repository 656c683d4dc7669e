"""Host metrics of the node (the ``host_*`` fields of gpuwatch.core.fields), read with psutil."""
from __future__ import annotations

import os

import psutil


class HostSampler:
    """Reads CPU, load, memory, network and disk counters; CPU share is measured between calls."""

    def __init__(self) -> None:
        psutil.cpu_percent(interval=None)  # primes the counter so the first tick measures a real interval

    def sample(self) -> dict[str, float]:
        values = {
            "host_cpu_utilization_ratio": psutil.cpu_percent(interval=None) / 100.0,
            "host_load1": os.getloadavg()[0],
        }
        mem = psutil.virtual_memory()
        values["host_memory_used_bytes"] = float(mem.total - mem.available)
        values["host_memory_total_bytes"] = float(mem.total)
        net = psutil.net_io_counters()
        if net is not None:
            values["host_network_rx_bytes_total"] = float(net.bytes_recv)
            values["host_network_tx_bytes_total"] = float(net.bytes_sent)
        disk = psutil.disk_io_counters()
        if disk is not None:
            values["host_disk_read_bytes_total"] = float(disk.read_bytes)
            values["host_disk_write_bytes_total"] = float(disk.write_bytes)
        return values
