from gpuwatch.v1 import telemetry_pb2 as _telemetry_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeSummary(_message.Message):
    __slots__ = ("node", "gpus", "samples", "last_seen_ms", "agent_id", "last_sequence")
    NODE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_MS_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    node: str
    gpus: int
    samples: int
    last_seen_ms: int
    agent_id: str
    last_sequence: int
    def __init__(self, node: _Optional[str] = ..., gpus: _Optional[int] = ..., samples: _Optional[int] = ..., last_seen_ms: _Optional[int] = ..., agent_id: _Optional[str] = ..., last_sequence: _Optional[int] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeSummary]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeSummary, _Mapping]]] = ...) -> None: ...

class ListGpusRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class GpuSummary(_message.Message):
    __slots__ = ("node", "info", "samples", "last_seen_ms", "job_id", "rank", "state", "failure", "namespace", "pod", "container")
    NODE_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_MS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    node: str
    info: _telemetry_pb2.GpuInfo
    samples: int
    last_seen_ms: int
    job_id: str
    rank: int
    state: str
    failure: str
    namespace: str
    pod: str
    container: str
    def __init__(self, node: _Optional[str] = ..., info: _Optional[_Union[_telemetry_pb2.GpuInfo, _Mapping]] = ..., samples: _Optional[int] = ..., last_seen_ms: _Optional[int] = ..., job_id: _Optional[str] = ..., rank: _Optional[int] = ..., state: _Optional[str] = ..., failure: _Optional[str] = ..., namespace: _Optional[str] = ..., pod: _Optional[str] = ..., container: _Optional[str] = ...) -> None: ...

class ListGpusResponse(_message.Message):
    __slots__ = ("gpus",)
    GPUS_FIELD_NUMBER: _ClassVar[int]
    gpus: _containers.RepeatedCompositeFieldContainer[GpuSummary]
    def __init__(self, gpus: _Optional[_Iterable[_Union[GpuSummary, _Mapping]]] = ...) -> None: ...

class LatestRequest(_message.Message):
    __slots__ = ("node", "gpu_index")
    NODE_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    node: str
    gpu_index: int
    def __init__(self, node: _Optional[str] = ..., gpu_index: _Optional[int] = ...) -> None: ...

class LatestRow(_message.Message):
    __slots__ = ("node", "gpu_index", "ts_ms", "values")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NODE_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    TS_MS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    node: str
    gpu_index: int
    ts_ms: int
    values: _containers.ScalarMap[str, float]
    def __init__(self, node: _Optional[str] = ..., gpu_index: _Optional[int] = ..., ts_ms: _Optional[int] = ..., values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class LatestResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[LatestRow]
    def __init__(self, rows: _Optional[_Iterable[_Union[LatestRow, _Mapping]]] = ...) -> None: ...

class SeriesRequest(_message.Message):
    __slots__ = ("node", "gpu_index", "field", "since_ms", "until_ms", "limit")
    NODE_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    SINCE_MS_FIELD_NUMBER: _ClassVar[int]
    UNTIL_MS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    node: str
    gpu_index: int
    field: str
    since_ms: int
    until_ms: int
    limit: int
    def __init__(self, node: _Optional[str] = ..., gpu_index: _Optional[int] = ..., field: _Optional[str] = ..., since_ms: _Optional[int] = ..., until_ms: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class SeriesResponse(_message.Message):
    __slots__ = ("ts_ms", "values", "resolution_s")
    TS_MS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    RESOLUTION_S_FIELD_NUMBER: _ClassVar[int]
    ts_ms: _containers.RepeatedScalarFieldContainer[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    resolution_s: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ts_ms: _Optional[_Iterable[int]] = ..., values: _Optional[_Iterable[float]] = ..., resolution_s: _Optional[_Iterable[int]] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("node", "kind", "since_ms", "limit")
    NODE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SINCE_MS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    node: str
    kind: str
    since_ms: int
    limit: int
    def __init__(self, node: _Optional[str] = ..., kind: _Optional[str] = ..., since_ms: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class EventsResponse(_message.Message):
    __slots__ = ("events",)
    class Row(_message.Message):
        __slots__ = ("node", "event")
        NODE_FIELD_NUMBER: _ClassVar[int]
        EVENT_FIELD_NUMBER: _ClassVar[int]
        node: str
        event: _telemetry_pb2.Event
        def __init__(self, node: _Optional[str] = ..., event: _Optional[_Union[_telemetry_pb2.Event, _Mapping]] = ...) -> None: ...
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[EventsResponse.Row]
    def __init__(self, events: _Optional[_Iterable[_Union[EventsResponse.Row, _Mapping]]] = ...) -> None: ...

class JsonResponse(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class SubmitTraceRequest(_message.Message):
    __slots__ = ("job_id", "filename", "content")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    filename: str
    content: bytes
    def __init__(self, job_id: _Optional[str] = ..., filename: _Optional[str] = ..., content: _Optional[bytes] = ...) -> None: ...

class SubmitTraceResponse(_message.Message):
    __slots__ = ("job_id", "ranks", "json")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    ranks: int
    json: str
    def __init__(self, job_id: _Optional[str] = ..., ranks: _Optional[int] = ..., json: _Optional[str] = ...) -> None: ...

class BreakdownRequest(_message.Message):
    __slots__ = ("job_id", "per_step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PER_STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    per_step: bool
    def __init__(self, job_id: _Optional[str] = ..., per_step: _Optional[bool] = ...) -> None: ...

class JobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AlertsRequest(_message.Message):
    __slots__ = ("include_resolved",)
    INCLUDE_RESOLVED_FIELD_NUMBER: _ClassVar[int]
    include_resolved: bool
    def __init__(self, include_resolved: _Optional[bool] = ...) -> None: ...

class UsageRequest(_message.Message):
    __slots__ = ("by", "since_ms", "until_ms")
    BY_FIELD_NUMBER: _ClassVar[int]
    SINCE_MS_FIELD_NUMBER: _ClassVar[int]
    UNTIL_MS_FIELD_NUMBER: _ClassVar[int]
    by: str
    since_ms: int
    until_ms: int
    def __init__(self, by: _Optional[str] = ..., since_ms: _Optional[int] = ..., until_ms: _Optional[int] = ...) -> None: ...
