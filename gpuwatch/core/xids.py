"""Names for XID codes: NVIDIA's description of each and the action it calls for.

An XID is only a number on the wire ("NVML event 0x8 data 48" tells an operator nothing), so every place
that shows one to a person (agent events, alerts, the exporter's ``xid_description`` label, the demo) names
it from this one table. Descriptions and actions follow NVIDIA's Xid catalog ("Analyzing Xid Errors with the
Xid Catalog", resolution buckets RESTART_APP, RESET_GPU, RESTART_BM, CONTACT_SUPPORT, IGNORE) as grouped in
docs/background.md §2. The table is finite on purpose: a code it does not list is
"Unknown XID", so a label built from it stays bounded whatever a driver reports.
"""
from __future__ import annotations

from dataclasses import dataclass

RESTART_APP = "restart the application; the GPU is fine unless this repeats on it"
IGNORE = "none for this XID alone; read the XID that accompanies it"
WATCH = "none now; the GPU is degrading: plan a reset or replacement"
RESET_GPU = "drain the GPU and reset it (nvidia-smi -r or node reboot) before the next job"
RESET_WHEN_IDLE = "reset the GPU when it is idle to apply the pending repair"
REBOOT = "drain the node, reboot it and check power and seating if it repeats"
RMA = "drain the node, run field diagnostics (dcgmi diag -r 3) and RMA the GPU if they fail"
CHECK_LINK = "drain the node, reset the GPU and check the NVLink / NVSwitch path if it repeats"
UNKNOWN_ACTION = "look the code up in NVIDIA's Xid catalog for this driver"


@dataclass(frozen=True)
class XidInfo:
    code: int
    description: str
    action: str


_TABLE: dict[int, tuple[str, str]] = {
    8: ("GPU stopped processing (FIFO idle timeout)", RESTART_APP),
    13: ("Graphics engine exception", RESTART_APP),
    31: ("GPU memory page fault", RESTART_APP),
    32: ("Invalid or corrupted push buffer stream", RESTART_APP),
    38: ("Driver firmware error", RESET_GPU),
    39: ("Copy engine exception", RESTART_APP),
    40: ("Copy engine exception", RESTART_APP),
    41: ("Copy engine exception", RESTART_APP),
    43: ("GPU stopped processing (context killed)", IGNORE),
    45: ("Preemptive cleanup after a previous error", IGNORE),
    46: ("GPU stopped processing (GPU timeout)", RESET_GPU),
    48: ("Double bit ECC error (uncorrectable memory error)", RESET_GPU),
    56: ("Display engine error", RESTART_APP),
    57: ("Error programming video memory interface", RESET_GPU),
    61: ("Internal micro-controller breakpoint or warning", RESET_GPU),
    62: ("Internal micro-controller halt", RESET_GPU),
    63: ("ECC page retirement or row remapping recorded", RESET_WHEN_IDLE),
    64: ("ECC page retirement or row remapper recording failure", RMA),
    68: ("Video processor exception", RESTART_APP),
    69: ("Graphics engine class error", RESTART_APP),
    70: ("Copy engine error", RESTART_APP),
    71: ("Copy engine error", RESTART_APP),
    72: ("Copy engine error", RESTART_APP),
    73: ("Copy engine error", RESTART_APP),
    74: ("NVLink error", CHECK_LINK),
    75: ("Copy engine error", RESTART_APP),
    76: ("Copy engine error", RESTART_APP),
    77: ("Copy engine error", RESTART_APP),
    79: ("GPU has fallen off the bus", REBOOT),
    92: ("High single-bit ECC error rate", WATCH),
    93: ("Non-fatal violation of provisioned InfoROM wear limit", WATCH),
    94: ("Contained ECC error (the application using the memory was stopped)", RESET_WHEN_IDLE),
    95: ("Uncontained ECC error", RESET_GPU),
    109: ("Context switch timeout", RESET_GPU),
    119: ("GSP RPC timeout", RESET_GPU),
    120: ("GSP error", RESET_GPU),
    121: ("C2C link corrected error", WATCH),
    136: ("Link training failure", REBOOT),
    140: ("Unrecovered ECC error (ECC escape)", RESET_GPU),
    143: ("GPU initialization failure", REBOOT),
    144: ("NVLink error (NVLink5)", CHECK_LINK),
    145: ("NVLink error (NVLink5)", CHECK_LINK),
    146: ("NVLink error (NVLink5)", CHECK_LINK),
    147: ("NVLink error (NVLink5)", CHECK_LINK),
    148: ("NVLink error (NVLink5)", CHECK_LINK),
    149: ("NVLink error (NVLink5)", CHECK_LINK),
    150: ("NVLink error (NVLink5)", CHECK_LINK),
    154: ("GPU recovery action changed", RESET_GPU),
    156: ("Resource retirement event", WATCH),
    157: ("Resource retirement failure", RMA),
    158: ("GPU fatal timeout", RESET_GPU),
    162: ("Power smoothing wear warning", WATCH),
    163: ("Power smoothing wear warning", WATCH),
    164: ("Power smoothing: low remaining lifetime", WATCH),
    165: ("Power smoothing wear warning", WATCH),
    167: ("PCIe fatal error", REBOOT),
}
for _code in range(126, 136):
    _TABLE[_code] = ("Copy engine error", RESTART_APP)

#: One hit does not indict the GPU (application or sympathetic errors).
APPLICATION = frozenset({8, 13, 31, 32, 43, 45, 68, 69, 39, 40, 41, 70, 71, 72, 73, 75, 76, 77} | set(range(126, 136)))
#: The GPU is degrading: remaps recorded, excessive SBE, contained memory errors, wear.
PRECURSOR = frozenset({63, 92, 93, 94, 121, 156, 157, 162, 163, 164, 165})
#: Act now: the GPU (or its link) has failed; it stays failed until it is reset.
FATAL = frozenset({46, 48, 62, 64, 74, 79, 95, 109, 119, 120, 136, 140, 143, 154, 158, 167} | set(range(144, 151)))

UNKNOWN_DESCRIPTION = "Unknown XID"
#: Every description the table can give: the bounded value set of the ``xid_description`` label.
DESCRIPTIONS: frozenset[str] = frozenset(d for d, _ in _TABLE.values()) | {UNKNOWN_DESCRIPTION}


def describe(code: int) -> XidInfo:
    """NVIDIA's name and action for ``code``; an unlisted code is "Unknown XID"."""
    description, action = _TABLE.get(int(code), (UNKNOWN_DESCRIPTION, UNKNOWN_ACTION))
    return XidInfo(int(code), description, action)


def title(code: int) -> str:
    """'XID 48 (Double bit ECC error (uncorrectable memory error))' — how a person reads one XID."""
    return f"XID {int(code)} ({describe(code).description})"


def message(code: int, detail: str = "") -> str:
    """An event's text: the named XID, what to do, and the source's own detail when it has any."""
    info = describe(code)
    text = f"{title(code)}; action: {info.action}"
    return f"{text}; {detail}" if detail else text
