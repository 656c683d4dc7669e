"""`gpuwatch collector` as a real process: durable acks, SIGKILL mid-stream with resend, SIGTERM flush."""
import threading

import grpc
import pytest

from gpuwatch.collector import client
from gpuwatch.collector.store.duckdb import DuckDBStore
from helpers import ROWS_PER_BATCH, CollectorProcess, make_batch

pytestmark = pytest.mark.slow


def _stored_rows(db_path: str) -> tuple[int, int]:
    """(rows, distinct (node, gpu, ts)) in gpu_samples, read by this process after the collector is gone."""
    store = DuckDBStore(db_path)
    try:
        df = store.query_df("SELECT count(*) AS n, count(DISTINCT (node, gpu_index, ts)) AS d FROM gpu_samples")
        return int(df["n"][0]), int(df["d"][0])
    finally:
        store.close()


def test_an_acked_batch_survives_sigkill(tmp_path):
    db = str(tmp_path / "c.duckdb")
    collector = CollectorProcess(db).start()
    ch = client.channel(collector.address)
    assert not client.push(ch, make_batch(1)).duplicate
    collector.kill()
    ch.close()
    assert _stored_rows(db) == (ROWS_PER_BATCH, ROWS_PER_BATCH)


def test_sigkill_mid_stream_then_resend_stores_every_sample_exactly_once(tmp_path):
    db = str(tmp_path / "c.duckdb")
    total = 400
    batches = [make_batch(seq).SerializeToString() for seq in range(1, total + 1)]
    collector = CollectorProcess(db).start()
    acked: set[int] = set()
    ch = client.channel(collector.address)
    killed = threading.Event()
    with pytest.raises(grpc.RpcError):  # the stream dies with the collector
        for ack in client.stream_batches(ch, batches, window=32):
            acked.add(ack.sequence)
            if len(acked) == 50 and not killed.is_set():
                killed.set()
                collector.kill()
    ch.close()
    assert 50 <= len(acked) < total

    collector.start()  # restart on the same port and store
    ch = client.channel(collector.address)
    unacked = [b for seq, b in enumerate(batches, start=1) if seq not in acked]
    resent = list(client.stream_batches(ch, unacked, window=32))
    assert len(resent) == len(unacked)
    ch.close()
    collector.stop()
    assert _stored_rows(db) == (total * ROWS_PER_BATCH, total * ROWS_PER_BATCH)
