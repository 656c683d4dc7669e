"""Metrics rendered on a background thread, so that scrapes of a large fleet copy bytes instead of rendering."""
from __future__ import annotations

import gzip
import logging
import threading
import time

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder, gzip_accepted

log = logging.getLogger(__name__)


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

