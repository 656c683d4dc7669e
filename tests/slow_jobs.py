"""Simulated jobs with a fail-slow injected, read as the collector reads them, without a collector: the
rank intervals and device evidence of :mod:`gpuwatch.collector.slow_evidence` straight from a SimulatedNode
sampled through the agent's own NVML sampler on a stepped simulated clock (tests and bench/why_slow.py).
No test here."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import pandas as pd

from gpuwatch.agent.nvml import NvmlSampler
from gpuwatch.collector.slow_evidence import GPU_COLUMNS, device_evidence, rank_intervals
from gpuwatch.simulator.clock import SimClock
from gpuwatch.simulator.fail_slow import FailSlowSpec
from gpuwatch.simulator.node import SimulatedNode

START_S = 1_800_000_000.0


class SteppedClock(SimClock):
    """Simulated time that moves only when told to."""

    def __init__(self, start: float) -> None:
        super().__init__(1.0, start, start)
        self.now = start

    def __call__(self) -> float:
        return self.now


def run_job(job: str, gpus: int, specs: Sequence[FailSlowSpec], *, seconds: float, window_s: float = 300.0,
            check_every_s: float = 30.0, sample_s: float = 1.0,
            ) -> Iterator[tuple[float, pd.DataFrame, pd.DataFrame, pd.DataFrame]]:
    """Every ``check_every_s`` simulated seconds: (seconds since start, the job's span rows, GPU sample rows
    and host sample rows of the last ``window_s``), sampling every ``sample_s``."""
    clock = SteppedClock(START_S)
    node = SimulatedNode(gpus, node=f"node-{job}", job=job, fail_slow=specs, job_straggler=False, clock=clock)
    spans: list[pd.DataFrame] = []
    gpu_rows: list[dict] = []
    host_rows: list[dict] = []
    with node:
        sampler = NvmlSampler(clock=clock)
        sampler.open()
        try:
            next_check = check_every_s
            t = 0.0
            while t < seconds:
                t += sample_s
                clock.now = START_S + t
                tick = sampler.sample()
                ts = pd.Timestamp(clock.now, unit="s")
                for index, values in tick.rows.items():
                    gpu_rows.append({"node": node.fleet.node, "gpu_index": index, "ts": ts, "job_id": job,
                                     "rank": index, **{c: values.get(c) for c in GPU_COLUMNS}})
                host_rows.append({"node": node.fleet.node, "ts": ts, **node.host.sample()})
                table = node.job.spans()
                spans.append(pd.DataFrame({f.name: list(getattr(table, f.name)) for f in table.DESCRIPTOR.fields}))
                if t >= next_check:
                    next_check += check_every_s
                    since = pd.Timestamp(clock.now - window_s, unit="s")
                    rows = pd.concat(spans, ignore_index=True)
                    rows = rows[rows["start_us"] >= (clock.now - window_s) * 1e6]
                    spans = [rows]
                    gpu = pd.DataFrame(gpu_rows)
                    gpu_rows = gpu[gpu["ts"] >= since].to_dict("records")
                    host = pd.DataFrame(host_rows)
                    host_rows = host[host["ts"] >= since].to_dict("records")
                    yield t, rows, pd.DataFrame(gpu_rows), pd.DataFrame(host_rows)
        finally:
            sampler.close()


def evidence(job: str, rows: pd.DataFrame, gpu: pd.DataFrame, host: pd.DataFrame, since_s: float | None = None):
    """(rank intervals, device evidence per rank) of a window, the device part cut at ``since_s`` (epoch s)."""
    since = pd.Timestamp(since_s, unit="s") if since_s is not None else None
    return rank_intervals(rows), device_evidence(gpu, host, job, since)
