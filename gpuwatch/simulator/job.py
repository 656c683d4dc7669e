"""A synthetic training job for simulated nodes: probe-style span rows on the simulated clock.

The demo's fleet has no real training process, so without this its recordings hold no spans and nothing can
be broken down. ``SimJob`` stands in for one: the node's ranks run steps of compute chunks, each followed by
an ``all_reduce`` of the default process group; one rank computes slower, so its peers wait for it in every
collective (the engine's comm_wait). How much slower drifts over simulated hours (a straggler that comes and
goes, as a noisy neighbour or a throttling GPU makes one), with a phase of its own per job, so a live view
shows each job's breakdown moving rather than one constant share. The rows are deterministic for a job id
and step, and come out as a ``SpanTable`` exactly like :meth:`ProbeListener.drain` output. Synthetic: no
timing here is measured.
"""
from __future__ import annotations

import math
import random
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpuwatch.v1 import telemetry_pb2 as pb

if TYPE_CHECKING:
    from gpuwatch.simulator.fail_slow import SlowRanks

COLLECTIVES_PER_STEP = 3
BUCKET_BYTES = 256 * 2**20  # gradient bucket per all_reduce
SLOW_FACTOR = 1.5  # the slow rank's mean compute time relative to its peers
SLOW_SWING = 0.4  # ... which swings by this much either way
SLOW_PERIOD_S = 3 * 3600.0  # over this many simulated seconds
COMPUTE_SHARE = 0.8  # a normal rank's compute share of the step time
TRANSFER_SHARE = 0.03  # each collective's transfer, as a share of the step time


class SimJob:
    """``ranks`` ranks of job ``job_id`` on ``node``, one step every ~``step_s`` simulated seconds."""

    def __init__(self, job_id: str, node: str, clock: Callable[[], float], *, ranks: int = 8,
                 step_s: float = 1.0, slow_rank: int | None = None, straggler: bool = True,
                 jitter: float = 0.0, slow: SlowRanks | None = None) -> None:
        """``straggler`` False: no built-in slow rank; ``jitter``: each compute chunk's relative noise (a
        real job's); ``slow``: injected fail-slow ranks (:mod:`gpuwatch.simulator.fail_slow`)."""
        if ranks < 1 or not step_s > 0:
            raise ValueError("a simulated job needs ranks >= 1 and step_s > 0")
        self.job_id, self.node, self.clock, self.ranks = job_id, node, clock, ranks
        self.slow_rank = (ranks - 1 if slow_rank is None else slow_rank) if straggler else -1
        self.jitter, self.slow = jitter, slow
        self._rng = random.Random(f"{job_id}/jitter")
        self.compute_s = step_s * COMPUTE_SHARE / COLLECTIVES_PER_STEP  # per chunk, normal ranks
        self.transfer_s = step_s * TRANSFER_SHARE
        self.step = 0
        self.seq = 0
        self._step_start = clock()  # every rank starts its steps together (the last collective syncs them)
        self._phase = (zlib.crc32(job_id.encode()) % 1000) / 1000 * 2 * math.pi

    def slow_factor(self, t_s: float) -> float:
        """The slow rank's compute time relative to its peers at simulated time ``t_s``."""
        return SLOW_FACTOR + SLOW_SWING * math.sin(2 * math.pi * t_s / SLOW_PERIOD_S + self._phase)

    def spans(self) -> pb.SpanTable:
        """Rows of every step finished on the simulated clock since the last call."""
        rows: dict[str, list] = {f.name: [] for f in pb.SpanTable.DESCRIPTOR.fields}
        now = self.clock()
        while True:  # a step is sent once it has ended; one that is still running is drawn again next call
            seq, rng_state = self.seq, self._rng.getstate()
            step_rows: dict[str, list] = {name: [] for name in rows}
            end = self._run_step(step_rows)
            if end > now:
                self.seq = seq
                self._rng.setstate(rng_state)
                return pb.SpanTable(**rows)
            for name, values in step_rows.items():
                rows[name].extend(values)
            self._step_start = end
            self.step += 1

    def _run_step(self, rows: dict[str, list]) -> float:
        """Append one step's rows (from ``self._step_start``); returns when the step ends."""
        ready = [self._step_start] * self.ranks
        done = self._step_start
        slow = self.slow_factor(self._step_start)
        t = self._step_start
        for _ in range(COLLECTIVES_PER_STEP):
            for rank in range(self.ranks):
                if self.slow is not None:  # the injected host stall and copies come before the rank's compute
                    ready[rank] += self.slow.stall_s(rank, t, self.compute_s)
                    copy = self.slow.copy_s(rank, t, self.compute_s)
                    if copy > 0:
                        self._row(rows, rank, "memcpy", "h2d_input", ready[rank], copy)
                        ready[rank] += copy
                compute = self.compute_s * (slow if rank == self.slow_rank else 1.0)
                if self.slow is not None:
                    compute *= self.slow.compute_factor(rank, t)
                if self.jitter:
                    compute *= max(0.5, 1.0 + self._rng.gauss(0.0, self.jitter))
                self._row(rows, rank, "compute", "forward_backward", ready[rank], compute)
                ready[rank] += compute
            transfer = self.transfer_s + (self.slow.transfer_extra_s(t, self.compute_s) if self.slow else 0.0)
            done = max(ready) + transfer  # nobody finishes before the last rank arrived
            for rank in range(self.ranks):
                self._row(rows, rank, "collective", "all_reduce", ready[rank], done - ready[rank],
                          group="0", seq=self.seq, nbytes=BUCKET_BYTES)
                ready[rank] = done
            self.seq += 1
        for rank in range(self.ranks):
            self._row(rows, rank, "step", "step", self._step_start, done - self._step_start)
        return done

    def _row(self, rows: dict[str, list], rank: int, kind: str, name: str, start_s: float, dur_s: float, *,
             group: str = "", seq: int = -1, nbytes: int = -1) -> None:
        values = {"job_id": self.job_id, "rank": rank, "step": self.step, "kind": kind, "name": name,
                  "start_us": start_s * 1e6, "dur_us": dur_s * 1e6, "process_group": group, "seq": seq,
                  "bytes": nbytes, "world_size": self.ranks, "node": self.node, "peer": -1}
        for column, value in values.items():
            rows[column].append(value)
