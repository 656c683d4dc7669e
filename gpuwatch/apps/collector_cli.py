"""`gpuwatch collector`: run the collector in the foreground until SIGTERM or SIGINT.

Settings come from a TOML file, ``GPUWATCH_<KEY>`` variables and flags (gpuwatch.core.settings). Beside ingest
and queries the collector runs the failure scorer, the jobs monitor, the alert path and, with
``--metrics-listen``, the Prometheus endpoint; :func:`start_collector` wires them (tests call it too).
"""
from __future__ import annotations

import argparse
import functools
import logging
import resource
import signal
import threading
from pathlib import Path
from typing import Any

from gpuwatch.core import settings as config
from gpuwatch.core.batches import TimeWindow
from gpuwatch.collector import jobs, scoring
from gpuwatch.collector.alert_hub import AlertHub
from gpuwatch.collector.alerts import AlertmanagerSender, AlertSender, WebhookSender
from gpuwatch.collector.lease import ClusterLease, holder_id
from gpuwatch.collector.server import CollectorServer, serve
from gpuwatch.collector.snapshot import MetricsService
from gpuwatch.collector.store import redacted
from gpuwatch.models.advisor import advise
from gpuwatch.models.model import default_model_path, load_model
from gpuwatch.core.errors import UserError
from gpuwatch.core.security import check_listen_policy, read_token

log = logging.getLogger(__name__)

def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    config.add_arguments(parser, config.COLLECTOR_OPTIONS)


def start_collector(cfg: config.Config) -> CollectorServer:
    """Start a collector with everything ``cfg`` (:func:`gpuwatch.core.settings.load_config` over COLLECTOR_OPTIONS) asks."""
    check_listen_policy(cfg.listen, cfg.tls_cert is not None or cfg.tls_key is not None, cfg.insecure)  # fail fast
    if cfg.model is not None and not Path(cfg.model).is_file():
        raise UserError(f"{cfg.model}: no such model file")
    # the model takes seconds to load: the collector listens first, scoring begins once it is loaded
    hub = AlertHub(None, _senders(cfg), advice=advise(n_gpus=cfg.job_gpus, checkpoint_s=cfg.checkpoint_cost))
    scorer = scoring.Scorer(None, hub, interval_s=cfg.score_interval, load_model=functools.partial(_model, cfg.model),
                            clock=cfg.score_clock, false_alarm_budget=cfg.false_alarm_budget)
    monitor = jobs.JobsMonitor(hub, interval_s=cfg.jobs_interval, window_s=cfg.jobs_window,
                               hang_threshold_s=cfg.hang_threshold)
    # one collector among those sharing a store scores, monitors jobs and sends alerts (collector/lease.py)
    lease = ClusterLease(min(cfg.score_interval, cfg.jobs_interval), holder=holder_id(cfg.listen),
                         on_acquire=[hub.reload])
    scorer.gate = monitor.gate = lease.held
    services: list[Any] = [hub, lease, scorer, monitor]  # started in order: the hub before the lease reloads it
    if cfg.metrics_listen:
        metrics_token = read_token(cfg.metrics_token_file) if cfg.metrics_token_file else None
        services.append(MetricsService(cfg.metrics_listen, scorer=scorer, jobs=monitor, token=metrics_token,
                                       insecure=cfg.insecure, gpu_telemetry=cfg.metrics_gpu_telemetry,
                                       interval_s=cfg.metrics_interval))
    try:
        return serve(cfg.listen, cfg.store or cfg.db, retention_days=cfg.retention_days, max_workers=cfg.max_workers,
                     max_in_flight=cfg.max_in_flight, stream_idle_s=cfg.stream_idle_timeout,
                     max_ingest_streams=cfg.max_ingest_streams,
                     time_window=TimeWindow(cfg.max_sample_age_days, cfg.max_sample_ahead_days),
                     memory_limit=cfg.memory_limit, span_retention_s=cfg.span_retention or None,
                     clickhouse_cluster=cfg.clickhouse_cluster,
                     services=services, tls_cert=cfg.tls_cert, tls_key=cfg.tls_key, tls_client_ca=cfg.tls_client_ca,
                     token=read_token(cfg.token_file) if cfg.token_file else None, insecure=cfg.insecure)
    except BaseException:
        hub.stop()  # its senders' threads started with it; serve stops only the services it started
        raise


def _model(path: str | None) -> dict | None:
    """The model named in the config, else the bundled one; without either, scoring gives health only."""
    if path is not None:
        return load_model(path)
    if not default_model_path().is_file():
        log.warning("no failure model (%s is missing): GPUs get health states, no failure risk",
                    default_model_path())
        return None
    return load_model(None)


def _senders(cfg: config.Config) -> list[AlertSender]:
    senders: list[AlertSender] = []
    if cfg.alertmanager_url:
        senders.append(AlertmanagerSender(cfg.alertmanager_url))
    if cfg.webhook_url:
        senders.append(WebhookSender(cfg.webhook_url))
    return senders


def raise_open_file_limit() -> int:
    """Raise the soft limit on open files to the hard one: every connected agent holds a socket."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def run(command: str, args: argparse.Namespace) -> int:
    cfg = config.load_config(config.COLLECTOR_OPTIONS, args)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if raise_open_file_limit() < 4 * 1024:
        log.warning("open-file limit %d: the collector can hold fewer agents than that; raise it (ulimit -n)",
                    resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    server = start_collector(cfg)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    metrics = next((s.server.url for s in server.services if isinstance(s, MetricsService)), None)
    print(f"gpuwatch collector listening on {server.address}, store {redacted(cfg.store or cfg.db)}"
          + (f", metrics {metrics}" if metrics else ""), flush=True)
    stop.wait()
    log.info("stopping: committing queued batches")
    server.stop()
    return 0

