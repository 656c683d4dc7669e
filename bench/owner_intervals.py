"""What reading GPU ownership costs in its stored form (``gpu_owner`` change points in the events table, joined
into intervals at query time), on both engines: the question behind keeping that form rather than a table of
intervals of its own (docs/owners.md, "Stored as intervals").

Writes --days of ownership for --gpus GPUs (8 per node): every GPU announced hourly (as agents do) and moved to
a new pod every --change-h hours, then times ``owner_intervals`` over the last 7 days and ``current_owners``.

    python bench/owner_intervals.py [--gpus 1000] [--days 7] [--change-h 6]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from gpuwatch.collector.owners import current_owners, owner_intervals
from gpuwatch.collector.store import open_store
from gpuwatch.core import events as ev
from gpuwatch.core.batches import BatchBuilder
from gpuwatch.v1 import telemetry_pb2 as pb

T0_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
HOUR_MS = 3_600_000


def fill(store, gpus: int, days: int, change_h: int) -> int:
    written = 0
    for node_no in range(0, gpus, 8):
        node = f"node-{node_no // 8:04d}"
        count = min(8, gpus - node_no)
        builder = BatchBuilder(pb.NodeIdentity(node=node), f"agent-{node}",
                               [pb.GpuInfo(index=i, uuid=f"GPU-{node}-{i}", name="H100") for i in range(count)])
        for hour in range(days * 24):
            ts = T0_MS + hour * HOUR_MS
            for gpu in range(count):
                pod = f"train-{(hour // change_h) % 1000}-{gpu}"
                builder.add_event(kind=ev.GPU_OWNER, ts_ms=ts, gpu_index=gpu, message="owner",
                                  attrs={"namespace": "ml", "pod": pod, "container": "c", "job_id": pod,
                                         "rank": "0", "mig": "", "user": "", "uuid": f"GPU-{node}-{gpu}"})
                written += 1
            builder.add_gpu_row(0, ts, {"gpu_utilization_ratio": 0.5})
        store.write(builder.build(1))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=1000)
    parser.add_argument("--days", type=int, default=7)
    parser.add_argument("--change-h", type=int, default=6)
    args = parser.parse_args()
    print(f"{'engine':8} {'events':>9} {'intervals':>10} {'owner_intervals 7d s':>21} {'current_owners s':>17}")
    for engine in ("duckdb", "chdb"):
        with tempfile.TemporaryDirectory() as tmp:
            url = str(Path(tmp) / "s.duckdb") if engine == "duckdb" else f"chdb://{tmp}/ch"
            store = open_store(url, retention_days=3650)
            written = fill(store, args.gpus, args.days, args.change_h)
            until = T0_MS + args.days * 24 * HOUR_MS
            start = time.perf_counter()
            intervals = owner_intervals(store, until - 7 * 24 * HOUR_MS)
            read_s = time.perf_counter() - start
            start = time.perf_counter()
            current_owners(store)
            now_s = time.perf_counter() - start
            store.close()
            print(f"{engine:8} {written:9d} {len(intervals):10d} {read_s:21.2f} {now_s:17.2f}")


if __name__ == "__main__":
    main()
