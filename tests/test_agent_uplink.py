"""The gRPC uplink against a real Ingest server on loopback: acks, reconnects, refused batches."""

from gpuwatch.simulator.collector_sink import IngestSink, SinkStore
from gpuwatch.agent.spool import Spool
from gpuwatch.agent.uplink import Uplink
from gpuwatch.core.batches import BatchBuilder
from gpuwatch.v1 import telemetry_pb2 as pb


def _spool_batches(spool, n, bad=()):
    builder = BatchBuilder(pb.NodeIdentity(node="n1"), spool.agent_id, [pb.GpuInfo(index=0)])
    for _ in range(n):
        seq = spool.next_sequence()
        builder.add_gpu_row(0, 1000 * seq, {"gpu_power_watts": float(seq)})
        batch = builder.build(seq)
        if seq in bad:
            batch.samples[0].columns[0].field = "not_a_field"
        spool.append(seq, batch.SerializeToString())


def test_batches_are_sent_in_order_acked_and_deleted(tmp_path, sink):
    server, address = sink
    spool = Spool(tmp_path)
    _spool_batches(spool, 50)
    uplink = Uplink(spool, address, window=8)
    uplink.start()
    try:
        assert uplink.wait_drained(20)
    finally:
        uplink.stop()
    assert server.store.sequences(spool.agent_id) == list(range(1, 51))
    assert server.store.received == 50 and uplink.stats.acked == 50 and spool.pending() == []


def test_reconnects_after_the_collector_comes_back_nothing_lost_nothing_duplicated(tmp_path):
    store = SinkStore()
    first = IngestSink(store)
    port = first.start()
    spool = Spool(tmp_path)
    uplink = Uplink(spool, f"127.0.0.1:{port}", backoff_initial_s=0.05, backoff_max_s=0.5)
    uplink.start()
    try:
        _spool_batches(spool, 5)
        uplink.notify()
        assert uplink.wait_drained(20)
        first.stop()
        _spool_batches(spool, 5)  # written while the collector is away
        uplink.notify()
        assert not uplink.wait_drained(0.3) and spool.pending() == [6, 7, 8, 9, 10]
        second = IngestSink(store)
        second.start(f"127.0.0.1:{port}")
        try:
            assert uplink.wait_drained(30)
        finally:
            second.stop()
    finally:
        uplink.stop()
    assert store.sequences(spool.agent_id) == list(range(1, 11))
    assert uplink.stats.reconnects >= 1


def test_refused_batch_is_quarantined_and_the_rest_go_through(tmp_path, sink):
    server, address = sink
    spool = Spool(tmp_path)
    _spool_batches(spool, 6, bad={3})
    uplink = Uplink(spool, address, window=4, backoff_initial_s=0.05)
    uplink.start()
    try:
        assert uplink.wait_drained(20)
    finally:
        uplink.stop()
    assert server.store.sequences(spool.agent_id) == [1, 2, 4, 5, 6]
    assert spool.rejected() == [3] and uplink.stats.rejected == 1
    reason = (tmp_path / "rejected" / f"{3:020d}.reason.txt").read_text()
    assert "INVALID_ARGUMENT" in reason and "not_a_field" in reason


def test_fails_over_to_the_next_collector_of_the_list_and_resends_what_was_not_acked(tmp_path):
    from helpers import free_port

    store = SinkStore()  # the collectors' shared store
    first, second = IngestSink(store), IngestSink(store)
    first_port, second_port = first.start(), second.start()
    spool = Spool(tmp_path)
    uplink = Uplink(spool, f"127.0.0.1:{free_port()},127.0.0.1:{first_port},127.0.0.1:{second_port}",
                    backoff_initial_s=0.05, backoff_max_s=0.5)
    uplink.start()
    try:
        _spool_batches(spool, 5)
        uplink.notify()
        assert uplink.wait_drained(30)  # the first address is dead: the uplink moved on
        assert uplink.address == f"127.0.0.1:{first_port}"
        first.stop()
        _spool_batches(spool, 5)
        uplink.notify()
        assert uplink.wait_drained(30)
        assert uplink.address == f"127.0.0.1:{second_port}"
    finally:
        uplink.stop()
        second.stop()
    assert store.sequences(spool.agent_id) == list(range(1, 11))
