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

class Straggler(_message.Message):
    __slots__ = ("rank", "last_share", "chance_share", "collectives", "last_count", "mean_lateness_us", "busy_per_step_us", "peer_median_busy_per_step_us", "busy_ratio", "node", "since")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LAST_SHARE_FIELD_NUMBER: _ClassVar[int]
    CHANCE_SHARE_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    LAST_COUNT_FIELD_NUMBER: _ClassVar[int]
    MEAN_LATENESS_US_FIELD_NUMBER: _ClassVar[int]
    BUSY_PER_STEP_US_FIELD_NUMBER: _ClassVar[int]
    PEER_MEDIAN_BUSY_PER_STEP_US_FIELD_NUMBER: _ClassVar[int]
    BUSY_RATIO_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    last_share: float
    chance_share: float
    collectives: int
    last_count: int
    mean_lateness_us: float
    busy_per_step_us: float
    peer_median_busy_per_step_us: float
    busy_ratio: float
    node: str
    since: str
    def __init__(self, rank: _Optional[int] = ..., last_share: _Optional[float] = ..., chance_share: _Optional[float] = ..., collectives: _Optional[int] = ..., last_count: _Optional[int] = ..., mean_lateness_us: _Optional[float] = ..., busy_per_step_us: _Optional[float] = ..., peer_median_busy_per_step_us: _Optional[float] = ..., busy_ratio: _Optional[float] = ..., node: _Optional[str] = ..., since: _Optional[str] = ...) -> None: ...

class SlowRank(_message.Message):
    __slots__ = ("rank", "node", "gpu_index", "cause", "evidence", "since", "lost_gpu_seconds", "speedup_without")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    LOST_GPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPEEDUP_WITHOUT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node: str
    gpu_index: int
    cause: str
    evidence: str
    since: str
    lost_gpu_seconds: float
    speedup_without: float
    def __init__(self, rank: _Optional[int] = ..., node: _Optional[str] = ..., gpu_index: _Optional[int] = ..., cause: _Optional[str] = ..., evidence: _Optional[str] = ..., since: _Optional[str] = ..., lost_gpu_seconds: _Optional[float] = ..., speedup_without: _Optional[float] = ...) -> None: ...

class StuckRank(_message.Message):
    __slots__ = ("rank", "node", "state", "op", "process_group", "seq", "since_us", "peer")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    PROCESS_GROUP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SINCE_US_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node: str
    state: str
    op: str
    process_group: str
    seq: int
    since_us: float
    peer: int
    def __init__(self, rank: _Optional[int] = ..., node: _Optional[str] = ..., state: _Optional[str] = ..., op: _Optional[str] = ..., process_group: _Optional[str] = ..., seq: _Optional[int] = ..., since_us: _Optional[float] = ..., peer: _Optional[int] = ...) -> None: ...

class Hang(_message.Message):
    __slots__ = ("job_id", "stalled_s", "stalled_ranks", "stuck", "culprits", "summary")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STALLED_S_FIELD_NUMBER: _ClassVar[int]
    STALLED_RANKS_FIELD_NUMBER: _ClassVar[int]
    STUCK_FIELD_NUMBER: _ClassVar[int]
    CULPRITS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stalled_s: float
    stalled_ranks: _containers.RepeatedScalarFieldContainer[int]
    stuck: _containers.RepeatedCompositeFieldContainer[StuckRank]
    culprits: _containers.RepeatedScalarFieldContainer[int]
    summary: str
    def __init__(self, job_id: _Optional[str] = ..., stalled_s: _Optional[float] = ..., stalled_ranks: _Optional[_Iterable[int]] = ..., stuck: _Optional[_Iterable[_Union[StuckRank, _Mapping]]] = ..., culprits: _Optional[_Iterable[int]] = ..., summary: _Optional[str] = ...) -> None: ...

class CategoryFraction(_message.Message):
    __slots__ = ("category", "fraction")
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    FRACTION_FIELD_NUMBER: _ClassVar[int]
    category: str
    fraction: float
    def __init__(self, category: _Optional[str] = ..., fraction: _Optional[float] = ...) -> None: ...

class RankRatio(_message.Message):
    __slots__ = ("rank", "ratio")
    RANK_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    rank: int
    ratio: float
    def __init__(self, rank: _Optional[int] = ..., ratio: _Optional[float] = ...) -> None: ...

class JobMonitorFlags(_message.Message):
    __slots__ = ("breakdown", "rank_lost_ratio", "lost_gpu_seconds_total", "gone")
    BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    RANK_LOST_RATIO_FIELD_NUMBER: _ClassVar[int]
    LOST_GPU_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GONE_FIELD_NUMBER: _ClassVar[int]
    breakdown: _containers.RepeatedCompositeFieldContainer[CategoryFraction]
    rank_lost_ratio: _containers.RepeatedCompositeFieldContainer[RankRatio]
    lost_gpu_seconds_total: float
    gone: bool
    def __init__(self, breakdown: _Optional[_Iterable[_Union[CategoryFraction, _Mapping]]] = ..., rank_lost_ratio: _Optional[_Iterable[_Union[RankRatio, _Mapping]]] = ..., lost_gpu_seconds_total: _Optional[float] = ..., gone: _Optional[bool] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "sources", "nodes", "ranks", "gpus", "world_size", "steps", "step_rate", "step_time_s", "last_step_us", "last_step", "last_step_age_s", "finished", "lost_fraction", "submitted_at", "last_sample", "stragglers", "delayed", "slow_ranks", "hang", "monitor")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_RATE_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_US_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_AGE_S_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    LOST_FRACTION_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    STRAGGLERS_FIELD_NUMBER: _ClassVar[int]
    DELAYED_FIELD_NUMBER: _ClassVar[int]
    SLOW_RANKS_FIELD_NUMBER: _ClassVar[int]
    HANG_FIELD_NUMBER: _ClassVar[int]
    MONITOR_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    sources: _containers.RepeatedScalarFieldContainer[str]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    ranks: int
    gpus: int
    world_size: int
    steps: int
    step_rate: float
    step_time_s: float
    last_step_us: float
    last_step: str
    last_step_age_s: float
    finished: bool
    lost_fraction: float
    submitted_at: str
    last_sample: str
    stragglers: _containers.RepeatedCompositeFieldContainer[Straggler]
    delayed: _containers.RepeatedCompositeFieldContainer[Straggler]
    slow_ranks: _containers.RepeatedCompositeFieldContainer[SlowRank]
    hang: Hang
    monitor: JobMonitorFlags
    def __init__(self, job_id: _Optional[str] = ..., sources: _Optional[_Iterable[str]] = ..., nodes: _Optional[_Iterable[str]] = ..., ranks: _Optional[int] = ..., gpus: _Optional[int] = ..., world_size: _Optional[int] = ..., steps: _Optional[int] = ..., step_rate: _Optional[float] = ..., step_time_s: _Optional[float] = ..., last_step_us: _Optional[float] = ..., last_step: _Optional[str] = ..., last_step_age_s: _Optional[float] = ..., finished: _Optional[bool] = ..., lost_fraction: _Optional[float] = ..., submitted_at: _Optional[str] = ..., last_sample: _Optional[str] = ..., stragglers: _Optional[_Iterable[_Union[Straggler, _Mapping]]] = ..., delayed: _Optional[_Iterable[_Union[Straggler, _Mapping]]] = ..., slow_ranks: _Optional[_Iterable[_Union[SlowRank, _Mapping]]] = ..., hang: _Optional[_Union[Hang, _Mapping]] = ..., monitor: _Optional[_Union[JobMonitorFlags, _Mapping]] = ...) -> None: ...

class JobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class Signal(_message.Message):
    __slots__ = ("signal", "value", "fleet_median", "contribution")
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    FLEET_MEDIAN_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    signal: str
    value: float
    fleet_median: float
    contribution: float
    def __init__(self, signal: _Optional[str] = ..., value: _Optional[float] = ..., fleet_median: _Optional[float] = ..., contribution: _Optional[float] = ...) -> None: ...

class GpuAlert(_message.Message):
    __slots__ = ("node", "gpu_index", "gpu_uuid", "state", "failed", "risk", "peak_risk", "jobs", "ranks", "signals", "action")
    NODE_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    RISK_FIELD_NUMBER: _ClassVar[int]
    PEAK_RISK_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SIGNALS_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    node: str
    gpu_index: int
    gpu_uuid: str
    state: str
    failed: str
    risk: float
    peak_risk: float
    jobs: _containers.RepeatedScalarFieldContainer[str]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    signals: _containers.RepeatedCompositeFieldContainer[Signal]
    action: str
    def __init__(self, node: _Optional[str] = ..., gpu_index: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., state: _Optional[str] = ..., failed: _Optional[str] = ..., risk: _Optional[float] = ..., peak_risk: _Optional[float] = ..., jobs: _Optional[_Iterable[str]] = ..., ranks: _Optional[_Iterable[int]] = ..., signals: _Optional[_Iterable[_Union[Signal, _Mapping]]] = ..., action: _Optional[str] = ...) -> None: ...

class Label(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: str
    def __init__(self, name: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class JobAlert(_message.Message):
    __slots__ = ("job_id", "labels", "straggler", "slow_rank", "hang")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FIELD_NUMBER: _ClassVar[int]
    SLOW_RANK_FIELD_NUMBER: _ClassVar[int]
    HANG_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    labels: _containers.RepeatedCompositeFieldContainer[Label]
    straggler: Straggler
    slow_rank: SlowRank
    hang: Hang
    def __init__(self, job_id: _Optional[str] = ..., labels: _Optional[_Iterable[_Union[Label, _Mapping]]] = ..., straggler: _Optional[_Union[Straggler, _Mapping]] = ..., slow_rank: _Optional[_Union[SlowRank, _Mapping]] = ..., hang: _Optional[_Union[Hang, _Mapping]] = ...) -> None: ...

class Alert(_message.Message):
    __slots__ = ("alertname", "status", "starts_at", "ends_at", "summary", "gpu", "job")
    ALERTNAME_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STARTS_AT_FIELD_NUMBER: _ClassVar[int]
    ENDS_AT_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    alertname: str
    status: str
    starts_at: str
    ends_at: str
    summary: str
    gpu: GpuAlert
    job: JobAlert
    def __init__(self, alertname: _Optional[str] = ..., status: _Optional[str] = ..., starts_at: _Optional[str] = ..., ends_at: _Optional[str] = ..., summary: _Optional[str] = ..., gpu: _Optional[_Union[GpuAlert, _Mapping]] = ..., job: _Optional[_Union[JobAlert, _Mapping]] = ...) -> None: ...

class AlertsResponse(_message.Message):
    __slots__ = ("alerts",)
    ALERTS_FIELD_NUMBER: _ClassVar[int]
    alerts: _containers.RepeatedCompositeFieldContainer[Alert]
    def __init__(self, alerts: _Optional[_Iterable[_Union[Alert, _Mapping]]] = ...) -> None: ...

class UsageRow(_message.Message):
    __slots__ = ("owner", "gpu_seconds", "lost_gpu_seconds", "mean_utilization", "energy_kwh", "process_utilization", "process_memory_bytes")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    GPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOST_GPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    ENERGY_KWH_FIELD_NUMBER: _ClassVar[int]
    PROCESS_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    PROCESS_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    owner: _containers.RepeatedCompositeFieldContainer[Label]
    gpu_seconds: float
    lost_gpu_seconds: float
    mean_utilization: float
    energy_kwh: float
    process_utilization: float
    process_memory_bytes: int
    def __init__(self, owner: _Optional[_Iterable[_Union[Label, _Mapping]]] = ..., gpu_seconds: _Optional[float] = ..., lost_gpu_seconds: _Optional[float] = ..., mean_utilization: _Optional[float] = ..., energy_kwh: _Optional[float] = ..., process_utilization: _Optional[float] = ..., process_memory_bytes: _Optional[int] = ...) -> None: ...

class UsageResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[UsageRow]
    def __init__(self, rows: _Optional[_Iterable[_Union[UsageRow, _Mapping]]] = ...) -> None: ...

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
