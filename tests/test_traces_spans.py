"""Span tables (CSV / Parquet / probe rows) -> timelines, including the probe's step-minus-comm rule."""
from __future__ import annotations

import pandas as pd
import pytest

from gpuwatch.efficiency import analyze, load_paths
from gpuwatch.efficiency.timeline import COLLECTIVE, COMPUTE
from gpuwatch.efficiency.traces.spans import timelines_from_spans
from gpuwatch.core.errors import UserError

T0 = 1_700_000_000_000_000.0


def probe_rows(rank: int, arrive: float, steps: int = 3) -> list[dict]:
    """Host-timed probe rows: one step row per step, and an all_reduce from `arrive` to the step's end."""
    rows = []
    for step in range(steps):
        s = T0 + step * 1000
        rows.append(dict(job_id="j1", rank=rank, step=step, kind="step", name="step", start_us=s, dur_us=1000,
                         process_group="0", seq=-1, bytes=-1, world_size=2, node="n", peer=-1))
        rows.append(dict(job_id="j1", rank=rank, step=step, kind="collective", name="all_reduce",
                         start_us=s + arrive, dur_us=1000 - arrive - 100, process_group="0", seq=step,
                         bytes=4096, world_size=2, node="n", peer=-1))
    return rows


def test_probe_steps_minus_communication_is_compute():
    tls = timelines_from_spans(pd.DataFrame(probe_rows(0, 600) + probe_rows(1, 800)))
    assert [tl.rank for tl in tls] == [0, 1]
    tl0 = tls[0]
    compute = tl0.kind == COMPUTE
    assert list(tl0.end_us[compute] - tl0.start_us[compute]) == [600, 100, 600, 100, 600, 100]
    assert set(tl0.step[compute].tolist()) == {0, 1, 2}
    doc = analyze(tls, per_step=True).to_json()
    assert doc["matched_collectives"] == 3  # by process group + seq
    r0, r1 = doc["ranks"]
    assert r0["breakdown_us"]["comm_wait"] == 3 * 200  # rank 0 arrives 200 us before rank 1
    assert r0["breakdown_us"]["comm_transfer"] == 3 * 100
    assert r1["breakdown_us"]["comm_wait"] == 0
    assert r0["window_us"] == sum(r0["breakdown_us"].values()) == 3000
    assert doc["job"]["job_id"] == "j1"


def test_csv_and_parquet_files(tmp_path):
    rows = [dict(rank=0, kind="compute", start_us=T0, dur_us=50),
            dict(rank=0, kind="memset", start_us=T0 + 60, dur_us=10),
            dict(rank=0, kind="collective", name="nccl:_all_gather_base", start_us=T0 + 100, dur_us=20)]
    pd.DataFrame(rows).to_csv(tmp_path / "s.csv", index=False)
    pd.DataFrame([{**r, "rank": 1} for r in rows]).to_parquet(tmp_path / "s.parquet")
    tls = load_paths([str(tmp_path)])
    assert sorted(tl.rank for tl in tls) == [0, 1]
    assert list(tls[0].type_names()[tls[0].kind == COLLECTIVE]) == ["all_gather"]
    b = analyze(tls).to_json()["ranks"][0]["breakdown_us"]
    assert (b["compute"], b["memcpy"], b["comm_transfer"], b["small_kernel_overhead"],
            b["idle_other"]) == (50, 10, 20, 10, 30)


def test_bad_span_tables(tmp_path):
    with pytest.raises(UserError, match="t.csv: missing column.*dur_us"):
        path = tmp_path / "t.csv"
        pd.DataFrame([dict(rank=0, kind="compute", start_us=1)]).to_csv(path, index=False)
        load_paths([str(path)])
    with pytest.raises(UserError, match="different jobs"):
        timelines_from_spans(pd.DataFrame(probe_rows(0, 600) + [{**r, "job_id": "j2"} for r in probe_rows(1, 600)]))
    with pytest.raises(UserError, match="unknown kind.*kernel"):
        timelines_from_spans(pd.DataFrame([dict(rank=0, kind="kernel", start_us=1, dur_us=1)]))
    with pytest.raises(UserError, match="negative dur_us"):
        timelines_from_spans(pd.DataFrame([dict(rank=0, kind="compute", start_us=1, dur_us=-1)]))
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(UserError, match="empty.csv: cannot read"):
        load_paths([str(tmp_path / "empty.csv")])
