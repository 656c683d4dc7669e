"""A function run in a forked copy of a one-shot process gives what a call gives: its value or its exception,
and leaves no child behind. Run in a fresh interpreter: the test process may hold gRPC's threads, and then
no fork is made (see `forkable`)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from helpers import KINETO_SAMPLED

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    from gpuwatch.efficiency.forking import Pending, forkable

    def where(x):
        return os.getpid(), x * 2

    def fails():
        raise ValueError("bad input 7")

    out = {"forkable": forkable(), "me": os.getpid()}
    forked, here = Pending(where, 21, fork=True), Pending(where, 21, fork=False)
    out["forked"], out["here"] = forked.result(), here.result()
    try:
        Pending(fails, fork=True).result()
    except ValueError as exc:
        out["raised"] = str(exc)
    cancelled = Pending(where, 1, fork=True)
    child = cancelled._pid
    cancelled.cancel()
    try:
        os.waitpid(child, os.WNOHANG)
        out["left"] = True
    except ChildProcessError:
        out["left"] = False
    print(json.dumps(out))
""")


@pytest.mark.skipif(sys.platform != "linux", reason="plain forks are used on Linux only")
def test_a_forked_call_returns_its_value_or_raises_and_leaves_no_child():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    out = json.loads(run.stdout)
    assert out["forkable"] is True
    pid, value = out["forked"]
    assert value == 42 and pid != out["me"]  # computed in a child
    assert out["here"] == [out["me"], 42]     # fork=False: computed here, when asked
    assert out["raised"] == "bad input 7"
    assert out["left"] is False


def test_a_child_that_dies_before_answering_is_computed_again_here():
    script = textwrap.dedent("""
        import os, signal
        from gpuwatch.efficiency.forking import Pending

        parent = os.getpid()

        def once():
            if os.getpid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)  # the child dies without a word
            return "here"

        print(Pending(once, fork=True).result())
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "here"


def test_the_what_if_of_a_large_job_runs_beside_the_analysis_with_the_same_result(tmp_path):
    """`analyze(fork=True)` on a job at the fork threshold: the what-if is computed in a child (it records
    the pid it ran in) and the document is the one `fork=False` gives."""
    script = textwrap.dedent(f"""
        import json, os
        from gpuwatch.efficiency import engine
        from gpuwatch.efficiency.load import load_paths

        timelines = load_paths([{json.dumps(KINETO_SAMPLED)}])
        real = engine.what_if

        def recorded(*args):
            with open({json.dumps(str(tmp_path / "pids"))}, "a") as f:
                f.write(f"{{os.getpid()}}\\n")
            return real(*args)

        engine.what_if = recorded
        engine.FORK_WHAT_IF_OPS = sum(len(tl) for tl in timelines)
        forked = engine.analyze(timelines, fork=True).to_json()
        here = engine.analyze(timelines, fork=False).to_json()
        print(json.dumps({{"same": forked == here, "me": os.getpid(), "slowdown": forked["what_if"]["slowdown"]}}))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    out = json.loads(run.stdout)
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert out["same"] is True and out["slowdown"] >= 1.0
    if sys.platform == "linux":
        assert len(pids) == 2 and pids[0] != out["me"] and pids[1] == out["me"]


@pytest.mark.skipif(sys.platform != "linux", reason="plain forks are used on Linux only")
def test_a_forked_load_shares_the_files_with_a_copy_and_reads_what_one_process_reads(tmp_path):
    """`load_paths(fork=True)` reads one share of the files here and the other in a forked copy (each file
    records the pid that read it); the timelines are those one process reads, in file order. A broken
    file in either share is one clear error, and no copy is left behind."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for rank, text in ((0, '{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 2}]}'),
                       (1, '{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": "late"}]}')):
        (broken / f"rank{rank}.json").write_text(text)
    script = textwrap.dedent(f"""
        import json, os
        import numpy as np
        from gpuwatch.core.errors import UserError
        from gpuwatch.efficiency import load

        real = load.load_file

        def recorded(path, **kwargs):
            found = real(path, **kwargs)
            for tl in found:
                tl.trace_meta["read_by"] = os.getpid()
            return found

        load.load_file = recorded
        forked = load.load_paths([{json.dumps(KINETO_SAMPLED)}], fork=True)
        alone = load.load_paths([{json.dumps(KINETO_SAMPLED)}], workers=1)
        same = all(np.array_equal(getattr(a, c), getattr(b, c), equal_nan=True) for a, b in zip(forked, alone)
                   for c in ("start_us", "end_us", "kind", "launch_us", "step", "coll_type", "seq", "name"))
        try:
            load.load_paths([{json.dumps(str(broken))}], fork=True)
            error = None
        except UserError as exc:
            error = str(exc)
        try:
            os.waitpid(-1, os.WNOHANG)
            left = True
        except ChildProcessError:
            left = False
        print(json.dumps({{"me": os.getpid(), "readers": [tl.trace_meta["read_by"] for tl in forked],
                          "ranks": [tl.rank for tl in forked], "same": same, "error": error, "left": left}}))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    out = json.loads(run.stdout)
    assert out["ranks"] == [0, 1] and out["same"] is True
    assert out["readers"].count(out["me"]) == 1 and len(set(out["readers"])) == 2  # one here, one in a copy
    assert "rank1.json: malformed trace event" in out["error"] and "\n" not in out["error"]
    assert out["left"] is False
