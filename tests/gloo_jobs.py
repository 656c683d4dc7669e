"""Real multi-process torch.distributed (gloo, CPU) jobs with the probe on, for the probe and jobs tests (no
tests here): starting and finishing a rank, running a job under a real ProbeListener, a 2-stage pipeline.

Worker functions live in a module, not a test file, because torch.multiprocessing pickles them by name."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gpuwatch.probe
from gpuwatch.agent.probe_socket import ProbeListener
from helpers import SPAN_FIELDS, free_port, poll

PIPELINE_STEPS = 4


def init_rank(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def finish_rank(probe, out_dir: str, rank: int, extra: dict | None = None) -> None:
    """Close the probe, leave its stats (and ``extra``) in ``out_dir``/rank<N>.json for the test, leave the group."""
    probe.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"stats": probe.stats(), **(extra or {})}, f)
    dist.destroy_process_group()


def run_job(worker, world: int, tmp_path: Path) -> tuple[dict, list[dict]]:
    """Run ``worker(rank, world, port, probe_socket, out_dir)`` on ``world`` processes; return each rank's
    result file and every span row the listener received (until each rank's "end" row arrived)."""
    sock = str(tmp_path / "probe.sock")
    listener = ProbeListener(sock)
    rows: list[dict] = []

    def every_rank_ended() -> bool:
        table = listener.drain()
        rows.extend(dict(zip(SPAN_FIELDS, values)) for values in zip(*(getattr(table, f) for f in SPAN_FIELDS)))
        return sum(r["kind"] == "end" for r in rows) == world

    try:
        mp.spawn(worker, args=(world, free_port(), sock, str(tmp_path)), nprocs=world)
        poll(every_rank_ended, 10, "every rank's end row", every=0.02)
        assert listener.malformed == 0
    finally:
        listener.close()
    results = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)}
    return results, rows


def pipeline_worker(rank: int, world: int, port: int, sock: str, out_dir: str) -> None:
    """A 2-stage pipeline: per step blocking and async send/recv plus a batch_isend_irecv; rank 1 arrives
    1 s late at the final barrier, so rank 0 reports its barrier as still running."""
    init_rank(rank, world, port)
    probe = gpuwatch.probe.start(job="job-pipe", endpoint=sock, stall_report_s=0.3)
    other = 1 - rank
    for _ in range(PIPELINE_STEPS):
        activation = torch.ones(32)                                            # 128 B
        if rank == 0:
            dist.send(activation, 1)
            dist.recv(torch.zeros(32))                                         # any source
            dist.irecv(torch.zeros(32), src=1).wait()                          # no future on gloo: timed wait
        else:
            dist.recv(activation, 0)
            dist.send(activation, 0)
            dist.isend(activation, dst=0).wait()
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(8), other),
                                        dist.P2POp(dist.irecv, torch.zeros(8), other)])
        for work in works:
            work.wait()
        probe.step()
    if rank == 1:
        time.sleep(1.0)  # arrive late at the barrier: rank 0 reports its barrier as still running
    dist.barrier()
    finish_rank(probe, out_dir, rank)


LOADER_STEPS, LOADER_ONSET, LOADER_SLOW_RANK = 30, 20, 1
LOADER_DELAY_S = 1.0  # far above what a loaded test machine's scheduling adds to a step (tens of ms)


def slow_loader_worker(rank: int, world: int, port: int, sock: str, out_dir: str) -> None:
    """Data-parallel steps (a small matmul, an all_reduce); from step LOADER_ONSET on, rank LOADER_SLOW_RANK's
    data loader takes LOADER_DELAY_S more per batch, so its peers wait for it in every all_reduce."""
    init_rank(rank, world, port)
    probe = gpuwatch.probe.start(job="dp-loader", endpoint=sock)
    weights = torch.ones(64, 64)
    for step in range(LOADER_STEPS):
        time.sleep(0.01 + (LOADER_DELAY_S if rank == LOADER_SLOW_RANK and step >= LOADER_ONSET else 0.0))  # batch
        grads = weights @ torch.ones(64, 64)
        dist.all_reduce(grads)
        probe.step()
    finish_rank(probe, out_dir, rank)
