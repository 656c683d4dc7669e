"""`gpuwatch export`: a collector store out as a recording, and back in through replay."""
import json
import subprocess
import sys

import pandas as pd
import pytest

from gpuwatch.apps import cli
from gpuwatch.apps.export import export_store
from gpuwatch.core.errors import UserError
from gpuwatch.core.recording import open_recording
from gpuwatch.apps.replay_offline import replay_offline
from helpers import T0, CollectorProcess, sorted_samples, two_rank_spans, write_small_recording


@pytest.fixture(scope="module")
def store_db(tmp_path_factory):
    """A collector store holding the small recording (2 GPUs, an XID, a 2-rank job's spans)."""
    folder = tmp_path_factory.mktemp("export")
    write_small_recording(folder / "R", two_rank_spans())
    replay_offline(folder / "R", db=folder / "c.duckdb", quiet=True)
    return folder


def _counts(result: dict) -> dict:
    return {n["node"]: (n["gpus"], n["samples"], n["events"]) for n in result["store"]["nodes"]}


def test_store_to_recording_to_replay_gives_the_same_counts_and_rows(store_db, tmp_path):
    result = export_store(store_db / "c.duckdb", tmp_path / "E", quiet=True)
    assert result["rows"] == {"gpu_samples": 10, "host_samples": 0, "events": 1, "spans": 12, "gpus": 2}
    exported = open_recording(tmp_path / "E")
    assert exported.manifest["source"] == "gpuwatch collector export" and exported.manifest["nodes"] == ["n1"]
    original = open_recording(store_db / "R")
    pd.testing.assert_frame_equal(sorted_samples(exported.table("gpu_samples")),
                                  sorted_samples(original.table("gpu_samples")), check_dtype=False)
    assert exported.table("events")["attrs"].tolist() == ['{"pid": "42"}']
    again = replay_offline(tmp_path / "E", quiet=True)
    first = replay_offline(store_db / "R", quiet=True)
    assert _counts(again) == _counts(first) == {"n1": (2, 10, 1)}
    assert again["store"]["breakdowns"] == first["store"]["breakdowns"]


def test_since_and_until_select_a_time_range(store_db, tmp_path):
    result = export_store(store_db / "c.duckdb", tmp_path / "E", since_ms=T0 + 1000, until_ms=T0 + 2000, quiet=True)
    assert result["rows"]["gpu_samples"] == 4 and result["rows"]["events"] == 0 and result["rows"]["spans"] == 0


def test_cli_and_a_store_held_by_a_running_collector(store_db, tmp_path):
    db = str(tmp_path / "live.duckdb")
    collector = CollectorProcess(db).start()
    try:
        run = subprocess.run([sys.executable, "-m", "gpuwatch", "export", "--db", db, "--out", str(tmp_path / "E")],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and "in use (a running collector holds its lock)" in run.stderr
        assert "export a copy" in run.stderr and len(run.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "E").exists()
    finally:
        collector.stop()
    run = subprocess.run([sys.executable, "-m", "gpuwatch", "export", "--db", str(store_db / "c.duckdb"), "--out",
                          str(tmp_path / "E"), "--json"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["nodes"] == ["n1"]


def test_bad_stores(tmp_path):
    with pytest.raises(UserError, match="no such collector store file"):
        export_store(tmp_path / "missing.duckdb", tmp_path / "E")
    (tmp_path / "junk.duckdb").write_text("not a database")
    with pytest.raises(UserError, match="junk.duckdb"):
        export_store(tmp_path / "junk.duckdb", tmp_path / "E")
    assert not (tmp_path / "E").exists()


def test_a_bad_until_is_named(tmp_path, capsys):
    assert cli.main(["export", "--db", str(tmp_path / "x.duckdb"), "--out", str(tmp_path / "E"),
                     "--until", "yesterday"]) == 2
    err = capsys.readouterr().err
    assert "--until 'yesterday' is not a duration" in err and "--since" not in err
