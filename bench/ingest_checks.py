"""What the hardening checks cost per batch, measured side by side in one run.

Ingest: parsing a batch alone, against the collector's decode_batch (parse, bounds and time-window
validation, ±inf to missing). Spool: framing a record (CRC32C) and checking it on read, against the durable
write (write + fsync) every spooled batch costs anyway. Batches are the agent's usual shape (8 GPUs x 5
ticks, every field) and a large one (8 GPUs x 600 ticks).

    python bench/ingest_checks.py [--repeat 200]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from gpuwatch.core import fields
from gpuwatch.agent.spool import write_durably
from gpuwatch.agent.spool import decode_record, encode_record
from gpuwatch.core.batches import BatchBuilder, TimeWindow
from gpuwatch.collector.ingest_service import decode_batch
from gpuwatch.v1 import telemetry_pb2 as pb


def batch_bytes(ticks: int, gpus: int = 8) -> bytes:
    rng = np.random.default_rng(0)
    builder = BatchBuilder(pb.NodeIdentity(node="bench"), "bench-agent", [pb.GpuInfo(index=i) for i in range(gpus)])
    now = int(time.time() * 1000)
    for t in range(ticks):
        for g in range(gpus):
            builder.add_gpu_row(g, now + 1000 * t, dict(zip(fields.GPU_FIELD_NAMES,
                                                             rng.uniform(0, 100, len(fields.GPU_FIELD_NAMES)))))
        builder.add_host_row(now + 1000 * t, dict(zip(fields.HOST_FIELD_NAMES,
                                                       rng.uniform(0, 100, len(fields.HOST_FIELD_NAMES)))))
    return builder.build(1).SerializeToString()


def per_call_us(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    window = TimeWindow()
    print(f"{'batch':<22}{'bytes':>10}{'parse us':>10}{'decode_batch us':>17}{'frame us':>10}{'check us':>10}"
          f"{'durable write us':>18}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "record.pb")
        for name, ticks in (("8 GPUs x 5 ticks", 5), ("8 GPUs x 600 ticks", 600)):
            data = batch_bytes(ticks)
            record = encode_record(data)
            repeat = max(5, args.repeat * 5 // ticks)
            parse = per_call_us(lambda data=data: pb.TelemetryBatch.FromString(data), repeat)
            decode = per_call_us(lambda data=data: decode_batch(data, window), repeat)
            frame = per_call_us(lambda data=data: encode_record(data), repeat)
            check = per_call_us(lambda record=record: decode_record(record), repeat)
            write = per_call_us(lambda record=record: write_durably(Path(path), record), repeat)
            print(f"{name:<22}{len(data):>10}{parse:>10.0f}{decode:>17.0f}{frame:>10.0f}{check:>10.0f}{write:>18.0f}")


if __name__ == "__main__":
    main()
