"""What the collector's periodic reads cost on a store holding a fleet's raw tier, before and now, both engines
side by side.

- A scoring round's look for newly arrived data. Before: the inventory with every GPU's sample count, newest
  sample and owner (``gpus()``: a scan of every raw sample), read twice a round. Now: the nodes whose agents
  sent batches since the last look (``nodes_heard_since``, the small agents table), the newest sample per GPU
  of those nodes after what the round saw a round ago (``newest_samples``), and the UUIDs from the inventory
  alone (``gpu_identities``).
- The latest values (/metrics every few seconds, the Latest query). Before: the last non-NULL value of every
  field per GPU over every raw sample (``latest_since(None, None)``, the old query). Now: ``latest()``, which
  merges the samples that arrived since its previous read (none here: the cost of looking). And the whole
  /metrics snapshot as it is built now (before, it read both ``gpus()`` and the old latest values).

The samples are generated in the store by SQL (utilisation only, the other fields NULL): ``--gpus`` GPUs, 8 per
node, at 1 Hz for ``--hours`` ending now, in time order as agents deliver them. Each engine runs in a process
of its own (one chdb engine per process).

    python bench/periodic_reads.py [--gpus 256] [--hours 48] [--engines duckdb,chdb]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from gpuwatch.collector.snapshot import build_snapshot
from gpuwatch.collector.store import open_store

ROUND_S = 60  # the default scoring interval: a round's new data


def fill(store: Any, engine: str, gpus: int, hours: float, end_s: int) -> None:
    """``gpus`` GPUs' samples at 1 Hz for ``hours`` up to ``end_s``, their inventory and their agents, written
    on the store's writer thread (the engine's connection is the writer's)."""
    store.run_write(lambda con: _fill(con.execute if engine == "duckdb" else con.command, engine, gpus, hours,
                                      end_s), None)


def _fill(run: Callable[[str], object], engine: str, gpus: int, hours: float, end_s: int) -> None:
    start_s, ticks = end_s - int(hours * 3600), int(hours * 3600)
    if engine == "duckdb":
        run(f"""INSERT INTO gpus SELECT 'node-' || (g // 8), g % 8, 'GPU-' || g, 'H100', '', '', 0, 'hopper',
                true, to_timestamp({start_s}), to_timestamp({end_s}) FROM range({gpus}) t(g)""")
        run(f"""INSERT INTO agents SELECT DISTINCT 'agent-' || (g // 8), 'node-' || (g // 8), 1, now()
                FROM range({gpus}) t(g)""")
        for hour in range(0, ticks, 3600):
            run(f"""INSERT INTO gpu_samples (node, gpu_index, ts, job_id, rank, gpu_utilization_ratio)
                    SELECT 'node-' || (g // 8), g % 8, to_timestamp({start_s + hour} + s), 'job', g, random()
                    FROM range({min(3600, ticks - hour)}) a(s), range({gpus}) b(g) ORDER BY s""")
        return
    run(f"""INSERT INTO gpus SELECT concat('node-', toString(intDiv(g, 8))), g % 8, concat('GPU-', toString(g)),
            'H100', '', '', 0, 'hopper', true, toDateTime64({start_s}, 3, 'UTC'), toDateTime64({end_s}, 3, 'UTC')
            FROM (SELECT number AS g FROM numbers({gpus}))""")
    run(f"""INSERT INTO agents SELECT DISTINCT concat('agent-', toString(intDiv(g, 8))),
            concat('node-', toString(intDiv(g, 8))), 1, now64(3) FROM (SELECT number AS g FROM numbers({gpus}))""")
    for part in range(0, ticks, 600):  # ten minutes an insert: the store's memory limit holds
        run(f"""INSERT INTO gpu_samples (node, gpu_index, ts, job_id, rank, gpu_utilization_ratio)
                SELECT concat('node-', toString(intDiv(g, 8))), g % 8, toDateTime64({start_s + part} + s, 3, 'UTC'),
                       'job', g, rand() / 4294967295.0
                FROM (SELECT number AS s FROM numbers({min(600, ticks - part)})) AS a
                CROSS JOIN (SELECT number AS g FROM numbers({gpus})) AS b""")


def timed(read: Callable[[], object], repeat: int = 3) -> dict[str, float]:
    """Median wall and CPU seconds of ``read`` (chdb runs in-process: its CPU is this process's)."""
    walls, cpus = [], []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        read()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}


def measure(engine: str, gpus: int, hours: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"duckdb:///{tmp}/s.duckdb" if engine == "duckdb" else f"chdb:///{tmp}/ch"
        store = open_store(url, retention_days=0)
        try:
            end_s = int(time.time())
            filled = time.perf_counter()
            fill(store, engine, gpus, hours, end_s)
            filled = time.perf_counter() - filled
            seen_ms = (end_s - ROUND_S) * 1000  # what the last round saw

            def look() -> object:
                nodes = store.nodes_heard_since(int(time.time() * 1000) - 300_000)
                return store.newest_samples(seen_ms, nodes), store.gpu_identities()

            store.latest()  # the first read is whole; the next ones merge what arrived since
            return {"engine": engine, "rows": gpus * int(hours * 3600), "fill_s": round(filled, 1),
                    "look_before": timed(lambda: (store.gpus(), store.gpus())), "look_now": timed(look),
                    "latest_before": timed(lambda: store.latest_since(None, None)),
                    "latest_now": timed(store.latest), "render_now": timed(lambda: build_snapshot(store))}
        finally:
            store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=256)
    parser.add_argument("--hours", type=float, default=48.0, help="raw samples kept (the default raw tier: 2 days)")
    parser.add_argument("--engines", default="duckdb,chdb")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # an engine measured in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.gpus, args.hours)))
        return
    print(f"{args.gpus} GPUs x {args.hours:g} h of raw samples at 1 Hz; median wall s / CPU s of each read")
    print(f"{'engine':<8}{'rows':>13}  {'scoring round look: before':>27}{'now':>16}  "
          f"{'latest values: before':>22}{'now':>16}  {'/metrics snapshot now':>22}")
    for engine in args.engines.split(","):
        run = subprocess.run([sys.executable, __file__, "--one", engine, "--gpus", str(args.gpus),
                              "--hours", str(args.hours)], capture_output=True, text=True)
        if run.returncode:
            sys.exit(f"periodic_reads: {engine} failed: {run.stderr.strip().splitlines()[-1]}")
        r = json.loads(run.stdout.strip().splitlines()[-1])
        cells = [f"{r[k]['wall_s']:.3f} / {r[k]['cpu_s']:.3f}"
                 for k in ("look_before", "look_now", "latest_before", "latest_now", "render_now")]
        print(f"{engine:<8}{r['rows']:>13,}  {cells[0]:>27}{cells[1]:>16}  {cells[2]:>22}{cells[3]:>16}"
              f"  {cells[4]:>22}")

if __name__ == "__main__":
    main()
