"""Naming of communication: which kernels are communication, and the canonical collective type.

Every source spells collectives differently (`nccl:_all_gather_base`, `allgather_into_tensor_coalesced`,
`ncclDevKernel_AllGather_RING_LL`, `all_gather`); the engine matches instances across ranks by type, so
all of them are reduced here to one vocabulary.
"""
from __future__ import annotations

import re

# Name patterns of communication kernels: NCCL (old `ncclKernel_*`, new `ncclDevKernel_*`, any case),
# RCCL/HCCL, and the common custom all-reduce kernels that bypass NCCL.
_COMM_WORDS = ("nccl", "rccl", "hccl", "cross_device_reduce", "userbuffers")
_COMM_KERNEL = re.compile("|".join(_COMM_WORDS), re.IGNORECASE)

# (substring of the squashed lower-case name, canonical type), most specific first.
_TYPES = (
    ("alltoall", "all_to_all"),
    ("allgather", "all_gather"),
    ("reducescatter", "reduce_scatter"),
    ("allreduce", "all_reduce"),
    ("crossdevicereduce", "all_reduce"),
    ("broadcast", "broadcast"),
    ("barrier", "barrier"),
    ("sendrecv", "sendrecv"),
    ("isend", "send"),
    ("irecv", "recv"),
    ("send", "send"),
    ("recv", "recv"),
    ("reduce", "reduce"),
    ("gather", "gather"),
    ("scatter", "scatter"),
)

P2P_TYPES = frozenset({"send", "recv", "sendrecv"})


def is_comm_kernel(name: str) -> bool:
    """True for kernels of a collective library (by name; used when the kernel carries no collective args).
    An ASCII name (any kernel's) is lower-cased and searched with `in`: the same answer as the
    case-insensitive expression, ten times faster on long templated names."""
    if name.isascii():
        lowered = name.lower()
        return any(word in lowered for word in _COMM_WORDS)
    return _COMM_KERNEL.search(name) is not None


def canonical_type(name: str) -> str | None:
    """Canonical collective type of an op, arg or kernel name; None when the name names no collective.

    From a kernel name alone `SendRecv` stays "sendrecv" (p2p): only the enclosing op can say that NCCL
    ran an all-to-all with it."""
    squashed = re.sub(r"[^a-z]", "", name.lower().removeprefix("nccl:"))
    squashed = squashed.removeprefix("ncclkernel").removeprefix("nccldevkernel")
    for needle, canonical in _TYPES:
        if needle in squashed:
            return canonical
    return None

