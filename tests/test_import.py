"""`gpuwatch import`: wide and long (dcgm-exporter via Prometheus) CSV/Parquet into a recording."""
import json
import subprocess
import sys

import pandas as pd
import pytest

from gpuwatch.core.errors import UserError
from gpuwatch.apps.importer import Columns, import_files
from gpuwatch.models.dataset import open_source
from gpuwatch.core.recording import open_recording, ts_ms
from gpuwatch.apps.replay_offline import replay_offline

T0_S = 1_767_225_600  # 2026-01-01T00:00:00Z


def _dcgm_history(ticks: int = 12) -> pd.DataFrame:
    """A dcgm-exporter history as Prometheus exports it: one row per series and timestamp (epoch s)."""
    rows = []
    for t in range(ticks):
        for host, gpus in (("h1", 2), ("h2", 1)):
            for g in range(gpus):
                xid = 79 if (host, g) == ("h1", 1) and t >= 8 else 0
                for metric, value in (("DCGM_FI_DEV_GPU_UTIL", 40 + t), ("DCGM_FI_DEV_FB_USED", 1024),
                                      ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 5000 * t),
                                      ("DCGM_FI_DEV_SM_CLOCK", 1980), ("DCGM_FI_DEV_GPU_TEMP", 60 + g),
                                      ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 0.5), ("DCGM_FI_DEV_XID_ERRORS", xid),
                                      ("DCGM_FI_DEV_VGPU_LICENSE_STATUS", 0)):
                    rows.append({"timestamp": T0_S + 15.0 * t, "Hostname": host, "instance": f"{host}:9400",
                                 "gpu": g, "UUID": f"GPU-{host}-{g}", "modelName": "NVIDIA H100 80GB HBM3",
                                 "__name__": metric, "value": value})
    return pd.DataFrame(rows)


def test_a_dcgm_exporter_history_becomes_a_recording_in_gpuwatch_units(tmp_path):
    src = tmp_path / "dcgm.csv"
    _dcgm_history().to_csv(src, index=False)
    result = import_files([src], tmp_path / "R", quiet=True)
    assert result["formats"] == {str(src): "long"} and result["gpu_samples"] == 36 and result["nodes"] == 2
    assert result["unknown_metrics"] == {"DCGM_FI_DEV_VGPU_LICENSE_STATUS": 36} and result["skipped_rows"] == 0
    rec = open_recording(tmp_path / "R")
    df = rec.table("gpu_samples").sort_values(["node", "gpu_index", "ts"]).reset_index(drop=True)
    first = df.iloc[0]
    assert (first["node"], first["gpu_index"], int(ts_ms(df["ts"])[0])) == ("h1", 0, T0_S * 1000)
    assert first["gpu_utilization_ratio"] == pytest.approx(0.40)
    assert first["gpu_memory_used_bytes"] == 1024 * 2**20 and first["gpu_sm_clock_hertz"] == 1.98e9
    assert df["gpu_energy_joules_total"].iloc[1] == pytest.approx(5.0)  # 5000 mJ
    assert df["gpu_tensor_active_ratio"].eq(0.5).all() and df["gpu_power_watts"].isna().all()
    events = rec.table("events")
    assert len(events) == 1 and (events["node"][0], events["gpu_index"][0], events["kind"][0], events["code"][0]) == \
        ("h1", 1, "xid", 79)
    assert int(ts_ms(events["ts"])[0]) == (T0_S + 15 * 8) * 1000
    gpus = rec.table("gpus")
    assert sorted(gpus["uuid"]) == ["GPU-h1-0", "GPU-h1-1", "GPU-h2-0"]
    assert set(gpus["name"]) == {"NVIDIA H100 80GB HBM3"}


def test_a_dcgm_exporter_4_9_history_in_base_units_imports_alike(tmp_path):
    """The same history under dcgm-exporter 4.9's names and units (Hz, J, ratio, bytes): the same recording."""
    renames = {"DCGM_FI_DEV_GPU_UTIL": ("DCGM_FI_DEV_GPU_UTIL_RATIO", 0.01),
               "DCGM_FI_DEV_FB_USED": ("DCGM_FI_DEV_FB_USED_BYTES", 2**20),
               "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": ("DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL", 1e-3),
               "DCGM_FI_DEV_SM_CLOCK": ("DCGM_FI_DEV_SM_CLOCK_HERTZ", 1e6),
               "DCGM_FI_DEV_GPU_TEMP": ("DCGM_FI_DEV_GPU_TEMP_CELSIUS", 1.0),
               "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": ("DCGM_FI_PROF_TENSOR_UTIL_RATIO", 1.0),
               "DCGM_FI_DEV_XID_ERRORS": ("DCGM_FI_DEV_XID_ERROR", 1.0)}
    history = _dcgm_history()
    for old, (new, factor) in renames.items():
        rows = history["__name__"] == old
        history.loc[rows, "value"] = history.loc[rows, "value"] * factor
        history.loc[rows, "__name__"] = new
    old_src, new_src = tmp_path / "old.csv", tmp_path / "new.csv"
    _dcgm_history().to_csv(old_src, index=False)
    history.to_csv(new_src, index=False)
    import_files([old_src], tmp_path / "OLD", quiet=True)
    result = import_files([new_src], tmp_path / "NEW", quiet=True)
    assert result["unknown_metrics"] == {"DCGM_FI_DEV_VGPU_LICENSE_STATUS": 36}
    old_rec, new_rec = open_recording(tmp_path / "OLD"), open_recording(tmp_path / "NEW")
    key = ["node", "gpu_index", "ts"]
    old_df = old_rec.table("gpu_samples").sort_values(key).reset_index(drop=True)
    new_df = new_rec.table("gpu_samples").sort_values(key).reset_index(drop=True)
    pd.testing.assert_frame_equal(new_df[old_df.columns], old_df, check_exact=False, rtol=1e-9)
    assert list(new_rec.table("events")["code"]) == [79]


def test_an_imported_recording_replays_and_the_training_loader_reads_it(tmp_path):
    src = tmp_path / "dcgm.parquet"
    _dcgm_history().to_parquet(src)
    import_files([src], tmp_path / "R", quiet=True)
    replayed = replay_offline(tmp_path / "R", quiet=True)
    assert {n["node"]: (n["gpus"], n["samples"], n["events"]) for n in replayed["store"]["nodes"]} == \
        {"h1": (2, 24, 1), "h2": (1, 12, 0)}
    source = open_source(tmp_path / "R")
    _, samples, events = next(source.chunks())
    assert source.nodes == ["h1", "h2"] and len(samples) == 36 and list(events["code"]) == [79]


def test_wide_files_with_the_recordings_own_columns(tmp_path):
    ts = pd.date_range("2026-01-01", periods=4, freq="1s", tz="UTC")
    wide = pd.DataFrame({"node": "w1", "gpu_index": [0, 0, 1, 1], "ts": ts.strftime("%Y-%m-%dT%H:%M:%SZ"),
                         "gpu_power_watts": [300.0, None, 310.0, 320.0],
                         "gpu_temperature_celsius": ["55", "x", "57", "58"],
                         "job_id": "j", "rank": [0, 0, 1, 1], "comment": "ignored"})
    wide.to_csv(tmp_path / "wide.csv", index=False)
    result = import_files([tmp_path / "wide.csv"], tmp_path / "R", fmt="wide", quiet=True)
    assert result["gpu_samples"] == 4 and result["ignored_columns"] == ["comment"] and result["bad_values"] == 1
    df = open_recording(tmp_path / "R").table("gpu_samples").sort_values(["gpu_index", "ts"])
    assert df["gpu_power_watts"].isna().tolist() == [False, True, False, False]
    assert df["gpu_temperature_celsius"].isna().tolist() == [False, True, False, False]
    assert df["rank"].tolist() == [0, 0, 1, 1] and set(df["job_id"]) == {"j"}


def test_wide_files_with_dcgm_exporter_columns_convert_like_long_ones(tmp_path):
    long = _dcgm_history()
    keys = ["timestamp", "Hostname", "gpu", "UUID", "modelName"]
    wide = long.pivot_table(index=keys, columns="__name__", values="value").reset_index()
    wide.columns.name = None
    wide.to_csv(tmp_path / "wide.csv", index=False)
    long.to_csv(tmp_path / "long.csv", index=False)
    result = import_files([tmp_path / "wide.csv"], tmp_path / "W", quiet=True)
    assert result["formats"] == {str(tmp_path / "wide.csv"): "wide"} and result["gpu_samples"] == 36
    assert result["ignored_columns"] == ["DCGM_FI_DEV_VGPU_LICENSE_STATUS"]
    import_files([tmp_path / "long.csv"], tmp_path / "L", quiet=True)
    a, b = (open_recording(tmp_path / r) for r in ("W", "L"))
    key = ["node", "gpu_index", "ts"]
    pd.testing.assert_frame_equal(a.table("gpu_samples").sort_values(key).reset_index(drop=True),
                                  b.table("gpu_samples").sort_values(key).reset_index(drop=True))
    assert a.table("gpu_samples")["gpu_utilization_ratio"].max() == pytest.approx(0.51)
    events = a.table("events")
    assert list(zip(events["node"], events["gpu_index"], events["code"])) == [("h1", 1, 79)]


def test_named_columns_and_rows_without_keys(tmp_path):
    df = pd.DataFrame({"when": [T0_S * 1000, T0_S * 1000 + 1000, None], "box": ["b1", "b1", "b1"],
                       "card": [0, 0, 0], "gpu_utilization_ratio": [0.1, 0.2, 0.3]})
    df.to_parquet(tmp_path / "x.parquet")
    result = import_files([tmp_path / "x.parquet"], tmp_path / "R",
                          columns=Columns(node="box", gpu="card", time="when"), quiet=True)
    assert result["gpu_samples"] == 2 and result["skipped_rows"] == 1
    assert list(ts_ms(open_recording(tmp_path / "R").table("gpu_samples")["ts"])) == [T0_S * 1000, T0_S * 1000 + 1000]


@pytest.mark.parametrize("setup, message", [
    (lambda d: pd.DataFrame({"ts": [1], "gpu": [0], "value": [1.0]}).to_csv(d / "f.csv", index=False),
     "f.csv: no node column (looked for node, Hostname"),
    (lambda d: pd.DataFrame({"node": ["a"], "ts": [1]}).to_csv(d / "f.csv", index=False),
     "f.csv: no GPU index column"),
    (lambda d: pd.DataFrame({"node": ["a"], "gpu": [0], "ts": ["yesterday"]}).to_csv(d / "f.csv", index=False),
     "f.csv: column 'ts' holds a value that is not a time"),
    (lambda d: (d / "f.csv").write_text(""), "f.csv: cannot read"),
    (lambda d: (d / "f.txt").write_text("x"), "unknown file type"),
    (lambda d: None, "f.csv: no such file"),
])
def test_bad_files_are_one_clear_line_and_leave_no_recording(tmp_path, setup, message):
    setup(tmp_path)
    name = "f.txt" if "unknown file type" in message else "f.csv"
    run = subprocess.run([sys.executable, "-m", "gpuwatch", "import", str(tmp_path / name), "--out",
                          str(tmp_path / "R")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and message in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and not (tmp_path / "R").exists()


def test_refuses_to_write_into_a_non_empty_directory_and_named_missing_column(tmp_path):
    (tmp_path / "R").mkdir()
    (tmp_path / "R" / "keep.txt").write_text("mine")
    pd.DataFrame({"node": ["a"], "gpu": [0], "ts": [1]}).to_csv(tmp_path / "f.csv", index=False)
    with pytest.raises(UserError, match="not an empty directory"):
        import_files([tmp_path / "f.csv"], tmp_path / "R", quiet=True)
    assert (tmp_path / "R" / "keep.txt").read_text() == "mine"
    with pytest.raises(UserError, match="f.csv: no column 'host' \\(--node-column\\)"):
        import_files([tmp_path / "f.csv"], tmp_path / "R2", columns=Columns(node="host"), quiet=True)
    pd.DataFrame({"node": ["a"], "gpu": [0], "ts": [1], "metric": ["FOO"], "value": [1]}).to_csv(tmp_path / "u.csv")
    with pytest.raises(UserError, match="no GPU samples found.*unknown metrics: {'FOO': 1}"):
        import_files([tmp_path / "u.csv"], tmp_path / "R3", quiet=True)
    assert not (tmp_path / "R3").exists()


def test_cli_json(tmp_path):
    _dcgm_history(2).to_csv(tmp_path / "d.csv", index=False)
    run = subprocess.run([sys.executable, "-m", "gpuwatch", "import", str(tmp_path / "d.csv"), "--out",
                          str(tmp_path / "R"), "--json"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["gpu_samples"] == 6 and run.stderr == ""  # no progress when not a terminal


def test_many_small_nodes_become_a_few_node_sorted_parts_each_node_readable(tmp_path):
    """One part per node made an import of 18,687 single-GPU nodes take minutes (bench/import_wide.py)."""
    rows = pd.DataFrame({"node": [f"c{i % 600:04d}" for i in range(1800)], "gpu_index": 0,
                         "ts": [T0_S + 60 * (i // 600) for i in range(1800)],
                         "gpu_power_watts": [float(i) for i in range(1800)],
                         "DCGM_FI_DEV_XID_ERRORS": [48 if i == 1205 else 0 for i in range(1800)]})
    rows.to_csv(tmp_path / "wide.csv", index=False)
    result = import_files([tmp_path / "wide.csv"], tmp_path / "rec", fmt="wide", quiet=True)
    assert (result["gpu_samples"], result["nodes"], result["events"]) == (1800, 600, 1)
    rec = open_recording(tmp_path / "rec")
    assert len(rec.parts("gpu_samples")) == 1 and len(rec.parts("events")) == 1
    one = rec.table("gpu_samples", ["node", "ts", "gpu_power_watts"], [("node", "in", ["c0005"])])
    assert list(one["gpu_power_watts"]) == [5.0, 605.0, 1205.0] and one["ts"].is_monotonic_increasing
    assert rec.table("events", ["node", "code"]).to_dict("records") == [{"node": "c0005", "code": 48}]
