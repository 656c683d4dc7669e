"""The collector put together once: the store's server with the alert hub, the failure scorer and the jobs
monitor, and the failure model they share.

Three programs run a collector: ``gpuwatch collector`` (periodic rounds on the wall clock, a cluster lease,
alert senders, a Prometheus endpoint; :func:`start_collector`), the demo and ``replay --offline`` (the caller
drives the rounds on the data clock; :func:`build_engines` then :meth:`CollectorEngines.drive`). All three
build the engines here, so a new engine or option is wired in one place.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwatch.collector.lease import ClusterLease, holder_id
from gpuwatch.collector.server import CollectorServer, Service, serve
from gpuwatch.collector.store.base import Store
from gpuwatch.core.errors import UserError
from gpuwatch.core.security import read_token
from gpuwatch.core.settings import CollectorSettings

if TYPE_CHECKING:  # the engines' modules (pandas, the model format) are imported when they are built, so
    # `gpuwatch collector` binds its port before it spends a second importing them (docs/operations.md)
    from gpuwatch.collector.alert_hub import AlertHub
    from gpuwatch.collector.alerts import AlertSender
    from gpuwatch.collector.jobs import JobsMonitor
    from gpuwatch.collector.scoring import Scorer
    from gpuwatch.models.advisor import Advice
    from gpuwatch.models.model import FailureModel

log = logging.getLogger(__name__)


def failure_model(path: str | Path | None) -> FailureModel | None:
    """The model at ``path``, else the shipped one; None (logged) when no path is given and none is shipped:
    the collector then gives GPUs health states and no failure risk. A named file that is missing or not a
    model raises UserError."""
    from gpuwatch.models.model import default_model_path, load_model

    if path is None and not default_model_path().is_file():
        log.warning("no failure model (%s is missing): GPUs get health states, no failure risk",
                    default_model_path())
        return None
    return load_model(path)


@dataclass
class CollectorEngines:
    """The engines over one store: the alert hub, the failure scorer feeding it and the jobs monitor."""

    hub: AlertHub
    scorer: Scorer
    jobs: JobsMonitor

    def drive(self, store: Store) -> None:
        """Use ``store`` with no periodic threads: the caller runs ``scorer.score_once`` and
        ``jobs.check_once`` at the times it chooses (demo, replay). Undo with :meth:`stop`."""
        self.hub.start(store)
        self.scorer.bind(store)
        self.jobs.bind(store)

    def stop(self) -> None:
        """Stop what :meth:`drive` started (the hub's senders)."""
        self.hub.stop()


def build_engines(*, model: FailureModel | None = None, model_path: str | Path | None = None,
                  load_in_background: bool = False, senders: list[AlertSender] | None = None,
                  advice: Advice | None = None, score_interval_s: float | None = None, score_clock: str | None = None,
                  false_alarm_budget: float | None = None, jobs_interval_s: float | None = None,
                  jobs_window_s: float | None = None, hang_threshold_s: float | None = None,
                  job_alerts: bool = True) -> CollectorEngines:
    """The hub, scorer and jobs monitor wired together (an option left None: the engine's own default).

    The failure model is ``model`` (None: health states only, no failure risk), or with
    ``load_in_background`` :func:`failure_model` of ``model_path``, loaded on the scorer's own thread when the
    scorer starts (seconds: the collector answers meanwhile, and the hub gets the model's alert policy once it
    is loaded). Without ``job_alerts`` the jobs monitor keeps its findings to itself (the demo shows them, it
    does not alert)."""
    from gpuwatch.collector.alert_hub import AlertHub
    from gpuwatch.collector.jobs import JobsMonitor
    from gpuwatch.collector.scoring import Scorer

    scoring_options = _given(interval_s=score_interval_s, clock=score_clock, false_alarm_budget=false_alarm_budget)
    if load_in_background:
        hub = AlertHub(None, senders or (), advice=advice)
        scorer = Scorer(None, hub, load_model=functools.partial(failure_model, model_path), **scoring_options)
    else:
        hub = AlertHub(model.alert_policy() if model else None, senders or (), advice=advice)
        scorer = Scorer(model, hub, **scoring_options)
    jobs = JobsMonitor(hub if job_alerts else None, **_given(interval_s=jobs_interval_s, window_s=jobs_window_s,
                                                             hang_threshold_s=hang_threshold_s))
    return CollectorEngines(hub, scorer, jobs)


def _given(**options: Any) -> dict[str, Any]:
    """The options that are not None (the others keep the engine's own default)."""
    return {name: value for name, value in options.items() if value is not None}


def start_collector(settings: CollectorSettings) -> CollectorServer:
    """Start a collector with everything ``settings`` asks: ingest and queries, the engines with periodic
    rounds, the cluster lease and, with ``metrics_listen``, the Prometheus endpoint. The port is bound first;
    the engines are built (their modules imported) once it is, and started once the store is open."""
    if settings.model is not None and not Path(settings.model).is_file():
        raise UserError(f"{settings.model}: no such model file")
    built: list[Service] = []

    def services() -> list[Service]:  # called by serve once the port is bound
        built.extend(_collector_services(settings))
        return built

    try:
        return serve(settings, services=services)
    except BaseException:
        if built:
            built[0].stop()  # the hub: its senders' threads started with it; serve stops only what it started
        raise


def _collector_services(cfg: CollectorSettings) -> list[Service]:
    """The hub, the cluster lease, the scorer, the jobs monitor and, with ``metrics_listen``, the metrics
    endpoint, in the order they start."""
    from gpuwatch.collector.snapshot import MetricsService
    from gpuwatch.models.advisor import advise

    engines = build_engines(model_path=cfg.model, load_in_background=True, senders=_senders(cfg),
                            advice=advise(n_gpus=cfg.job_gpus, checkpoint_s=cfg.checkpoint_cost),
                            score_interval_s=cfg.score_interval, score_clock=cfg.score_clock,
                            false_alarm_budget=cfg.false_alarm_budget, jobs_interval_s=cfg.jobs_interval,
                            jobs_window_s=cfg.jobs_window, hang_threshold_s=cfg.hang_threshold)
    # one collector among those sharing a store scores, monitors jobs and sends alerts (collector/lease.py)
    lease = ClusterLease(min(cfg.score_interval, cfg.jobs_interval), holder=holder_id(cfg.listen),
                         on_acquire=[engines.hub.reload])
    engines.scorer.gate = engines.jobs.gate = lease.held
    # started in order: the hub restores the firing alerts before the lease reloads them, rounds come last
    services: list[Service] = [engines.hub, lease, engines.scorer, engines.jobs]
    if cfg.metrics_listen:
        metrics_token = read_token(cfg.metrics_token_file) if cfg.metrics_token_file else None
        services.append(MetricsService(cfg.metrics_listen, scorer=engines.scorer, jobs=engines.jobs,
                                       token=metrics_token, insecure=cfg.insecure,
                                       gpu_telemetry=cfg.metrics_gpu_telemetry, interval_s=cfg.metrics_interval))
    return services


def _senders(cfg: CollectorSettings) -> list[AlertSender]:
    from gpuwatch.collector.alerts import AlertmanagerSender, WebhookSender

    senders: list[AlertSender] = []
    if cfg.alertmanager_url:
        senders.append(AlertmanagerSender(cfg.alertmanager_url))
    if cfg.webhook_url:
        senders.append(WebhookSender(cfg.webhook_url))
    return senders
