"""The demo end to end: agent processes on accelerated simulated time -> real gRPC -> collector, DuckDB store,
scoring on the data clock and alerts; the degrading GPU must be flagged before its failure, read back from
the store. Then the demo's recordings replayed offline must give the same counts and the same alert."""
import subprocess
import sys
from pathlib import Path

import pytest

from gpuwatch.collector.store.duckdb import DuckDBStore
from gpuwatch.apps.demo import DemoPlan, run_demo
from gpuwatch.apps.demo_report import DemoResult, failure_report, summary_text
from gpuwatch.apps.demo_view import DemoView, GpuCell, JobRow, NodeRow, render_rich, render_text
from gpuwatch.apps.replay_offline import replay_offline
from gpuwatch.core.times import iso_ms

# 2 nodes x 4 GPUs for 20 s at 1500x (5 simulated minutes per 0.2 s tick): ~8 simulated hours, the scripted
# ECC fault of GPU 3 on the last node degrading from ~50 min to ~7 h.
PLAN = DemoPlan(nodes=2, gpus=4, duration_s=20, interval_s=0.2, speed=1500)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    home, workdir = root / "home", root / "run"
    home.mkdir()
    workdir.mkdir()
    views = []
    with pytest.MonkeyPatch.context() as mp:  # agents and collector must write nowhere but workdir
        mp.setenv("HOME", str(home))
        mp.setenv("TMPDIR", str(home))
        mp.chdir(home)
        result = run_demo(workdir, PLAN, show=views.append, record=True)
    return result, views, home, workdir


def test_nodes_and_samples_are_stored(demo):
    result, views, _, _ = demo
    assert [n["node"] for n in result.nodes] == ["demo-node-00", "demo-node-01"]
    assert all(n["gpus"] == 4 and n["samples"] >= 4 * 40 for n in result.nodes)  # >= 40 of ~100 ticks per GPU
    assert result.events["agent_start"] == 2 and result.events["xid"] >= 2
    last = render_text(views[-1])
    assert len(views) >= 5 and "max risk" in last and "demo-node-01" in last
    job_line = next(line for line in last.splitlines() if line.startswith("demo-job-demo-node-01"))
    assert int(job_line.split()[4]) == 1  # the stragglers column counts ranks
    # The synthetic job's slow rank makes the others wait at every point of its swing (1.1x to 1.9x its peers),
    # but near the low end the transfers outweigh the wait, so which loss tops the line depends on where the
    # last view lands in the swing (on the machine's load): the wait itself is what must show.
    [job] = [j for j in views[-1].jobs if j.job_id == "demo-job-demo-node-01"]
    assert job.breakdown["comm_wait"] > 0


def test_jobs_breakdowns_move_over_the_run(demo):
    """Each job's breakdown covers its recent window, and its slow rank drifts: the shares change."""
    _, views, _, _ = demo
    for job in ("demo-job-demo-node-00", "demo-job-demo-node-01"):
        waits = [j.breakdown.get("comm_wait") for v in views for j in v.jobs if j.job_id == job and j.breakdown]
        assert len(waits) >= 3 and max(waits) - min(waits) > 0.02, waits


def test_the_failed_gpu_is_shown_failed_and_idle(demo):
    _, views, _, _ = demo
    (node,) = [n for n in views[-1].nodes if n.node == "demo-node-01"]
    failed = [g for g in node.gpus if g.failed]
    assert [g.index for g in failed] == [3] and "XID 48" in failed[0].failed and failed[0].health == "fail"
    assert failed[0].utilization == 0.0  # a fatal XID stopped its work
    assert "GPU 3" in next(line for line in render_text(views[-1]).splitlines() if line.startswith("demo-node-01"))
    assert any(a.get("state") == "failed" for a in views[-1].alerts)


def test_views_with_unknown_values_render_as_dashes_in_text_and_rich():
    """Before the first samples and scores every value is unknown: both views draw "-" and never fail."""
    from io import StringIO

    from rich.console import Console

    view = DemoView(elapsed_s=1.0, duration_s=60.0, sim_speed=600.0, data_ms=None, threshold=None,
                    nodes=[NodeRow("n1", None, [GpuCell(0), GpuCell(1, utilization=float("nan"), risk=0.9)]),
                           NodeRow("n2", 5, [])],
                    jobs=[JobRow("j", None, None, None, {}), JobRow("k", 2, 10, 0.3, {"compute": 0.7, "bubble": None})],
                    alerts=[{"alertname": "GPUFailureRisk"}, {}])
    text = render_text(view)
    assert "--:--" in text and "n1" in text and " - " in text
    console = Console(file=StringIO(), width=160, color_system="truecolor", force_terminal=True)
    console.print(render_rich(view))
    drawn = console.file.getvalue()
    assert "n1" in drawn and "-" in drawn and "\x1b[" in drawn  # drawn, in colour
    empty = DemoView(0.0, 60.0, 600.0, None, None, [], [], [])
    assert "waiting for the first batches" in render_text(empty)
    console.print(render_rich(empty))
    assert "none" in summary_text(DemoResult(nodes=[], events={}, report={"failed": [], "false_alarms": []},
                                             workdir=""))


def test_the_degrading_gpu_is_flagged_before_it_fails_and_no_healthy_gpu_is(demo):
    result, views, _, _ = demo
    [failed] = result.report["failed"]
    assert (failed["node"], failed["gpu_index"]) == ("demo-node-01", 3)
    assert failed["flagged_ms"] is not None and failed["lead_time_s"] > 0
    assert failed["lead_time_s"] == (failed["failed_ms"] - failed["flagged_ms"]) / 1000
    assert failed["peak_risk"] > 0.5
    assert result.report["false_alarms"] == []
    assert any("GPUFailureRisk: GPU 3 on demo-node-01" in render_text(v) for v in views)
    assert "GPU 3 on node demo-node-01 flagged at" in summary_text(result)


def test_the_report_is_read_back_from_the_store(demo):
    result, _, _, workdir = demo
    store = DuckDBStore(str(workdir / "gpuwatch.duckdb"))
    try:
        assert failure_report(store) == result.report
        fault_codes = store.query_df("""SELECT DISTINCT code FROM events
                                        WHERE node = 'demo-node-01' AND gpu_index = 3 AND kind = 'xid'""")["code"]
        assert 48 in set(fault_codes) and 63 in set(fault_codes)  # the fault XID after the remap precursors
    finally:
        store.close()


def test_nothing_is_written_outside_the_demo_dir(demo):
    result, _, home, workdir = demo
    assert list(home.iterdir()) == []
    assert {p.name for p in workdir.iterdir()} == {"gpuwatch.duckdb", "spool", "recordings",
                                                   "demo-node-00.log", "demo-node-01.log"}
    assert result.recordings == [str(workdir / "recordings" / n) for n in ("demo-node-00", "demo-node-01")]


def test_replaying_the_recordings_offline_reproduces_counts_and_the_alert(demo, tmp_path):
    result, _, _, workdir = demo
    live = DuckDBStore(str(workdir / "gpuwatch.duckdb"))
    try:
        live_events = live.query_df("SELECT node, count(*) AS n FROM events GROUP BY node").set_index("node")["n"]
        live_breakdowns = {f"demo-job-{n['node']}": _breakdown_us(live, f"demo-job-{n['node']}") for n in result.nodes}
    finally:
        live.close()
    failed = result.report["failed"][0]
    for path in result.recordings:
        db = tmp_path / f"{Path(path).name}.duckdb"
        out = replay_offline(path, db=db, score_interval_s=600, quiet=True)
        [node] = out["store"]["nodes"]
        replayed = DuckDBStore(str(db))
        try:
            job = f"demo-job-{node['node']}"
            assert _breakdown_us(replayed, job) == live_breakdowns[job]
            assert live_breakdowns[job]["comm_wait"] > 0
        finally:
            replayed.close()
        stored = next(n for n in result.nodes if n["node"] == node["node"])
        assert (node["gpus"], node["samples"]) == (stored["gpus"], stored["samples"])
        assert node["events"] == live_events[node["node"]]
        flagged = {(a["node"], a["gpu_index"]) for a in out["scoring"]["alerts"] if a["alertname"] == "GPUFailureRisk"}
        if node["node"] == failed["node"]:
            assert flagged == {(failed["node"], failed["gpu_index"])}
            [alert] = [a for a in out["scoring"]["alerts"] if a["alertname"] == "GPUFailureRisk"]
            assert iso_ms(alert["starts_at"]) < failed["failed_ms"]
        else:
            assert flagged == set()


def _breakdown_us(store: DuckDBStore, job_id: str) -> dict[str, float]:
    """The job's breakdown as `gpuwatch breakdown JOB --json` gives it (job.breakdown_us)."""
    import json

    from gpuwatch.collector.breakdowns import BreakdownService
    from gpuwatch.v1 import query_pb2 as q

    reply = BreakdownService().breakdown(q.BreakdownRequest(job_id=job_id), store)
    return json.loads(reply.json)["job"]["breakdown_us"]



def test_bad_demo_flags_are_one_line(tmp_path):
    for extra, problem in [(["--fault", "disk"], "--fault disk"), (["--nodes", "0"], "must be positive")]:
        out = subprocess.run([sys.executable, "-m", "gpuwatch", "demo", "--dir", str(tmp_path / "d"), *extra],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and problem in out.stderr and "Traceback" not in out.stderr
    assert not Path(tmp_path / "d").exists()


def test_piped_the_view_prints_a_frame_on_change_and_hourly_in_simulated_time_and_the_last_one(capsys):
    """A frame per scoring round (several a second) floods a pipe: 985 lines in 18 s before."""
    from gpuwatch.apps.demo_view import PLAIN_EVERY_SIM_S, TerminalView

    def frame(i: int, alerts: list) -> DemoView:
        gpus = [GpuCell(0, utilization=0.5 + i / 1000, risk=i / 1000)]
        return DemoView(elapsed_s=0.2 * i, duration_s=60.0, sim_speed=600.0, data_ms=None, threshold=None,
                        nodes=[NodeRow("n1", i, gpus)], jobs=[], alerts=alerts)

    view = TerminalView()  # pytest's captured stdout is not a terminal: the plain view
    alert = [{"alertname": "GPUFailureRisk", "node": "n1", "gpu_index": 0}]
    rounds = 300  # 60 s at 0.2 s per round: 10 simulated hours
    for i in range(rounds):
        view(frame(i, alert if 100 <= i < 200 else []))
    view.close()
    out = capsys.readouterr().out
    frames = out.split("gpuwatch demo: simulated fleet")[1:]
    hours = rounds * 0.2 * 600.0 / PLAIN_EVERY_SIM_S
    # the first, one per simulated hour, the alert's start and end, the last
    assert 3 + hours <= len(frames) <= 4 + hours, len(frames)
    assert "GPUFailureRisk" in out
    assert f" {rounds - 1} " in frames[-1]  # the last view, though nothing changed since the hour's frame


def test_streaming_the_recording_into_a_live_collector_raises_the_alert_replay_offline_raises(demo, tmp_path):
    """Before the fix: `replay --offline` raised "GPUFailureRisk ... has failed" for the failed GPU; the same
    recording streamed into a live collector raised none (its rounds jumped over the risk's rise). The demo's
    data ends when the demo does, so a collector on the default auto clock may score it on the wall clock: the
    recording arrives as a backlog (like a spool drained after an outage), which must be caught up too."""

    from gpuwatch.apps import cli
    from gpuwatch.collector.alert_hub import list_alerts
    from gpuwatch.collector.query_documents import alert_documents
    from gpuwatch.collector.assembly import start_collector
    from gpuwatch.collector.scoring import Scorer
    from gpuwatch.core.settings import COLLECTOR_OPTIONS, CollectorSettings, load_config
    from gpuwatch.v1 import query_pb2 as q
    from helpers import poll

    result, _, _, _ = demo
    failed = result.report["failed"][0]
    cfg = load_config(COLLECTOR_OPTIONS, {"listen": "127.0.0.1:0", "db": str(tmp_path / "live.duckdb"),
                                          "score_interval": 0.5}, env={})
    server = start_collector(cfg.build(CollectorSettings))
    try:
        for path in result.recordings:
            assert cli.main(["replay", str(path), "--collector", server.address, "--quiet"]) == 0

        (scorer,) = [s for s in server.services if isinstance(s, Scorer)]
        stored_by = scorer.rounds
        # the round under way may have begun before the last batch was stored; the one after it did not
        poll(lambda: scorer.rounds >= stored_by + 2, 600, "two scoring rounds after the recordings were stored")
        alerts = alert_documents(list_alerts(q.AlertsRequest(include_resolved=True), server.store))
        (alert,) = [a for a in alerts if a["alertname"] == "GPUFailureRisk" and a["state"] == "failed"]
        assert (alert["node"], alert["gpu_index"]) == (failed["node"], failed["gpu_index"])
        assert "has failed" in alert["summary"]
    finally:
        server.stop()
