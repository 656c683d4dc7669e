"""What reading GPU ownership costs, on both engines: folding the ``gpu_owner`` change points of the events
table at query time (a store whose ``owner_intervals`` table was never built) against reading that table
(docs/owners.md, "Stored as intervals"), and what building the table costs.

Writes --days of ownership for --gpus GPUs (8 per node): every GPU announced hourly (as agents do) and moved to
a new pod every --change-h hours, then times ``owner_intervals`` over the last 7 days and ``current_owners``
before and after ``build_owner_intervals`` (the same answers both ways, checked).

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
    print(f"{'engine':8} {'events':>9} {'intervals':>10} {'build s':>8} "
          f"{'owner_intervals 7d s: events':>29} {'table':>6} {'current_owners s: events':>25} {'table':>6}")
    for engine in ("duckdb", "chdb"):
        with tempfile.TemporaryDirectory() as tmp:
            url = str(Path(tmp) / "s.duckdb") if engine == "duckdb" else f"chdb://{tmp}/ch"
            store = open_store(url, retention_days=3650)
            written = fill(store, args.gpus, args.days, args.change_h)
            since = T0_MS + args.days * 24 * HOUR_MS - 7 * 24 * HOUR_MS
            timed = []
            for step in ("events", "table"):
                start = time.perf_counter()
                intervals = owner_intervals(store, since)
                read_s = time.perf_counter() - start
                start = time.perf_counter()
                owners = current_owners(store)
                timed.append((intervals, read_s, owners, time.perf_counter() - start))
                if step == "events":
                    start = time.perf_counter()
                    store.build_owner_intervals()
                    build_s = time.perf_counter() - start
            store.close()
            (folded, fold_s, owners, owners_s), (table, table_s, table_owners, table_owners_s) = timed
            assert owners == table_owners and len(folded) == len(table)
            print(f"{engine:8} {written:9d} {len(table):10d} {build_s:8.2f} {fold_s:29.2f} {table_s:6.2f} "
                  f"{owners_s:25.2f} {table_owners_s:6.2f}")


if __name__ == "__main__":
    main()
