"""Tiered retention of GPU samples on both engines: per-minute rollups built from the raw rows, exactly once,
read transparently across the raw cutoff by series and scoring."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from gpuwatch.apps import cli
from gpuwatch.collector import client
from gpuwatch.collector.scoring import score_gpus
from gpuwatch.collector.server import serve
from gpuwatch.core.settings import local_collector
from gpuwatch.collector.store import open_store, rollups
from gpuwatch.core.errors import UserError
from gpuwatch.core.settings import COLLECTOR_OPTIONS, load_config
from gpuwatch.core.times import parse_duration
from gpuwatch.models.model import load_model
from gpuwatch.simulator.failing_fleet import HOUR_MS
from helpers import STORE_KINDS, T0, T0_MS, degrading_node, make_batch, sim_batches, store_url

FIELDS = ["gpu_power_watts", "gpu_memory_temperature_celsius", "gpu_utilization_ratio"]
BATCHES = 60  # 3 ticks of 1 s each: three minutes of two GPUs


@pytest.fixture(params=STORE_KINDS)
def kind(request):
    return request.param


def _tiered(kind, tmp_path, name="tiered", raw_s=60.0):
    return open_store(store_url(kind, tmp_path, name), raw_retention_s=raw_s, rollup_retention_s=None)


def _rollup_rows(store, kind):
    table = rollups.ROLLUP_TABLE
    if kind == "duckdb":
        return store.query_df(f"SELECT *, epoch_ms(minute) AS minute_ms FROM {table} ORDER BY node, gpu_index, minute")
    return store.query_df(f"SELECT *, toInt64(toUnixTimestamp64Milli(minute)) AS minute_ms FROM {table} "
                          "ORDER BY node, gpu_index, minute")


def test_rollups_equal_the_raw_minute_aggregates_and_a_resent_batch_counts_once(kind, tmp_path):
    store = _tiered(kind, tmp_path)
    try:
        for seq in range(1, BATCHES + 1):
            store.write(make_batch(seq))
        store.build_rollups()
        assert all(store.write(make_batch(seq)).duplicate for seq in (5, 30))  # resends after a build
        store.build_rollups()
        raw = store.gpu_minutes(0, T0_MS + 10**7, last=FIELDS, means=[], mins=[], maxs=[])
        rolled = _rollup_rows(store, kind)
        assert len(rolled) == len(raw) == 2 * 4  # 180 s from an unaligned start: four minutes per GPU
        full = T0_MS - T0_MS % 60_000 + 60_000  # the first whole minute holds 60 one-second samples
        assert rolled.loc[rolled["minute_ms"] == full, "samples"].tolist() == [60, 60]
        assert rolled["samples"].sum() == BATCHES * 3 * 2
        for field in FIELDS:  # min, max, mean from the raw rows, in pandas
            for gpu in (0, 1):
                points = store.series("node-1", gpu, field)
                expected = points.groupby(points["ts_ms"] // 60_000 * 60_000)["value"].agg(["min", "max", "mean"])
                mine = rolled[rolled["gpu_index"] == gpu].set_index("minute_ms").loc[expected.index]
                for stat in ("min", "max", "mean"):
                    np.testing.assert_allclose(mine[rollups.column(field, stat)].to_numpy(float), expected[stat])
        for field in FIELDS:  # last: the value of the minute's last sample that has one
            np.testing.assert_allclose(rolled[rollups.column(field, "last")].to_numpy(float),
                                       raw[field].to_numpy(float))
    finally:
        store.close()


def test_series_reads_rollups_before_the_raw_cutoff_and_raw_rows_after(kind, tmp_path):
    store = _tiered(kind, tmp_path)
    try:
        for seq in range(1, BATCHES + 1):
            store.write(make_batch(seq))
        before = store.series("node-1", 0, "gpu_power_watts")
        assert set(before["resolution_s"]) == {1}
        end = int(before["ts_ms"].max())
        minutes = {"last": FIELDS[:1], "means": FIELDS[1:], "mins": [], "maxs": []}
        scorer_before = store.gpu_minutes(T0_MS, end, **minutes)
        deleted = store.apply_retention(now_ms=end + 1)  # raw rows kept for the last minute only
        assert deleted["gpu_samples"] > 0
        scorer_after = store.gpu_minutes(T0_MS, end, **minutes)  # rollups, then raw rows: the same minutes
        assert len(scorer_after) == len(scorer_before) == 8
        np.testing.assert_allclose(scorer_after[FIELDS].to_numpy(float), scorer_before[FIELDS].to_numpy(float))
        after = store.series("node-1", 0, "gpu_power_watts")
        cutoff = rollups.floor_minute(end + 1 - 60_000)
        old, new = after[after["ts_ms"] < cutoff], after[after["ts_ms"] >= cutoff]
        assert set(old["resolution_s"]) == {60} and set(new["resolution_s"]) == {1}
        raw_old = before[before["ts_ms"] < cutoff]
        means = raw_old.groupby(raw_old["ts_ms"] // 60_000 * 60_000)["value"].mean()
        np.testing.assert_allclose(old["value"].to_numpy(), means.to_numpy())
        pd.testing.assert_frame_equal(new.reset_index(drop=True),
                                      before[before["ts_ms"] >= cutoff].reset_index(drop=True))
        since = int(old["ts_ms"].iloc[-1])  # a range across the boundary
        across = store.series("node-1", 0, "gpu_power_watts", since_ms=since, limit=len(new) + 1)
        assert across["resolution_s"].tolist() == [60] + [1] * len(new)
        assert store.apply_retention(now_ms=end + 1)["gpu_samples"] == 0  # idempotent
    finally:
        store.close()


def test_scoring_gives_the_same_alerts_on_rollups_as_on_raw_samples(kind, tmp_path):
    model = load_model(None)
    gpu, events = degrading_node(T0, hours=30, fault_after_h=29, failing_gpu=1)
    store = _tiered(kind, tmp_path, raw_s=3600.0)  # one store (one chdb engine per process): raw, then tiered
    times = (T0 + 20 * HOUR_MS, T0 + 28 * HOUR_MS)
    try:
        for batch in sim_batches(gpu, events):
            store.write(batch)
        on_raw = [{g["gpu_index"]: g for g in score_gpus(store, model, at)} for at in times]
        assert store.apply_retention(now_ms=T0 + 30 * HOUR_MS)["gpu_samples"] > 0  # raw rows from 29 h on
        on_rollups = [{g["gpu_index"]: g for g in score_gpus(store, model, at)} for at in times]
        for raw, rolled in zip(on_raw, on_rollups):
            assert raw.keys() == rolled.keys() == {0, 1, 2, 3}
            for index, g in raw.items():
                assert rolled[index]["risk"] == pytest.approx(g["risk"], rel=1e-9)
                assert rolled[index]["health"] == g["health"]
        assert on_rollups[1][1]["risk"] >= model.threshold  # the failing GPU alerts at 28 h, on either tier
    finally:
        store.close()


def test_series_json_states_each_points_resolution(kind, tmp_path, capsys):
    server = serve(local_collector(store_url(kind, tmp_path, "served"), raw_retention="60s"))
    try:
        channel = client.channel(server.address)
        list(client.stream_batches(channel, [make_batch(seq) for seq in range(1, BATCHES + 1)]))
        channel.close()
        end = T0_MS + 1000 * (BATCHES * 3 + 2)
        server.store.apply_retention(now_ms=end)
        argv = ["series", "--node", "node-1", "--gpu", "1", "--field", "gpu_power_watts", "--since", "100000d",
                "--json", "--collector", server.address]
        assert cli.main(argv) == 0
        points = json.loads(capsys.readouterr().out)
        cutoff = rollups.floor_minute(end - 60_000)
        assert [p["resolution_s"] for p in points] == [60 if p["ts_ms"] < cutoff else 1 for p in points]
        assert {60, 1} <= {p["resolution_s"] for p in points}
    finally:
        server.stop()


def test_retention_flags_take_durations():
    cfg = load_config(COLLECTOR_OPTIONS, {}, env={})
    assert (parse_duration(cfg.raw_retention), parse_duration(cfg.rollup_retention)) == (2 * 86400, 90 * 86400)
    assert load_config(COLLECTOR_OPTIONS, {"raw_retention": "36h"}, env={}).raw_retention == "36h"
    with pytest.raises(UserError, match=r"raw_retention .*'2x' is not a duration"):
        load_config(COLLECTOR_OPTIONS, {"raw_retention": "2x"}, env={})

