"""Prometheus exposition of what the collector knows: per-GPU telemetry, job efficiency, failure risk, ingest.

The exporter owns names, types, labels and the HTTP endpoint; it knows nothing about the store. It calls a
*snapshot provider* (any callable returning a :class:`Snapshot`: plain dicts) and turns the answer into
metric families: at each scrape for a small endpoint (the agent's), or with ``render_interval_s`` once per
interval on a background thread, scrapes then copying the bytes of the last render (:class:`RenderedMetrics`:
the collector's, where thousands of GPUs take seconds to render).

Names follow Prometheus conventions (base units, ``_total`` counters, ``_ratio`` 0-1) and labels stay
bounded: node, GPU index/UUID/model, job id, rank, breakdown category, health state, XID code. Never step
numbers, sequence ids or PIDs. The per-GPU names are those of :mod:`gpuwatch.core.fields`, so the agent's
node-local endpoint (the same server with a provider that fills only ``gpus`` and ``hosts``) and the
collector export identical series. :data:`EXPORTED_METRICS` is the catalogue dashboards and rules are
checked against.

Naming is chosen per endpoint: ``gpuwatch`` (these names) or ``dcgm`` (dcgm-exporter's names, units and
labels for the per-GPU values, see :mod:`gpuwatch.core.dcgm_names`). Per-GPU truth has one source per
deployment (docs/operations.md): the collector exports per-GPU telemetry unless told that Prometheus
scrapes the agents (``gpu_telemetry=False``), and then exports only what needs the fleet's history.
"""
from __future__ import annotations

import bisect
import gzip
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any, TypedDict
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuwatch import __version__
from gpuwatch.core import fields, xids
from gpuwatch.core.dcgm_names import NAMINGS as DCGM_NAMINGS
from gpuwatch.core.dcgm_names import dcgm_families
from gpuwatch.core.settings import split_address
from gpuwatch.core.errors import UserError
from gpuwatch.core.security import check_exposure, token_matches
from gpuwatch.core.vocabulary import BREAKDOWN_CATEGORIES, HEALTH_STATES

log = logging.getLogger(__name__)

DEFAULT_MAX_JOBS = 500  # jobs exported per scrape (most lost time first), to bound job_id cardinality


# ---- the snapshot a provider returns ------------------------------------------------------------------

class GpuSnapshot(TypedDict, total=False):
    node: str
    gpu: int                        # index on the node
    gpu_uuid: str
    model: str                      # product name, e.g. "NVIDIA H100 80GB HBM3"
    values: Mapping[str, float]     # gpuwatch.core.fields name -> latest value; NaN / missing = not exported
    pci_bus_id: str                 # NVML's bus id, e.g. "00000000:3B:00.0"
    driver_version: str
    xid_counts: Mapping[int, int]   # XID code -> events counted (a counter, never reset by the provider)
    last_xid: int                   # the most recent XID (dcgm naming's DCGM_FI_DEV_XID_ERRORS); 0: none
    failure_risk: float             # 0-1, the online failure score
    health: str                     # one of HEALTH_STATES
    job_id: str                     # job owning the GPU now ("" or absent: none)
    rank: int
    namespace: str                  # the Kubernetes pod holding the GPU now ("" or absent: none)
    pod: str
    container: str


class HostSnapshot(TypedDict):
    node: str
    values: Mapping[str, float]     # HOST_FIELDS name -> latest value


class JobSnapshot(TypedDict, total=False):
    job_id: str
    breakdown: Mapping[str, float]        # BREAKDOWN_CATEGORIES -> fraction of the window (sums to 1)
    lost_gpu_seconds_total: float         # GPU-seconds lost (everything but compute) since the job was seen
    rank_lost_ratio: Mapping[int, float]  # rank -> lost fraction of its window
    stragglers: Mapping[int, float]       # straggler rank -> mean lateness in seconds (empty: none)
    slow_ranks: Sequence[Mapping[str, Any]]  # the jobs view's slow_ranks (rank None: the path between ranks)


class IngestSnapshot(TypedDict, total=False):
    batches_total: int
    samples_total: int
    duplicates_total: int
    rejected_total: int
    write_queue_depth: int
    commit_seconds: Mapping[str, Any]     # LatencyHistogram.snapshot(): {"buckets": [(le, cumulative)], "sum"}


class AgentSnapshot(TypedDict, total=False):
    node: str
    spool_bytes: float                    # bytes waiting in the agent's spool
    spool_dropped_total: int              # batches the agent dropped because its spool was full
    last_seen_timestamp_seconds: float | None  # unix time of the agent's last batch (None: none yet)


class Snapshot(TypedDict, total=False):
    gpus: Sequence[GpuSnapshot]
    hosts: Sequence[HostSnapshot]
    jobs: Sequence[JobSnapshot]
    ingest: IngestSnapshot
    agents: Sequence[AgentSnapshot]


SnapshotProvider = Callable[[], Snapshot]


# ---- the catalogue ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # "gauge" | "counter" | "histogram"
    help: str
    labels: tuple[str, ...]


GPU_LABELS = ("node", "gpu", "gpu_uuid", "model")
_JOB, _RANK = ("job_id",), ("job_id", "rank")

_OWN_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("gpu_xid_errors_total", "counter",
               "XID events reported by the driver, per code; xid_description is NVIDIA's name for the code.",
               GPU_LABELS + ("xid", "xid_description")),
    MetricSpec("gpuwatch_gpu_failure_risk_ratio", "gauge", "Online failure risk score (0-1); 1 once the GPU failed.",
               GPU_LABELS),
    MetricSpec("gpuwatch_gpu_health_state", "gauge", "1 for the GPU's current rule-based health state.",
               GPU_LABELS + ("state",)),
    MetricSpec("gpuwatch_gpu_job_info", "gauge", "1 for the job and rank owning a GPU; join on node, gpu.",
               ("node", "gpu", "gpu_uuid", "job_id", "rank")),
    MetricSpec("gpuwatch_gpu_owner_info", "gauge", "1 for the pod and job holding a GPU now (empty: none); join "
               "on node, gpu with group_left instead of labelling every series.",
               ("node", "gpu", "uuid", "pod", "namespace", "container", "job", "rank")),
    MetricSpec("gpuwatch_job_breakdown_ratio", "gauge", "Share of the job's GPU time per efficiency category.",
               _JOB + ("category",)),
    MetricSpec("gpuwatch_job_lost_gpu_seconds_total", "counter", "GPU-seconds lost to anything but compute.", _JOB),
    MetricSpec("gpuwatch_job_rank_lost_ratio", "gauge", "Share of a rank's window lost to anything but compute.",
               _RANK),
    MetricSpec("gpuwatch_job_stragglers", "gauge", "Ranks currently classified as stragglers.", _JOB),
    MetricSpec("gpuwatch_job_straggler_lateness_seconds", "gauge", "A straggler rank's mean lateness at collectives.",
               _RANK),
    MetricSpec("gpuwatch_job_slow_rank_lost_gpu_seconds", "gauge",
               "GPU-seconds the job lost to a slow rank since its onset, by cause (rank empty: the network).",
               _RANK + ("cause",)),
    MetricSpec("gpuwatch_job_slow_rank_speedup_ratio", "gauge",
               "How much faster the job would run without a slow rank's slowdown (0.25: 25 %), by cause.",
               _RANK + ("cause",)),
    MetricSpec("gpuwatch_ingest_batches_total", "counter", "Telemetry batches committed.", ()),
    MetricSpec("gpuwatch_ingest_samples_total", "counter", "Per-GPU sample rows committed.", ()),
    MetricSpec("gpuwatch_ingest_duplicates_total", "counter", "Batches acknowledged as already stored.", ()),
    MetricSpec("gpuwatch_ingest_rejected_total", "counter", "Batches refused (malformed, oversized, version).", ()),
    MetricSpec("gpuwatch_ingest_write_queue_depth", "gauge", "Batches waiting for the store writer.", ()),
    MetricSpec("gpuwatch_ingest_commit_seconds", "histogram", "Time to commit one group of batches.", ()),
    MetricSpec("gpuwatch_agent_spool_bytes", "gauge", "Bytes waiting in an agent's spool.", ("node",)),
    MetricSpec("gpuwatch_agent_spool_dropped_total", "counter", "Batches an agent dropped: spool full.", ("node",)),
    MetricSpec("gpuwatch_agent_last_seen_timestamp_seconds", "gauge", "Unix time of an agent's last batch.",
               ("node",)),
    MetricSpec("gpuwatch_exporter_jobs_omitted", "gauge", "Jobs left out of this scrape by the job limit.", ()),
    MetricSpec("gpuwatch_build_info", "gauge", "Always 1; the gpuwatch version as a label.", ("version",)),
)

METRICS: tuple[MetricSpec, ...] = (
    tuple(MetricSpec(f.name, f.kind.value, f.help, GPU_LABELS) for f in fields.GPU_FIELDS)
    + tuple(MetricSpec(f.name, f.kind.value, f.help, ("node",)) for f in fields.HOST_FIELDS)
    + _OWN_METRICS
)
EXPORTED_METRICS: dict[str, str] = {m.name: m.kind for m in METRICS}
_SPECS: dict[str, MetricSpec] = {m.name: m for m in METRICS}
#: --metrics-names values: the project's own names, or dcgm-exporter's for the per-GPU values.
NAMINGS: tuple[str, ...] = ("gpuwatch", *DCGM_NAMINGS)
_FAMILY_TYPES = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily, "histogram": HistogramMetricFamily}


# ---- snapshot -> metric families ----------------------------------------------------------------------

class _Families:
    """One family per catalogue entry, filled sample by sample; only non-empty families are exposed."""

    def __init__(self) -> None:
        self._families: dict[str, GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily] = {
            m.name: _FAMILY_TYPES[m.kind](m.name, m.help, labels=m.labels) for m in METRICS
        }

    def add(self, name: str, labels: Sequence[Any], value: Any) -> None:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return
        family = self._families[name]
        if isinstance(family, HistogramMetricFamily):
            raise TypeError(f"{name} is a histogram: fill it with histogram()")
        family.add_metric([str(v) for v in labels], float(value))

    def histogram(self, name: str, snapshot: Mapping[str, Any]) -> None:
        buckets = [(_le_text(le), float(count)) for le, count in snapshot["buckets"]]
        family = self._families[name]
        if not isinstance(family, HistogramMetricFamily):
            raise TypeError(f"{name} is not a histogram")
        family.add_metric([], buckets, float(snapshot["sum"]))

    def __iter__(self) -> Iterator[Metric]:
        return (family for family in self._families.values() if family.samples)


def _le_text(le: float) -> str:
    return "+Inf" if math.isinf(le) else repr(float(le))


def _add_gpu(out: _Families, gpu: GpuSnapshot, telemetry: bool = True) -> None:
    """A GPU's series; without ``telemetry`` only the scores (risk, health), not the sampled values."""
    labels = (gpu["node"], gpu["gpu"], gpu.get("gpu_uuid", ""), gpu.get("model", ""))
    if telemetry:
        values = gpu.get("values", {})
        for field in fields.GPU_FIELDS:
            out.add(field.name, labels, values.get(field.name))
        for code, count in sorted(gpu.get("xid_counts", {}).items()):
            out.add("gpu_xid_errors_total", labels + (int(code), xids.describe(code).description), count)
        if gpu.get("job_id"):
            out.add("gpuwatch_gpu_job_info", labels[:3] + (gpu["job_id"], gpu.get("rank", -1)), 1)
        if gpu.get("job_id") or gpu.get("pod"):
            out.add("gpuwatch_gpu_owner_info", labels[:3] + (gpu.get("pod", ""), gpu.get("namespace", ""),
                                                             gpu.get("container", ""), gpu.get("job_id", ""),
                                                             gpu.get("rank", -1)), 1)
    out.add("gpuwatch_gpu_failure_risk_ratio", labels, gpu.get("failure_risk"))
    health = gpu.get("health")
    if health is not None:
        if health in HEALTH_STATES:
            for state in HEALTH_STATES:
                out.add("gpuwatch_gpu_health_state", labels + (state,), state == health)
        else:
            log.warning("GPU %s/%s: unknown health state %r not exported", gpu["node"], gpu["gpu"], health)


def _add_host(out: _Families, host: HostSnapshot) -> None:
    for field in fields.HOST_FIELDS:
        out.add(field.name, (host["node"],), host["values"].get(field.name))


def _add_job(out: _Families, job: JobSnapshot) -> None:
    job_id = job["job_id"]
    breakdown = job.get("breakdown", {})
    for category in BREAKDOWN_CATEGORIES:
        out.add("gpuwatch_job_breakdown_ratio", (job_id, category), breakdown.get(category))
    out.add("gpuwatch_job_lost_gpu_seconds_total", (job_id,), job.get("lost_gpu_seconds_total"))
    for rank, ratio in sorted(job.get("rank_lost_ratio", {}).items()):
        out.add("gpuwatch_job_rank_lost_ratio", (job_id, int(rank)), ratio)
    stragglers = job.get("stragglers", {})
    out.add("gpuwatch_job_stragglers", (job_id,), len(stragglers))
    for rank, lateness in sorted(stragglers.items()):
        out.add("gpuwatch_job_straggler_lateness_seconds", (job_id, int(rank)), lateness)
    for slow in job.get("slow_ranks", ()):
        labels = (job_id, "" if slow["rank"] is None else int(slow["rank"]), slow["cause"])
        out.add("gpuwatch_job_slow_rank_lost_gpu_seconds", labels, slow["lost_gpu_seconds"])
        out.add("gpuwatch_job_slow_rank_speedup_ratio", labels, slow["speedup_without"])


def _add_prefixed(out: _Families, prefix: str, values: Mapping[str, Any], labels: tuple[str, ...] = ()) -> None:
    """Snapshot keys are the metric names without ``prefix``: ``batches_total`` -> gpuwatch_ingest_batches_total.

    Keys that name no scalar metric (the histogram, ``node``) are skipped here.
    """
    for key, value in values.items():
        spec = _SPECS.get(prefix + key)
        if spec is not None and spec.kind != "histogram":
            out.add(spec.name, labels, value)


def _top_jobs(jobs: Sequence[JobSnapshot], limit: int) -> tuple[list[JobSnapshot], int]:
    ranked = sorted(jobs, key=lambda j: j.get("lost_gpu_seconds_total") or 0.0, reverse=True)
    return ranked[:limit], max(0, len(ranked) - limit)


class SnapshotCollector(Collector):
    """A prometheus_client collector that turns one provider snapshot into families at each scrape.

    ``names``: one of :data:`NAMINGS`. ``gpu_telemetry``: export the sampled per-GPU and host values (off
    on a collector whose agents Prometheus scrapes directly, so every series has one source).
    """

    def __init__(self, provider: SnapshotProvider, max_jobs: int = DEFAULT_MAX_JOBS, *, names: str = "gpuwatch",
                 gpu_telemetry: bool = True) -> None:
        if names not in NAMINGS:
            raise UserError(f"metrics names {names!r}: expected one of {', '.join(NAMINGS)}")
        self._provider = provider
        self._max_jobs = max_jobs
        self._dcgm = DCGM_NAMINGS.get(names)
        self._telemetry = gpu_telemetry

    def collect(self) -> Iterable[Metric]:
        snap = self._provider()
        out = _Families()
        for gpu in snap.get("gpus", ()):
            _add_gpu(out, gpu, self._telemetry and self._dcgm is None)
        if self._telemetry:
            for host in snap.get("hosts", ()):
                _add_host(out, host)
        jobs, omitted = _top_jobs(snap.get("jobs", ()), self._max_jobs)
        for job in jobs:
            _add_job(out, job)
        ingest = snap.get("ingest")
        if ingest:
            _add_prefixed(out, "gpuwatch_ingest_", ingest)
            if "commit_seconds" in ingest:
                out.histogram("gpuwatch_ingest_commit_seconds", ingest["commit_seconds"])
            out.add("gpuwatch_exporter_jobs_omitted", (), omitted)
        for agent in snap.get("agents", ()):
            _add_prefixed(out, "gpuwatch_agent_", agent, (agent["node"],))
        out.add("gpuwatch_build_info", (__version__,), 1)
        if self._dcgm is not None and self._telemetry:
            return [*dcgm_families(snap.get("gpus", ()), self._dcgm), *out]
        return out

    def describe(self) -> Iterable[Metric]:
        return ()  # families depend on the snapshot; do not call the provider at registration


def build_registry(provider: SnapshotProvider, max_jobs: int = DEFAULT_MAX_JOBS, *, names: str = "gpuwatch",
                   gpu_telemetry: bool = True) -> CollectorRegistry:
    """A registry of its own (never the process-global one) holding the snapshot collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(provider, max_jobs, names=names, gpu_telemetry=gpu_telemetry))
    return registry


class RenderedMetrics:
    """The exposition of a registry rendered every ``interval_s`` on a background thread; scrapes copy bytes.

    prometheus_client formats ~30 microseconds per series, so 8,000 GPUs take seconds per render: a scrape
    must not pay that, nor several scrapers pay it each. Each render collects the families once and encodes
    the variants (format, gzip) that scrapers asked for; a variant first asked for is encoded then, from the
    last render. Between renders the thread waits ``interval_s`` or twice the last render's duration,
    whichever is longer, so rendering takes at most a third of a core however large the fleet.
    """

    FIRST_RENDER_WAIT_S = 60.0

    def __init__(self, registry: CollectorRegistry, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"render interval must be positive, got {interval_s}")
        self.interval_s = interval_s
        self.renders = 0
        self.last_render_s = 0.0
        self._registry = registry
        self._families: list[Metric] = []
        self._outputs: dict[tuple[str, bool], bytes] = {}
        self._wanted: set[tuple[str, bool]] = set()
        self._lock = threading.Lock()
        self._rendered = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-render", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def render(self) -> None:
        """Collect and encode now (the background thread calls this; tests may too)."""
        started = time.perf_counter()
        families = list(self._registry.collect())
        with self._lock:
            wanted = set(self._wanted)
        outputs = {variant: _encode(families, *variant) for variant in wanted}
        with self._lock:
            self._families, self._outputs = families, outputs
            self.renders += 1
            self.last_render_s = time.perf_counter() - started
        self._rendered.set()

    def output(self, accept: str | None, accept_encoding: str | None) -> tuple[list[tuple[str, str]], bytes] | None:
        """Headers and body for a scrape with these Accept headers; None before the first render finished."""
        if not self._rendered.wait(self.FIRST_RENDER_WAIT_S):
            return None
        _, content_type = choose_encoder(accept or "")
        variant = (content_type, gzip_accepted(accept_encoding or ""))
        with self._lock:
            body = self._outputs.get(variant)
            if body is None:
                body = self._outputs[variant] = _encode(self._families, *variant)
                self._wanted.add(variant)
        headers = [("Content-Type", content_type)] + ([("Content-Encoding", "gzip")] if variant[1] else [])
        return headers, body

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                self.render()
            except Exception:  # a failing provider must not end the endpoint; the last render stays served
                log.exception("rendering metrics failed; serving the last render")
            self._stop.wait(max(self.interval_s, 2 * (time.perf_counter() - started)))


class _Rendered:
    """What an encoder iterates: the families of one render."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def _encode(families: list[Metric], content_type: str, compress: bool) -> bytes:
    encoder, _ = choose_encoder(content_type)
    body = encoder(_Rendered(families))
    return gzip.compress(body, compresslevel=1) if compress else body


# ---- commit latency, kept by the collector, exported via the snapshot ---------------------------------

DEFAULT_LATENCY_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class LatencyHistogram:
    """Thread-safe cumulative histogram of durations in seconds, in the shape ``commit_seconds`` expects."""

    def __init__(self, buckets: Sequence[float] = DEFAULT_LATENCY_BUCKETS) -> None:
        self._bounds = sorted(buckets)
        self._counts = [0] * (len(self._bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self._bounds, seconds)] += 1
            self._sum += seconds

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, count in zip([*self._bounds, math.inf], counts):
            running += count
            cumulative.append((bound, running))
        return {"buckets": cumulative, "sum": total}


# ---- HTTP endpoint ------------------------------------------------------------------------------------

class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - signature of the base class
        log.debug("metrics %s - " + format, self.address_string(), *args)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


def _guarded_app(registry: CollectorRegistry, token: str | None,
                 rendered: RenderedMetrics | None = None) -> Callable[..., Iterable[bytes]]:
    metrics = make_wsgi_app(registry) if rendered is None else _rendered_app(rendered)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if token is not None and not token_matches(environ.get("HTTP_AUTHORIZATION"), token):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"missing or invalid bearer token\n"]
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"gpuwatch metrics are at /metrics\n"]
        return metrics(environ, start_response)

    return app


def _rendered_app(rendered: RenderedMetrics) -> Callable[..., Iterable[bytes]]:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        answer = rendered.output(environ.get("HTTP_ACCEPT"), environ.get("HTTP_ACCEPT_ENCODING"))
        if answer is None:
            start_response("503 Service Unavailable", [("Content-Type", "text/plain"), ("Retry-After", "10")])
            return [b"the first render of the metrics has not finished yet\n"]
        headers, body = answer
        start_response("200 OK", headers + [("Content-Length", str(len(body)))])
        return [body]

    return app


class MetricsServer:
    """A running /metrics endpoint; ``close()`` stops it."""

    def __init__(self, server: _Server, rendered: RenderedMetrics | None = None) -> None:
        self._server = server
        self.rendered = rendered
        self._thread = threading.Thread(target=server.serve_forever, name="gpuwatch-metrics", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = str(self._server.server_address[0])
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        if self.rendered is not None:
            self.rendered.close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_metrics_server(
    listen: str,
    snapshot_provider: SnapshotProvider,
    token: str | None = None,
    *,
    insecure: bool = False,
    max_jobs: int = DEFAULT_MAX_JOBS,
    names: str = "gpuwatch",
    gpu_telemetry: bool = True,
    render_interval_s: float | None = None,
) -> MetricsServer:
    """Serve ``/metrics`` on ``listen`` (HOST:PORT, port 0 = any) in a daemon thread.

    Without ``render_interval_s`` each scrape renders the provider's snapshot; with it a background thread
    renders every ``render_interval_s`` seconds and scrapes get the last render (:class:`RenderedMetrics`).

    With ``token`` every request needs ``Authorization: Bearer <token>`` (401 otherwise). Binding beyond
    loopback without a token is refused unless ``insecure``: telemetry names nodes and jobs. ``names`` and
    ``gpu_telemetry``: see :class:`SnapshotCollector`.
    """
    try:
        host, port = split_address(listen)
    except ValueError as exc:
        raise UserError(f"metrics listen address {exc}") from None
    check_exposure(listen, protected=token is not None, insecure=insecure, what="to serve metrics on",
                   needs="a bearer token (metrics_token_file)")
    server_class = _Server6 if ":" in host else _Server
    registry = build_registry(snapshot_provider, max_jobs, names=names, gpu_telemetry=gpu_telemetry)
    rendered = RenderedMetrics(registry, render_interval_s) if render_interval_s is not None else None
    app = _guarded_app(registry, token, rendered)
    try:
        server = make_server(host, port, app, server_class=server_class, handler_class=_QuietHandler)
    except OSError as exc:
        raise UserError(f"cannot serve metrics on {listen}: {exc.strerror or exc}") from None
    if rendered is not None:
        rendered.start()
    return MetricsServer(server, rendered)
