"""The demo's live view with partial data (issue 10, point 12): a job known from GPU samples before any of its
step data arrived, a node with no latest row yet; the view renders unknown values as '-' and never raises."""
import json
import time

from gpuwatch.collector import client
from gpuwatch.collector.alert_hub import AlertHub, JobFinding
from gpuwatch.collector.jobs import JobsMonitor
from gpuwatch.collector.server import serve
from gpuwatch.demo import DemoPlan, fleet_view
from gpuwatch.v1 import query_pb2
from helpers import make_batch, poll


def test_the_view_renders_jobs_without_step_data_as_dashes(tmp_path):
    hub = AlertHub(None)
    jobs = JobsMonitor(None, interval_s=3600, window_s=10 * 365 * 86400, hang_threshold_s=3600)
    server = serve("127.0.0.1:0", str(tmp_path / "demo.duckdb"), services=[hub, jobs])
    try:
        server.store.write(make_batch(1))  # GPU 1 runs job-7; no spans (steps) from it yet
        query = client.connect(server.address)
        listed = poll(lambda: json.loads(query.Jobs(query_pb2.JobsRequest(), timeout=5).json), 10,
                      "job-7 to be listed")
        assert listed[0]["job_id"] == "job-7" and listed[0].get("steps") is None  # the partial data of the bug
        text = fleet_view(query, {}, elapsed_s=1.0, plan=DemoPlan(duration_s=10), data_ms=int(time.time() * 1000))
    finally:
        server.stop()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("job-7")]
    print(line)
    assert line.split()[2:4] == ["-", "-"]  # steps and lost % not known yet


def test_the_view_renders_job_alerts_that_have_no_gpu_or_risk(tmp_path):
    hub = AlertHub(None)
    jobs = JobsMonitor(None, interval_s=3600, window_s=3600, hang_threshold_s=3600)
    server = serve("127.0.0.1:0", str(tmp_path / "demo.duckdb"), services=[hub, jobs])
    try:
        hub.set_job_alerts("SlowRank", [JobFinding("job-7", "job-7/rank-3", "rank 3 is slow", {"rank": 3})])
        query = client.connect(server.address)
        text = fleet_view(query, {}, elapsed_s=1.0, plan=DemoPlan(duration_s=10), data_ms=None)
    finally:
        server.stop()
    (line,) = [ln for ln in text.splitlines() if "SlowRank" in ln]
    assert "GPU - on -, risk -" in line
