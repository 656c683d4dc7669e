"""How `gpuwatch analyze DIR --json` scales with the rank count: wall, CPU and peak memory summed over the
process tree, for sets of 8, 64, 256 and 1,024 ranks side by side, in one run.

Each set is made of copies of the shared real traces (by default control_rank3_of8, a real A100 rank of an
8-rank job) with the rank id and world size rewritten in `distributedInfo`, nothing else changed: every rank
holds the same events, so the set's cross-rank matching pairs every collective, as a real job's would. A
copy is written as two gzip members, a freshly compressed head (up to the end of `distributedInfo`) and the
trace's remaining bytes compressed once for the whole set: a gzip reader sees one stream, and building 1,024
ranks costs a copy of bytes, not 1,024 compressions.

Memory is the peak of the RSS summed over the command's whole process tree, sampled every 10 ms (and at
least the largest `ru_maxrss` of one process); CPU is user+system summed over the tree (the rusage of the
waited-for children, or the sampled sum, the larger). Load average is printed beside each row: the machine
may be shared, and CPU time moves far less with load than wall time does.

    python bench/analyze_scale.py [--ranks 8,64,256,1024] [--trace FILE] [--keep DIR] [--runs 1]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINETO = os.environ.get("GPUWATCH_KINETO", "/work/shared/data/kineto" if os.path.isdir("/work/shared/data/kineto") else os.path.join(ROOT, "..", "shared", "data", "kineto"))
DEFAULT_TRACE = os.path.join(KINETO, "control_rank3_of8", "rank3.json.gz")
_INFO = b'"distributedInfo"'


def build_set(trace: str, folder: str, ranks: int) -> int:
    """Write `ranks` copies of `trace` into `folder` as rank<N>.json.gz, each with its rank id and the world
    size rewritten. Returns the bytes written."""
    with gzip.open(trace, "rb") as f:
        data = f.read()
    at = data.find(_INFO)
    if at < 0:
        raise SystemExit(f"{trace}: no distributedInfo to rewrite")
    end = data.index(b"}", at) + 1
    info = json.loads(data[at + len(_INFO):end].lstrip(b": "))
    body = gzip.compress(data[end:], compresslevel=6)
    total = 0
    os.makedirs(folder, exist_ok=True)
    for rank in range(ranks):
        head = data[:at] + _INFO + b": " + json.dumps({**info, "rank": rank, "world_size": ranks}).encode()
        path = os.path.join(folder, f"rank{rank}.json.gz")
        with open(path, "wb") as out:
            out.write(gzip.compress(head, compresslevel=6))
            out.write(body)
        total += os.path.getsize(path)
    return total
