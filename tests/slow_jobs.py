"""Simulated jobs with a fail-slow injected, sampled through the agent's own NVML sampler on a stepped
simulated clock (tests and bench/why_slow.py): every check, the window of span rows, GPU and host samples
as :mod:`gpuwatch.collector.slow_evidence` reads them, and, given a store, the same rows written to it as an
agent's batches. No test here."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import json
from pathlib import Path

import pandas as pd

from gpuwatch.agent.nccl_inspector import InspectorReader
from gpuwatch.agent.nvml import NvmlSampler
from gpuwatch.collector.slow_evidence import GPU_COLUMNS, device_evidence, rank_intervals
from gpuwatch.core.batches import BatchBuilder
from gpuwatch.simulator.clock import SimClock
from gpuwatch.simulator.fail_slow import FailSlowSpec
from gpuwatch.simulator.node import SimulatedNode
from gpuwatch.v1 import telemetry_pb2 as pb

START_S = 1_800_000_000.0


class SteppedClock(SimClock):
    """Simulated time that moves only when told to."""

    def __init__(self, start: float) -> None:
        super().__init__(1.0, start, start)
        self.now = start

    def __call__(self) -> float:
        return self.now


@dataclass
class Check:
    """One check: ``t`` simulated seconds after the start, the job's window of rows."""

    t: float
    now_s: float
    spans: pd.DataFrame
    gpu: pd.DataFrame
    host: pd.DataFrame

    def evidence(self, job: str) -> tuple[pd.DataFrame, Any]:
        """(rank intervals, device evidence per rank since an onset in epoch us)."""
        return (rank_intervals(self.spans),
                lambda since_us: device_evidence(self.gpu, self.host, job, since_us / 1e6))


def run_job(job: str, gpus: int, specs: Sequence[FailSlowSpec], *, seconds: float, window_s: float = 300.0,
            check_every_s: float = 30.0, store: Any = None, node_name: str | None = None,
            jitter: float = 0.02, inspector_dir: Path | None = None) -> Iterator[Check]:
    """Run ``job`` on ``gpus`` simulated GPUs (rank r on GPU r) with ``specs`` for ``seconds``, sampling every
    simulated second; every ``check_every_s`` yield a :class:`Check` (having written the rows since the last
    one to ``store`` as one batch, when given). With ``inspector_dir`` the job's collectives reach the spans
    only as NCCL inspector dump files written there and read back by the agent's reader (no probe)."""
    clock = SteppedClock(START_S)
    node = SimulatedNode(gpus, node=node_name or f"node-{job}", job=job, fail_slow=specs, job_straggler=False,
                         job_jitter=jitter, clock=clock)
    spans: list[pd.DataFrame] = []
    gpu_rows: list[dict] = []
    host_rows: list[dict] = []
    with node:
        sampler = NvmlSampler(clock=clock)
        devices = sampler.open()
        builder = BatchBuilder(pb.NodeIdentity(node=node.fleet.node), f"agent-{job}", [d.info() for d in devices])
        reader = InspectorReader(inspector_dir, node.environ) if inspector_dir is not None else None
        try:
            next_check, t, seq = check_every_s, 0.0, 0
            while t < seconds:
                t += 1.0
                clock.now = START_S + t
                tick = sampler.sample()
                ts_ms = int(clock.now * 1000)
                for index, values in tick.rows.items():
                    gpu_rows.append({"node": node.fleet.node, "gpu_index": index, "ts": pd.Timestamp(ts_ms, unit="ms"),
                                     "job_id": job, "rank": index, **{c: values.get(c) for c in GPU_COLUMNS}})
                    builder.add_gpu_row(index, ts_ms, values, job, index, index)
                host = node.host.sample()
                host_rows.append({"node": node.fleet.node, "ts": pd.Timestamp(ts_ms, unit="ms"), **host})
                builder.add_host_row(ts_ms, host)
                table = node.job.spans()
                if reader is not None:
                    pids = {g.index: g.processes[0].pid for g in node.fleet.gpus}
                    write_inspector_records(inspector_dir, table, pids)
                    table = reader.drain()
                    del table.node[:]  # the agent names the node
                    table.node.extend([node.fleet.node] * len(table.start_us))
                builder.add_spans(table)
                spans.append(pd.DataFrame({f.name: list(getattr(table, f.name)) for f in table.DESCRIPTOR.fields}))
                if t < next_check:
                    continue
                next_check += check_every_s
                if store is not None:
                    seq += 1
                    store.write(builder.build(seq))
                since_s = clock.now - window_s
                rows = pd.concat(spans, ignore_index=True)
                spans = [rows[rows["start_us"] >= since_s * 1e6]]
                gpu_rows = [r for r in gpu_rows if r["ts"] >= pd.Timestamp(since_s - 60, unit="s")]
                host_rows = [r for r in host_rows if r["ts"] >= pd.Timestamp(since_s, unit="s")]
                yield Check(t, clock.now, spans[0], pd.DataFrame(gpu_rows), pd.DataFrame(host_rows))
        finally:
            sampler.close()


def write_inspector_records(directory: Path, table: pb.SpanTable, pids: dict[int, int],
                            verbose: bool = True) -> None:
    """Append the table's collectives to ``<directory>/<host>-pid<pid>.log`` of each rank's process, one JSON
    object per line as NCCL's inspector plugin writes them (v4.0 format; with ``event_trace_ts`` if verbose)."""
    for i, kind in enumerate(table.kind):
        if kind != "collective":
            continue
        rank, start, dur = table.rank[i], table.start_us[i], table.dur_us[i]
        perf: dict[str, Any] = {"coll": "AllReduce", "coll_sn": table.seq[i], "coll_msg_size_bytes": table.bytes[i],
                                "coll_exec_time_us": round(dur), "coll_timing_source": "kernel_gpu",
                                "coll_algobw_gbs": 100.0, "coll_busbw_gbs": 175.0}
        if verbose:
            perf["event_trace_sn"] = {"coll_start_sn": 1, "coll_stop_sn": 2, "kernel_events": [
                {"channel_id": 0, "kernel_start_sn": 3, "kernel_stop_sn": 4, "kernel_record_sn": 4}]}
            perf["event_trace_ts"] = {"coll_start_ts": round(start) - 5, "coll_stop_ts": round(start) - 2,
                                      "kernel_events": [{"channel_id": 0, "kernel_start_ts": round(start),
                                                         "kernel_stop_ts": round(start + dur),
                                                         "kernel_record_ts": round(start + dur)}]}
        record = {"header": {"id": "0x7f8c496ae9f661", "comm_name": "world", "rank": rank,
                             "n_ranks": table.world_size[i], "nnodes": 1},
                  "metadata": {"inspector_output_format_version": "v4.0", "git_rev": "",
                               "rec_mechanism": "nccl_profiler_interface",
                               "dump_timestamp_us": round(start + dur) + 300, "hostname": "sim-host",
                               "pid": pids[rank]},
                  "coll_perf": perf}
        with (directory / f"sim-host-pid{pids[rank]}.log").open("a") as f:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
