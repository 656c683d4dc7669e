"""The demo's view over partial data from a real collector: a job known from GPU samples
before any of its step data arrived, and a job alert with no GPU or risk, go through the Jobs and Alerts
RPCs into the view, and both renderings come out without an exception."""

from rich.console import Console

from gpuwatch.collector import client
from gpuwatch.collector.alert_hub import AlertHub, JobFinding
from gpuwatch.collector.jobs import JobsMonitor
from gpuwatch.collector.server import serve
from gpuwatch.core.settings import local_collector
from gpuwatch.apps.demo import DemoPlan
from gpuwatch.apps.demo_view import collect_view, render_rich, render_text
from gpuwatch.collector.query_documents import job_documents
from gpuwatch.v1 import query_pb2
from helpers import make_batch, poll


def test_the_view_renders_partial_jobs_and_job_alerts_from_a_real_collector(tmp_path):
    hub = AlertHub(None)
    jobs = JobsMonitor(None, interval_s=3600, window_s=10 * 365 * 86400, hang_threshold_s=3600)
    server = serve(local_collector(str(tmp_path / "demo.duckdb")), services=[hub, jobs])
    try:
        server.store.write(make_batch(1))  # GPU 1 runs job-7; no spans (steps) from it yet
        hub.set_job_alerts("SlowRank", [JobFinding("job-7", "job-7/rank-3", "rank 3 is slow", {"rank": 3})])
        query = client.connect(server.address)
        listed = poll(lambda: job_documents(query.Jobs(query_pb2.JobsRequest(), timeout=5)), 10, "job-7")
        assert listed[0]["job_id"] == "job-7" and listed[0].get("steps") is None  # the partial data of the bug
        view = collect_view(query, {}, listed + [{"job_id": "job-8"}], elapsed_s=1.0, plan=DemoPlan(duration_s=10),
                            data_ms=None, threshold=None)
    finally:
        server.stop()
    text = render_text(view)
    (line,) = [ln for ln in text.splitlines() if ln.startswith("job-8")]
    assert line.split()[1:4] == ["-", "-", "-"]  # ranks, steps and lost share not known yet
    assert "SlowRank: rank 3 is slow" in text
    console = Console(record=True, width=140)
    console.print(render_rich(view))
    assert "job-8" in console.export_text()
