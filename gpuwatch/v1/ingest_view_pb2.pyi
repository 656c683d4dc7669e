from gpuwatch.v1 import telemetry_pb2 as _telemetry_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GpuSamplesView(_message.Message):
    __slots__ = ("gpu_index", "ts_ms", "columns", "job_id", "rank", "local_rank")
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    TS_MS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    gpu_index: int
    ts_ms: _containers.RepeatedScalarFieldContainer[int]
    columns: _containers.RepeatedScalarFieldContainer[bytes]
    job_id: _containers.RepeatedScalarFieldContainer[str]
    rank: _containers.RepeatedScalarFieldContainer[int]
    local_rank: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, gpu_index: _Optional[int] = ..., ts_ms: _Optional[_Iterable[int]] = ..., columns: _Optional[_Iterable[bytes]] = ..., job_id: _Optional[_Iterable[str]] = ..., rank: _Optional[_Iterable[int]] = ..., local_rank: _Optional[_Iterable[int]] = ...) -> None: ...

class HostSamplesView(_message.Message):
    __slots__ = ("ts_ms", "columns")
    TS_MS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    ts_ms: _containers.RepeatedScalarFieldContainer[int]
    columns: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, ts_ms: _Optional[_Iterable[int]] = ..., columns: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TelemetryBatchView(_message.Message):
    __slots__ = ("schema_version", "agent_id", "sequence", "node", "gpus", "samples", "host", "events", "spans", "created_ms")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    CREATED_MS_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    agent_id: str
    sequence: int
    node: _telemetry_pb2.NodeIdentity
    gpus: _containers.RepeatedCompositeFieldContainer[_telemetry_pb2.GpuInfo]
    samples: _containers.RepeatedCompositeFieldContainer[GpuSamplesView]
    host: HostSamplesView
    events: _containers.RepeatedCompositeFieldContainer[_telemetry_pb2.Event]
    spans: _telemetry_pb2.SpanTable
    created_ms: int
    def __init__(self, schema_version: _Optional[int] = ..., agent_id: _Optional[str] = ..., sequence: _Optional[int] = ..., node: _Optional[_Union[_telemetry_pb2.NodeIdentity, _Mapping]] = ..., gpus: _Optional[_Iterable[_Union[_telemetry_pb2.GpuInfo, _Mapping]]] = ..., samples: _Optional[_Iterable[_Union[GpuSamplesView, _Mapping]]] = ..., host: _Optional[_Union[HostSamplesView, _Mapping]] = ..., events: _Optional[_Iterable[_Union[_telemetry_pb2.Event, _Mapping]]] = ..., spans: _Optional[_Union[_telemetry_pb2.SpanTable, _Mapping]] = ..., created_ms: _Optional[int] = ...) -> None: ...
