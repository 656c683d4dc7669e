from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SchemaVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEMA_VERSION_UNSPECIFIED: _ClassVar[SchemaVersion]
    SCHEMA_VERSION_1: _ClassVar[SchemaVersion]
SCHEMA_VERSION_UNSPECIFIED: SchemaVersion
SCHEMA_VERSION_1: SchemaVersion

class NodeIdentity(_message.Message):
    __slots__ = ("node", "agent_version", "driver_version", "cuda_version", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CUDA_VERSION_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    node: str
    agent_version: str
    driver_version: str
    cuda_version: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, node: _Optional[str] = ..., agent_version: _Optional[str] = ..., driver_version: _Optional[str] = ..., cuda_version: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GpuInfo(_message.Message):
    __slots__ = ("index", "uuid", "name", "pci_bus_id", "serial", "memory_total_bytes", "architecture", "gpm_supported")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    GPM_SUPPORTED_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    serial: str
    memory_total_bytes: int
    architecture: str
    gpm_supported: bool
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., pci_bus_id: _Optional[str] = ..., serial: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., architecture: _Optional[str] = ..., gpm_supported: _Optional[bool] = ...) -> None: ...

class Column(_message.Message):
    __slots__ = ("field", "values")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    field: str
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, field: _Optional[str] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class GpuSamples(_message.Message):
    __slots__ = ("gpu_index", "ts_ms", "columns", "job_id", "rank", "local_rank")
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    TS_MS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    gpu_index: int
    ts_ms: _containers.RepeatedScalarFieldContainer[int]
    columns: _containers.RepeatedCompositeFieldContainer[Column]
    job_id: _containers.RepeatedScalarFieldContainer[str]
    rank: _containers.RepeatedScalarFieldContainer[int]
    local_rank: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, gpu_index: _Optional[int] = ..., ts_ms: _Optional[_Iterable[int]] = ..., columns: _Optional[_Iterable[_Union[Column, _Mapping]]] = ..., job_id: _Optional[_Iterable[str]] = ..., rank: _Optional[_Iterable[int]] = ..., local_rank: _Optional[_Iterable[int]] = ...) -> None: ...

class HostSamples(_message.Message):
    __slots__ = ("ts_ms", "columns")
    TS_MS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    ts_ms: _containers.RepeatedScalarFieldContainer[int]
    columns: _containers.RepeatedCompositeFieldContainer[Column]
    def __init__(self, ts_ms: _Optional[_Iterable[int]] = ..., columns: _Optional[_Iterable[_Union[Column, _Mapping]]] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("ts_ms", "gpu_index", "kind", "code", "message", "attrs")
    class AttrsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TS_MS_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ATTRS_FIELD_NUMBER: _ClassVar[int]
    ts_ms: int
    gpu_index: int
    kind: str
    code: int
    message: str
    attrs: _containers.ScalarMap[str, str]
    def __init__(self, ts_ms: _Optional[int] = ..., gpu_index: _Optional[int] = ..., kind: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., attrs: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SpanTable(_message.Message):
    __slots__ = ("job_id", "rank", "step", "kind", "name", "start_us", "dur_us", "process_group", "seq", "bytes", "world_size", "node", "peer")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    START_US_FIELD_NUMBER: _ClassVar[int]
    DUR_US_FIELD_NUMBER: _ClassVar[int]
    PROCESS_GROUP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    job_id: _containers.RepeatedScalarFieldContainer[str]
    rank: _containers.RepeatedScalarFieldContainer[int]
    step: _containers.RepeatedScalarFieldContainer[int]
    kind: _containers.RepeatedScalarFieldContainer[str]
    name: _containers.RepeatedScalarFieldContainer[str]
    start_us: _containers.RepeatedScalarFieldContainer[float]
    dur_us: _containers.RepeatedScalarFieldContainer[float]
    process_group: _containers.RepeatedScalarFieldContainer[str]
    seq: _containers.RepeatedScalarFieldContainer[int]
    bytes: _containers.RepeatedScalarFieldContainer[int]
    world_size: _containers.RepeatedScalarFieldContainer[int]
    node: _containers.RepeatedScalarFieldContainer[str]
    peer: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[_Iterable[str]] = ..., rank: _Optional[_Iterable[int]] = ..., step: _Optional[_Iterable[int]] = ..., kind: _Optional[_Iterable[str]] = ..., name: _Optional[_Iterable[str]] = ..., start_us: _Optional[_Iterable[float]] = ..., dur_us: _Optional[_Iterable[float]] = ..., process_group: _Optional[_Iterable[str]] = ..., seq: _Optional[_Iterable[int]] = ..., bytes: _Optional[_Iterable[int]] = ..., world_size: _Optional[_Iterable[int]] = ..., node: _Optional[_Iterable[str]] = ..., peer: _Optional[_Iterable[int]] = ...) -> None: ...

class TelemetryBatch(_message.Message):
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
    node: NodeIdentity
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    samples: _containers.RepeatedCompositeFieldContainer[GpuSamples]
    host: HostSamples
    events: _containers.RepeatedCompositeFieldContainer[Event]
    spans: SpanTable
    created_ms: int
    def __init__(self, schema_version: _Optional[int] = ..., agent_id: _Optional[str] = ..., sequence: _Optional[int] = ..., node: _Optional[_Union[NodeIdentity, _Mapping]] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., samples: _Optional[_Iterable[_Union[GpuSamples, _Mapping]]] = ..., host: _Optional[_Union[HostSamples, _Mapping]] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., spans: _Optional[_Union[SpanTable, _Mapping]] = ..., created_ms: _Optional[int] = ...) -> None: ...

class BatchAck(_message.Message):
    __slots__ = ("agent_id", "sequence", "duplicate")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    sequence: int
    duplicate: bool
    def __init__(self, agent_id: _Optional[str] = ..., sequence: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...
