"""`gpuwatch export`: a collector store (DuckDB or chdb) out as a recording, and back in through replay."""
import json
import subprocess
import sys

import duckdb
import pandas as pd
import pytest

from gpuwatch.apps import cli
from gpuwatch.apps.export import export_store
from gpuwatch.apps.replay_offline import replay_offline
from gpuwatch.collector.store import open_store, rollups
from gpuwatch.core.errors import UserError
from gpuwatch.core.recording import TABLES, open_recording
from helpers import (STORE_KINDS, T0, T0_MS, CollectorProcess, make_batch, sorted_samples, store_url, ts_ms,
                     two_rank_spans, write_small_recording)

BATCHES = 60  # 3 ticks of 1 s each: three minutes of two GPUs


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """The small recording (2 GPUs, an XID, a 2-rank job's spans) replayed into a store of each engine."""
    folder = tmp_path_factory.mktemp("export")
    write_small_recording(folder / "R", two_rank_spans())
    urls = {kind: store_url(kind, folder) for kind in STORE_KINDS}
    for url in urls.values():
        replay_offline(folder / "R", db=url, quiet=True)
    return folder, urls


@pytest.fixture(params=STORE_KINDS)
def kind(request):
    return request.param


def _counts(result: dict) -> dict:
    return {n["node"]: (n["gpus"], n["samples"], n["events"]) for n in result["store"]["nodes"]}


def _tables(path) -> dict[str, pd.DataFrame]:
    rec = open_recording(path)
    return {table: rec.table(table) for table in TABLES}


def test_store_to_recording_to_replay_gives_the_same_counts_and_rows(stores, kind, tmp_path):
    folder, urls = stores
    result = export_store(urls[kind], tmp_path / "E", quiet=True)
    assert result["rows"] == {"gpu_samples": 10, "host_samples": 0, "events": 1, "spans": 12, "gpus": 2}
    assert result["gpu_rows_from_rollups"] == 0
    exported = open_recording(tmp_path / "E")
    assert exported.manifest["source"] == "gpuwatch collector export" and exported.manifest["nodes"] == ["n1"]
    original = open_recording(folder / "R")
    pd.testing.assert_frame_equal(sorted_samples(exported.table("gpu_samples")),
                                  sorted_samples(original.table("gpu_samples")), check_dtype=False)
    assert exported.table("events")["attrs"].tolist() == ['{"pid": "42"}']
    again = replay_offline(tmp_path / "E", quiet=True)
    first = replay_offline(folder / "R", quiet=True)
    assert _counts(again) == _counts(first) == {"n1": (2, 10, 1)}
    assert again["store"]["breakdowns"] == first["store"]["breakdowns"]


def test_both_engines_export_the_same_recording(stores, tmp_path):
    _, urls = stores
    exported = {kind: _tables(export_store(url, tmp_path / kind, quiet=True)["out"]) for kind, url in urls.items()}
    for table in TABLES:
        pd.testing.assert_frame_equal(exported["duckdb"][table], exported["chdb"][table], obj=table)


def test_since_and_until_select_a_time_range(stores, kind, tmp_path):
    _, urls = stores
    result = export_store(urls[kind], tmp_path / "E", since_ms=T0 + 1000, until_ms=T0 + 2000, quiet=True)
    assert result["rows"]["gpu_samples"] == 4 and result["rows"]["events"] == 0 and result["rows"]["spans"] == 0
    result = export_store(urls[kind], tmp_path / "F", since_ms=T0 + 3000, until_ms=T0 + 3000, quiet=True)
    assert result["rows"]["gpu_samples"] == 2 and result["rows"]["events"] == 1


def _tiered_store(kind, tmp_path):
    """Three minutes of two GPUs through a tiered store whose raw cutoff then falls inside them."""
    url = store_url(kind, tmp_path, "tiered")
    store = open_store(url, raw_retention_s=60.0, rollup_retention_s=None)
    try:
        for seq in range(1, BATCHES + 1):
            store.write(make_batch(seq))
        end = T0_MS + 1000 * (BATCHES * 3 + 2)
        store.apply_retention(now_ms=end)
        counts = store.count("gpu_samples"), store.count(rollups.ROLLUP_TABLE), store.count("host_samples")
        expected = store.series("node-1", 0, "gpu_power_watts")
    finally:
        store.close()
    return url, rollups.floor_minute(end - 60_000), counts, expected


def test_a_store_across_the_rollup_cutoff_exports_rolled_up_minutes_then_raw_rows(kind, tmp_path):
    url, cutoff, (raw_left, minutes, hosts), expected = _tiered_store(kind, tmp_path)
    result = export_store(url, tmp_path / "E", quiet=True)
    rolled_before = len(range(rollups.floor_minute(T0_MS), cutoff, 60_000)) * 2  # minutes x GPUs
    assert 0 < result["gpu_rows_from_rollups"] == rolled_before < minutes
    assert result["rows"]["gpu_samples"] == raw_left + rolled_before
    assert result["rows"]["host_samples"] == hosts and result["rows"]["events"] == BATCHES
    gpu = open_recording(tmp_path / "E").table("gpu_samples")
    gpu0 = gpu[gpu["gpu_index"] == 0]
    assert gpu0["gpu_power_watts"].tolist() == pytest.approx(expected["value"].tolist())
    times = pd.Series(ts_ms(gpu0["ts"]))
    assert (times.diff().dropna() > 0).all()  # rolled-up minutes, then raw rows, oldest first
    assert (times[times < cutoff] % 60_000 != 0).any()  # at the minute's newest sample, not its start
    late = export_store(url, tmp_path / "L", since_ms=cutoff, quiet=True)
    assert late["gpu_rows_from_rollups"] == 0 and late["rows"]["gpu_samples"] == raw_left


def test_both_engines_export_the_same_tiered_recording(tmp_path):
    exported = {}
    for kind in STORE_KINDS:
        url, _, _, _ = _tiered_store(kind, tmp_path)
        exported[kind] = _tables(export_store(url, tmp_path / kind, quiet=True)["out"])
    for table in TABLES:
        pd.testing.assert_frame_equal(exported["duckdb"][table], exported["chdb"][table], obj=table)


def test_cli_and_a_store_held_by_a_running_collector(stores, kind, tmp_path):
    _, urls = stores
    live = store_url(kind, tmp_path, "live")
    flag = "--db" if kind == "duckdb" else "--store"
    collector = CollectorProcess(live).start()
    try:
        run = subprocess.run([sys.executable, "-m", "gpuwatch", "export", flag, live, "--out", str(tmp_path / "E")],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 2 and "in use (a running collector holds its lock)" in run.stderr, run.stderr
        assert "export a copy" in run.stderr and len(run.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "E").exists()
    finally:
        collector.stop()
    run = subprocess.run([sys.executable, "-m", "gpuwatch", "export", "--store", urls[kind], "--out",
                          str(tmp_path / "E"), "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["nodes"] == ["n1"]


def test_bad_stores(tmp_path):
    with pytest.raises(UserError, match="no such collector store file"):
        export_store(tmp_path / "missing.duckdb", tmp_path / "E")
    with pytest.raises(UserError, match="no such chdb store directory"):
        export_store(f"chdb://{tmp_path / 'missing'}", tmp_path / "E")
    assert not (tmp_path / "missing").exists()
    (tmp_path / "junk.duckdb").write_text("not a database")
    with pytest.raises(UserError, match="junk.duckdb"):
        export_store(tmp_path / "junk.duckdb", tmp_path / "E")
    with duckdb.connect(str(tmp_path / "other.duckdb")) as con:
        con.execute("CREATE TABLE t (x INTEGER)")
    with pytest.raises(UserError, match="other.duckdb: not a gpuwatch collector store"):
        export_store(tmp_path / "other.duckdb", tmp_path / "E")
    with duckdb.connect(str(tmp_path / "other.duckdb"), read_only=True) as con:  # left as it was
        assert [r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()] == ["t"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="empty: not a gpuwatch collector store"):
        export_store(f"chdb://{tmp_path / 'empty'}", tmp_path / "E")
    assert list((tmp_path / "empty").iterdir()) == []
    assert not (tmp_path / "E").exists()


def test_a_bad_until_is_named(tmp_path, capsys):
    assert cli.main(["export", "--db", str(tmp_path / "x.duckdb"), "--out", str(tmp_path / "E"),
                     "--until", "yesterday"]) == 2
    err = capsys.readouterr().err
    assert "--until 'yesterday' is not a duration" in err and "--since" not in err


def test_db_and_store_are_one_choice(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["export", "--db", "a.duckdb", "--store", "chdb:///x", "--out", str(tmp_path / "E")])
    assert "not allowed with argument" in capsys.readouterr().err
