"""The /metrics HTTP endpoint: binding (with the exposure policy), bearer tokens, and serving renders.

Without a render interval each scrape renders the provider's snapshot (a small endpoint: the agent's); with
one, scrapes copy the bytes of the last background render (:class:`~gpuwatch.core.metrics_render.RenderedMetrics`:
the collector's, where thousands of GPUs take seconds to render).
"""
from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from gpuwatch.core.errors import UserError
from gpuwatch.core.metrics_families import DEFAULT_MAX_JOBS, build_registry
from gpuwatch.core.metrics_render import RenderedMetrics
from gpuwatch.core.metrics_snapshot import SnapshotProvider
from gpuwatch.core.security import check_exposure, token_matches
from gpuwatch.core.settings import split_address

log = logging.getLogger(__name__)


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
