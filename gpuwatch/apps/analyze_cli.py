"""`gpuwatch analyze PATH...`: a thin layer over `load_paths()` and `analyze()`."""
from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

from gpuwatch.apps.commandline import Command, add_json_flag
from gpuwatch.efficiency.engine import analyze, analyze_summaries
from gpuwatch.efficiency.load import expand_paths, load_paths
from gpuwatch.efficiency.partition import CATEGORIES
from gpuwatch.efficiency.result import Analysis, JobBreakdown, RankBreakdown
from gpuwatch.efficiency.summary import summarize_paths
from gpuwatch.efficiency.traces.eventstream import BLOCK_BYTES
from gpuwatch.efficiency.words import coverage_lines, what_if_lines
from gpuwatch.core.errors import UserError

_PROGRESS_BYTES = 64 << 20  # report reading progress on stderr past this many bytes per file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="Kineto trace files (.json/.json.gz, one per rank), folders of them, "
                             "or span tables (.csv/.parquet)")
    add_json_flag(parser, "print the breakdown document as JSON")
    parser.add_argument("--per-step", action="store_true", help="add a breakdown per step for each rank")
    parser.add_argument("--steps", metavar="A:B|hta",
                        help="analyse only steps A..B (either end may be empty), or 'hta': HolisticTraceAnalysis's "
                             "window (work launched before the last ProfilerStep)")
    parser.add_argument("--flops-per-step", type=float, help="model FLOPs per step and rank (for MFU)")
    parser.add_argument("--peak-tflops", type=float, help="peak TFLOP/s of one GPU (for MFU)")
    parser.add_argument("--gpu-hour-price", type=float, help="price of one GPU-hour (for lost cost)")
    parser.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    parser.add_argument("--perfetto", metavar="FILE", help="write the classified timeline as a Chrome/Perfetto trace")


def run(args: argparse.Namespace) -> int:
    for name in ("flops_per_step", "peak_tflops", "gpu_hour_price"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if (args.flops_per_step is None) != (args.peak_tflops is None):
        raise UserError("MFU needs both --flops-per-step and --peak-tflops; give both or neither")
    options = dict(per_step=args.per_step or bool(args.html), flops_per_step=args.flops_per_step,
                   peak_tflops=args.peak_tflops, gpu_hour_price=args.gpu_hour_price, steps=args.steps)
    if args.perfetto:  # every kernel is drawn: the timelines are kept
        doc = analyze(read_in_pool(args.paths, load_paths), keep_segments=True, **options)
    else:  # each rank is reduced where it is read; only the summaries are kept
        doc = analyze_summaries(read_in_pool(args.paths, functools.partial(summarize_paths, steps=args.steps)),
                                **options)
    if args.perfetto:
        from gpuwatch.efficiency.perfetto import perfetto_trace

        _write(args.perfetto, perfetto_trace(doc))
    if args.html:
        from gpuwatch.efficiency.html import html_report

        _write(args.html, html_report(doc).encode())
    if args.json:
        sys.stdout.write(doc.json_text() + "\n")
    else:
        sys.stdout.write(format_table(doc))
    return 0


ANALYZE = Command(add_arguments, run)


_T = TypeVar("_T")


def read_in_pool(paths: list[str], read: Callable[..., list[_T]]) -> list[_T]:
    """`read(paths, progress=..., map_files=...)` (`load_paths` or `summarize_paths`) with the files read in
    parallel by a pool of processes, one per core (reading is CPU-bound Python; a summary, or a timeline, is
    a few arrays, cheap to send back); one file is read here. Workers are spawned, not forked: the caller may
    have threads running (a test, an embedding application), whose locks a fork would copy taken or not, and
    a fork server is one more process holding numpy (a spawned pool peaked 25-33 MB lower on 8- and 64-rank
    sets, for the same CPU)."""
    workers = min(len(expand_paths(paths)), os.cpu_count() or 1)
    if workers <= 1:
        return read(paths, progress=_progress)
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return read(paths, progress=_progress, map_files=pool.map)


def _write(path: str, data: bytes) -> None:
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as exc:
        raise UserError(f"{path}: cannot write ({exc.strerror})") from None


def _progress(path: str, nbytes: int) -> None:
    if nbytes >= _PROGRESS_BYTES and nbytes % _PROGRESS_BYTES < BLOCK_BYTES:  # once per 64 MB (reads are blocks)
        print(f"reading {path}: {nbytes >> 20} MB", file=sys.stderr, flush=True)


def format_table(doc: Analysis) -> str:
    """Human-readable breakdown: the job, then ranks by lost time, biggest loss first; after the window, the lost
    time and compute, the lost categories in the spec's order, every trace alike (so reports compare column by
    column), each column as wide as its name; the line after the table names the biggest losses."""
    job = doc.job
    lost = [c for c in CATEGORIES if c != "compute"]
    widths = {c: max(len(c), 8) for c in lost}
    header = (f"{'':>8} {'window ms':>10} {'lost ms':>10} {'compute':>9} | "
              + " ".join(f"{c:>{widths[c]}}" for c in lost))
    lines = [header]

    def row(label: str, entry: JobBreakdown | RankBreakdown) -> str:
        cells = " ".join(f"{100 * entry.breakdown_fraction[c]:>{widths[c] - 1}.2f}%" for c in lost)
        return (f"{label:>8} {entry.window_us / 1000:>10.1f} {entry.lost_us / 1000:>10.1f} "
                f"{100 * entry.breakdown_fraction['compute']:>8.2f}% | {cells}")

    lines.append(row("job", job))
    lines += [row(f"rank {r.rank}", r) for r in sorted(doc.ranks, key=lambda r: (-r.lost_us, r.rank))]
    lines.append("")
    biggest = [c for c in sorted(lost, key=lambda c: -job.breakdown_us[c]) if job.breakdown_us[c] > 0][:3]
    if biggest:
        lines.append("biggest losses: " + ", ".join(f"{c} {100 * job.breakdown_fraction[c]:.1f} %" for c in biggest))
    lines.append(f"lost: {job.lost_us / 1e6:.3f} GPU-s = {job.lost_gpu_hours:.5f} GPU-hours"
                 + ("" if job.lost_cost is None else f", cost {job.lost_cost:.2f}"))
    if job.overlap_ratio is not None:
        lines.append(f"communication hidden under compute: {100 * job.overlap_ratio:.1f} %")
    lines.append(f"short kernels (< 10 us): {job.short_kernels.count} taking {job.short_kernels.time_us / 1000:.1f} ms")
    lines.append(f"collectives matched across ranks: {doc.matched_collectives}")
    lines += coverage_lines(doc)
    if job.mfu is not None:
        lines.append(f"MFU: {100 * job.mfu:.1f} %")
    among = "" if doc.coverage.complete else " (among the ranks present)"
    for label, entries in ((f"straggler{among}", doc.stragglers), ("delayed", doc.delayed)):
        for s in entries:
            lines.append(f"{label}: rank {s.rank} last at {100 * s.last_share:.0f} % of {s.collectives} "
                         f"collectives (chance {100 * s.chance_share:.0f} %), "
                         f"mean lateness {s.mean_lateness_us:.0f} us, "
                         f"busy {s.busy_per_step_us:.0f} us/step vs peer median {s.peer_median_busy_per_step_us:.0f}")
    if doc.straggler_verdict == "none" and not doc.delayed:
        lines.append("no stragglers")
    lines += what_if_lines(doc.what_if)
    for r in doc.ranks:
        for p in r.per_step or []:
            lines.append(f"rank {r.rank} step {p.step}: {p.window_us / 1000:.1f} ms, "
                         f"lost {100 * p.lost_fraction:.1f} %"
                         + ("" if p.mfu is None else f", MFU {100 * p.mfu:.1f} %"))
    return "\n".join(lines) + "\n"

