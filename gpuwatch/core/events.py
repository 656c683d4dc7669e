"""Event kinds (the wire contract of gpuwatch.v1.Event.kind) and the record that carries one in the agent.

The agent emits these kinds; the collector, alert rules and models match on them, so they live in one place
that both sides import. The agent's samplers and threads produce :class:`Event` records; the daemon copies
them into the next batch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

AGENT_START = "agent_start"
AGENT_STOP = "agent_stop"
XID = "xid"  # code = XID number
GPU_LOST = "gpu_lost"
FIELD_UNSUPPORTED = "field_unsupported"  # attrs["field"] = NVML call or field id, reported once per GPU
SPOOL_DROPPED = "spool_dropped"  # code = batches dropped, attrs["bytes"]
ECC_DBE = "ecc_dbe"
ECC_SBE = "ecc_sbe"
GPU_OWNER = "gpu_owner"  # the GPU's owner changed: attrs namespace, pod, container, job_id, rank, user, uuid, mig
#: Agents send every GPU's owner again this often although unchanged, so readers need look back only this far
#: (twice, for margin) to find who holds a GPU at a time, and an owner outlives the store's event retention.
GPU_OWNER_REANNOUNCE_S = 3600.0
GPU_PROCESSES = "gpu_processes"  # per slow tick, a GPU's compute processes rolled up per owner: attrs["owners"]
#                  = JSON list of {namespace, pod, container, job_id, user, sm_util, mem_util, memory_bytes, processes}
MIG_INSTANCES = "mig_instances"  # per slow tick, a MIG-mode GPU's instances: attrs["instances"] = JSON list of
#                  {uuid, gpu_instance_id, namespace, pod, container, memory_used_bytes, memory_total_bytes,
#                   sm_active, sm_occupancy, tensor_active, dram_active} (ratios of the instance's own slice)
NVML_EVENT = "nvml_event"  # any other NVML event type, attrs["event_type"]
FAULT = "fault"  # one fault of an operator's fault log (gpuwatch import --format faults); code = XID or 0,
#                  message = the log's description, attrs["kind"], ["gpu"], ["class"], ["end_ms"] (repair end)

#: What each kind means to a person reading a count of them (the demo's summary, `gpuwatch events`).
MEANINGS: dict[str, str] = {
    AGENT_START: "an agent started (after a reset or reboot it clears a GPU's failed state)",
    AGENT_STOP: "an agent stopped cleanly",
    XID: "driver error reports, each named from NVIDIA's XID catalog (gpuwatch events --kind xid)",
    GPU_LOST: "a GPU stopped answering NVML (fell off the bus)",
    FIELD_UNSUPPORTED: "NVML readings this GPU model does not offer, reported once per GPU and reading: normal",
    SPOOL_DROPPED: "batches an agent dropped because the collector was unreachable and its spool was full",
    ECC_DBE: "uncorrectable memory errors reported as events",
    ECC_SBE: "correctable memory errors reported as events",
    NVML_EVENT: "other NVML events (clock changes, power events)",
    GPU_PROCESSES: "per-owner process use of a GPU (per-process utilisation and memory, for gpuwatch usage)",
    MIG_INSTANCES: "MIG instances' memory and activity with the pods holding them (for gpuwatch usage)",
    FAULT: "faults from an imported fault log (gpuwatch import --format faults; gpuwatch fleet counts them)",
}


@dataclass(frozen=True)
class Event:
    kind: str
    ts_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    gpu_index: int = -1
    code: int = 0
    message: str = ""
    attrs: dict[str, str] = field(default_factory=dict)
