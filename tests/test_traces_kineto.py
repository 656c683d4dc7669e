"""Kineto loading: real traces from the shared data set (../shared/data/kineto) (against HTA's numbers) and
constructed ones."""
from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path
from collections import Counter

import numpy as np
import pytest

from gpuwatch.efficiency import analyze, load_paths
from gpuwatch.efficiency.timeline import COLLECTIVE, P2P
from gpuwatch.efficiency.traces.collectives import is_comm_kernel
from gpuwatch.efficiency.traces.kineto import load_kineto
from gpuwatch.core.errors import UserError
from helpers import KINETO_DATA

DATA = KINETO_DATA
CONTROL = os.path.join(DATA, "control_rank3_of8", "rank3.json.gz")
SAMPLED = os.path.join(DATA, "sampled_2ranks_of128")


def hta_window(tl):
    """HTA drops the last ProfilerStep: keep GPU work launched before the last step annotation began."""
    return tl.select(tl.launch_us < tl.step_marks[:, 1].max())


def idle_and_compute_pct(entry):
    b, w = entry["breakdown_us"], entry["window_us"]
    return 100 * (b["small_kernel_overhead"] + b["host_stall"] + b["idle_other"]) / w, 100 * b["compute"] / w


@pytest.fixture(scope="module")
def control():
    return load_kineto(CONTROL)


def test_control_trace_partition_and_collective_types(control):
    assert (control.rank, control.world_size) == (3, 8)
    assert len(control) == 8568 + 654 + 228
    comm = control.kind >= COLLECTIVE
    assert Counter(control.type_names()[comm]) == {"all_to_all": 42, "all_reduce": 18}
    assert not (control.kind == P2P).any()  # SendRecv under nccl:all_to_all is a collective
    assert set(control.step.tolist()) == {1009, 1010, 1011, 1012, 1013, 1014}
    entry = analyze([control], per_step=True).to_json()["ranks"][0]
    assert sum(entry["breakdown_us"].values()) == entry["window_us"]
    assert len(entry["per_step"]) == 6


@pytest.mark.parametrize("path, rank, window_ms, idle_pct, compute_pct, overlap_pct", [
    (CONTROL, 3, 383.4, 16.20, 61.23, 47.03),
    (os.path.join(SAMPLED, "rank0.json.gz"), 0, 600.1, 53.56, 17.71, 11.81),
    (os.path.join(SAMPLED, "rank1.json.gz"), 1, 600.7, 54.72, 22.57, 20.05),
])
def test_agrees_with_hta_temporal_breakdown(path, rank, window_ms, idle_pct, compute_pct, overlap_pct):
    """HTA 0.5.0 numbers (docs/efficiency.md, "Agreement with HolisticTraceAnalysis") on the same window, within
    0.5 % of the window."""
    entry = analyze([hta_window(load_kineto(path))]).to_json()["ranks"][0]
    assert entry["rank"] == rank
    assert entry["window_us"] / 1000 == pytest.approx(window_ms, abs=0.05)
    idle, compute = idle_and_compute_pct(entry)
    assert idle == pytest.approx(idle_pct, abs=0.5)
    assert compute == pytest.approx(compute_pct, abs=0.5)
    assert 100 * entry["overlap_ratio"] == pytest.approx(overlap_pct, abs=0.5)


def test_sampled_ranks_matched_against_each_other():
    tls = load_paths([SAMPLED])
    assert [tl.rank for tl in tls] == [0, 1]
    doc = analyze(tls).to_json()
    assert doc["matched_collectives"] == 10  # 4 all_to_all + 4 all_reduce + 2 all_gather, by order
    waits = [r["breakdown_us"]["comm_wait"] for r in doc["ranks"]]
    assert all(w > 0 for w in waits)
    for r in doc["ranks"]:
        assert sum(r["breakdown_us"].values()) == r["window_us"]


def test_small_blocks_stream_to_the_same_timeline(control, monkeypatch):
    import gpuwatch.efficiency.traces.eventstream as eventstream

    monkeypatch.setattr(eventstream, "BLOCK_BYTES", 64 << 10)
    small = load_kineto(CONTROL)
    np.testing.assert_array_equal(small.start_us, control.start_us)
    np.testing.assert_array_equal(small.coll_type, control.coll_type)
    np.testing.assert_array_equal(small.step, control.step)


# ---- constructed traces -------------------------------------------------------------------------------

def _launch(corr, ts, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": tid, "ts": ts, "dur": 2,
            "args": {"correlation": corr}}


def _kernel(corr, name, ts, dur, stream=7, **args):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "stream": stream, **args}}


def _op(name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def write_trace(path, events, rank=0, world=2, gz=False, minified=False):
    doc = {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world},
           "traceEvents": events, "displayTimeUnit": "ms"}
    text = json.dumps(doc) if minified else json.dumps(doc, indent=2)
    opener = gzip.open if gz else open
    with opener(path, "wt") as f:
        f.write(text)
    return str(path)


COMM_EVENTS = [
    {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#5", "pid": 1, "tid": 1, "ts": 0, "dur": 1000,
     "args": {}},
    _op("nccl:all_to_all", 10, 20), _launch(1, 12), _kernel(1, "ncclDevKernel_SendRecv(ncclDevComm*)", 100, 50, 20),
    _op("nccl:send", 30, 20), _launch(2, 32), _kernel(2, "ncclKernel_SendRecv_RING", 200, 50, 20),
    _launch(3, 60), _kernel(3, "nccldevkernel_sendrecv", 300, 50, 20),
    _launch(4, 70), _kernel(4, "some_kernel", 400, 50, 20, **{"Collective name": "allreduce", "Process Group Name": "3",
                                                             "Seq": 9, "In msg nelems": 10, "dtype": "Float"}),
    _op("record_param_comms", 75, 10, **{"Collective name": "_allgather_base", "Seq": 4, "Process Group Name": "0"}),
    _launch(5, 80), _kernel(5, "ncclDevKernel_Generic", 500, 10, 20),
    _launch(6, 90), _kernel(6, "void gemm()", 10, 80),
    {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "pid": 0, "tid": 7, "ts": 95, "dur": 1,
     "args": {"stream": 7, "correlation": 77}},
]


@pytest.mark.parametrize("gz, minified", [(False, False), (True, True)])
def test_collective_type_resolution_order(tmp_path, gz, minified):
    tl = load_kineto(write_trace(tmp_path / "t.json", COMM_EVENTS, gz=gz, minified=minified))
    names = list(tl.type_names())
    # The third SendRecv has a launch but no enclosing op and no args: no evidence of p2p, type unknown.
    assert names[:5] == ["all_to_all", "send", "unknown", "all_reduce", "all_gather"]
    assert list(tl.kind[:5]) == [COLLECTIVE, P2P, COLLECTIVE, COLLECTIVE, COLLECTIVE]
    assert tl.group_names()[3] == "3" and tl.seq[3] == 9 and tl.nbytes[3] == 40
    assert tl.group_names()[4] == "0" and tl.seq[4] == 4
    assert list(tl.step[:5]) == [5, 5, 5, 5, 5]
    assert np.isnan(tl.launch_us[-1])  # the memset's correlation has no launch event


def test_bad_inputs_name_the_file(tmp_path):
    good = write_trace(tmp_path / "good.json", COMM_EVENTS)
    truncated = tmp_path / "cut.json"
    truncated.write_bytes(Path(good).read_bytes()[:-400])
    with pytest.raises(UserError, match="cut.json: truncated"):
        load_kineto(str(truncated))
    cpu_only = write_trace(tmp_path / "cpu.json", [_op("aten::mm", 0, 5)])
    with pytest.raises(UserError, match="cpu.json: no GPU activity"):
        load_kineto(cpu_only)
    not_trace = tmp_path / "x.json"
    not_trace.write_text('{"hello": 1}')
    with pytest.raises(UserError, match="x.json: not a Chrome/Kineto trace"):
        load_kineto(str(not_trace))
    for empty in (tmp_path / "empty.json.gz", tmp_path / "blank.json"):  # as a snapshot without LFS files has them
        empty.write_bytes(b"" if empty.suffix == ".gz" else b" \n")
        with pytest.raises(UserError, match=f"{empty.name}: empty file, not a trace"):
            load_kineto(str(empty))
    execution_trace = tmp_path / "et.json"
    execution_trace.write_text('{\n  "schema": "1.0.1", "pid": 5, "time": "2023-07-14 11:53:07",\n  "nodes": [\n'
                               '    {"name": "[pytorch|profiler|execution_trace|thread]", "id": 2}]}')
    with pytest.raises(UserError, match="et.json: a PyTorch execution trace .*, not a profiler trace"):
        load_kineto(str(execution_trace))
    pointer = tmp_path / "lfs.json.gz"
    pointer.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 12345\n")
    with pytest.raises(UserError, match="lfs.json.gz: a Git LFS pointer, not the trace itself"):
        load_kineto(str(pointer))
    bad_gz = tmp_path / "bad.json.gz"
    bad_gz.write_bytes(gzip.compress(Path(good).read_bytes())[:-50])
    with pytest.raises(UserError, match="bad.json.gz"):
        load_kineto(str(bad_gz))
    twin = write_trace(tmp_path / "twin.json", COMM_EVENTS)
    with pytest.raises(UserError, match="rank 0 given twice"):
        analyze(load_paths([good, twin]))
    other_job = write_trace(tmp_path / "other.json", COMM_EVENTS, rank=1, world=16)
    with pytest.raises(UserError, match="different jobs"):
        analyze(load_paths([good, other_job]))


@pytest.mark.parametrize("name", ["ncclDevKernel_AllGather_RING_LL", "NCCLKERNEL_x", "void RCCL<float>", "hcclSend",
                                  "cross_device_reduce_1stage", "UserBuffers_fp8", "ampere_sgemm_128x64", "n_ccl",
                                  "kernel_\u212a_nccl", "NCC\u0141", "USERBUFFER\u017f"])
def test_comm_kernel_names_read_as_by_the_case_insensitive_pattern(name):
    """The fast path for ASCII names (lower-case, then `in`) answers as the case-insensitive expression does,
    and names with other characters are left to the expression."""
    expected = re.search("nccl|rccl|hccl|cross_device_reduce|userbuffers", name, re.IGNORECASE) is not None
    assert is_comm_kernel(name) == expected


def test_the_library_reads_in_the_callers_process_and_a_pool_reads_the_same(monkeypatch):
    """`load_paths` starts no process and leaves no thread behind; an application's process pool, passed as
    `map_files`, reads the same timelines in the same order."""
    import multiprocessing
    import threading
    from concurrent.futures import ProcessPoolExecutor

    monkeypatch.setattr(os, "fork", lambda: pytest.fail("the library forked"))
    threads = threading.active_count()
    here = load_paths([SAMPLED])
    assert not multiprocessing.active_children() and threading.active_count() == threads
    monkeypatch.undo()
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        pooled = load_paths([SAMPLED], map_files=pool.map)
    assert [tl.rank for tl in pooled] == [tl.rank for tl in here] == [0, 1]
    for a, b in zip(pooled, here):
        for column in ("start_us", "end_us", "kind", "launch_us", "step", "coll_type", "seq", "name"):
            np.testing.assert_array_equal(getattr(a, column), getattr(b, column))
