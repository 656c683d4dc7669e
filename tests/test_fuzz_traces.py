"""Fuzzing the trace loaders: Hypothesis draws Kineto-like traces (any event shape, any number,
missing or odd fields) and span tables, and raw bytes, and submits them over real gRPC. Every answer is
the job's breakdown or a clear refusal, never UNKNOWN; a stored trace's breakdown reads back as standard
JSON."""
import io
import json

import grpc
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwatch.collector import client
from gpuwatch.collector.server import serve
from gpuwatch.core.settings import local_collector
from gpuwatch.v1 import query_pb2 as q

ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])
numbers = st.one_of(st.floats(0, 1e7), st.integers(-(2**63), 2**63 - 1), st.floats(), st.text(max_size=4),
                    st.none())
names = st.sampled_from(["ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ampere_sgemm_128x64_tn", "Memcpy HtoD",
                         "ProfilerStep#3", "record_param_comms", "aten::mm", "cudaLaunchKernel", ""])
cats = st.sampled_from(["kernel", "gpu_memcpy", "gpu_memset", "cpu_op", "cuda_runtime", "user_annotation",
                        "ac2g", "python_function", "weird"])


@st.composite
def events(draw):
    event = {"ph": draw(st.sampled_from(["X", "X", "X", "i", "s", "f", "M"])), "cat": draw(cats),
             "name": draw(names), "ts": draw(st.one_of(st.floats(1.7e15, 1.7e15 + 1e7), numbers)),
             "dur": draw(st.one_of(st.floats(0, 1e5), numbers)), "pid": draw(st.integers(0, 3)),
             "tid": draw(st.integers(0, 3))}
    args = draw(st.dictionaries(st.sampled_from(["correlation", "stream", "device", "External id",
                                                 "Collective name", "In msg nelems", "dtype", "Group size",
                                                 "Process Group Name", "Rank"]), numbers, max_size=4))
    if args:
        event["args"] = args
    for key in draw(st.lists(st.sampled_from(list(event)), max_size=2, unique=True)):
        del event[key]  # fields a broken exporter left out
    return event


@st.composite
def kineto_traces(draw) -> bytes:
    doc = {"traceEvents": draw(st.lists(events(), max_size=30))}
    if draw(st.booleans()):
        doc["distributedInfo"] = {"rank": draw(st.one_of(st.integers(-2, 8), numbers)),
                                  "world_size": draw(st.one_of(st.integers(0, 8), numbers))}
    text = json.dumps(doc, allow_nan=True)
    return text.encode()[:draw(st.integers(0, len(text)))] if draw(st.integers(0, 4)) == 0 else text.encode()


@st.composite
def span_tables(draw) -> bytes:
    n = draw(st.integers(0, 12))
    rows = {"job_id": ["J"] * n, "rank": draw(st.lists(st.integers(-1, 3), min_size=n, max_size=n)),
            "step": draw(st.lists(st.integers(-1, 3), min_size=n, max_size=n)),
            "kind": draw(st.lists(st.sampled_from(["step", "compute", "collective", "memcpy", "p2p", "x"]),
                                  min_size=n, max_size=n)),
            "start_us": draw(st.lists(st.one_of(st.floats(0, 1e6), st.floats()), min_size=n, max_size=n)),
            "dur_us": draw(st.lists(st.one_of(st.floats(0, 1e5), st.floats()), min_size=n, max_size=n))}
    for key in draw(st.lists(st.sampled_from(list(rows)), max_size=1, unique=True)):
        del rows[key]
    buf = io.StringIO()
    pd.DataFrame(rows).to_csv(buf, index=False)
    return buf.getvalue().encode()


@pytest.fixture(scope="module")
def query(tmp_path_factory):
    server = serve(local_collector(str(tmp_path_factory.mktemp("fuzz-traces") / "t.duckdb")))
    yield client.connect(server.address)
    server.stop()


def _submit_and_read_back(query, filename: str, content: bytes) -> None:
    try:
        query.SubmitTrace(q.SubmitTraceRequest(job_id="fuzz-job", filename=filename, content=content), timeout=120)
    except grpc.RpcError as exc:
        assert exc.code() in ANSWERS, f"{exc.code().name}: {exc.details()}"
        assert exc.details() and "Traceback" not in exc.details()
        return
    doc = query.Breakdown(q.BreakdownRequest(job_id="fuzz-job"), timeout=120).json
    parsed = json.loads(doc, parse_constant=lambda c: pytest.fail(f"{c} in the breakdown JSON"))
    assert parsed["ranks"] and parsed["source"] == "traces"


@FUZZ
@given(content=kineto_traces(), rank=st.integers(0, 3))
def test_any_kineto_trace_is_analysed_or_refused_clearly(query, content, rank):
    _submit_and_read_back(query, f"trace_rank{rank}.json", content)


@FUZZ
@given(content=span_tables())
def test_any_span_table_is_analysed_or_refused_clearly(query, content):
    _submit_and_read_back(query, "spans.csv", content)


@FUZZ
@given(content=st.binary(min_size=1, max_size=512), suffix=st.sampled_from([".json", ".json.gz", ".csv",
                                                                            ".parquet", ".txt"]))
def test_any_bytes_are_refused_clearly(query, content, suffix):
    _submit_and_read_back(query, f"rank0{suffix}", content)
