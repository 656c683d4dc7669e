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
