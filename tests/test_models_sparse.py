"""Long, sparse and telemetry-free data (a real fault log converted to a recording): `train` refuses in one
line before building anything, and features cost what the samples do, not the time span times the GPUs."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

import gpuwatch.models.features as features_module
from gpuwatch.apps.cli import main
from gpuwatch.core.errors import UserError
from gpuwatch.models.dataset import build_dataset, open_source
from gpuwatch.models.features import feature_names
from gpuwatch.models.history import history_names
from gpuwatch.models.train import train_model
from gpuwatch.simulator.failing_fleet import FleetConfig, simulate_fleet
from sparse_fleet import write_sparse_recording

#: Bins of one feature row's look-back (24 h at 10 min) plus the row's own.
_HISTORY_BINS = features_module.HISTORY_S // features_module.DEFAULT_STEP_S + 1


@pytest.fixture
def cells_built(monkeypatch):
    """Records the size (GPUs x bins) of every feature grid the window sums run over."""
    sizes: list[int] = []
    window_sum = features_module._window_sum

    def spy(inc, *args, **kwargs):
        sizes.append(inc.size)
        return window_sum(inc, *args, **kwargs)

    monkeypatch.setattr(features_module, "_window_sum", spy)
    return sizes


def _to_duckdb(recording, store):
    import duckdb

    from gpuwatch.collector.store.duckdb import DDL

    with duckdb.connect(str(store)) as con:
        con.execute("SET TimeZone = 'UTC'")
        for table in ("gpu_samples", "events"):
            con.execute(next(d for d in DDL if f"EXISTS {table} (" in d))
            con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM read_parquet('{recording / table}/*.parquet')")
    return store


@pytest.mark.parametrize("engine", ["recording", "duckdb"])
def test_train_on_a_telemetry_free_recording_is_one_line_before_any_window(tmp_path, capsys, cells_built, engine):
    rec = tmp_path / "faultlog"
    write_sparse_recording(rec, nodes=16, gpus_per_node=4, days=60, lives_per_gpu=3)
    data = rec if engine == "recording" else _to_duckdb(rec, tmp_path / "store.duckdb")
    assert not open_source(data).has_telemetry()
    assert main(["train", str(data), "--horizon", "1h", "-o", str(tmp_path / "m.skops"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert str(data) in err and "no telemetry" in err
    assert not cells_built  # refused before any feature window was built
    assert not (tmp_path / "m.skops").exists()


def test_training_where_every_feature_is_constant_is_a_user_error(tmp_path):
    """Telemetry that never moves passes the presence check; without a fault history to learn from either,
    the model has nothing to learn from."""
    rec = tmp_path / "flat"
    write_sparse_recording(rec, nodes=16, gpus_per_node=4, days=60, lives_per_gpu=3,
                           telemetry={"gpu_temperature_celsius": 40.0})
    assert open_source(rec).has_telemetry()
    ds = build_dataset(rec, quiet=True)
    ds.rows[history_names()] = 0.0
    with pytest.raises(UserError, match="no feature varies"):
        train_model(ds, quiet=True)


def test_a_long_sparse_recording_builds_windows_only_around_its_samples(tmp_path, cells_built):
    """6 years of 40 GPU slots seen at insert and removal: the dense grid would be 40 x 315,360 bins per
    chunk; the pieces hold about a day of bins per sample."""
    rec = tmp_path / "long"
    counts = write_sparse_recording(rec, nodes=40, gpus_per_node=1, days=6 * 365, lives_per_gpu=3,
                                    telemetry={"gpu_temperature_celsius": 40.0})
    ds = build_dataset(rec, quiet=True)
    assert len(ds.rows) == counts["samples"]  # one row per sampled bin, as before
    assert sum(cells_built) <= 330 * counts["samples"] * 2 * _HISTORY_BINS  # ~330 window sums per grid
    assert max(cells_built) <= features_module.MAX_CELLS


def test_pieces_give_the_rows_of_one_grid(tmp_path, monkeypatch):
    """Splitting a GPU's data into day-long pieces batched a few at a time changes no feature value."""
    simulate_fleet(FleetConfig(seed=5, nodes=2, gpus_per_node=4, days=3, resolution_s=300,
                               fault_rate_multiplier=400), tmp_path / "sim", quiet=True)
    whole = build_dataset(tmp_path / "sim", quiet=True).rows
    monkeypatch.setattr(features_module, "PIECE_S", 86400)
    monkeypatch.setattr(features_module, "MAX_CELLS", 2000)
    cut = build_dataset(tmp_path / "sim", quiet=True).rows
    key = ["node", "gpu_index", "t_ms"]
    cols = key + ["job_id", "label", "censored"] + feature_names()
    pd.testing.assert_frame_equal(whole.sort_values(key).reset_index(drop=True)[cols],
                                  cut.sort_values(key).reset_index(drop=True)[cols], check_dtype=False)


def test_score_on_a_sparse_recording_scores_each_sampled_bin(tmp_path, capsys, cells_built):
    rec = tmp_path / "sparse"
    counts = write_sparse_recording(rec, nodes=12, gpus_per_node=8, days=120, lives_per_gpu=3)
    assert main(["score", str(rec), "--model", "default", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpu_days"] == pytest.approx(counts["samples"] * 600 / 86400, abs=0.1)
    assert np.isfinite(out["threshold_last"])
    assert sum(cells_built) <= 330 * counts["samples"] * 2 * _HISTORY_BINS
