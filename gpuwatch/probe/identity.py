"""Who is this process: job id, rank, world size and node, read from the launcher's environment.

torchrun sets TORCHELASTIC_RUN_ID / RANK / LOCAL_RANK / WORLD_SIZE; SLURM sets SLURM_JOB_ID / SLURM_PROCID /
SLURM_LOCALID / SLURM_NTASKS. When neither is set (mp.spawn), an initialised torch.distributed fills rank and
world size; it is only consulted when the job has already imported torch.
"""
from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from collections.abc import Mapping


@dataclass(frozen=True)
class ProbeIdentity:
    job_id: str
    rank: int
    local_rank: int
    world_size: int
    node: str


JOB_VARIABLES = ("GPUWATCH_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


def _job_value(env: Mapping[str, str], name: str) -> str:
    """A job id variable's value, "" when unset: torchrun without --rdzv-id sets TORCHELASTIC_RUN_ID=none,
    which names no job and must not merge every such run into one job "none"."""
    value = env.get(name, "").strip()
    return "" if value.lower() == "none" else value


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        value = env.get(name, "").strip()
        if value.lstrip("-").isdigit():
            return int(value)
    return None


def _distributed_rank_and_size() -> tuple[int | None, int | None]:
    """Rank and world size from torch.distributed, if the job imported it and initialised a group."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # a half-initialised group must not stop the probe from starting
        pass
    return None, None


def identity_from_environment(job: str | None = None, env: Mapping[str, str] | None = None) -> ProbeIdentity:
    """The probe's identity; `job` overrides the job id found in the environment."""
    env = os.environ if env is None else env
    job_id = job or next((v for name in JOB_VARIABLES if (v := _job_value(env, name))), "unknown")
    rank = _first_int(env, ("RANK", "SLURM_PROCID"))
    world_size = _first_int(env, ("WORLD_SIZE", "SLURM_NTASKS"))
    if rank is None or world_size is None:
        dist_rank, dist_size = _distributed_rank_and_size()
        rank = dist_rank if rank is None else rank
        world_size = dist_size if world_size is None else world_size
    local_rank = _first_int(env, ("LOCAL_RANK", "SLURM_LOCALID"))
    return ProbeIdentity(
        job_id=job_id,
        rank=0 if rank is None else rank,
        local_rank=0 if local_rank is None else local_rank,
        world_size=1 if world_size is None else world_size,
        node=env.get("GPUWATCH_NODE") or socket.gethostname(),
    )
