"""/metrics at fleet scale: scrape latency rendered per scrape vs served from the background render.

Builds a snapshot of ``--gpus`` GPUs (8 per node) with every GPU field, XID counts, failure risk and health,
and ``--jobs`` jobs, and serves it twice on loopback with the collector's exporter: once rendering at each
scrape (what the agent's small endpoint does) and once rendering in the background every interval and
serving the last render (what the collector does). Prints the time of each scrape (plain text, and gzip as
Prometheus asks), the background render's duration and the body size. Target: a scrape of 8,000 GPUs
<= 200 ms.

    python bench/metrics.py [--gpus 8000] [--scrapes 3]
"""
from __future__ import annotations

import argparse
import sys
import time
import urllib.request

import numpy as np

from gpuwatch.core import fields
from gpuwatch.core.metrics_http import start_metrics_server
from gpuwatch.core.vocabulary import BREAKDOWN_CATEGORIES


def fleet_snapshot(n_gpus: int, n_jobs: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    values = rng.uniform(0, 1000, (n_gpus, len(fields.GPU_FIELD_NAMES)))
    gpus = [{"node": f"node-{i // 8:05d}", "gpu": i % 8, "gpu_uuid": f"GPU-{i:08x}-5d1c-4f2a-9e3b-1a2b3c4d5e6f",
             "model": "NVIDIA H100 80GB HBM3", "values": dict(zip(fields.GPU_FIELD_NAMES, values[i].tolist())),
             "xid_counts": {79: 1} if i % 97 == 0 else {}, "failure_risk": float(rng.uniform()),
             "health": "ok", "job_id": f"job-{i % max(n_jobs, 1)}", "rank": i % 64} for i in range(n_gpus)]
    jobs = [{"job_id": f"job-{j}", "breakdown": dict.fromkeys(BREAKDOWN_CATEGORIES, 1 / len(BREAKDOWN_CATEGORIES)),
             "lost_gpu_seconds_total": 100.0 * j, "rank_lost_ratio": {r: 0.1 for r in range(64)},
             "stragglers": {}} for j in range(n_jobs)]
    return {"gpus": gpus, "jobs": jobs, "ingest": {"batches_total": 1, "samples_total": 1}}


def scrape(url: str, gzip: bool = False) -> tuple[float, int]:
    request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"} if gzip else {})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        size = len(response.read())
    return time.perf_counter() - started, size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8000)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--scrapes", type=int, default=3)
    args = parser.parse_args()
    snapshot = fleet_snapshot(args.gpus, args.jobs)
    print(f"{args.gpus} GPUs, {args.jobs} jobs")
    with start_metrics_server("127.0.0.1:0", lambda: snapshot) as server:
        times = [scrape(server.url) for _ in range(args.scrapes)]
        print(f"rendered per scrape:      scrape {', '.join(f'{t * 1000:,.0f}' for t, _ in times)} ms "
              f"({times[0][1] / 1e6:.1f} MB)", flush=True)
    with start_metrics_server("127.0.0.1:0", lambda: snapshot, render_interval_s=3600) as server:
        scrape(server.url)  # waits for the first render
        scrape(server.url, gzip=True)  # asks for the gzip variant once; later renders make it in the background
        server.rendered.render()
        plain = [scrape(server.url) for _ in range(args.scrapes)]
        packed = [scrape(server.url, gzip=True) for _ in range(args.scrapes)]
        print(f"served from the render:   scrape {', '.join(f'{t * 1000:,.0f}' for t, _ in plain)} ms "
              f"({plain[0][1] / 1e6:.1f} MB); gzip {', '.join(f'{t * 1000:,.0f}' for t, _ in packed)} ms "
              f"({packed[0][1] / 1e6:.1f} MB)")
        print(f"background render (text + gzip): {server.rendered.last_render_s:,.1f} s, "
              f"repeated every max(interval, 2 x render)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
