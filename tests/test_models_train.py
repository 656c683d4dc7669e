"""Training, saving/loading (skops, trusted types), labels without leakage, evaluation keys, the CLI."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import skops.io as sio

from gpuwatch.apps.cli import main
from gpuwatch.core.errors import UserError
from gpuwatch.models.dataset import build_dataset
from gpuwatch.models.evaluate import METRIC_KEYS, evaluate_model
from gpuwatch.simulator.failing_fleet import FleetConfig, simulate_fleet
from gpuwatch.models.features import feature_names
from gpuwatch.models.labels import label, time_split
from gpuwatch.models.model import TRUSTED_TYPES, default_model_path, load_model, save_model
from gpuwatch.models.train import FIT_HORIZON_S, fit_labels, train_model
from gpuwatch.core.recording import SCHEMAS
from helpers import run_on_terminal

# ~30 faults at the real GPU rate
SMALL = dict(nodes=4, gpus_per_node=8, days=6, resolution_s=300, fault_rate_multiplier=1400)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    simulate_fleet(FleetConfig(seed=3, **SMALL), root / "train")
    simulate_fleet(FleetConfig(seed=4, **SMALL), root / "heldout")
    return root


@pytest.fixture(scope="module")
def trained(fleet):
    ds = build_dataset(fleet / "train")
    model = train_model(ds, description="test")
    path = fleet / "model.skops"
    save_model(model, path)
    return ds, model, path


def test_labels_positive_within_horizon_and_censored_around_faults():
    feats = pd.DataFrame({"node": "n", "gpu_index": 0, "t_ms": np.arange(0, 10 * 3_600_000, 600_000)})
    ep = pd.DataFrame({"node": ["n"], "gpu_index": [0], "start_ms": [5 * 3_600_000],
                       "end_ms": [5 * 3_600_000 + 60_000]})
    out = label(feats, ep, horizon_s=3600, warning_s=300, data_end_ms=10 * 3_600_000)
    until = (5 * 3_600_000 - out["t_ms"]) / 60_000
    assert out.loc[out["label"] == 1, "t_ms"].map(lambda t: (5 * 3_600_000 - t) / 60_000).tolist() == [60, 50, 40,
                                                                                                        30, 20, 10]
    assert out.loc[(until > 0) & (until <= 5), "censored"].all()  # the warning gap
    after = out[(out["t_ms"] >= 5 * 3_600_000) & (out["t_ms"] <= 5 * 3_600_000 + 60_000 + 3_600_000)]
    assert after["censored"].all() and after["label"].eq(0).all()
    assert out.loc[out["t_ms"] + 3_600_000 > 10 * 3_600_000, "censored"].all()  # horizon past the data end


def test_fit_labels_cover_the_hours_before_a_fault_and_evaluation_labels_keep_the_horizon():
    feats = pd.DataFrame({"node": "n", "gpu_index": 0, "t_ms": np.arange(0, 10 * 3_600_000, 600_000)})
    ep = pd.DataFrame({"node": ["n"], "gpu_index": [0], "start_ms": [5 * 3_600_000],
                       "end_ms": [5 * 3_600_000 + 60_000]})
    out = label(feats, ep, horizon_s=3600, warning_s=300, data_end_ms=10 * 3_600_000)
    fit = fit_labels(out, 3600, 300)
    assert fit.sum() == FIT_HORIZON_S // 600 and out["label"].sum() == 6  # 18 rows to fit on, 6 to judge by
    assert (fit >= out["label"].to_numpy()).all()
    assert fit_labels(out, 24 * 3600, 300).sum() == 5 * 6  # a longer horizon than the fit's is kept


def test_split_blocks_cannot_leak(trained):
    ds, model, _ = trained
    split = time_split(ds.source.start_ms, ds.source.end_ms, horizon_s=ds.horizon_s)
    h = ds.horizon_s * 1000
    t = ds.rows["t_ms"]
    train_rows = t[(t >= split.train[0]) & (t < split.train[1])]
    val_rows = t[(t >= split.validation[0]) & (t < split.validation[1])]
    assert train_rows.max() + h < split.validation[0] + 1  # no training horizon reaches into validation
    assert val_rows.max() + h < split.test[0] + 1
    assert model.training.test_ms == split.test


def test_model_file_round_trip_with_trusted_types(trained, tmp_path):
    ds, model, path = trained
    assert path.stat().st_size < 2_000_000
    loaded = load_model(path)
    assert set(loaded.features) <= set(feature_names()) and loaded.horizon_s == 3600
    rows = ds.rows.head(500)
    assert np.allclose(loaded.risk(rows), model.risk(rows))
    assert ((loaded.risk(rows) >= 0) & (loaded.risk(rows) <= 1)).all()
    signals = loaded.top_signals(ds.rows[ds.rows["label"] == 1].head(3))
    assert len(signals) == 3 and all(s and s[0]["signal"] in loaded.features for s in signals)
    bad = tmp_path / "bad.skops"
    sio.dump({"format": "gpuwatch-failure-model", "payload": pd.Timestamp("2026-01-01")}, bad)
    with pytest.raises(UserError, match="does not trust"):
        load_model(bad)
    (tmp_path / "junk.skops").write_text("not a model")
    with pytest.raises(UserError, match="not a skops model file"):
        load_model(tmp_path / "junk.skops")


def test_a_model_file_holds_the_same_dict_as_before(trained):
    """The stored dict is the file format (files of every version, and other gpuwatch builds, read alike)."""
    _, _, path = trained
    for p in (path, default_model_path()):
        stored = sio.load(p, trusted=TRUSTED_TYPES)
        again = load_model(p).to_dict()
        assert list(again) == list(stored) and list(again["training"]) == list(stored["training"])
        assert {k: v for k, v in again.items() if k != "estimator"} == \
            {k: v for k, v in stored.items() if k != "estimator"}
        assert again["estimator"] is not None


def test_a_file_that_is_not_a_gpuwatch_model_is_refused_in_one_line(trained, fleet, tmp_path, capsys):
    _, model, path = trained
    stored = sio.load(path, trusted=TRUSTED_TYPES)
    cases = {
        "estimator": (stored["estimator"], r"not a gpuwatch failure model$"),
        "no-threshold": ({k: v for k, v in stored.items() if k != "threshold"},
                         r"not a gpuwatch failure model: 'threshold' is missing, expected a number"),
        "text-step": ({**stored, "step_s": "10m"}, r"'step_s' is a str, expected an integer"),
        "short-importance": ({**stored, "importance": stored["importance"][:-1]},
                             rf"{len(model.features) - 1} importance values for {len(model.features)} features"),
        "newer": ({**stored, "version": 99}, r"model version 99 is newer than this gpuwatch reads"),
    }
    for name, (content, message) in cases.items():
        bad = tmp_path / f"{name}.skops"
        sio.dump(content, bad)
        with pytest.raises(UserError, match=message):
            load_model(bad)
        assert main(["score", str(fleet / "heldout"), "--model", str(bad), "--json"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(bad) in err and "Traceback" not in err, err


def test_a_model_file_from_before_the_baseline_still_scores(trained, fleet, tmp_path):
    """The first model files lack the rule baseline and the dropped features; they score as they did, and
    `gpuwatch evaluate`, which needs the baseline, says so in one line."""
    ds, model, path = trained
    stored = sio.load(path, trusted=TRUSTED_TYPES)
    del stored["baseline_threshold"]
    for key in ("dropped_features", "false_alarm_budget", "seconds"):
        del stored["training"][key]
    old = tmp_path / "old.skops"
    sio.dump(stored, old)
    loaded = load_model(old)
    rows = ds.rows.head(200)
    assert np.array_equal(loaded.risk(rows), model.risk(rows)) and loaded.training.dropped_features == ()
    with pytest.raises(UserError, match="retrain it to evaluate"):
        evaluate_model(loaded, build_dataset(fleet / "heldout"))


def test_default_model_loads():
    model = load_model()
    assert "simulated" in model.description and set(model.features) <= set(feature_names())
    assert 0 < model.threshold < 1 and model.baseline_threshold is not None and 0 < model.baseline_threshold <= 1
    assert (default_model_path().parent / "MODEL_CARD.md").is_file()


def test_evaluation_reports_model_and_baseline_side_by_side(trained, fleet):
    _, model, _ = trained
    held = build_dataset(fleet / "heldout")
    result = evaluate_model(model, held)
    for key in METRIC_KEYS:
        assert key in result and key in result["baseline"] and key in result["baseline_calibrated"]
    assert result["evaluated_on"]["held_out"] == "whole data set"
    # side-by-side thresholds come from the training data: evaluating other data cannot move them
    assert result["baseline"]["threshold"] == model.baseline_threshold
    assert result["fixed_threshold"]["threshold"] == model.threshold
    assert sum(int(v.split("/")[1]) for v in result["recall_by_kind"].values()) == result["faults"]
    assert result["false_alert_hours_per_1000_gpu_days"] >= 0
    assert result["faults"] > 0 and result["event_recall"] is not None
    assert result["event_recall"] > result["event_recall_sudden"]  # precursors are what makes faults predictable
    assert 0 <= result["pr_auc"] <= 1


def test_cli_simulate_train_evaluate(fleet, tmp_path, capsys):
    out = tmp_path / "rec"
    assert main(["simulate", "--nodes", "2", "--gpus", "2", "--days", "0.5", "--resolution", "5m", "--seed", "9",
                 "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpu_rows"] > 0
    assert main(["train", str(fleet / "train"), "--horizon", "1h", "-o", str(tmp_path / "m.skops"), "--json",
                 "--prior", "none"]) == 0  # the prior has tests of its own (test_models_prior.py)
    capsys.readouterr()
    assert main(["evaluate", str(fleet / "train"), "--model", str(tmp_path / "m.skops"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["evaluated_on"]["held_out"] == "test block of the training data"
    assert main(["evaluate", str(fleet / "train"), "--model", str(tmp_path / "m.skops")]) == 0
    assert "false_alarms_per_1000_gpu_days" in capsys.readouterr().out
    assert main(["train", str(tmp_path / "nope"), "-o", str(tmp_path / "x.skops")]) == 2
    assert "no such recording directory" in capsys.readouterr().err


def test_train_shows_progress_on_a_terminal_and_none_with_quiet(fleet, tmp_path):
    status, out, shown = run_on_terminal("train", str(fleet / "train"), "-o", str(tmp_path / "m.skops"), "--json",
                                         "--prior", "none")  # the prior's fleets are built quietly either way
    assert status == 0 and json.loads(out)["model"] == str(tmp_path / "m.skops")
    assert f"features: {SMALL['nodes']}/{SMALL['nodes']} nodes" in shown and "train: 4/4 stages" in shown
    status, _, shown = run_on_terminal("simulate", "--nodes", "2", "--gpus", "2", "--days", "0.2", "--out",
                                       str(tmp_path / "sim"), "--quiet")
    assert status == 0 and shown == ""


def test_duckdb_store_gives_the_same_dataset_as_the_recording(fleet, trained, tmp_path):
    """The collector store's own tables (its DDL) take a recording's rows as they are, and train the same."""
    import duckdb

    from gpuwatch.collector.store.duckdb import DDL

    ds, _, _ = trained
    store = tmp_path / "store.duckdb"
    with duckdb.connect(str(store)) as con:
        con.execute("SET TimeZone = 'UTC'")
        for table in ("gpu_samples", "events"):
            con.execute(next(d for d in DDL if f"EXISTS {table} (" in d))
            parts = fleet / "train" / table / "*.parquet"
            con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM read_parquet('{parts}')")
            store_cols = [r[0] for r in con.execute(f"DESCRIBE {table}").fetchall()]
            assert store_cols == SCHEMAS[table].names  # same columns, same order
    from_store = build_dataset(store)
    assert (from_store.source.start_ms, from_store.source.end_ms) == (ds.source.start_ms, ds.source.end_ms)
    key = ["node", "gpu_index", "t_ms"]
    a = ds.rows.sort_values(key).reset_index(drop=True)
    b = from_store.rows.sort_values(key).reset_index(drop=True)
    pd.testing.assert_frame_equal(a[key + ["label", "censored"] + feature_names()],
                                  b[key + ["label", "censored"] + feature_names()], check_dtype=False)
    (tmp_path / "not-a-store.duckdb").write_text("hello")
    with pytest.raises(UserError, match="neither a recording directory nor a collector .duckdb store"):
        build_dataset(tmp_path / "not-a-store.duckdb")
    with duckdb.connect(str(tmp_path / "other.duckdb")) as con:
        con.execute("CREATE TABLE t (x INT)")
    with pytest.raises(UserError, match="not a gpuwatch DuckDB store"):
        build_dataset(tmp_path / "other.duckdb")


def test_bad_output_paths_are_one_line_before_any_work(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["simulate", "--nodes", "1", "--days", "0.01", "--out", str(tmp_path / "file")]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    # the data does not exist either: the output is checked first, so no training time is spent
    assert main(["train", str(tmp_path / "nope"), "-o", str(tmp_path / "missing" / "m.skops")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"directory {tmp_path / 'missing'} does not exist")
    assert main(["train", str(tmp_path / "nope"), "-o", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_bench_predict_deletes_its_work_dir(tmp_path):
    """A run too small to train says so after simulating; its temporary recordings must go anyway."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parent.parent / "bench" / "predict.py"
    done = subprocess.run([sys.executable, str(bench), "--nodes", "1", "--gpus", "1", "--days", "0.5",
                           "--resolution", "600", "--fault-rate-multiplier", "1"],
                          env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=900)
    assert "too few faults" in done.stdout + done.stderr, done.stdout + done.stderr
    assert list(tmp_path.iterdir()) == []


def test_loading_a_model_leaves_array_libraries_unimported():
    """skops imports every sklearn module, and through sklearn's array-API shims torch where installed:
    a collector or replay loading the model must not pay for it (seconds, hundreds of MB)."""
    import subprocess
    import sys

    code = ("import sys, threading; from gpuwatch.models.model import load_model\n"
            "models = []\n"  # several collectors in one process load at once (each in its own thread)
            "threads = [threading.Thread(target=lambda: models.append(load_model(None))) for _ in range(3)]\n"
            "[t.start() for t in threads]; [t.join() for t in threads]\n"
            "print('torch' in sys.modules, sum(0 < m.threshold < 1 for m in models))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "3"]
