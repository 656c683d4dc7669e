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
    """How often the agent samples a field (see ../shared/reference/nvml-and-dcgm.md, cadence plan)."""

    FAST = "fast"  # every tick (default 1 s)
    SLOW = "slow"  # every slow interval (default 30 s)
    GPM = "gpm"  # every tick, Hopper and newer only (NVML GPM)


class Kind(str, Enum):
    GAUGE = "gauge"
    COUNTER = "counter"  # monotonically non-decreasing while the driver is loaded


@dataclass(frozen=True)
class Field:
    name: str
    unit: str
    tier: Tier
    kind: Kind
    help: str


def _f(name: str, unit: str, tier: Tier, kind: Kind, help_text: str) -> Field:
    return Field(name, unit, tier, kind, help_text)


F, S, G = Tier.FAST, Tier.SLOW, Tier.GPM
GA, CO = Kind.GAUGE, Kind.COUNTER

GPU_FIELDS: tuple[Field, ...] = (
    # fast tier
    _f("gpu_utilization_ratio", "ratio", F, GA, "Share of the last sample period a kernel ran (NVML utilization.gpu)."),
    _f("gpu_memory_utilization_ratio", "ratio", F, GA, "Share of the period device memory was read or written."),
    _f("gpu_memory_used_bytes", "bytes", F, GA, "Framebuffer memory in use."),
    _f("gpu_memory_total_bytes", "bytes", F, GA, "Framebuffer memory in total."),
    _f("gpu_temperature_celsius", "celsius", F, GA, "GPU core temperature."),
    _f("gpu_memory_temperature_celsius", "celsius", F, GA, "HBM temperature (field 82)."),
    _f("gpu_power_watts", "watts", F, GA, "Power draw (1 s average on Ampere and newer)."),
    _f("gpu_power_limit_watts", "watts", F, GA, "Enforced power limit."),
    _f("gpu_energy_joules_total", "joules", F, CO, "Energy consumed since the driver loaded."),
    _f("gpu_sm_clock_hertz", "hertz", F, GA, "SM clock."),
    _f("gpu_memory_clock_hertz", "hertz", F, GA, "Memory clock."),
    _f("gpu_clock_event_reasons", "bitmask", F, GA, "Active clock-event (throttle) reasons, NVML bitmask."),
    _f("gpu_throttle_power_seconds_total", "seconds", F, CO, "Time clocks were held down by the power cap (field 74)."),
    _f("gpu_throttle_thermal_seconds_total", "seconds", F, CO, "Time clocks were held down thermally (field 75)."),
    _f("gpu_pcie_tx_bytes_total", "bytes", F, CO, "PCIe bytes sent (field 197)."),
    _f("gpu_pcie_rx_bytes_total", "bytes", F, CO, "PCIe bytes received (field 198)."),
    _f("gpu_nvlink_tx_bytes_total", "bytes", F, CO, "NVLink bytes sent, all links (field 138)."),
    _f("gpu_nvlink_rx_bytes_total", "bytes", F, CO, "NVLink bytes received, all links (field 139)."),
    # GPM (Hopper+)
    _f("gpu_sm_active_ratio", "ratio", G, GA, "Share of time at least one warp was resident on an SM (GPM SM_UTIL)."),
    _f("gpu_sm_occupancy_ratio", "ratio", G, GA, "Resident warps over the maximum (GPM SM_OCCUPANCY)."),
    _f("gpu_tensor_active_ratio", "ratio", G, GA, "Share of time any tensor pipe was active (GPM ANY_TENSOR_UTIL)."),
    _f("gpu_dram_bandwidth_utilization_ratio", "ratio", G, GA, "HBM bandwidth used over peak (GPM DRAM_BW_UTIL)."),
    _f("gpu_pcie_tx_bytes_per_second", "bytes_per_second", G, GA, "PCIe transmit throughput (GPM)."),
    _f("gpu_pcie_rx_bytes_per_second", "bytes_per_second", G, GA, "PCIe receive throughput (GPM)."),
    _f("gpu_nvlink_tx_bytes_per_second", "bytes_per_second", G, GA, "NVLink transmit throughput (GPM)."),
    _f("gpu_nvlink_rx_bytes_per_second", "bytes_per_second", G, GA, "NVLink receive throughput (GPM)."),
    # slow tier: reliability
    _f("gpu_ecc_sbe_volatile_total", "errors", S, CO, "Correctable ECC errors since the driver loaded (field 3)."),
    _f("gpu_ecc_dbe_volatile_total", "errors", S, CO, "Uncorrectable ECC errors since the driver loaded (field 4)."),
    _f("gpu_ecc_sbe_aggregate_total", "errors", S, CO, "Correctable ECC errors over the GPU's life (field 5)."),
    _f("gpu_ecc_dbe_aggregate_total", "errors", S, CO, "Uncorrectable ECC errors over the GPU's life (field 6)."),
    _f("gpu_retired_pages_sbe", "pages", S, GA, "Pages retired for correctable errors (pre-Ampere)."),
    _f("gpu_retired_pages_dbe", "pages", S, GA, "Pages retired for uncorrectable errors (pre-Ampere)."),
    _f("gpu_retired_pages_pending", "bool", S, GA, "1 when a page retirement waits for the next driver reload."),
    _f("gpu_remapped_rows_correctable", "rows", S, GA, "Rows remapped for correctable errors (Ampere+)."),
    _f("gpu_remapped_rows_uncorrectable", "rows", S, GA, "Rows remapped for uncorrectable errors (Ampere+)."),
    _f("gpu_remapped_rows_pending", "bool", S, GA, "1 when a row remap waits for a GPU reset."),
    _f("gpu_remapped_rows_failure", "bool", S, GA, "1 when a row remap failed (RMA path)."),
    _f("gpu_pcie_replay_total", "replays", S, CO, "PCIe replay counter (field 94)."),
    _f("gpu_pcie_link_gen", "generation", S, GA, "Current PCIe link generation."),
    _f("gpu_pcie_link_width", "lanes", S, GA, "Current PCIe link width."),
    _f("gpu_pcie_link_gen_max", "generation", S, GA, "Maximum PCIe link generation."),
    _f("gpu_pcie_link_width_max", "lanes", S, GA, "Maximum PCIe link width."),
    _f("gpu_nvlink_crc_flit_errors_total", "errors", S, CO, "NVLink CRC flit errors, all links (field 38)."),
    _f("gpu_nvlink_crc_data_errors_total", "errors", S, CO, "NVLink CRC data errors, all links (field 45)."),
    _f("gpu_nvlink_replay_errors_total", "errors", S, CO, "NVLink replay errors, all links (field 52)."),
    _f("gpu_nvlink_recovery_errors_total", "errors", S, CO, "NVLink recovery errors, all links (field 59)."),
)

HOST_FIELDS: tuple[Field, ...] = (
    _f("host_cpu_utilization_ratio", "ratio", F, GA, "Share of all CPUs busy since the last tick."),
    _f("host_load1", "tasks", F, GA, "One-minute load average."),
    _f("host_memory_used_bytes", "bytes", F, GA, "Host memory in use."),
    _f("host_memory_total_bytes", "bytes", F, GA, "Host memory in total."),
    _f("host_network_rx_bytes_total", "bytes", F, CO, "Bytes received on all interfaces."),
    _f("host_network_tx_bytes_total", "bytes", F, CO, "Bytes sent on all interfaces."),
    _f("host_disk_read_bytes_total", "bytes", F, CO, "Bytes read from all disks."),
    _f("host_disk_write_bytes_total", "bytes", F, CO, "Bytes written to all disks."),
)

GPU_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in GPU_FIELDS)
HOST_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in HOST_FIELDS)
BY_NAME: dict[str, Field] = {f.name: f for f in GPU_FIELDS + HOST_FIELDS}


def gpu_fields(tier: Tier) -> tuple[Field, ...]:
    """The GPU fields sampled at one cadence tier."""
    return tuple(f for f in GPU_FIELDS if f.tier == tier)
