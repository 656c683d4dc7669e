"""`gpuwatch analyze` through the real CLI dispatcher: --json keys, reports, errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from gpuwatch.apps.cli import main
from gpuwatch.apps.analyze_cli import format_table
from gpuwatch.core.vocabulary import BREAKDOWN_CATEGORIES
from gpuwatch.efficiency.result import Analysis
from helpers import KINETO_DATA

DATA = KINETO_DATA
SAMPLED = os.path.join(DATA, "sampled_2ranks_of128")
CATEGORIES = set(BREAKDOWN_CATEGORIES)


def test_json_document_keys(capsys, tmp_path):
    html, perfetto = tmp_path / "r.html", tmp_path / "p.json"
    rc = main(["analyze", SAMPLED, "--json", "--per-step", "--flops-per-step", "1e14", "--peak-tflops", "312",
               "--gpu-hour-price", "2.5", "--html", str(html), "--perfetto", str(perfetto)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"ranks", "job", "stragglers", "delayed", "matched_collectives"} <= set(doc)
    for r in doc["ranks"]:
        assert {"rank", "window_us", "breakdown_us", "comm_overlapped_us", "overlap_ratio", "short_kernels",
                "per_step"} <= set(r)
        assert set(r["breakdown_us"]) == CATEGORIES
        assert set(r["short_kernels"]) == {"count", "time_us"}
        assert sum(r["breakdown_us"].values()) == r["window_us"]
        assert [s["step"] for s in r["per_step"]] == [551, 552]
    assert set(doc["job"]["breakdown_us"]) == set(doc["job"]["breakdown_fraction"]) == CATEGORIES
    assert doc["job"]["lost_gpu_hours"] > 0 and doc["job"]["lost_cost"] == doc["job"]["lost_gpu_hours"] * 2.5
    assert doc["matched_collectives"] == 10
    page = html.read_text()
    assert "<svg" in page and "http" not in page.replace("http-equiv", "")
    trace = json.loads(perfetto.read_text())
    tracks = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {pid for pid, _ in tracks} == {0, 1}
    categories = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 0 and e["cat"] in CATEGORIES]
    busy = sum(e["dur"] for e in categories)
    assert abs(busy - doc["ranks"][0]["window_us"]) < 1e-6 * busy
    kernels = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] not in CATEGORIES]
    assert len(kernels) == doc["window"]["activities"]
    comm = [e for e in kernels if e["args"].get("collective") == "all_to_all"]
    assert comm and all(e["name"].startswith("ncclKernel_SendRecv") and e["args"]["stream"] >= 0 for e in comm)
    assert all("correlation" in e["args"] and "launch_us" in e["args"] for e in kernels)


def test_the_process_ends_at_once_with_its_output_whole(tmp_path):
    """As a process, `analyze` writes all of its output (stdout through a pipe, the report files), the same
    as a library call of `main` prints; an error still exits 2, and a closed pipe still ends quietly."""
    html, perfetto = tmp_path / "r.html", tmp_path / "p.json"
    args = ["analyze", SAMPLED, "--per-step"]
    buffered = {**os.environ, "PYTHONUNBUFFERED": ""}  # as a user's shell has it: output waits in a buffer

    def process(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gpuwatch", *args, *extra], capture_output=True, text=True,
                              cwd=tmp_path, env=buffered)

    def library_call(*extra: str) -> str:
        code = f"import sys; from gpuwatch.apps.cli import main; sys.exit(main({[*args, *extra]!r}))"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                              check=True).stdout

    done = process("--json", "--html", str(html), "--perfetto", str(perfetto))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == json.loads(library_call("--json"))
    assert html.read_text().rstrip().endswith("</html>")
    assert len(json.loads(perfetto.read_text())["traceEvents"]) > 100
    table = process()
    assert table.returncode == 0 and table.stdout == library_call() and "GPU-hours" in table.stdout
    missing = subprocess.run([sys.executable, "-m", "gpuwatch", "analyze", str(tmp_path / "nope.json")],
                             capture_output=True, text=True, cwd=tmp_path)
    assert missing.returncode == 2 and "no such file" in missing.stderr
    closed = subprocess.run(f"{sys.executable} -m gpuwatch {' '.join(args)} --json | head -c 10", shell=True,
                            capture_output=True, text=True, cwd=tmp_path, env=buffered)
    assert closed.stdout == done.stdout[:10] and "Traceback" not in closed.stderr



def test_table_output_and_errors(capsys, tmp_path):
    assert main(["analyze", SAMPLED]) == 0
    out = capsys.readouterr().out
    assert "rank 0" in out and "rank 1" in out and "compute" in out
    assert main(["analyze", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "missing.json: no such file" in err and "Traceback" not in err
    assert main(["analyze", SAMPLED, "--peak-tflops", "-1"]) == 2
    assert "--peak-tflops must be positive" in capsys.readouterr().err


def test_mfu_needs_both_flops_and_peak(capsys):
    for flag, value in (("--flops-per-step", "1e14"), ("--peak-tflops", "312")):
        assert main(["analyze", SAMPLED, flag, value]) == 2
        err = capsys.readouterr().err
        assert "MFU needs both --flops-per-step and --peak-tflops" in err and len(err.strip().splitlines()) == 1


def test_table_columns_are_whole_names_in_one_order_and_the_biggest_losses_are_named(capsys):
    """Every trace's table has the same columns in the spec's order (reports compare column by column), names
    uncut; the line after the table names the biggest losses."""
    assert main(["analyze", SAMPLED, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for trace in (SAMPLED, os.path.join(DATA, "control_rank3_of8")):
        assert main(["analyze", trace]) == 0
        header = capsys.readouterr().out.splitlines()[0]
        assert header.split("|")[1].split() == [c for c in BREAKDOWN_CATEGORIES if c != "compute"]
        assert header.split("|")[0].split()[-1] == "compute"  # compute apart from the losses
    assert main(["analyze", SAMPLED]) == 0
    header, job_row, *rest = capsys.readouterr().out.splitlines()
    cells = [float(c.rstrip("%")) for c in job_row.split("|")[1].split()]
    lost = [c for c in BREAKDOWN_CATEGORIES if c != "compute"]
    assert cells == [round(100 * doc["job"]["breakdown_fraction"][c], 2) for c in lost]
    by_size = [c for c in sorted(lost, key=lambda c: -doc["job"]["breakdown_us"][c])
               if doc["job"]["breakdown_us"][c] > 0][:3]
    (named,) = [line for line in rest if line.startswith("biggest losses: ")]
    assert [part.split()[0] for part in named.removeprefix("biggest losses: ").split(", ")] == by_size
    rank_rows = [line for line in rest if line.strip().startswith("rank ") and "|" in line]
    lost_ms = [float(line.split()[3]) for line in rank_rows]
    assert len(lost_ms) == len(doc["ranks"]) and lost_ms == sorted(lost_ms, reverse=True)
    expected = sorted(doc["ranks"], key=lambda r: -r["lost_us"])
    assert [int(line.split()[1]) for line in rank_rows] == [r["rank"] for r in expected]


def test_table_ranks_the_rank_that_lost_most_first(capsys):
    assert main(["analyze", SAMPLED, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    doc["ranks"][1]["lost_us"] = doc["ranks"][0]["lost_us"] + 1000.0  # rank 1 now loses more than rank 0
    table = format_table(Analysis.from_json(doc))
    rows = [line.split()[1] for line in table.splitlines() if line.strip().startswith("rank ")]
    assert rows[:2] == ["1", "0"]


def test_the_gpuwatch_process_writes_what_a_library_call_writes(capsys, tmp_path):
    """The document of `gpuwatch analyze` as a process (its workers reading the files) is that of a library
    call of `main`, byte for byte."""
    for trace in (SAMPLED, os.path.join(DATA, "ns_resolution_rank0")):
        assert main(["analyze", trace, "--json"]) == 0
        in_process = capsys.readouterr().out
        ran = subprocess.run([sys.executable, "-m", "gpuwatch", "analyze", trace, "--json"],
                             capture_output=True, text=True, cwd=tmp_path)
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout == in_process and json.loads(ran.stdout)["ranks"]



_KERNEL = {"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 2, "pid": 0, "tid": 7,
           "args": {"device": 0, "stream": 7}}


def test_analyze_words_for_arrays_nulls_reversed_steps_and_a_longer_ideal(capsys, tmp_path):
    # the bare JSON Array Format may end without its `]` (Trace Event Format): not "truncated"
    bare = tmp_path / "rank0.json"
    bare.write_text("[\n" + ",\n".join(json.dumps(e) for e in (_KERNEL, {**_KERNEL, "ts": 5})) + ",\n")
    assert main(["analyze", str(bare)]) == 0
    assert "truncated" not in capsys.readouterr().err
    cut = tmp_path / "cut_rank0.json"
    cut.write_text(json.dumps([_KERNEL])[:-20])
    assert main(["analyze", str(cut)]) == 2
    assert "the array of events does not end" in capsys.readouterr().err
    # a null field is named in JSON's words, never Python's None
    for key in ("ts", "dur", "name"):
        trace = tmp_path / f"null_{key}_rank0.json"
        trace.write_text(json.dumps({"traceEvents": [{**_KERNEL, key: None}]}))
        assert main(["analyze", str(trace)]) == 2
        err = capsys.readouterr().err
        assert f"'{key}' is missing or null" in err and "None" not in err and len(err.splitlines()) == 1
    # a reversed step range is empty, said as such
    assert main(["analyze", SAMPLED, "--steps", "552:551"]) == 2
    err = capsys.readouterr().err
    assert "the range is empty" in err and "no GPU activity" not in err
    # an ideal longer than the step is explained, not shown bare beside a 1.000x
    assert main(["analyze", os.path.join(DATA, "control_rank3_of8"), "--json"]) == 0
    what_if = json.loads(capsys.readouterr().out)["what_if"]
    assert what_if["slowdown_unclamped"] < 1 and what_if["slowdown"] == 1
    assert main(["analyze", os.path.join(DATA, "control_rank3_of8")]) == 0
    assert "the ideal is longer than the step without launch delays" in capsys.readouterr().out
