"""Hostile batches at the collector's door: every one gets a final status
that names the problem, nothing is stored that a query cannot read back, idle or cloned clients are
refused or timed out while real agents and queries keep being served."""
import json
import logging
import math
import threading

import grpc
import pytest

from gpuwatch.apps import cli
from gpuwatch.core.batches import INSTANCE_METADATA
from gpuwatch.collector import client
from gpuwatch.collector.server import serve
from gpuwatch.core.settings import local_collector
from gpuwatch.v1 import query_pb2 as q
from helpers import fill_disk, make_batch, poll, serving, small_filesystem


@pytest.fixture
def collector(tmp_path):
    yield from serving(str(tmp_path / "c.duckdb"), max_sample_age_days=3650, max_sample_ahead_days=1)


def _poisoned(seq: int, kind: str):
    batch = make_batch(seq, agent="poison1")
    if kind == "gpu_index":
        batch.gpus[0].index = 2**31
        batch.samples[0].gpu_index = 2**31
    elif kind == "ts_far_future":
        batch.samples[0].ts_ms[0] = 9_300_000_000_000_000
    elif kind == "ts_negative":
        batch.samples[0].ts_ms[0] = -10**15
    elif kind == "memory":  # found by the fuzz test: broke `gpuwatch gpus` for everyone
        batch.gpus[0].memory_total_bytes = 2**64 - 2
    elif kind == "sequence":
        batch.sequence = 2**64 - 1
    elif kind == "event_ts":
        batch.events[0].ts_ms = -10**15
    elif kind == "span_inf":
        batch.spans.start_us.append(math.inf)
        batch.spans.dur_us.append(1.0)
    return batch


POISONS = ["gpu_index", "memory", "ts_far_future", "ts_negative", "sequence", "event_ts", "span_inf"]


@pytest.mark.parametrize("kind", POISONS)
def test_unstorable_batches_get_invalid_argument_over_push_and_stream(collector, channel, kind):
    with pytest.raises(grpc.RpcError) as pushed:
        client.push(channel, _poisoned(3, kind))
    assert pushed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, pushed.value.details()
    assert "poison1" in pushed.value.details()
    acks = []
    with pytest.raises(grpc.RpcError) as streamed:
        for ack in client.stream_batches(channel, [make_batch(1, agent="poison1"), make_batch(2, agent="poison1"),
                                                    _poisoned(3, kind)]):
            acks.append(ack.sequence)
    assert streamed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and acks == [1, 2]
    # the good batches after the refused one go through; every query still answers for every node
    assert [a.sequence for a in client.stream_batches(channel, [make_batch(4, agent="poison1")])] == [4]
    for command in ("nodes", "gpus", "latest"):
        assert cli.main([command, "--collector", collector.address, "--json"]) == 0


def test_refusals_are_counted_per_agent(collector, channel):
    for seq in (3, 4):
        with pytest.raises(grpc.RpcError):
            client.push(channel, _poisoned(seq, "ts_negative"))
    with pytest.raises(grpc.RpcError) as exc:
        client.push(channel, _poisoned(5, "ts_negative"))
    assert "3 refused from this agent so far" in exc.value.details()
    assert collector.store.counters.snapshot()["rejected_total"] == 3


def test_times_outside_the_configured_window_are_refused(tmp_path):
    server = serve(local_collector(str(tmp_path / "w.duckdb"), max_sample_age_days=1, max_sample_ahead_days=1))
    try:
        with client.channel(server.address) as ch, pytest.raises(grpc.RpcError) as exc:
            client.push(ch, make_batch(1))  # helpers' batches are from 2023
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "outside the accepted times" in exc.value.details()
    finally:
        server.stop()


def test_infinite_values_are_stored_as_missing_and_json_stays_valid(collector, channel, capsys):
    batch = make_batch(1)
    batch.samples[0].columns[0].values[:] = [math.inf, -math.inf, 5.0]
    assert not client.push(channel, batch).duplicate
    capsys.readouterr()
    assert cli.main(["latest", "--collector", collector.address, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert rows[0]["gpu_power_watts"] == 5.0
    series = client.connect(collector.address).Series(
        q.SeriesRequest(node="node-1", gpu_index=0, field="gpu_power_watts"))
    assert list(series.values) == [5.0]  # the two infinite readings are stored as not sampled


def test_query_json_never_prints_non_standard_numbers():
    from gpuwatch.apps.commandline import json_text

    text = json_text([{"a": math.inf, "b": [math.nan, 1.5], "c": {"d": -math.inf}}])
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in JSON")) == [
        {"a": None, "b": [None, 1.5], "c": {"d": None}}]


# ---- point 7: one agent id, two running agents ----------------------------------------------------
def _stream_as(channel, instance: str, batches):
    call = channel.stream_stream("/gpuwatch.v1.Ingest/Stream", request_serializer=lambda b: b.SerializeToString(),
                                 response_deserializer=lambda b: b)
    return call(iter(batches), metadata=((INSTANCE_METADATA, instance),))


def test_a_second_live_instance_of_an_agent_id_is_refused_with_advice(collector, channel):
    release = threading.Event()

    def first_agent():
        yield make_batch(1, agent="cloned")
        release.wait(30)

    held = _stream_as(channel, "instance-a", first_agent())
    assert next(iter(held)) is not None  # instance A's batch 1 is acked; its stream stays open
    with pytest.raises(grpc.RpcError) as exc:
        list(_stream_as(channel, "instance-b", [make_batch(7, agent="cloned", node="node-2")]))
    assert exc.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "used by two agents" in exc.value.details() and "--new-agent-id" in exc.value.details()
    release.set()
    list(held)
    # once A is gone, a restarted A (new instance token) is served again
    assert len(list(_stream_as(channel, "instance-a2", [make_batch(2, agent="cloned")]))) == 1


def test_a_clone_that_reuses_sequences_later_is_refused_not_taken_for_resends(collector, channel):
    assert not client.push(channel, make_batch(1, agent="cloned")).duplicate
    assert client.push(channel, make_batch(1, agent="cloned")).duplicate  # a real resend: same content
    clone = make_batch(1, agent="cloned", node="node-2")
    with pytest.raises(grpc.RpcError) as exc:
        client.push(channel, clone)
    assert exc.value.code() == grpc.StatusCode.ALREADY_EXISTS and "used by two agents" in exc.value.details()


# ---- point 9: idle streams and per-client limits -------------------------------------------------
def test_idle_streams_are_bounded_and_timed_out_while_agents_and_queries_are_served(tmp_path):
    server = serve(local_collector(str(tmp_path / "idle.duckdb"), max_workers=12, max_ingest_streams=4,
                                 stream_idle_timeout=1.0))
    stop = threading.Event()
    channels = [client.channel(server.address) for _ in range(6)]
    try:
        calls = []
        for ch in channels:  # six clients each open a stream and never send
            call = ch.stream_stream("/gpuwatch.v1.Ingest/Stream")(iter(lambda: stop.wait(60) and None, 1))
            calls.append(call)
        outcomes = [dict(call.initial_metadata()).get("gpuwatch-stream") or call.code().name for call in calls]
        assert sorted(outcomes) == ["RESOURCE_EXHAUSTED"] * 2 + ["admitted"] * 4
        # queries are answered while the idle streams are held
        assert client.connect(server.address).ListNodes(q.ListNodesRequest(), timeout=10) is not None
        admitted = [c for c, o in zip(calls, outcomes) if o == "admitted"]
        poll(lambda: all(c.code() is not None for c in admitted), 30, "the idle streams to be closed")
        assert {c.code() for c in admitted} == {grpc.StatusCode.UNAVAILABLE}
        assert "no batch for 1 s" in admitted[0].details()
        with client.channel(server.address) as ch:  # a real agent's batches are acked again
            assert [a.sequence for a in client.stream_batches(ch, [make_batch(s) for s in (1, 2)])] == [1, 2]
    finally:
        stop.set()
        for ch in channels:
            ch.close()
        server.stop()


def test_server_sets_per_connection_limits():
    from gpuwatch.collector.server import STREAMS_PER_CONNECTION, _server_options

    options = dict(_server_options())
    assert options["grpc.max_concurrent_streams"] == STREAMS_PER_CONNECTION
    assert options["grpc.max_connection_idle_ms"] > 0 and options["grpc.http2.max_ping_strikes"] > 0


# ---- point 10: causes in the logs ----------------------------------------------------------------
def test_a_failed_token_check_is_logged_with_the_peer(tmp_path, caplog):
    token_file = tmp_path / "token"
    token_file.write_text("right-token\n")
    token_file.chmod(0o600)
    server = serve(local_collector(str(tmp_path / "t.duckdb"), token_file=str(token_file)))
    try:
        with caplog.at_level(logging.WARNING, logger="gpuwatch.core.security"), client.channel(server.address) as ch:
            with pytest.raises(grpc.RpcError):
                client.push(ch, make_batch(1))
        assert any("refused /gpuwatch.v1.Ingest/Push from ipv4:127.0.0.1" in r.getMessage() and
                   "no bearer token" in r.getMessage() for r in caplog.records)
    finally:
        server.stop()


def test_a_full_collector_disk_is_named_as_the_cause(tmp_path, caplog):
    from gpuwatch.collector.store.duckdb import DuckDBStore

    with small_filesystem(tmp_path / "disk", "3m") as disk:
        store = DuckDBStore(str(disk / "s.duckdb"))
        try:
            store.write(make_batch(1))
            fill_disk(disk)
            with caplog.at_level(logging.ERROR), pytest.raises(Exception) as exc:
                for seq in range(2, 200):  # until DuckDB needs a new block
                    store.write(make_batch(seq), timeout=30)
            assert "cannot rollback" not in str(exc.value)
            logged = " ".join(r.getMessage() for r in caplog.records)
            assert "is full" in logged and "cannot rollback" not in logged
        finally:
            store.close()
