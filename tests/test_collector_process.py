"""`gpuwatch collector` as a real process: durable acks, SIGKILL mid-stream with resend, SIGTERM flush."""
import threading

import grpc
import pytest

from gpuwatch.collector import client
from gpuwatch.collector.store import open_store
from helpers import ROWS_PER_BATCH, STORE_KINDS, CollectorProcess, make_batch, store_url

pytestmark = pytest.mark.slow


def _stored_rows(url: str) -> tuple[int, int]:
    """(rows, distinct (node, gpu, ts)) in gpu_samples, read by this process after the collector is gone."""
    store = open_store(url)
    try:
        rows = store.gpu_samples(columns=[])
        return len(rows), len(rows.drop_duplicates(["node", "gpu_index", "ts"]))
    finally:
        store.close()


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_an_acked_batch_survives_sigkill(kind, tmp_path):
    db = store_url(kind, tmp_path, "c")
    collector = CollectorProcess(db).start()
    ch = client.channel(collector.address)
    assert not client.push(ch, make_batch(1)).duplicate
    collector.kill()
    ch.close()
    assert _stored_rows(db) == (ROWS_PER_BATCH, ROWS_PER_BATCH)


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_sigkill_mid_stream_then_resend_stores_every_sample_exactly_once(kind, tmp_path):
    db = store_url(kind, tmp_path, "c")
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
