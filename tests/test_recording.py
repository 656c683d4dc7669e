"""The recording format: write, read back with gpuwatch and with plain pandas, append, and refuse bad input."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from gpuwatch.core.errors import UserError
from gpuwatch.core.fields import GPU_FIELD_NAMES
from gpuwatch.core.recording import SCHEMAS, RecordingWriter, open_recording

T0 = 1_767_225_600_000


def gpu_rows(node: str, n: int, t0: int = T0) -> pd.DataFrame:
    return pd.DataFrame({"node": node, "gpu_index": np.arange(n) % 2, "ts": t0 + 1000 * np.arange(n),
                         "job_id": "j1", "rank": 0, "local_rank": 0, "gpu_temperature_celsius": 50.0 + np.arange(n)})


def test_round_trip_and_plain_pandas(tmp_path):
    rec_dir = tmp_path / "rec"
    with RecordingWriter(rec_dir, source="test", resolution_s=1.0) as w:
        w.append("gpu_samples", gpu_rows("n1", 4))
        w.append("gpu_samples", gpu_rows("n2", 2, T0 + 10_000))
        w.append("events", pd.DataFrame({"node": ["n1"], "gpu_index": [1], "ts": [T0 + 500], "kind": ["xid"],
                                         "code": [79], "attrs": [{"pci": "0000:18:00.0"}]}))
    rec = open_recording(rec_dir)
    m = rec.manifest
    assert (m["format"], m["version"], m["source"], m["resolution_s"]) == ("gpuwatch-recording", 1, "test", 1.0)
    assert (m["start_ms"], m["end_ms"], m["nodes"]) == (T0, T0 + 11_000, ["n1", "n2"])
    samples = rec.table("gpu_samples")
    assert list(samples.columns) == ["node", "gpu_index", "ts", "job_id", "rank", "local_rank", *GPU_FIELD_NAMES]
    assert len(samples) == 6 and str(samples["ts"].dtype) == "datetime64[ms, UTC]"
    assert samples["gpu_power_watts"].isna().all()  # fields not given are NaN, not invented values
    plain = pd.read_parquet(rec_dir / "gpu_samples")
    assert len(plain) == 6 and plain["gpu_temperature_celsius"].max() == 53.0
    ev = rec.table("events")
    assert json.loads(ev["attrs"][0]) == {"pci": "0000:18:00.0"} and ev["message"][0] == ""
    only_n2 = rec.table("gpu_samples", columns=["node", "ts"], filters=[("node", "==", "n2")])
    assert list(only_n2.columns) == ["node", "ts"] and (only_n2["node"] == "n2").all() and len(only_n2) == 2
    assert [len(p) for p in rec.iter_parts("gpu_samples")] == [4, 2]
    assert rec.table("spans").empty and list(rec.table("spans").columns) == SCHEMAS["spans"].names


def test_reopen_appends_parts_and_merges_manifest(tmp_path):
    with RecordingWriter(tmp_path, source="agent") as w:
        w.append("gpu_samples", gpu_rows("n1", 2))
    with RecordingWriter(tmp_path, source="agent") as w:
        w.append("gpu_samples", gpu_rows("n3", 2, T0 - 5000))
    rec = open_recording(tmp_path)
    assert len(rec.parts("gpu_samples")) == 2 and rec.manifest["start_ms"] == T0 - 5000
    assert rec.manifest["nodes"] == ["n1", "n3"] and len(rec.table("gpu_samples")) == 4


def test_spans_without_a_node_add_no_node(tmp_path):
    spans = pd.DataFrame({"job_id": "j", "rank": [0, 1], "step": 1, "kind": "step", "name": "", "start_us": 1e15,
                          "dur_us": 10.0, "process_group": "", "seq": -1, "bytes": -1, "world_size": 2,
                          "node": ["", None], "peer": -1})
    with RecordingWriter(tmp_path, source="t") as w:
        w.append("spans", spans)
        w.append("gpu_samples", gpu_rows("n1", 2))
    assert open_recording(tmp_path).manifest["nodes"] == ["n1"]


def test_bad_input_is_named(tmp_path):
    with pytest.raises(UserError, match="not a gpuwatch recording"):
        open_recording(tmp_path)
    (tmp_path / "plain.txt").write_text("x")
    with pytest.raises(UserError, match="plain.txt is a file, not a recording directory"):
        open_recording(tmp_path / "plain.txt")
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "gpuwatch-recording", "version": 99}))
    with pytest.raises(UserError, match="version 99 is newer"):
        open_recording(tmp_path)
    w = RecordingWriter(tmp_path / "new", source="t")
    with pytest.raises(UserError, match="unknown columns \\['bogus'\\]"):
        w.append("gpu_samples", gpu_rows("n1", 2).assign(bogus=1))
    with pytest.raises(UserError, match="missing required columns \\['ts'\\]"):
        w.append("gpu_samples", gpu_rows("n1", 2).drop(columns="ts"))
    with pytest.raises(UserError, match="unknown table"):
        w.append("gpu_sample", gpu_rows("n1", 2))
    with pytest.raises(UserError, match="'gpu_temperature_celsius' is not double"):
        w.append("gpu_samples", gpu_rows("n1", 2).assign(gpu_temperature_celsius="hot"))
