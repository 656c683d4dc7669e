"""The catalogue of per-GPU and per-host telemetry fields.

One list that the agent (what it samples), the wire format (column names), the collector store (table
columns), the Prometheus exporter and the failure features all read, so a field is named, typed and
documented exactly once. Names follow Prometheus conventions: base units, ``_ratio`` for 0-1 values,
``_total`` for counters that only grow.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Tier(str, Enum):
    """How often the agent samples a field (docs/background.md §1)."""

    FAST = "fast"  # every tick (default 1 s)
    SLOW = "slow"  # every slow interval (default 30 s)
    GPM = "gpm"  # every tick, Hopper and newer only (NVML GPM)


class Kind(str, Enum):
    """How a field's value behaves over time: features take rates of counters and levels of gauges."""

    GAUGE = "gauge"
    COUNTER = "counter"  # monotonically non-decreasing while the driver is loaded


@dataclass(frozen=True)
class Field:
    """One telemetry field: its Prometheus-style name, unit, sampling tier, kind and one line of help."""

    name: str
    unit: str
    tier: Tier
    kind: Kind
    help: str


def _gauge(name: str, unit: str, tier: Tier, help_text: str) -> Field:
    return Field(name, unit, tier, Kind.GAUGE, help_text)


def _counter(name: str, unit: str, tier: Tier, help_text: str) -> Field:
    return Field(name, unit, tier, Kind.COUNTER, help_text)


FAST, SLOW, GPM = Tier.FAST, Tier.SLOW, Tier.GPM

GPU_FIELDS: tuple[Field, ...] = (
    # fast tier
    _gauge("gpu_utilization_ratio", "ratio", FAST,
           "Share of the last sample period a kernel ran (NVML utilization.gpu)."),
    _gauge("gpu_memory_utilization_ratio", "ratio", FAST, "Share of the period device memory was read or written."),
    _gauge("gpu_memory_used_bytes", "bytes", FAST, "Framebuffer memory in use."),
    _gauge("gpu_memory_total_bytes", "bytes", FAST, "Framebuffer memory in total."),
    _gauge("gpu_temperature_celsius", "celsius", FAST, "GPU core temperature."),
    _gauge("gpu_memory_temperature_celsius", "celsius", FAST, "HBM temperature (field 82)."),
    _gauge("gpu_power_watts", "watts", FAST, "Power draw (1 s average on Ampere and newer)."),
    _gauge("gpu_power_limit_watts", "watts", FAST, "Enforced power limit."),
    _counter("gpu_energy_joules_total", "joules", FAST, "Energy consumed since the driver loaded."),
    _gauge("gpu_sm_clock_hertz", "hertz", FAST, "SM clock."),
    _gauge("gpu_memory_clock_hertz", "hertz", FAST, "Memory clock."),
    _gauge("gpu_clock_event_reasons", "bitmask", FAST, "Active clock-event (throttle) reasons, NVML bitmask."),
    _counter("gpu_throttle_power_seconds_total", "seconds", FAST,
             "Time clocks were held down by the power cap (field 74)."),
    _counter("gpu_throttle_thermal_seconds_total", "seconds", FAST, "Time clocks were held down thermally (field 75)."),
    _counter("gpu_pcie_tx_bytes_total", "bytes", FAST, "PCIe bytes sent (field 197)."),
    _counter("gpu_pcie_rx_bytes_total", "bytes", FAST, "PCIe bytes received (field 198)."),
    _counter("gpu_nvlink_tx_bytes_total", "bytes", FAST, "NVLink bytes sent, all links (field 138)."),
    _counter("gpu_nvlink_rx_bytes_total", "bytes", FAST, "NVLink bytes received, all links (field 139)."),
    # GPM (Hopper+)
    _gauge("gpu_sm_active_ratio", "ratio", GPM, "Share of time at least one warp was resident on an SM (GPM SM_UTIL)."),
    _gauge("gpu_sm_occupancy_ratio", "ratio", GPM, "Resident warps over the maximum (GPM SM_OCCUPANCY)."),
    _gauge("gpu_tensor_active_ratio", "ratio", GPM, "Share of time any tensor pipe was active (GPM ANY_TENSOR_UTIL)."),
    _gauge("gpu_dram_bandwidth_utilization_ratio", "ratio", GPM, "HBM bandwidth used over peak (GPM DRAM_BW_UTIL)."),
    _gauge("gpu_pcie_tx_bytes_per_second", "bytes_per_second", GPM, "PCIe transmit throughput (GPM)."),
    _gauge("gpu_pcie_rx_bytes_per_second", "bytes_per_second", GPM, "PCIe receive throughput (GPM)."),
    _gauge("gpu_nvlink_tx_bytes_per_second", "bytes_per_second", GPM, "NVLink transmit throughput (GPM)."),
    _gauge("gpu_nvlink_rx_bytes_per_second", "bytes_per_second", GPM, "NVLink receive throughput (GPM)."),
    # slow tier: reliability
    _counter("gpu_ecc_sbe_volatile_total", "errors", SLOW, "Correctable ECC errors since the driver loaded (field 3)."),
    _counter("gpu_ecc_dbe_volatile_total", "errors", SLOW,
             "Uncorrectable ECC errors since the driver loaded (field 4)."),
    _counter("gpu_ecc_sbe_aggregate_total", "errors", SLOW, "Correctable ECC errors over the GPU's life (field 5)."),
    _counter("gpu_ecc_dbe_aggregate_total", "errors", SLOW, "Uncorrectable ECC errors over the GPU's life (field 6)."),
    _gauge("gpu_retired_pages_sbe", "pages", SLOW, "Pages retired for correctable errors (pre-Ampere)."),
    _gauge("gpu_retired_pages_dbe", "pages", SLOW, "Pages retired for uncorrectable errors (pre-Ampere)."),
    _gauge("gpu_retired_pages_pending", "bool", SLOW, "1 when a page retirement waits for the next driver reload."),
    _gauge("gpu_remapped_rows_correctable", "rows", SLOW, "Rows remapped for correctable errors (Ampere+)."),
    _gauge("gpu_remapped_rows_uncorrectable", "rows", SLOW, "Rows remapped for uncorrectable errors (Ampere+)."),
    _gauge("gpu_remapped_rows_pending", "bool", SLOW, "1 when a row remap waits for a GPU reset."),
    _gauge("gpu_remapped_rows_failure", "bool", SLOW, "1 when a row remap failed (RMA path)."),
    _counter("gpu_pcie_replay_total", "replays", SLOW, "PCIe replay counter (field 94)."),
    _gauge("gpu_pcie_link_gen", "generation", SLOW, "Current PCIe link generation."),
    _gauge("gpu_pcie_link_width", "lanes", SLOW, "Current PCIe link width."),
    _gauge("gpu_pcie_link_gen_max", "generation", SLOW, "Maximum PCIe link generation."),
    _gauge("gpu_pcie_link_width_max", "lanes", SLOW, "Maximum PCIe link width."),
    _counter("gpu_nvlink_crc_flit_errors_total", "errors", SLOW, "NVLink CRC flit errors, all links (field 38)."),
    _counter("gpu_nvlink_crc_data_errors_total", "errors", SLOW, "NVLink CRC data errors, all links (field 45)."),
    _counter("gpu_nvlink_replay_errors_total", "errors", SLOW, "NVLink replay errors, all links (field 52)."),
    _counter("gpu_nvlink_recovery_errors_total", "errors", SLOW, "NVLink recovery errors, all links (field 59)."),
)

HOST_FIELDS: tuple[Field, ...] = (
    _gauge("host_cpu_utilization_ratio", "ratio", FAST, "Share of all CPUs busy since the last tick."),
    _gauge("host_load1", "tasks", FAST, "One-minute load average."),
    _gauge("host_memory_used_bytes", "bytes", FAST, "Host memory in use."),
    _gauge("host_memory_total_bytes", "bytes", FAST, "Host memory in total."),
    _counter("host_network_rx_bytes_total", "bytes", FAST, "Bytes received on all interfaces."),
    _counter("host_network_tx_bytes_total", "bytes", FAST, "Bytes sent on all interfaces."),
    _counter("host_disk_read_bytes_total", "bytes", FAST, "Bytes read from all disks."),
    _counter("host_disk_write_bytes_total", "bytes", FAST, "Bytes written to all disks."),
)

GPU_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in GPU_FIELDS)
HOST_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in HOST_FIELDS)
BY_NAME: dict[str, Field] = {f.name: f for f in GPU_FIELDS + HOST_FIELDS}


def gpu_fields(tier: Tier) -> tuple[Field, ...]:
    """The GPU fields sampled at one cadence tier."""
    return tuple(f for f in GPU_FIELDS if f.tier == tier)
