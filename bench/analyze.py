"""Benchmark `gpuwatch analyze` against HolisticTraceAnalysis 0.5.0 on the same real Kineto traces.

Prints, side by side in one run, for each single real trace and for an 8-rank set: whole-process wall
time and peak memory of each tool, each run as its own subprocess; memory is the peak of the RSS summed
over the tool's whole process tree (both tools start workers for multi-rank sets), sampled every 10 ms by
a wrapper, and CPU time is summed over the same tree (the larger of the sampled sum and the rusage of the
waited-for children: a worker's parent may not wait for it, as a fork server's do not). The tools take
turns and the best of `--runs` counts, with the load average before and after, as the machine may be
shared. Then the agreement of compute and idle with HTA's temporal breakdown over HTA's window
(`--steps hta`), and where gpuwatch's time goes: decompression alone (zlib and ISA-L), the floor of
reading everything (decompression and a full orjson parse), the floor of reading only what gpuwatch keeps
(decompression and a parse of just those events, by orjson into dicts and by msgspec into the reader's
structs, as gpuwatch decodes them), gpuwatch's filtered stream, the whole load, the
breakdown, the what-if, the JSON output, and the interpreter with its imports (also `python -c pass` of
each interpreter: their start-up differs with the site hooks of each environment).

Both tools run as a user installs them, each from a venv made the same way (`python -m venv`, no system
site-packages): HTA from `--hta-venv` (default ~/.cache/gpuwatch-bench/hta-venv, HolisticTraceAnalysis
0.5.0 installed on first use; or this interpreter, if it imports HTA), gpuwatch as the `gpuwatch` command
of a regular install of this tree into `--gpuwatch-venv` (reinstalled every run). Beside them: `python -m
gpuwatch` of this (development) interpreter, which pays this machine's .pth hooks and the editable
install's finder at every start, and with `--old-tree DIR` an older tree installed as this one is, for a
before/after in the same run. CPU time is printed beside the wall time: on a loaded machine it moves far
less than wall time. Targets: >= 12x on single traces, >= 20x on the 8-rank set, agreement within 0.5 %
of the window.

    python bench/analyze.py [--trace FILE ...] [--runs 3] [--multi-runs 2] [--multi-mb 450] [--no-hta]
                            [--hta-venv DIR] [--gpuwatch-venv DIR] [--old-tree DIR] [--keep DIR] [--only-multi]
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
import time

import orjson

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINETO = os.path.join(ROOT, "..", "shared", "data", "kineto")
DEFAULT_TRACES = [os.path.join(KINETO, "control_rank3_of8", "rank3.json.gz"),
                  os.path.join(KINETO, "ns_resolution_rank0", "rank0.json.gz")]
VENV = os.path.expanduser("~/.cache/gpuwatch-bench/hta-venv")
GW_VENV = os.path.expanduser("~/.cache/gpuwatch-bench/gpuwatch-venv")

# Runs a command and prints its wall time and the peak of the RSS summed over its process tree. A thread
# waits for the command (reading its output as it comes, so no pipe fills) and notes when it ended; the tree's
# memory is sampled every 10 ms meanwhile. (Sampling until a poll saw the command gone counted up to 10 ms past
# its end, 5 ms on average: 3 % of a 0.15 s run, 0.3 % of HTA's.) The peak is also at least the largest RSS
# of one process of the tree, which the kernel keeps exactly (`ru_maxrss`): a peak between two samples counts.
MEASURE = """
import json, resource, subprocess, sys, threading, time, psutil
t = time.perf_counter()
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
ended = {}

def wait():
    ended["out"], ended["err"] = proc.communicate()
    ended["wall"] = time.perf_counter() - t

waiter = threading.Thread(target=wait)
waiter.start()
root = psutil.Process(proc.pid)
peak = 0
cpu = {}  # pid -> its CPU seconds when last seen (a worker's parent may not wait for it)
while waiter.is_alive():
    try:
        tree = [root] + root.children(recursive=True)
        rss = 0
        for p in tree:
            with p.oneshot():
                rss += p.memory_info().rss
                times = p.cpu_times()
                cpu[p.pid] = times.user + times.system
        peak = max(peak, rss)
    except psutil.Error:
        pass
    waiter.join(0.01)
usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # exact for the command and the children it waited for
sys.stderr.write(ended["err"].decode()[-2000:])
print(json.dumps({"wall_s": ended["wall"], "cpu_s": max(usage.ru_utime + usage.ru_stime, sum(cpu.values())),
                  "peak_mb": max(peak, usage.ru_maxrss * 1024) / 2**20, "rc": proc.returncode,
                  "stdout": ended["out"].decode()}))
"""

# HTA's temporal breakdown of one rank folder (defaults; drops the last ProfilerStep as HTA does).
HTA_SCRIPT = """
import json, sys, warnings
warnings.simplefilter("ignore")
from hta.trace_analysis import TraceAnalysis
analyzer = TraceAnalysis(trace_dir=sys.argv[1])
df = analyzer.get_temporal_breakdown(visualize=False)
print(json.dumps(df.to_dict(orient="records")))
"""

# gpuwatch over HTA's window (`--steps hta`), one rank entry per file (bench/gpu/trace_step.py uses it too).
GPUWATCH_WINDOW = """
import json, sys
from gpuwatch.efficiency import analyze, load_paths
print(json.dumps([analyze([tl], steps="hta").to_json()["ranks"][0] for tl in load_paths(sys.argv[1:])]))
"""

# Where gpuwatch's time goes on one trace file (each phase timed alone, best of 3).
PHASES = """
import gc, gzip, json, sys, time
path = sys.argv[1]
def best(fn, n=5):
    out = []
    for _ in range(n):
        t = time.perf_counter(); fn(); out.append(time.perf_counter() - t)
    return min(out)
t0 = time.perf_counter()
import numpy, orjson
from isal import isal_zlib
from gpuwatch.efficiency import analyze, load_paths
from gpuwatch.efficiency.matching import match_collectives
from gpuwatch.efficiency.summary import summarize
from gpuwatch.efficiency.whatif import what_if
from gpuwatch.efficiency.traces.eventstream import TraceEventStream
from gpuwatch.efficiency.traces.kineto import _DECODER, _LAUNCH_FLOWS, _WANTED
imports = time.perf_counter() - t0
with open(path, "rb") as f:
    raw = f.read()
gz = raw[:2] == b"\\x1f\\x8b"
def paused(fn):
    gc.disable()
    try:
        fn()
    finally:
        gc.enable()
def stream():
    for _ in TraceEventStream(path, only=_WANTED, watch=_LAUNCH_FLOWS, decoder=_DECODER):
        pass
kept = orjson.dumps([e for events in TraceEventStream(path, only=_WANTED) for e in events])
tls = load_paths([path])
summaries = [summarize(tl, peers=False) for tl in tls]
m = match_collectives([s.collectives for s in summaries])
doc = analyze(tls)
print(json.dumps({
    "imports_s": imports,
    "gunzip_zlib_s": best(lambda: gzip.decompress(raw)) if gz else 0.0,
    "gunzip_isal_s": best(lambda: isal_zlib.decompress(raw, 31)) if gz else 0.0,
    "bare_floor_s": best(lambda: orjson.loads(gzip.decompress(raw) if gz else raw)),
    "best_floor_s": best(lambda: paused(lambda: orjson.loads(isal_zlib.decompress(raw, 31) if gz else raw))),
    "kept_parse_s": best(lambda: paused(lambda: orjson.loads(kept))), "kept_mb": len(kept) / 1e6,
    "kept_decode_s": best(lambda: paused(lambda: _DECODER.decode(kept))),
    "stream_s": best(stream), "load_s": best(lambda: load_paths([path])),
    "breakdown_s": best(lambda: analyze(tls, with_what_if=False)),
    "what_if_s": best(lambda: what_if([s.graph for s in summaries], [s.rank for s in summaries], m)),
    "output_s": best(lambda: orjson.dumps(doc.to_json(), option=orjson.OPT_INDENT_2)),
}))
"""


def measure(cmd: list[str]) -> dict:
    # Run from elsewhere than the tree: `python -c` puts the working folder first on sys.path, and the
    # tree's gpuwatch/ folder would shadow the installed package.
    result = subprocess.run([sys.executable, "-c", MEASURE, *cmd], capture_output=True, text=True, check=True,
                            cwd=tempfile.gettempdir())
    return json.loads(result.stdout)


def hta_python(use_hta: bool, venv: str) -> str | None:
    """An interpreter that imports HTA 0.5.0: this one, else the venv `venv` (created on first use)."""
    if not use_hta:
        return None
    if subprocess.run([sys.executable, "-c", "import hta"], capture_output=True).returncode == 0:
        return sys.executable
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    if subprocess.run([python, "-c", "import hta"], capture_output=True).returncode != 0:
        install = subprocess.run([python, "-m", "pip", "install", "-q", "HolisticTraceAnalysis==0.5.0"],
                                 capture_output=True, text=True)
        if install.returncode != 0:
            print(f"HTA 0.5.0 could not be installed: {install.stderr.strip()[-300:]}")
            return None
    return python


def gpuwatch_command(venv: str, root: str = ROOT) -> list[str]:
    """The `gpuwatch` command as a user installs it, in a venv made as HTA's is (`python -m venv`: no system
    site-packages, so none of the machine's .pth hooks run at start-up) with a regular install of this tree
    (byte-compiled by pip; not the editable install of a development venv, whose finder is imported by every
    interpreter start). Its dependencies are this interpreter's, named as plain folders in a .pth file: a
    folder named there goes on sys.path without the .pth files inside it being run. Reinstalled on every
    run, so that it is the code of the tree (`root`: this one, or an older one to compare with)."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    site_dir = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
    deps = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    with open(os.path.join(site_dir, "gpuwatch_bench_deps.pth"), "w") as f:
        f.write("".join(f"{p}\n" for p in deps))
    with tempfile.TemporaryDirectory(prefix="gw-bench-wheel-") as wheels:
        source = os.path.join(wheels, "src")  # built from a copy: a build leaves build/ behind
        shutil.copytree(root, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__"))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", wheels, source],
                       check=True, capture_output=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
                        *[os.path.join(wheels, w) for w in os.listdir(wheels) if w.endswith(".whl")]],
                       check=True, capture_output=True)
    return [os.path.join(venv, "bin", "gpuwatch")]


def best_of(runs: int, cmds: dict[str, list[str]]) -> dict[str, dict]:
    """The fastest of `runs` runs of each command, the commands taking turns (so that each sees the same
    load on a shared machine; the minimum is the least disturbed run), with the range of wall times."""
    results: dict[str, list[dict]] = {name: [] for name in cmds}
    for _ in range(runs):
        for name, cmd in cmds.items():
            result = measure(cmd)
            if result["rc"] != 0:
                raise SystemExit(f"command failed: {' '.join(cmd)}")
            results[name].append(result)
    best = {}
    for name, found in results.items():
        pick = dict(min(found, key=lambda r: r["wall_s"]))
        pick["walls"] = sorted(r["wall_s"] for r in found)
        pick["cpu_s"] = min(r["cpu_s"] for r in found)
        best[name] = pick
    return best


def _load() -> str:
    """The 1-minute load average: the machine may be shared, and timings mean little without it."""
    return f"{os.getloadavg()[0]:.2f}"


STARTUP = ["-c", "import gpuwatch.apps.cli, gpuwatch.apps.analyze_cli, gpuwatch.efficiency.traces.kineto"]


def compare(label: str, folder: str, size_mb: float, runs: int, python: str | None, gpuwatch: list[str],
            old: list[str] | None) -> dict:
    """gpuwatch (the installed command `gpuwatch`, and this interpreter's `python -m gpuwatch`) and HTA on one
    folder, side by side (and gpuwatch's start-up alone); prints one table row per tool."""
    load_before = _load()
    cmds = {"gpuwatch": [*gpuwatch, "analyze", folder, "--json"],
            "dev": [sys.executable, "-m", "gpuwatch", "analyze", folder, "--json"],
            "startup": [os.path.join(os.path.dirname(gpuwatch[0]), "python"), *STARTUP],
            "bare": [os.path.join(os.path.dirname(gpuwatch[0]), "python"), "-c", "pass"],
            "dev_bare": [sys.executable, "-c", "pass"]}
    if old:
        cmds["old"] = [*old, "analyze", folder, "--json"]
    if python:
        cmds["hta"] = [python, "-c", HTA_SCRIPT, folder]
        cmds["hta_bare"] = [python, "-c", "pass"]
    best = best_of(runs, cmds)
    gw, hta = best["gpuwatch"], best.get("hta")
    print(f"\n{label} ({size_mb:.1f} MB on disk); best of {runs}, taking turns; load average before {load_before}, "
          f"after {_load()}")
    print(f"{'tool':<26}{'wall s (best)':>14}  {'all runs':<42}{'CPU s (tree)':>14}{'peak MB (tree)':>16}")
    for name, row in (("gpuwatch analyze --json", gw), ("HTA 0.5.0 temporal", hta),
                      ("(python -m gpuwatch, dev)", best["dev"]), ("(older tree, installed)", best.get("old"))):
        if row is not None:
            walls = ", ".join(f"{w:.3f}" for w in row["walls"])  # ms matter: a small trace runs in 0.2 s
            print(f"{name:<26}{row['wall_s']:>14.3f}  {walls:<42}{row['cpu_s']:>14.3f}{row['peak_mb']:>16.0f}")
    if hta is not None:
        print(f"speed-up {hta['wall_s'] / gw['wall_s']:.1f}x wall, {hta['cpu_s'] / gw['cpu_s']:.1f}x CPU time; "
              f"memory {gw['peak_mb'] / hta['peak_mb']:.2f}x of HTA; "
              f"development venv {hta['wall_s'] / best['dev']['wall_s']:.1f}x wall")
        print(f"bare interpreter start-up (`python -c pass`): gpuwatch's {best['bare']['wall_s']:.3f} s wall / "
              f"{best['bare']['cpu_s']:.3f} s CPU, "
              f"HTA's {best['hta_bare']['wall_s']:.3f} / {best['hta_bare']['cpu_s']:.3f} s, "
              f"the development venv's {best['dev_bare']['wall_s']:.3f} / {best['dev_bare']['cpu_s']:.3f} s "
              f"(this machine's "
              f".pth hooks and the editable install's finder)")
    return {"gpuwatch": gw, "hta": hta, "startup": best["startup"]}


def single(trace: str, runs: int, python: str | None, gpuwatch: list[str], old: list[str] | None) -> None:
    folder = tempfile.mkdtemp(prefix="gw-bench-")
    try:
        os.symlink(os.path.abspath(trace), os.path.join(folder, os.path.basename(trace)))
        result = compare(f"trace {os.path.relpath(trace, ROOT)}", folder, os.path.getsize(trace) / 1e6, runs, python,
                         gpuwatch, old)
        window = json.loads(measure([sys.executable, "-c", GPUWATCH_WINDOW, folder])["stdout"])[0]
        _print_window(window, json.loads(result["hta"]["stdout"])[0] if result["hta"] else None)
        phases = json.loads(subprocess.run([sys.executable, "-c", PHASES, trace], capture_output=True, text=True,
                                           check=True).stdout)
        _print_phases(phases, result["gpuwatch"]["wall_s"], result["startup"]["wall_s"])
    finally:
        shutil.rmtree(folder)


def _print_window(gw: dict, hta: dict | None) -> None:
    b, w = gw["breakdown_us"], gw["window_us"]
    idle = b["small_kernel_overhead"] + b["host_stall"] + b["idle_other"]
    print(f"gpuwatch --steps hta: window {w / 1000:.1f} ms, compute {100 * b['compute'] / w:.2f} %, "
          f"idle {100 * idle / w:.2f} %")
    if hta is not None:
        hw = hta["kernel_time(us)"]
        d_compute = 100 * abs(b["compute"] - hta["compute_time(us)"]) / w
        d_idle = 100 * abs(idle - hta["idle_time(us)"]) / w
        print(f"HTA: window {hw / 1000:.1f} ms, compute {hta['compute_time_pctg']:.2f} %, "
              f"idle {hta['idle_time_pctg']:.2f} %")
        print(f"agreement: compute differs by {d_compute:.3f} % of the window, idle by {d_idle:.3f} % "
              "(target <= 0.5 %)")
        if max(d_compute, d_idle) > 0.5:
            print("  (HTA rounds fractional-us timestamps inward, shrinking every kernel, and counts cuda_sync "
                  "events as GPU busy: docs/efficiency.md, 'Agreement with HolisticTraceAnalysis')")


def _print_phases(p: dict, wall: float, startup: float) -> None:
    """Where the time goes, and how close the reader is to the floor of decompressing and parsing."""
    print("where gpuwatch's time goes (each phase alone, best of 5, in one process):")
    print(f"  interpreter start-up + imports {startup:.3f} s of the {wall:.3f} s whole process (measured taking turns)")
    print(f"  decompression alone: zlib {p['gunzip_zlib_s']:.3f} s, "
          f"ISA-L (what gpuwatch uses) {p['gunzip_isal_s']:.3f} s")
    print(f"  floor of reading everything: gzip.decompress + orjson.loads {p['bare_floor_s']:.3f} s; "
          f"ISA-L + orjson.loads with the cycle collector paused {p['best_floor_s']:.3f} s")
    needed = p["gunzip_isal_s"] + p["kept_decode_s"]
    print(f"  floor of reading what gpuwatch needs, as if finding those events cost nothing: ISA-L + a parse of only "
          f"the events it keeps ({p['kept_mb']:.1f} MB compact): "
          f"orjson.loads {p['gunzip_isal_s'] + p['kept_parse_s']:.3f} s, "
          f"msgspec into the reader's structs (what gpuwatch does) {needed:.3f} s")
    print(f"  gpuwatch stream (decompress + filter + parse of the events it needs) {p['stream_s']:.3f} s = "
          f"{p['stream_s'] / p['bare_floor_s']:.2f}x of the bare floor, "
          f"{p['stream_s'] / p['best_floor_s']:.2f}x of the best, "
          f"{p['stream_s'] / needed:.2f}x of the floor of what it needs")
    print(f"  load (stream + columns + launch/step/collective joins) {p['load_s']:.3f} s; "
          f"classification and breakdown {p['breakdown_s']:.3f} s; what-if {p['what_if_s']:.3f} s; "
          f"JSON output {p['output_s']:.3f} s")


def build_synthetic(trace: str, folder: str, target_mb: int, ranks: int = 8) -> int:
    """Write `ranks` plain-JSON traces of ~target_mb/ranks MB each, by repeating the real trace's events
    shifted in time (and per rank by a few us), with correlation ids kept unique. Returns bytes written."""
    with gzip.open(trace, "rb") as f:
        doc = orjson.loads(f.read())
    events = doc.pop("traceEvents")
    one_copy = len(orjson.dumps(events))
    copies = max(1, round(target_mb * 1e6 / ranks / one_copy))
    ts = [e["ts"] for e in events if "ts" in e and isinstance(e["ts"], (int, float))]
    span = max(ts) - min(ts) + 1000
    total = 0
    for rank in range(ranks):
        path = os.path.join(folder, f"rank{rank}.json")
        head = {**doc, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": ranks}}
        with open(path, "wb") as out:
            # json, not orjson: HTA finds a file's rank with the regex `"rank":\s+(\d+)`, which needs the space
            # (without it every file is rank 0 and HTA silently analyses one of them).
            out.write(json.dumps(head).encode()[:-1] + b', "traceEvents": [\n')
            for copy in range(copies):
                shift, corr_shift = copy * span + rank * 7, copy * 10_000_000
                shifted = [_shift(e, shift, corr_shift) for e in events]
                chunk = orjson.dumps(shifted, option=orjson.OPT_INDENT_2)[1:-1].strip()
                out.write((b",\n" if copy else b"") + chunk)
            out.write(b"\n]}\n")
        total += os.path.getsize(path)
    return total


def _shift(e: dict, shift: float, corr_shift: int) -> dict:
    e = dict(e)
    if isinstance(e.get("ts"), (int, float)):
        e["ts"] = e["ts"] + shift
    args = e.get("args")
    if isinstance(args, dict) and isinstance(args.get("correlation"), int):
        e["args"] = {**args, "correlation": args["correlation"] + corr_shift}
    if e.get("name", "").startswith("ProfilerStep#"):
        e["name"] = f"ProfilerStep#{int(e['name'][13:]) + corr_shift // 1000}"
    return e


def multi(trace: str, target_mb: int, runs: int, python: str | None, gpuwatch: list[str], old: list[str] | None,
          keep: str | None) -> None:
    folder = keep or tempfile.mkdtemp(prefix="gw-bench-multi-")
    os.makedirs(folder, exist_ok=True)
    try:
        size = build_synthetic(trace, folder, target_mb)
        result = compare(f"8-rank set built from {os.path.basename(os.path.dirname(trace))}", folder, size / 1e6,
                         runs, python, gpuwatch, old)
        gw_ranks = len(json.loads(result["gpuwatch"]["stdout"])["ranks"])
        hta_ranks = len(json.loads(result["hta"]["stdout"])) if result["hta"] else None
        print(f"ranks analysed: gpuwatch {gw_ranks}, HTA {hta_ranks}")
    finally:
        if not keep:
            shutil.rmtree(folder)


def compile_sources() -> None:
    """Byte-compile the project's sources, as a regular (non-editable) install does: an editable install
    run with PYTHONDONTWRITEBYTECODE=1 (as on the shared test machine) compiles every module on every run,
    while HTA's site-packages come compiled by pip."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-x", r"/\.", ROOT], check=True, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", action="append", help="a single real trace (repeatable); default: two shared traces")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--multi-runs", type=int, default=2)
    parser.add_argument("--multi-mb", type=int, default=450, help="size of the 8-rank set; 0 skips it")
    parser.add_argument("--no-hta", action="store_true")
    parser.add_argument("--hta-venv", default=os.environ.get("GPUWATCH_HTA_VENV", VENV),
                        help=f"venv holding (or to hold) HTA 0.5.0, if this interpreter has none (default {VENV}, "
                             "or $GPUWATCH_HTA_VENV)")
    parser.add_argument("--gpuwatch-venv", default=GW_VENV,
                        help=f"venv to install this tree's gpuwatch into, as a user would (default {GW_VENV})")
    parser.add_argument("--old-tree", metavar="DIR", help="also time the gpuwatch of this tree (e.g. a "
                        "`git worktree add DIR COMMIT`), installed the same way: before/after in one run")
    parser.add_argument("--keep", help="write the 8-rank set here and keep it")
    parser.add_argument("--only-multi", action="store_true", help="skip the single traces")
    args = parser.parse_args()
    python = hta_python(not args.no_hta, args.hta_venv)
    gpuwatch = gpuwatch_command(args.gpuwatch_venv)
    old = gpuwatch_command(args.gpuwatch_venv + "-old", args.old_tree) if args.old_tree else None
    compile_sources()
    started = time.perf_counter()
    for trace in [] if args.only_multi else args.trace or DEFAULT_TRACES:
        single(trace, args.runs, python, gpuwatch, old)
    if args.multi_mb:
        multi((args.trace or DEFAULT_TRACES)[0], args.multi_mb, args.multi_runs, python, gpuwatch, old, args.keep)
    print(f"\nbench took {time.perf_counter() - started:.0f} s; load average now {_load()}")


if __name__ == "__main__":
    main()
