"""Several collectors sharing one ClickHouse store (chdb in-process: one engine per process, so the collectors
are instances in this process; separate processes on a ClickHouse server are not exercised here): an agent
given both fails over and every batch is stored once; scoring, the jobs monitor and alerts run on one
collector at a time (the lease), another takes over when it dies, and no alert fires twice for one event."""
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gpuwatch.collector.assembly import start_collector
from gpuwatch.collector.lease import ClusterLease
from gpuwatch.collector.store import open_store
from gpuwatch.core.columnar import from_message
from gpuwatch.core.settings import COLLECTOR_OPTIONS, CollectorSettings, load_config
from helpers import ROWS_PER_BATCH, make_batch, poll

INTERVAL_S = 0.5


class _Hook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server API)
        _Hook.received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def webhook():
    _Hook.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/hook"
    server.shutdown()


def _collector(store: str, webhook_url: str):
    cfg = load_config(COLLECTOR_OPTIONS, {
        "listen": "127.0.0.1:0", "store": store, "jobs_interval": INTERVAL_S, "score_interval": INTERVAL_S,
        "webhook_url": webhook_url, "log_level": "warning"}, env={})
    return start_collector(cfg.build(CollectorSettings))


def _lease(server) -> ClusterLease:
    return next(s for s in server.services if isinstance(s, ClusterLease))


def _slow_rank_alerts() -> set[tuple]:
    """Distinct SlowRank alerts delivered (one per straggler event: its subject and start)."""
    return {(a["job_id"], a["rank"], a["starts_at"]) for body in _Hook.received for a in body["alerts"]
            if a["alertname"] == "SlowRank" and a["status"] == "firing"}


def test_two_collectors_share_the_work_and_an_agent_fails_over(tmp_path, webhook):
    store = f"chdb://{tmp_path / 'shared'}"
    first, second = _collector(store, webhook), _collector(store, webhook)
    servers = [first, second]
    agent = subprocess.Popen([
        sys.executable, "-m", "gpuwatch", "agent", "--collector", f"{first.address},{second.address}",
        "--simulate", "4", "--node", "cluster-node", "--interval", "0.2", "--batch-interval", "0.4",
        "--spool", str(tmp_path / "spool"), "--sim-job", "cluster-job", "--sim-speed", "10", "--log-level", "error"])
    try:
        holders = poll(lambda: [s for s in servers if _lease(s).held()], 30, "a lease holder")
        assert len(holders) == 1  # one collector does the cluster's background work
        holder = holders[0]
        other = second if holder is first else first
        poll(_slow_rank_alerts, 120, "a SlowRank alert from the lease holder")
        assert first.store.count("gpu_samples") > 0

        # the holder dies: it stops renewing without giving the lease up, and stops serving
        _lease(holder).stop(release=False)
        holder.stop()
        poll(lambda: _lease(other).held(), 60, "the other collector taking the lease over")
        assert _lease(other).acquisitions >= 1
        delivered = len(_Hook.received)
        poll(lambda: len(_Hook.received) > delivered + 1, 60, "alerts delivered by the new holder")
        assert len(_slow_rank_alerts()) == 1, _slow_rank_alerts()  # resent, never fired anew

        # the agent failed over to the surviving collector: its new batches arrive there
        stored = other.store.count("ingested")
        poll(lambda: other.store.count("ingested") > stored + 3, 60, "batches after the fail-over")
    finally:
        agent.kill()
        agent.wait(30)
        for server in servers:
            server.stop()
    reader = open_store(store)
    try:
        samples = reader.gpu_samples(columns=[])
        assert len(samples) == len(samples.drop_duplicates(["node", "gpu_index", "ts"])) > 0
        assert reader.count("ingested") == reader.query_df(
            "SELECT uniqExact(agent_id, sequence) AS n FROM ingested")["n"].iloc[0]
    finally:
        reader.close()


def test_a_batch_resent_to_another_collector_is_stored_once(tmp_path):
    store = f"chdb://{tmp_path / 'shared'}"
    first, second = open_store(store), open_store(store)
    try:
        assert not first.write(make_batch(1)).duplicate
        assert second.write(make_batch(1)).duplicate  # same agent and sequence, other collector
        assert not second.write(make_batch(2)).duplicate
        assert first.write(make_batch(2)).duplicate
        assert first.count("gpu_samples") == second.count("gpu_samples") == 2 * ROWS_PER_BATCH
    finally:
        first.close()
        second.close()


def test_rows_written_twice_by_a_collector_killed_before_recording_the_batch_read_once(tmp_path):
    """The crash window: rows inserted, the `ingested` mark not. The resend writes the same rows again;
    the ReplacingMergeTree keys and final reads keep one copy."""
    store = open_store(f"chdb://{tmp_path / 'crash'}")
    try:
        batch = make_batch(1)
        store.run_write(lambda _: store._commit([from_message(batch)]))  # the group's rows and mark
        store.run_write(lambda _: [store._insert(name, table) for name, table in _rows_without_mark(batch)])
        assert store.count("gpu_samples") == sum(len(s.ts_ms) for s in batch.samples)
        assert store.count("events") == len(batch.events)
    finally:
        store.close()


def _rows_without_mark(batch):
    from gpuwatch.collector.store.clickhouse import _plain_strings
    from gpuwatch.collector.store.duckdb import batch_tables, ms_to_datetime

    tables = batch_tables([from_message(batch)], ms_to_datetime(0))
    return [(name, _plain_strings(table)) for name, table in tables.items() if name != "ingested"]


def test_a_lease_claim_stored_after_the_winners_never_wins_whatever_its_clock(tmp_path):
    """Two collectors that both saw the lease free claim the same term; the one whose claim the store holds
    first wins, even when the other's clock (its claimed_ms) is earlier: no moment with two holders."""
    import pandas as pd

    store = open_store(f"chdb://{tmp_path / 'lease'}")
    try:
        assert store.take_lease("work", "a", 30)
        late_claim = pd.DataFrame([{"name": "work", "holder": "b", "term": 1, "claimed_ms": 0, "expires_ms": 10**13}])
        store.run_write(lambda _: store._insert("leases", late_claim))
        assert not store.take_lease("work", "b", 30)
        assert store.take_lease("work", "a", 30)
    finally:
        store.close()


def test_a_lapsed_lease_is_claimed_by_another_collector_only_after_a_grace(tmp_path):
    """A holder that read its lease as valid just before it lapsed may still be storing its renewal: another
    collector waits a third of the ttl past the lapse before it claims, so there are never two holders."""
    store = open_store(f"chdb://{tmp_path / 'lease'}")
    try:
        assert store.take_lease("work", "a", 0.3)
        poll(lambda: store._lease_state("work")[2] < time.time() * 1000, 10, "the lease to lapse")
        assert not store.take_lease("work", "b", 600)  # lapsed, but within the grace of a ttl of 600 s
        assert store.take_lease("work", "a", 0.3)  # the holder renews its own lapsed lease at once
        poll(lambda: store.take_lease("work", "b", 0.3), 10, "the other collector taking the lease after the grace")
    finally:
        store.close()
