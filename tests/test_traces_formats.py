"""Every Kineto spelling HolisticTraceAnalysis reads (old categories, MTIA), point-to-point only with
evidence, coverage said plainly (ranks present, sampling, the straggler verdict, comm_wait as a lower
bound), the analysed window and --steps, and p2p pairing by `Process Group Ranks` and `Seq`."""
from __future__ import annotations

import gzip
import json
import os
import re

import orjson
import pytest

from gpuwatch.apps.cli import main
from gpuwatch.efficiency import analyze, load_paths, whatif
from gpuwatch.efficiency.matching import collectives_of, match_collectives
from gpuwatch.efficiency.timeline import COLLECTIVE, COMPUTE, MEMCPY, P2P
from gpuwatch.efficiency.traces.kineto import load_kineto
from gpuwatch.core.errors import UserError
from helpers import KINETO_DATA

DATA = KINETO_DATA
CONTROL = os.path.join(DATA, "control_rank3_of8", "rank3.json.gz")
SAMPLED = os.path.join(DATA, "sampled_2ranks_of128")
OLD_CATEGORIES = {"kernel": "Kernel", "gpu_memcpy": "Memcpy", "gpu_memset": "Memset", "cuda_runtime": "Runtime"}


def _read(path: str) -> dict:
    with gzip.open(path, "rb") as f:
        return orjson.loads(f.read())


def _write(path, doc: dict) -> str:
    with open(path, "wb") as f:
        f.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return str(path)


def test_old_kineto_categories_read_like_the_new_ones(tmp_path):
    """The same real trace spelt with the old categories (`Kernel`, `Memcpy`, `Memset`, `Runtime`, plus
    the `async_gpu` flow arrows of that era) gives the same breakdown, to the nanosecond."""
    doc = _read(os.path.join(SAMPLED, "rank0.json.gz"))
    for e in doc["traceEvents"]:
        e["cat"] = OLD_CATEGORIES.get(e.get("cat"), e.get("cat"))
    doc["traceEvents"] += [{"ph": "s", "cat": "async_gpu", "name": "cudaLaunchKernel", "id": 1, "pid": 1, "tid": 1,
                            "ts": 1}]
    old = analyze([load_kineto(_write(tmp_path / "old_rank0.json", doc))]).to_json()
    new = analyze([load_kineto(os.path.join(SAMPLED, "rank0.json.gz"))]).to_json()
    assert old["ranks"][0]["breakdown_us"] == new["ranks"][0]["breakdown_us"]
    assert old["window"]["activities"] == new["window"]["activities"] > 1000


def _mtia_event(name, ts, dur, corr=None, stream=1):
    args = {"stream": stream} | ({"correlation": corr} if corr is not None else {})
    return {"ph": "X", "cat": "mtia_ccp_events", "name": name, "pid": 9, "tid": 4, "ts": ts, "dur": dur, "args": args}


def test_mtia_trace(tmp_path):
    events = [
        {"ph": "X", "cat": "mtia_runtime", "name": "runFunction - job_prep_and_submit_for_execution", "pid": 3,
         "tid": 3, "ts": 90, "dur": 5, "args": {"correlation": 11}},
        _mtia_event("fc-dtype_Float", 100, 50, corr=11),
        _mtia_event("dma_request", 150, 10),
        _mtia_event("event_wait", 160, 500),  # a synchronisation marker: not work
        _mtia_event("add-dtype_Float", 200, 20, corr=12),
    ]
    tl = load_kineto(_write(tmp_path / "mtia_rank0.json", {"traceEvents": events}))
    assert list(tl.kind) == [COMPUTE, MEMCPY, COMPUTE]
    assert list(tl.kernel_names()) == ["fc-dtype_Float", "dma_request", "add-dtype_Float"]
    assert tl.launch_us[0] == 90
    b = analyze([tl]).to_json()["ranks"][0]["breakdown_us"]
    assert b["compute"] == 70 and b["memcpy"] == 10 and b["idle_other"] == 40


def test_no_gpu_events_stays_a_clear_error(tmp_path):
    events = [{"ph": "X", "cat": "cuda_sync", "name": "Event Sync", "pid": 0, "tid": 7, "ts": 1, "dur": 5,
               "args": {"stream": 7}},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 9, "args": {}}]
    with pytest.raises(UserError, match="sync.json: no GPU activity in the trace"):
        load_kineto(_write(tmp_path / "sync.json", {"traceEvents": events}))


@pytest.mark.parametrize("key, value, named", [
    ("args", [1, 2], "got `array` - at `args`"),
    ("ts", "late", '\'ts\' is "late", not a number, in an event of category "kernel" named "k2"'),
    ("name", None, '\'name\' is missing or null, in an event of category "kernel" named null')])
def test_a_mistyped_key_of_an_event_read_is_one_clear_line(tmp_path, key, value, named):
    events = [{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 10, "dur": 5,
               "args": {"correlation": 1}},
              {"ph": "X", "cat": "kernel", "name": "k2", "pid": 0, "tid": 7, "ts": 20, "dur": 5,
               "args": {"correlation": 2}}]
    events[1][key] = value
    with pytest.raises(UserError, match=r"^\S*bad.json: malformed trace event \(.*" + re.escape(named)) as error:
        load_kineto(_write(tmp_path / "bad.json", {"traceEvents": events}))
    assert "\n" not in str(error.value) and "$[" not in str(error.value) and "None" not in str(error.value)


def test_launchless_sendrecv_is_never_a_bubble(tmp_path):
    """SendRecv kernels already running when profiling began (no launch record): they take the type the
    trace gives every other kernel of that name (all-to-all here); one that nothing types is
    communication of unknown type. Neither is a pipeline bubble."""
    doc = _read(CONTROL)
    sendrecv = [e for e in doc["traceEvents"] if e.get("cat") == "kernel" and "SendRecv" in e["name"]]
    orphaned = {e["args"]["correlation"] for e in sendrecv[:3]}
    sendrecv[3]["name"] = "ncclDevKernel_SendRecv_unseen"
    orphaned.add(sendrecv[3]["args"]["correlation"])
    doc["traceEvents"] = [e for e in doc["traceEvents"]
                          if not (e.get("cat") == "cuda_runtime" and e.get("args", {}).get("correlation") in orphaned)]
    tl = load_kineto(_write(tmp_path / "rank3.json", doc))
    types = tl.type_names()
    comm = tl.kind == COLLECTIVE
    assert not (tl.kind == P2P).any()
    assert sorted(set(types[comm])) == ["all_reduce", "all_to_all", "unknown"]
    assert (types == "unknown").sum() == 1
    result = analyze([tl]).to_json()
    assert result["ranks"][0]["breakdown_us"]["bubble"] == 0


def test_one_rank_of_eight_says_what_it_cannot_know(capsys):
    assert main(["analyze", CONTROL, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    cov = doc["coverage"]
    assert (cov["ranks_present"], cov["world_size"], cov["ranks"]) == (1, 8, [3])
    assert cov["complete"] is False and cov["comm_wait_lower_bound"] is True and cov["events_sampled"] is False
    assert doc["straggler_verdict"] == "undetermined"
    assert main(["analyze", CONTROL]) == 0
    text = capsys.readouterr().out
    assert "1 of 8 rank(s) present" in text and "comm_wait is a lower bound" in text
    assert "stragglers: undetermined" in text and "no stragglers" not in text
    assert "analysed window: every GPU activity" in text


def test_sampled_ranks_are_flagged(capsys):
    assert main(["analyze", SAMPLED, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["coverage"]["ranks_present"] == 2 and doc["coverage"]["world_size"] == 128
    assert doc["coverage"]["events_sampled"] is True
    assert doc["straggler_verdict"] == "undetermined"


def test_complete_job_gives_a_verdict(tmp_path):
    """Both ranks of a two-rank job: the verdict is `none` or `found`, never `undetermined`."""
    for rank in (0, 1):
        doc = _read(os.path.join(SAMPLED, f"rank{rank}.json.gz"))
        doc["distributedInfo"]["world_size"] = 2
        _write(tmp_path / f"rank{rank}.json", doc)
    result = analyze(load_paths([str(tmp_path)])).to_json()
    assert result["coverage"]["complete"] and not result["coverage"]["comm_wait_lower_bound"]
    assert result["straggler_verdict"] in ("none", "found")
    assert result["straggler_verdict"] == ("found" if result["stragglers"] else "none")


def test_window_stated_and_steps_picked(capsys):
    assert main(["analyze", CONTROL, "--json", "--steps", "hta"]) == 0
    hta = json.loads(capsys.readouterr().out)
    assert hta["window"]["selection"] == "hta" and hta["window"]["steps"] == [1009, 1010, 1011, 1012, 1013]
    assert round(hta["ranks"][0]["window_us"] / 1000, 1) == 383.4  # HTA's kernel_time on this trace
    assert main(["analyze", CONTROL, "--json", "--steps", "1010:1011"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["window"]["steps"] == [1010, 1011] and two["what_if"]["steps"] == 2
    assert main(["analyze", CONTROL, "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert full["window"]["selection"] == "all" and full["window"]["steps"][-1] == 1014
    assert full["window"]["activities"] > hta["window"]["activities"] > two["window"]["activities"]
    assert main(["analyze", CONTROL, "--steps", "7:8"]) == 2
    assert "--steps 7:8" in capsys.readouterr().err


def _p2p_rank(rank: int, kernels: list[tuple]) -> dict:
    """A Kineto trace of one pipeline rank: per kernel (name, ts, dur, op, args) a launch, the enclosing
    op, and the kernel with its args."""
    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0,
               "dur": 10_000}]
    for corr, (name, ts, dur, op, args) in enumerate(kernels, start=1):
        if op:
            events.append({"ph": "X", "cat": "cpu_op", "name": op, "pid": 1, "tid": 1, "ts": ts - 20, "dur": 15,
                           "args": {}})
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts - 10,
                       "dur": 5, "args": {"correlation": corr}})
        events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
                       "args": {"correlation": corr, "stream": 30 if op else 7, **args}})
    return {"distributedInfo": {"rank": rank, "world_size": 2}, "traceEvents": events}


def test_p2p_paired_by_process_group_ranks_and_seq(tmp_path):
    """Rank 0 computes then sends; rank 1 posts its receive early and waits. Pairing by the kernel args
    `Process Group Ranks` and `Seq` lets the replay reproduce the receive ending after the send began."""
    pg = {"Process Group Name": "pp", "Process Group Ranks": "[0, 1]"}
    r0 = [("gemm", 100, 1000, None, {}), ("ncclDevKernel_SendRecv", 1100, 300, "nccl:send", {**pg, "Seq": 1}),
          ("gemm", 1400, 1000, None, {}), ("ncclDevKernel_SendRecv", 2400, 300, "nccl:send", {**pg, "Seq": 2})]
    r1 = [("ncclDevKernel_SendRecv", 100, 1300, "nccl:recv", {**pg, "Seq": 1}), ("gemm", 1400, 1000, None, {}),
          ("ncclDevKernel_SendRecv", 2400, 300, "nccl:recv", {**pg, "Seq": 2}), ("gemm", 2700, 1000, None, {})]
    paths = [_write(tmp_path / f"rank{r}.json", _p2p_rank(r, k)) for r, k in ((0, r0), (1, r1))]
    timelines = load_paths(paths)
    assert all(tl.group_ranks == {"pp": [0, 1]} for tl in timelines)
    assert all((tl.kind == P2P).sum() == 2 for tl in timelines)
    w = analyze(timelines).to_json()["what_if"]
    assert w["replay_error"] == pytest.approx(0.0, abs=1e-4)
    # Paired, the receive's transfer is 300 us like every other (its 1000 us wait emerges): nothing to gain.
    assert w["slowdown_unclamped"] == pytest.approx(1.0, abs=1e-4)
    collectives = [collectives_of(tl) for tl in timelines]
    graph = whatif._join([whatif.rank_graph(tl, c, peers=True) for tl, c in zip(timelines, collectives)],
                         match_collectives(collectives))
    assert graph is not None
    pairs = [sorted(graph.node_rank[m].tolist()) for m in graph.members if m]
    assert pairs == [[0, 1], [0, 1]]
    p2p = [m for ms in graph.members for m in ms]
    assert sorted(graph.actual[p2p].tolist()) == [300.0] * 4
