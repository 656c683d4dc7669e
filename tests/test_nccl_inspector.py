"""NCCL's inspector plugin dumps as collective spans: records written exactly as its README and source document
them (v4.0, JSON Lines in <dir>/<host>-pid<pid>.log), read by the agent's reader and by `gpuwatch agent
--nccl-inspector-dir`, and a job with the inspector and no probe named slow, with its cause, on both engines."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpuwatch.agent.nccl_inspector import InspectorReader
from gpuwatch.collector.alert_hub import AlertHub
from gpuwatch.collector.jobs import JobsMonitor
from gpuwatch.collector.store import open_store
from gpuwatch.core.recording import open_recording
from gpuwatch.simulator.fail_slow import parse_fail_slow_spec
from helpers import STORE_KINDS, store_url
from slow_jobs import run_job

# the README's examples, as the plugin writes them: one object per line
COLL = {"header": {"id": "0x7f8c496ae9f661", "rank": 2, "n_ranks": 8, "nnodes": 1},
        "metadata": {"inspector_output_format_version": "v4.0", "git_rev": "", "rec_mechanism": "profiler_plugin",
                     "dump_timestamp_us": 1748030377748202, "hostname": "example-hostname", "pid": 1639453},
        "coll_perf": {"coll": "AllReduce", "coll_sn": 1407, "coll_msg_size_bytes": 17179869184,
                      "coll_exec_time_us": 61974, "coll_algobw_gbs": 277.210914, "coll_busbw_gbs": 485.119099}}
VERBOSE = {"header": {"id": "0xe62dedaa97644a", "comm_name": "DP Group 0", "rank": 4, "n_ranks": 8, "nnodes": 1},
           "metadata": {"inspector_output_format_version": "v4.0", "git_rev": "9019a1912-dirty",
                        "rec_mechanism": "nccl_profiler_interface", "dump_timestamp_us": 1752867229276385,
                        "hostname": "example-hostname", "pid": 438776},
           "coll_perf": {"coll": "ReduceScatter", "coll_sn": 1231, "coll_msg_size_bytes": 2147483648,
                         "coll_exec_time_us": 41057, "coll_timing_source": "kernel_gpu", "coll_algobw_gbs": 418.439467,
                         "coll_busbw_gbs": 366.134533,
                         "event_trace_sn": {"coll_start_sn": 1, "coll_stop_sn": 2, "kernel_events": [
                             {"channel_id": 0, "kernel_start_sn": 3, "kernel_stop_sn": 48, "kernel_record_sn": 47}]},
                         "event_trace_ts": {"coll_start_ts": 1752867229235059, "coll_stop_ts": 1752867229235064,
                                            "kernel_events": [{"channel_id": 0, "kernel_start_ts": 1752867229235181,
                                                               "kernel_stop_ts": 1752867229275811,
                                                               "kernel_record_ts": 1752867229275811}]}}}
P2P = {"header": {"id": "0x7f8c496ae9f661", "comm_name": "PP", "rank": 2, "n_ranks": 8, "nnodes": 1},
       "metadata": {**COLL["metadata"], "dump_timestamp_us": 1748030377800000},
       "p2p_perf": {"p2p": "Send", "p2p_sn": 12, "p2p_peer": 3, "p2p_msg_size_bytes": 536870912,
                    "p2p_exec_time_us": 1154, "p2p_timing_source": "kernel_gpu", "p2p_algobw_gbs": 464.9,
                    "p2p_busbw_gbs": 464.9}}
ENVIRON = {1639453: {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "10", "SLURM_LOCALID": "2"}}


def _rows(table) -> list[dict]:
    names = [f.name for f in table.DESCRIPTOR.fields]
    return [dict(zip(names, values)) for values in zip(*(getattr(table, n) for n in names))]


def _write(path, *records, tail: str = "") -> None:
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_documented_records_become_collective_and_p2p_spans(tmp_path):
    _write(tmp_path / "example-hostname-pid1639453.log", COLL, P2P)
    _write(tmp_path / "example-hostname-pid438776.log", VERBOSE)
    reader = InspectorReader(tmp_path, ENVIRON.get)
    rows = sorted(_rows(reader.drain()), key=lambda r: r["seq"])
    p2p, verbose, coll = rows
    # the job and the global rank from the writing process's environment; the communicator's rank otherwise
    assert (coll["job_id"], coll["rank"], coll["kind"], coll["name"]) == ("4242", 10, "collective", "all_reduce")
    assert (coll["seq"], coll["bytes"], coll["process_group"]) == (1407, 17179869184, "0x7f8c496ae9f661")
    assert coll["dur_us"] == 61974 and coll["start_us"] == 1748030377748202 - 61974  # not verbose: dump - exec
    assert (verbose["job_id"], verbose["rank"], verbose["name"]) == ("", 4, "reduce_scatter")
    assert verbose["start_us"] == 1752867229235181 and verbose["dur_us"] == 41057  # the kernel's start
    assert (p2p["kind"], p2p["name"], p2p["peer"], p2p["seq"]) == ("p2p", "send", 3, 12)
    assert _rows(reader.drain()) == []  # read once


def test_a_line_being_written_waits_bad_lines_are_skipped_and_counted(tmp_path):
    log = tmp_path / "nccl-inspector-777" / "h-pid5.log"
    log.parent.mkdir()
    line = json.dumps({**COLL, "metadata": {**COLL["metadata"], "pid": 5}})
    _write(log, tail=line[:40])
    reader = InspectorReader(tmp_path, lambda pid: None)
    assert _rows(reader.drain()) == []
    _write(log, tail=line[40:] + "\nnot json\n" + json.dumps({"header": {}}) + "\n")
    (row,) = _rows(reader.drain())
    assert row["job_id"] == "777" and row["rank"] == 2  # the SLURM job of the plugin's default directory name
    assert reader.malformed == 2
    log.write_text(line + "\n")  # replaced by a shorter file: read from its start again
    assert len(_rows(reader.drain())) == 1


def test_agent_sends_inspector_records_as_spans(tmp_path):
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    _write(dumps / "h-pid1.log", COLL, VERBOSE)
    rec = tmp_path / "R"
    run = subprocess.run([sys.executable, "-m", "gpuwatch", "agent", "--simulate", "1", "--ticks", "2", "--interval",
                          "0.1", "--record", str(rec), "--node", "insp-node", "--nccl-inspector-dir", str(dumps)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    spans = open_recording(rec).table("spans")
    assert sorted(spans["seq"]) == [1231, 1407] and set(spans["node"]) == {"insp-node"}
    assert set(spans["kind"]) == {"collective"}


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_a_job_with_the_inspector_and_no_probe_gets_the_same_live_view(kind, tmp_path):
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    store = open_store(store_url(kind, tmp_path))
    try:
        monitor = JobsMonitor(AlertHub(), window_s=300, hang_threshold_s=600)
        monitor.bind(store)
        flags = {}
        for check in run_job("insp-job", 4, [parse_fail_slow_spec("gpu=1,kind=thermal,after=90")], seconds=210,
                             store=store, node_name="node-insp", inspector_dir=dumps):
            store.flush()
            flags = monitor.check_once(check.now_s * 1e6)
        assert set(store.spans("insp-job")["kind"]) == {"collective"}  # no probe: only the inspector's records
        (slow,) = flags["insp-job"]["slow_ranks"]
        assert (slow["rank"], slow["gpu_index"], slow["cause"]) == (1, 1, "thermal")
        assert "thermal slowdown active" in slow["evidence"] and slow["speedup_without"] > 0.1
        assert flags["insp-job"]["breakdown"]["comm_wait"] > 0  # the engine's breakdown from the same spans
    finally:
        store.close()
