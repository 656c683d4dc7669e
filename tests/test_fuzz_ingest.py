"""Fuzzing the collector's door: Hypothesis draws batches with any field in its full wire range,
raw or damaged bytes, and Columns damaged from the inside, and sends them over real gRPC to a
collector on each store engine. The collector never answers UNKNOWN or crashes,
and whatever it stores every query reads back (standard JSON included)."""
import itertools
import json
import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwatch.core import fields
from gpuwatch.core.batches import SCHEMA_VERSION
from gpuwatch.collector import client
from gpuwatch.apps import query_cli
from gpuwatch.apps.commandline import json_text
from gpuwatch.collector.server import serve
from gpuwatch.core.settings import local_collector
from gpuwatch.v1 import ingest_view_pb2 as view
from gpuwatch.v1 import query_pb2 as q
from gpuwatch.v1 import telemetry_pb2 as pb
from helpers import STORE_KINDS, T0_MS, make_batch, store_url

# Final answers a client can act on; UNKNOWN (an unhandled exception) and INTERNAL never.
ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS}
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])

def mostly(valid, wild):
    """``valid`` about four times in five, else ``wild``."""
    return st.one_of(valid, valid, valid, valid, wild)


def chooser(wild: bool):
    """In a tame batch every field is drawn valid, so half of the batches reach the store and the queries."""
    return mostly if wild else (lambda valid, _wild: valid)


uint32 = st.integers(0, 2**32 - 1)
int32 = st.integers(-(2**31), 2**31 - 1)
int64 = st.integers(-(2**63), 2**63 - 1)
near_t0 = st.integers(T0_MS - 10**6, T0_MS + 10**6)
values = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just(math.inf), st.just(-math.inf))
short_text = st.text(max_size=12)


@st.composite
def columns(draw, n: int, names: tuple[str, ...], wild: bool):
    mostly = chooser(wild)
    chosen = draw(st.lists(mostly(st.sampled_from(names), short_text), max_size=4, unique=True))
    return [pb.Column(field=name, values=draw(mostly(st.lists(values, min_size=n, max_size=n),
                                                     st.lists(values, max_size=4)))) for name in chosen]


@st.composite
def gpu_samples(draw, index: int, wild: bool):
    mostly = chooser(wild)
    n = draw(st.integers(0, 4))

    def per_row(strategy):
        return draw(mostly(st.lists(strategy, min_size=n, max_size=n), st.lists(strategy, max_size=4)))

    return pb.GpuSamples(gpu_index=index, ts_ms=draw(st.lists(mostly(near_t0, int64), min_size=n, max_size=n)),
                         columns=draw(columns(n, fields.GPU_FIELD_NAMES, wild)), job_id=per_row(short_text),
                         rank=per_row(int32), local_rank=per_row(int32))


@st.composite
def spans(draw, wild: bool):
    mostly = chooser(wild)
    n = draw(st.integers(0, 3))

    def col(strategy):
        return draw(mostly(st.lists(strategy, min_size=n, max_size=n), st.lists(strategy, max_size=3)))

    return pb.SpanTable(job_id=col(short_text), rank=col(int32), step=col(int64), kind=col(short_text),
                        name=col(short_text), start_us=col(mostly(near_t0.map(lambda t: t * 1e3), st.floats())),
                        dur_us=col(mostly(st.floats(-1, 1e9), st.floats())), process_group=col(short_text),
                        seq=col(int64), bytes=col(int64), world_size=col(int32), node=col(short_text),
                        peer=col(int32))


@st.composite
def batches(draw):
    """Batches valid by construction, or (wild ones) with any field drawn from its whole wire range."""
    wild = draw(st.booleans())
    mostly = chooser(wild)
    gpu_indexes = mostly(st.integers(0, 7), uint32)
    timestamps = mostly(near_t0, int64)
    indexes = draw(st.lists(gpu_indexes, max_size=3, unique=True))
    host_n = draw(st.integers(0, 3))
    return pb.TelemetryBatch(
        schema_version=draw(mostly(st.just(SCHEMA_VERSION), uint32)),
        agent_id=draw(mostly(st.sampled_from(["fuzz-a", "fuzz-b"]), short_text)),
        sequence=draw(mostly(st.integers(1, 2**63 - 1), st.integers(0, 2**64 - 1))),
        node=pb.NodeIdentity(node=draw(mostly(st.sampled_from(["fuzz-node", "n\u00e9-2"]), short_text)),
                             labels=draw(st.dictionaries(short_text, short_text, max_size=2))),
        gpus=[pb.GpuInfo(index=i, uuid=draw(short_text), name=draw(short_text),
                         memory_total_bytes=draw(st.integers(0, 2**64 - 1))) for i in indexes],
        samples=[draw(gpu_samples(i, wild)) for i in draw(mostly(st.just(indexes), st.lists(gpu_indexes, max_size=3)))],
        host=pb.HostSamples(ts_ms=draw(st.lists(timestamps, min_size=host_n, max_size=host_n)),
                            columns=draw(columns(host_n, fields.HOST_FIELD_NAMES, wild))),
        events=[pb.Event(ts_ms=t, gpu_index=g, kind=k, code=c, message=m, attrs=a) for t, g, k, c, m, a in
                draw(st.lists(st.tuples(timestamps, mostly(st.integers(-1, 7), int32),
                                        mostly(st.sampled_from(["xid", "spool_dropped", "agent_start"]), short_text),
                                        int64, short_text, st.dictionaries(short_text, short_text, max_size=2)),
                              max_size=3))],
        spans=draw(spans(wild)),
        created_ms=draw(int64),
    )


@pytest.fixture(scope="module", params=STORE_KINDS)
def collector(tmp_path_factory, request):
    server = serve(local_collector(store_url(request.param, tmp_path_factory.mktemp("fuzz"), "fuzz")))
    channel = client.channel(server.address)
    yield server, channel, client.connect(server.address)
    channel.close()
    server.stop()


def _answer(channel, data: bytes) -> grpc.StatusCode:
    try:
        client.push(channel, data, timeout=60)
    except grpc.RpcError as exc:
        assert exc.code() in ANSWERS, f"{exc.code().name}: {exc.details()}"
        assert exc.details(), "a refusal names the problem"
        return exc.code()
    return grpc.StatusCode.OK


def _every_query_reads_back(stub) -> None:
    for fetch in (query_cli.fetch_nodes, query_cli.fetch_gpus, query_cli.fetch_latest, query_cli.fetch_events):
        rows = fetch(stub)
        json.loads(json_text(rows), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    for node in stub.ListNodes(q.ListNodesRequest(), timeout=30).nodes:
        for gpu in stub.ListGpus(q.ListGpusRequest(node=node.node), timeout=30).gpus:
            stub.Series(q.SeriesRequest(node=node.node, gpu_index=gpu.info.index, field="gpu_power_watts"), timeout=30)


@FUZZ
@given(batch=batches())
def test_any_batch_gets_a_final_answer_and_what_is_stored_reads_back(collector, batch):
    _, channel, stub = collector
    if _answer(channel, batch.SerializeToString()) == grpc.StatusCode.OK:
        _every_query_reads_back(stub)


@FUZZ
@given(data=st.binary(max_size=2048))
def test_raw_bytes_get_a_final_answer(collector, data):
    assert _answer(collector[1], data) in ANSWERS


@FUZZ
@given(cut=st.integers(0, 10**6), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=4))
def test_damaged_valid_batches_get_a_final_answer_and_read_back(collector, cut, flips):
    _, channel, stub = collector
    data = bytearray(make_batch(7, agent="fuzz-damaged").SerializeToString())
    for at, bits in flips:
        data[at % len(data)] ^= bits
    if _answer(channel, bytes(data[:cut % (len(data) + 1)])) == grpc.StatusCode.OK:
        _every_query_reads_back(stub)


def test_the_stream_answers_like_push(collector):
    _, channel, _ = collector
    poison = make_batch(1, agent="fuzz-stream")
    poison.samples[0].ts_ms[0] = -(2**63)
    with pytest.raises(grpc.RpcError) as exc:
        list(client.stream_batches(channel, [poison]))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@st.composite
def column_mutations(draw):
    """A valid batch's bytes with one Column damaged from the inside: its name's bytes (any, UTF-8 or not),
    its packed values (cut, lengthened, any bytes) or the column's bytes as a whole (flipped, cut, extended)."""
    batch = view.TelemetryBatchView.FromString(make_batch(draw(st.integers(1, 10**6)), agent="fuzz-col")
                                               .SerializeToString())
    blocks = [s.columns for s in batch.samples] + [batch.host.columns]
    columns = draw(st.sampled_from([b for b in blocks if len(b)]))
    at = draw(st.integers(0, len(columns) - 1))
    column = pb.Column.FromString(columns[at])
    how = draw(st.sampled_from(["name", "values", "bytes"]))
    if how == "name":
        name = draw(st.one_of(st.binary(max_size=40), st.sampled_from([n.encode() for n in fields.GPU_FIELD_NAMES])))
        values = pb.Column(values=column.values).SerializeToString()
        columns[at] = b"\x0a" + bytes([len(name)]) + name + values if len(name) < 128 else b"\x0a\x80\x01" + name
    elif how == "values":
        packed = draw(st.binary(max_size=64))
        declared = draw(st.one_of(st.just(len(packed)), st.integers(0, 200)))
        columns[at] = (pb.Column(field=column.field).SerializeToString() + b"\x12" + bytes([declared & 0x7F])
                       + packed)
    else:
        data = bytearray(columns[at])
        for where, bits in draw(st.lists(st.tuples(st.integers(0, 10**4), st.integers(1, 255)), min_size=1,
                                         max_size=3)):
            data[where % len(data)] ^= bits
        columns[at] = bytes(data[:draw(st.integers(0, len(data)))]) + draw(st.binary(max_size=8))
    return batch.SerializeToString()


_STREAM_SEQUENCES = itertools.count(2)  # a fresh sequence per example: a reused one with other content is a clone


@FUZZ
@given(data=column_mutations())
def test_damaged_columns_get_a_final_answer_on_push_and_stream_and_what_is_stored_reads_back(collector, data):
    """Before the fix: a Column whose name is not UTF-8 or whose inner bytes are not protobuf answered UNKNOWN on
    Push and ended a stream with OK after earlier acks (the agent resent it forever)."""
    _, channel, stub = collector
    pushed = _answer(channel, data)
    if pushed == grpc.StatusCode.OK:
        _every_query_reads_back(stub)
    opener = make_batch(1, agent="fuzz-col-stream")  # acked first, so a refusal comes after an ack
    sent = view.TelemetryBatchView.FromString(data)
    sent.agent_id = "fuzz-col-stream"
    sent.sequence = next(_STREAM_SEQUENCES)
    acks = []
    try:
        for ack in client.stream_batches(channel, [opener, sent.SerializeToString()]):
            acks.append(ack.sequence)
    except grpc.RpcError as exc:
        assert exc.code() in ANSWERS and exc.code() != grpc.StatusCode.OK, f"{exc.code().name}: {exc.details()}"
        assert acks == [1]
        assert pushed != grpc.StatusCode.OK, "the stream refused what Push took"
    else:
        assert acks == [1, sent.sequence], "a stream ended OK without answering every batch"
        assert pushed == grpc.StatusCode.OK, f"Push answered {pushed.name}, the stream took it"
