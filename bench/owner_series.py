"""Series count and exporter memory for GPU ownership: owner labels on every per-GPU series (what dcgm-exporter's
pod mapping and per-job labels do) against one ``gpuwatch_gpu_owner_info`` series per GPU (gpuwatch's design).

Builds a snapshot of N simulated GPUs (every GPU field, each GPU held by a pod and a job), renders the real
exporter (gpuwatch.core.metrics_families) for the info design, and the same series with the owner labels added to
every per-GPU series for the other. Prints, side by side: series per scrape, exposition bytes, the peak Python
memory of one render (tracemalloc), and the series Prometheus creates over a day when every GPU changes owner
every --changes-per-day (a labelled series set is new with each owner; an info series is one per owner).

    python bench/owner_series.py [--gpus 1000] [--changes-per-day 24]
"""
from __future__ import annotations

import argparse
import tracemalloc
from collections.abc import Iterable
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from gpuwatch.core import fields
from gpuwatch.core.metrics_families import build_registry
from gpuwatch.core.metrics_snapshot import GpuSnapshot, Snapshot

OWNER_LABELS = ("pod", "namespace", "container", "job", "rank")


def snapshot(gpus: int) -> Snapshot:
    rows: list[GpuSnapshot] = []
    for i in range(gpus):
        node, index = f"node-{i // 8:04d}", i % 8
        rows.append({"node": node, "gpu": index, "gpu_uuid": f"GPU-{i:08x}", "model": "NVIDIA H100 80GB HBM3",
                     "values": {f.name: float(i % 97) for f in fields.GPU_FIELDS},
                     "job_id": f"job-{i // 64}", "rank": i % 64, "pod": f"train-{i // 64}-worker-{i % 64 // 8}",
                     "namespace": f"team-{i % 13}", "container": "trainer"})
    return {"gpus": rows}


class _Labelled(Collector):
    """The exporter's families with the owner labels put on every per-GPU series (the design not taken)."""

    def __init__(self, inner: CollectorRegistry, owners: dict[tuple[str, str], dict[str, str]]) -> None:
        self._inner, self._owners = inner, owners

    def collect(self) -> Iterable[Metric]:
        for family in self._inner.collect():
            if family.name == "gpuwatch_gpu_owner_info":
                continue
            out = Metric(family.name, family.documentation, family.type)
            for s in family.samples:
                owner = self._owners.get((s.labels.get("node", ""), s.labels.get("gpu", "")), {})
                out.add_sample(s.name, {**s.labels, **owner}, s.value)
            yield out


def render(registry: CollectorRegistry) -> tuple[int, int, float]:
    """(series, exposition bytes, peak MiB of one render)."""
    tracemalloc.start()
    text = generate_latest(registry)
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
    return series, len(text), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=1000)
    parser.add_argument("--changes-per-day", type=int, default=24)
    args = parser.parse_args()
    snap = snapshot(args.gpus)
    info_registry = build_registry(lambda: snap)
    owners = {(g["node"], str(g["gpu"])): {"pod": g["pod"], "namespace": g["namespace"], "container": g["container"],
                                           "job": g["job_id"], "rank": str(g["rank"])} for g in snap["gpus"]}
    labelled_registry = CollectorRegistry()
    labelled_registry.register(_Labelled(build_registry(lambda: snap), owners))
    info = render(info_registry)
    labelled = render(labelled_registry)
    per_gpu_info = (info[0] - args.gpus) / args.gpus  # the per-GPU series besides the info series
    day_labelled = labelled[0] * args.changes_per_day
    day_info = info[0] + args.gpus * (args.changes_per_day - 1)
    print(f"{args.gpus} GPUs, {per_gpu_info:.0f} per-GPU series each, owner changes {args.changes_per_day}/GPU/day")
    print(f"{'':32}{'owner labels on every series':>30}{'info series (gpuwatch)':>26}")
    print(f"{'series per scrape':32}{labelled[0]:>30,}{info[0]:>26,}")
    print(f"{'exposition bytes':32}{labelled[1]:>30,}{info[1]:>26,}")
    print(f"{'peak MiB of one render':32}{labelled[2]:>30.1f}{info[2]:>26.1f}")
    print(f"{'series created per day':32}{day_labelled:>30,}{day_info:>26,}")


if __name__ == "__main__":
    main()
