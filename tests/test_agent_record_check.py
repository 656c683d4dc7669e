"""`gpuwatch agent --record` (the recording format, with or without a collector) and `gpuwatch agent --check`."""
import ctypes.util
import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from gpuwatch.core.recording import SCHEMAS, open_recording
from kubelet_standin import StandInKubelet, pod


def _agent(*argv, timeout=120):
    return subprocess.run([sys.executable, "-m", "gpuwatch", "agent", *argv], capture_output=True, text=True,
                          timeout=timeout)


def test_record_only_writes_a_recording_pandas_reads(tmp_path):
    rec = tmp_path / "R"
    run = _agent("--simulate", "2", "--ticks", "5", "--interval", "0.1", "--record", str(rec), "--node", "rec-node")
    assert run.returncode == 0, run.stderr
    df = pd.read_parquet(rec / "gpu_samples")
    assert len(df) == 10 and list(df.columns) == SCHEMAS["gpu_samples"].names
    assert sorted(df.groupby("gpu_index").size().items()) == [(0, 5), (1, 5)]
    assert set(df["job_id"]) == {"sim-rec-node"} and df["gpu_power_watts"].between(50, 700).all()
    recording = open_recording(rec)
    assert recording.manifest["nodes"] == ["rec-node"] and recording.manifest["source"] == "gpuwatch agent"
    assert len(recording.table("host_samples")) == 5 and len(recording.table("gpus")) == 2
    assert {"agent_start", "agent_stop"} <= set(recording.table("events")["kind"])
    assert not (tmp_path / "spool").exists()


def test_record_alongside_a_collector_holds_what_the_collector_got(tmp_path, sink):
    server, address = sink
    rec = tmp_path / "R"
    run = _agent("--collector", address, "--simulate", "2", "--ticks", "4", "--interval", "0.05", "--record", str(rec),
                 "--spool", str(tmp_path / "spool"))
    assert run.returncode == 0, run.stderr
    sent = sorted((s.gpu_index, t) for b in server.store.batches.values() for s in b.samples for t in s.ts_ms)
    df = open_recording(rec).table("gpu_samples")
    recorded = sorted(zip(df["gpu_index"], df["ts"].astype("datetime64[ms, UTC]").astype("int64")))
    assert len(sent) == 8 and recorded == sent


def _check(*argv):
    run = _agent("--check", "--json", "--no-probe-socket", *argv, timeout=60)
    return run.returncode, json.loads(run.stdout)


def test_check_passes_on_a_simulated_node_with_a_reachable_collector(tmp_path, sink):
    _, address = sink
    rc, report = _check("--simulate", "2", "--collector", address, "--spool", str(tmp_path / "spool"))
    assert rc == 0 and report["ok"], report
    assert [c["name"] for c in report["checks"]] == ["nvml", "collector", "kubelet", "spool"]
    (kubelet,) = [c for c in report["checks"] if c["name"] == "kubelet"]
    assert kubelet["ok"] and "process environments only" in kubelet["detail"]  # --simulate: no host kubelet
    gpu = report["gpus"][0]
    assert len(report["gpus"]) == 2 and gpu["gpm"] and "gpu_tensor_active_ratio" in gpu["fields"]
    assert "gpu_retired_pages_sbe" in gpu["unsupported"] and "gpu_retired_pages_sbe" not in gpu["fields"]


def test_check_fails_on_an_unreachable_collector_and_a_spool_that_is_a_file(tmp_path):
    spool = tmp_path / "spool"
    spool.write_text("a file, not a directory")
    rc, report = _check("--simulate", "1", "--sim-model", "A100", "--collector", "127.0.0.1:1", "--spool", str(spool))
    failed = {c["name"]: c["detail"] for c in report["checks"] if not c["ok"]}
    assert rc == 1 and not report["ok"]
    assert set(failed) == {"collector", "spool"} and "no connection" in failed["collector"]
    assert not report["gpus"][0]["gpm"]  # A100: no GPM


def test_check_text_report(tmp_path):
    run = _agent("--check", "--simulate", "1", "--record", str(tmp_path / "R"), "--no-probe-socket", timeout=60)
    assert run.returncode == 0, run.stderr
    assert "ok    nvml: driver" in run.stdout and "record-only" in run.stdout and "all checks passed" in run.stdout


def test_check_names_the_pods_a_kubelet_reports_and_fails_when_its_socket_is_gone(tmp_path):
    with StandInKubelet() as kubelet:
        kubelet.set_pods(pod("ml", "train-0", ("trainer", "nvidia.com/gpu", ["GPU-x"])))
        rc, report = _check("--simulate", "1", "--record", str(tmp_path / "R"), "--kubelet-socket", kubelet.socket)
        (item,) = [c for c in report["checks"] if c["name"] == "kubelet"]
        assert rc == 0 and item["ok"] and "1 GPU devices held by 1 pods: ml/train-0" in item["detail"]
        kubelet.stop()
        rc, report = _check("--simulate", "1", "--record", str(tmp_path / "R"), "--kubelet-socket", kubelet.socket)
        (item,) = [c for c in report["checks"] if c["name"] == "kubelet"]
        assert rc == 1 and not item["ok"] and "does not exist" in item["detail"]


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="this node has an NVIDIA driver")
def test_check_without_a_driver_says_so(tmp_path):
    rc, report = _check("--record", str(tmp_path / "R"))
    (nvml,) = [c for c in report["checks"] if c["name"] == "nvml"]
    assert rc == 1 and not nvml["ok"] and "no NVIDIA driver" in nvml["detail"] and report["gpus"] == []


def test_a_closed_pipe_ends_the_command_quietly(tmp_path):
    """`gpuwatch ... | head`: the reader is gone before anything is written; no BrokenPipeError traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run([sys.executable, "-m", "gpuwatch", "agent", "--check", "--json", "--simulate", "2",
                              "--collector", "127.0.0.1:1", "--spool", str(tmp_path)], stdout=write_end,
                             stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert out.returncode == 141 and out.stderr == ""
