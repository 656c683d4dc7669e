"""dcgm-exporter's metric names, units and labels for gpuwatch's per-GPU values (``--metrics-names dcgm`` and
``dcgm-legacy``).

Sites that already run NVIDIA's dcgm-exporter have its Grafana dashboard (NVIDIA/dcgm-exporter
``grafana/dcgm-exporter-dashboard.json``) and alert rules written against ``DCGM_FI_*`` names. With these
namings an agent serves the same names, in dcgm-exporter's units, with the labels dcgm-exporter puts on every
GPU series (and ``hpc_job`` when a job owns the GPU, like its HPC job mapping; ``pod``, ``namespace``,
``container`` when a pod holds it). Two generations:

- ``dcgm-legacy`` (:data:`LEGACY`): the names up to dcgm-exporter 4.8 (DCGM_FI_DEV_GPU_UTIL in %, FB in MiB,
  clocks in MHz, energy in mJ; labels ``Hostname``, ``DCGM_FI_DRIVER_VERSION``), as gpuwatch served them.
- ``dcgm`` (:data:`DCGM_4_9`): dcgm-exporter 4.9, which renames the fields DCGM 4.7 deprecates to their DCGM
  names and moves the unit-bearing ones to base units (Hz, J, ratio, bytes), and labels ``hostname`` and
  ``DCGM_FI_SYSTEM_DRIVER_VERSION``. :data:`RENAMED_4_9` is that table; the sources are cited in
  docs/dcgm-compatibility.md.

``XID`` is, as there, a gauge holding the last XID, labelled ``err_code`` and ``err_msg`` (0 / "No Error" before
the first). Which DCGM field comes from which NVML call, and which have no equivalent, is in
docs/dcgm-compatibility.md; :data:`DCGM_FIELDS` is that table in code.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import Metric

from gpuwatch.core import xids

DCGM_LABELS: tuple[str, ...] = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname",
                                "DCGM_FI_DRIVER_VERSION")
MIB = float(2**20)


@dataclass(frozen=True)
class DcgmField:
    name: str            # dcgm-exporter's metric name
    kind: str            # "gauge" | "counter", as in dcgm-exporter's counters CSV
    source: str          # the gpuwatch.core.fields value it is computed from
    scale: float         # dcgm value = gpuwatch value * scale
    help: str


def _d(name: str, kind: str, source: str, scale: float, help_text: str) -> DcgmField:
    return DcgmField(name, kind, source, scale, help_text)


#: dcgm-exporter's default counters first (etc/default-counters.csv), then the ones it ships commented out.
DCGM_FIELDS: tuple[DcgmField, ...] = (
    _d("DCGM_FI_DEV_SM_CLOCK", "gauge", "gpu_sm_clock_hertz", 1e-6, "SM clock frequency (in MHz)."),
    _d("DCGM_FI_DEV_MEM_CLOCK", "gauge", "gpu_memory_clock_hertz", 1e-6, "Memory clock frequency (in MHz)."),
    _d("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "gpu_memory_temperature_celsius", 1.0, "Memory temperature (in C)."),
    _d("DCGM_FI_DEV_GPU_TEMP", "gauge", "gpu_temperature_celsius", 1.0, "GPU temperature (in C)."),
    _d("DCGM_FI_DEV_POWER_USAGE", "gauge", "gpu_power_watts", 1.0, "Power draw (in W)."),
    _d("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "gpu_energy_joules_total", 1e3,
       "Total energy consumption since boot (in mJ)."),
    _d("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "gpu_pcie_replay_total", 1.0, "Total number of PCIe retries."),
    _d("DCGM_FI_DEV_GPU_UTIL", "gauge", "gpu_utilization_ratio", 100.0, "GPU utilization (in %)."),
    _d("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "gpu_memory_utilization_ratio", 100.0, "Memory utilization (in %)."),
    _d("DCGM_FI_DEV_FB_USED", "gauge", "gpu_memory_used_bytes", 1 / MIB, "Framebuffer memory used (in MiB)."),
    _d("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter", "gpu_remapped_rows_uncorrectable", 1.0,
       "Number of remapped rows for uncorrectable errors"),
    _d("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter", "gpu_remapped_rows_correctable", 1.0,
       "Number of remapped rows for correctable errors"),
    _d("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "gpu_remapped_rows_failure", 1.0,
       "Whether remapping of rows has failed"),
    _d("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "gpu_utilization_ratio", 1.0,
       "Ratio of time the graphics engine is active (NVML utilization.gpu, not DCP)."),
    _d("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", "gpu_tensor_active_ratio", 1.0,
       "Ratio of cycles the tensor (HMMA) pipe is active."),
    _d("DCGM_FI_PROF_DRAM_ACTIVE", "gauge", "gpu_dram_bandwidth_utilization_ratio", 1.0,
       "Ratio of cycles the device memory interface is active sending or receiving data."),
    _d("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge", "gpu_pcie_tx_bytes_per_second", 1.0,
       "The rate of data transmitted over the PCIe bus, in bytes per second."),
    _d("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge", "gpu_pcie_rx_bytes_per_second", 1.0,
       "The rate of data received over the PCIe bus, in bytes per second."),
    # shipped commented out in dcgm-exporter's CSV; served because gpuwatch samples them anyway
    _d("DCGM_FI_DEV_FB_TOTAL", "gauge", "gpu_memory_total_bytes", 1 / MIB, "Framebuffer memory total (in MiB)."),
    _d("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "gauge", "gpu_power_limit_watts", 1.0, "Enforced power limit (in W)."),
    _d("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "gauge", "gpu_clock_event_reasons", 1.0,
       "Current clock event (throttle) reasons, NVML bitmask."),
    _d("DCGM_FI_DEV_POWER_VIOLATION", "counter", "gpu_throttle_power_seconds_total", 1e6,
       "Throttling duration due to power constraints (in us)."),
    _d("DCGM_FI_DEV_THERMAL_VIOLATION", "counter", "gpu_throttle_thermal_seconds_total", 1e6,
       "Throttling duration due to thermal constraints (in us)."),
    _d("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter", "gpu_ecc_sbe_volatile_total", 1.0,
       "Total number of single-bit volatile ECC errors."),
    _d("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "gpu_ecc_dbe_volatile_total", 1.0,
       "Total number of double-bit volatile ECC errors."),
    _d("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "counter", "gpu_ecc_sbe_aggregate_total", 1.0,
       "Total number of single-bit persistent ECC errors."),
    _d("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "counter", "gpu_ecc_dbe_aggregate_total", 1.0,
       "Total number of double-bit persistent ECC errors."),
    _d("DCGM_FI_DEV_RETIRED_SBE", "counter", "gpu_retired_pages_sbe", 1.0,
       "Total number of retired pages due to single-bit errors."),
    _d("DCGM_FI_DEV_RETIRED_DBE", "counter", "gpu_retired_pages_dbe", 1.0,
       "Total number of retired pages due to double-bit errors."),
    _d("DCGM_FI_DEV_RETIRED_PENDING", "counter", "gpu_retired_pages_pending", 1.0,
       "Total number of pages pending retirement."),
    _d("DCGM_FI_DEV_ROW_REMAP_PENDING", "gauge", "gpu_remapped_rows_pending", 1.0, "Whether a row remap is pending."),
    _d("DCGM_FI_DEV_PCIE_LINK_GEN", "gauge", "gpu_pcie_link_gen", 1.0, "PCIe current link generation."),
    _d("DCGM_FI_DEV_PCIE_LINK_WIDTH", "gauge", "gpu_pcie_link_width", 1.0, "PCIe current link width."),
    _d("DCGM_FI_DEV_PCIE_MAX_LINK_GEN", "gauge", "gpu_pcie_link_gen_max", 1.0, "PCIe maximum link generation."),
    _d("DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH", "gauge", "gpu_pcie_link_width_max", 1.0, "PCIe maximum link width."),
    _d("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "counter", "gpu_nvlink_crc_flit_errors_total", 1.0,
       "Total number of NVLink flow-control CRC errors."),
    _d("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", "counter", "gpu_nvlink_crc_data_errors_total", 1.0,
       "Total number of NVLink data CRC errors."),
    _d("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "counter", "gpu_nvlink_replay_errors_total", 1.0,
       "Total number of NVLink retries."),
    _d("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "counter", "gpu_nvlink_recovery_errors_total", 1.0,
       "Total number of NVLink recovery errors."),
    _d("DCGM_FI_PROF_SM_ACTIVE", "gauge", "gpu_sm_active_ratio", 1.0,
       "The ratio of cycles an SM has at least 1 warp assigned."),
    _d("DCGM_FI_PROF_SM_OCCUPANCY", "gauge", "gpu_sm_occupancy_ratio", 1.0,
       "The ratio of number of warps resident on an SM."),
    _d("DCGM_FI_PROF_NVLINK_TX_BYTES", "gauge", "gpu_nvlink_tx_bytes_per_second", 1.0,
       "The rate of data transmitted over NVLink, in bytes per second."),
    _d("DCGM_FI_PROF_NVLINK_RX_BYTES", "gauge", "gpu_nvlink_rx_bytes_per_second", 1.0,
       "The rate of data received over NVLink, in bytes per second."),
)
XID_ERRORS = "DCGM_FI_DEV_XID_ERRORS"
FB_FREE = "DCGM_FI_DEV_FB_FREE"

#: dcgm-exporter 4.9 (DCGM 4.7): legacy name -> (new name, new scale from the gpuwatch value or None: unit
#: unchanged, new help). The new names are DCGM's own for the deprecated ones (dcgm_fields.h's deprecated block,
#: go-dcgm's base-unit fields); the unit changes are the eleven 4.9's release notes list.
RENAMED_4_9: dict[str, tuple[str, float | None, str]] = {
    "DCGM_FI_DEV_SM_CLOCK": ("DCGM_FI_DEV_SM_CLOCK_HERTZ", 1.0, "SM clock frequency (in Hz)."),
    "DCGM_FI_DEV_MEM_CLOCK": ("DCGM_FI_DEV_MEMORY_CLOCK_HERTZ", 1.0, "Memory clock frequency (in Hz)."),
    "DCGM_FI_DEV_MEMORY_TEMP": ("DCGM_FI_DEV_MEMORY_TEMP_CELSIUS", None, "Memory temperature (in C)."),
    "DCGM_FI_DEV_GPU_TEMP": ("DCGM_FI_DEV_GPU_TEMP_CELSIUS", None, "GPU temperature (in C)."),
    "DCGM_FI_DEV_POWER_USAGE": ("DCGM_FI_DEV_BOARD_POWER_WATTS", None, "Power draw (in W)."),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": ("DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL", 1.0,
                                             "Total energy consumption since boot (in J)."),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("DCGM_FI_DEV_PCIE_REPLAY_TOTAL", None, "Total number of PCIe retries."),
    "DCGM_FI_DEV_GPU_UTIL": ("DCGM_FI_DEV_GPU_UTIL_RATIO", 1.0, "GPU utilization (ratio, 0 to 1)."),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("DCGM_FI_DEV_MEMORY_UTIL_RATIO", 1.0, "Memory utilization (ratio, 0 to 1)."),
    "DCGM_FI_DEV_FB_USED": ("DCGM_FI_DEV_FB_USED_BYTES", 1.0, "Framebuffer memory used (in bytes)."),
    "DCGM_FI_DEV_FB_TOTAL": ("DCGM_FI_DEV_FB_CAPACITY_BYTES", 1.0, "Framebuffer memory capacity (in bytes)."),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": ("DCGM_FI_DEV_ROW_REMAP_UNCORRECTABLE_TOTAL", None,
                                                "Number of remapped rows for uncorrectable errors"),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": ("DCGM_FI_DEV_ROW_REMAP_CORRECTABLE_TOTAL", None,
                                              "Number of remapped rows for correctable errors"),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": ("DCGM_FI_DEV_ROW_REMAP_FAILED", None, "Whether remapping of rows has failed"),
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": ("DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO", None,
                                      "Ratio of time the graphics engine is active (NVML utilization.gpu, not DCP)."),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": ("DCGM_FI_PROF_TENSOR_UTIL_RATIO", None,
                                        "Ratio of cycles the tensor (HMMA) pipe is active."),
    "DCGM_FI_PROF_DRAM_ACTIVE": ("DCGM_FI_PROF_DRAM_UTIL_RATIO", None,
                                 "Ratio of cycles the device memory interface is active sending or receiving data."),
    "DCGM_FI_PROF_SM_ACTIVE": ("DCGM_FI_PROF_SM_UTIL_RATIO", None,
                               "The ratio of cycles an SM has at least 1 warp assigned."),
    "DCGM_FI_PROF_SM_OCCUPANCY": ("DCGM_FI_PROF_SM_OCCUPANCY_RATIO", None,
                                  "The ratio of number of warps resident on an SM."),
    "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": ("DCGM_FI_DEV_BOARD_POWER_LIMIT_ENFORCED_WATTS", None,
                                         "Enforced power limit (in W)."),
    "DCGM_FI_DEV_RETIRED_SBE": ("DCGM_FI_DEV_PAGE_RETIRED_SBE_TOTAL", None,
                                "Total number of retired pages due to single-bit errors."),
    "DCGM_FI_DEV_RETIRED_DBE": ("DCGM_FI_DEV_PAGE_RETIRED_DBE_TOTAL", None,
                                "Total number of retired pages due to double-bit errors."),
    "DCGM_FI_DEV_RETIRED_PENDING": ("DCGM_FI_DEV_PAGE_RETIRED_PENDING", None,
                                    "Total number of pages pending retirement."),
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_TOTAL", None,
                                                      "Total number of NVLink flow-control CRC errors."),
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": ("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_TOTAL", None,
                                                      "Total number of NVLink data CRC errors."),
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": ("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_TOTAL", None,
                                                    "Total number of NVLink retries."),
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": ("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_TOTAL", None,
                                                      "Total number of NVLink recovery errors."),
    XID_ERRORS: ("DCGM_FI_DEV_XID_ERROR", None, "Value of the last XID error encountered."),
    FB_FREE: ("DCGM_FI_DEV_FB_FREE_BYTES", 1.0, "Framebuffer memory free (in bytes)."),
}


@dataclass(frozen=True)
class DcgmNaming:
    """One generation of dcgm-exporter's names: its fields, the last-XID and free-memory gauges (computed, not
    sampled: free = total - used, scaled by ``fb_free_scale`` from bytes) and its identity labels."""

    fields: tuple[DcgmField, ...]
    xid: DcgmField
    fb_free: DcgmField
    labels: tuple[str, ...]

    def metrics(self) -> dict[str, str]:
        """Every name this naming serves, with its type."""
        return {**{f.name: f.kind for f in self.fields}, self.xid.name: "gauge", self.fb_free.name: "gauge"}


def _renamed(f: DcgmField) -> DcgmField:
    if f.name not in RENAMED_4_9:
        return f
    name, scale, help_text = RENAMED_4_9[f.name]
    return DcgmField(name, f.kind, f.source, f.scale if scale is None else scale, help_text)


_XID = _d(XID_ERRORS, "gauge", "", 1.0, "Value of the last XID error encountered.")
_FB_FREE = _d(FB_FREE, "gauge", "", 1 / MIB, "Framebuffer memory free (in MiB).")
LEGACY = DcgmNaming(DCGM_FIELDS, _XID, _FB_FREE, DCGM_LABELS)
DCGM_4_9 = DcgmNaming(tuple(map(_renamed, DCGM_FIELDS)), _renamed(_XID), _renamed(_FB_FREE),
                      ("gpu", "UUID", "pci_bus_id", "device", "modelName", "hostname", "DCGM_FI_SYSTEM_DRIVER_VERSION"))
#: --metrics-names value -> naming.
NAMINGS: dict[str, DcgmNaming] = {"dcgm": DCGM_4_9, "dcgm-legacy": LEGACY}


def dcgm_labels(gpu: Mapping[str, Any], naming: DcgmNaming = LEGACY) -> dict[str, str]:
    """dcgm-exporter's identity labels of one GPU snapshot (plus ``hpc_job`` when a job owns the GPU, and
    ``pod``, ``namespace``, ``container`` when a Kubernetes pod holds it)."""
    labels = dict(zip(naming.labels, (str(gpu["gpu"]), gpu.get("gpu_uuid", ""), gpu.get("pci_bus_id", ""),
                                      f"nvidia{gpu['gpu']}", gpu.get("model", ""), gpu["node"],
                                      gpu.get("driver_version", ""))))
    if gpu.get("job_id"):
        labels["hpc_job"] = gpu["job_id"]
    if gpu.get("pod"):  # dcgm-exporter's Kubernetes mode: on the series of a GPU a pod holds
        labels.update(pod=gpu["pod"], namespace=gpu.get("namespace", ""), container=gpu.get("container", ""))
    return labels


def dcgm_families(gpus: Sequence[Mapping[str, Any]], naming: DcgmNaming = LEGACY) -> list[Metric]:
    """The DCGM-named families of every GPU snapshot (``GpuSnapshot`` of gpuwatch.core.metrics_snapshot).

    Built as plain :class:`Metric` objects: a GPU with a job carries one label more than one without.
    """
    # prometheus_client writes a counter's TYPE line as NAME_total, which would not match dcgm-exporter's bare
    # counter names; they go out typed gauge (PromQL's rate() and increase() do not read the type).
    xid, fb_free = naming.xid, naming.fb_free
    families = {f.name: Metric(f.name, f.help, "gauge") for f in (*naming.fields, fb_free, xid)}
    for gpu in gpus:
        labels, values = dcgm_labels(gpu, naming), gpu.get("values", {})
        for f in naming.fields:
            value = values.get(f.source)
            if value is not None and value == value:  # NaN: not sampled
                families[f.name].add_sample(f.name, labels, float(value) * f.scale)
        used, total = values.get("gpu_memory_used_bytes"), values.get("gpu_memory_total_bytes")
        if used is not None and total is not None:
            families[fb_free.name].add_sample(fb_free.name, labels, max(0.0, total - used) * fb_free.scale)
        last = int(gpu.get("last_xid") or 0)
        err = {"err_code": str(last), "err_msg": xids.describe(last).description if last else "No Error"}
        families[xid.name].add_sample(xid.name, {**labels, **err}, float(last))
    return [family for family in families.values() if family.samples]
