"""The single writer thread every store engine shares: grouped commits, dedup, acks after commit.

Columnar engines are built for bulk operations, so every write goes through one writer thread that takes all
batches queued at that moment, drops those already stored (by agent and sequence), commits the rest as one
group (the engine's :meth:`GroupWriter._commit`) and only then resolves the batches' futures, which is when
the server acknowledges them. Other writes (retention, breakdowns, alerts, leases) run on the same thread
between groups through :meth:`GroupWriter.run_write`, so the engine sees one writer and their writes are
ordered with ingest. Housekeeping (retention, trimming raw spans) runs on it at its interval.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuwatch.core.metrics_snapshot import IngestSnapshot, LatencyHistogram
from gpuwatch.collector.store.base import StoreClosed, WriteResult
from gpuwatch.core.columnar import ColumnarBatch, from_message
from gpuwatch.core.errors import AgentIdConflict
from gpuwatch.v1 import telemetry_pb2 as pb

log = logging.getLogger(__name__)

__all__ = ["GroupWriter", "IngestCounters", "StoreClosed", "WriteResult", "fingerprint"]


@dataclass
class _Pending:
    batch: ColumnarBatch
    future: Future = field(default_factory=Future)


@dataclass
class _Task:
    """Work other than a batch that must run on the writer thread (retention, flush barriers)."""

    fn: Callable[[Any], Any]
    future: Future = field(default_factory=Future)


_STOP = object()


class IngestCounters:
    """What the writer committed since the store was opened (exported as gpuwatch_ingest_* metrics)."""

    def __init__(self) -> None:
        self.batches = self.samples = self.duplicates = self.rejected = 0
        self.commit_seconds = LatencyHistogram()
        self._oldest_sample_ms: int | None = None
        self._lock = threading.Lock()

    def committed(self, batches: Sequence[ColumnarBatch], duplicates: int, seconds: float) -> None:
        times = np.concatenate([b.gpu_ts for b in batches]) if batches else np.empty(0, np.int64)
        rows = len(times)
        oldest = int(times.min()) if rows else None
        with self._lock:
            self.batches += len(batches)
            self.samples += rows
            self.duplicates += duplicates
            if oldest is not None and (self._oldest_sample_ms is None or oldest < self._oldest_sample_ms):
                self._oldest_sample_ms = oldest
        self.commit_seconds.observe(seconds)

    def take_oldest_sample_ms(self) -> int | None:
        """The oldest GPU sample time committed since the last call (None: no samples since), so a reader
        that keeps aggregates of recent data (the scorer) knows when late data (a spool replay) needs a re-read."""
        with self._lock:
            oldest, self._oldest_sample_ms = self._oldest_sample_ms, None
        return oldest

    def reject(self) -> None:
        """The server refused a batch before it reached the store (malformed, oversized, wrong version)."""
        with self._lock:
            self.rejected += 1

    def snapshot(self) -> IngestSnapshot:
        with self._lock:
            batches, samples, duplicates, rejected = self.batches, self.samples, self.duplicates, self.rejected
        return IngestSnapshot(batches_total=batches, samples_total=samples, duplicates_total=duplicates,
                              rejected_total=rejected, commit_seconds=self.commit_seconds.snapshot())


class GroupWriter:
    """The writer thread and its queue. An engine implements ``_commit`` (store a group of fresh batches
    atomically, or idempotently, with each batch's :func:`fingerprint` in its ``ingested`` row),
    ``_stored_keys`` (which (agent, sequence) pairs are stored, with their fingerprints), ``_housekeeping``,
    ``_task_argument`` (what :meth:`run_write` functions get) and ``_close_engine``; ``_failure_hint`` may add
    the likely cause of a failed write (a full disk) to its log line."""

    #: Engine errors that mean a batch holds something the engine cannot keep (a value out of its range), as
    #: opposed to the engine failing (a full disk): the server refuses such a batch for good.
    unstorable_errors: tuple[type[BaseException], ...] = ()
    #: Under load (the previous group was more than one batch), how long after a commit the writer goes on
    #: taking in batches before it commits the next group. 0: commit what is queued at once. An engine whose
    #: every insert has a fixed cost and makes a part that merges rewrite (ClickHouse) stores the same rows
    #: in fewer, larger inserts; a store that gets a batch now and then still commits it at once.
    linger_s = 0.0

    def __init__(self, last_sequence: dict[str, int], *, retention_days: float | None, span_retention_s: float | None,
                 retention_interval_s: float, span_trim_interval_s: float, max_group_batches: int,
                 max_queued_batches: int) -> None:
        self.retention_days = retention_days
        self.span_retention_s = span_retention_s
        self._retention_interval_s = retention_interval_s
        self._span_trim_interval_s = span_trim_interval_s
        self._max_group = max_group_batches
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued_batches)
        self._closed = False
        self.counters = IngestCounters()
        self._last_sequence = last_sequence
        self._writer = threading.Thread(target=self._write_loop, name="store-writer", daemon=True)
        self._writer.start()

    # ---- engine hooks --------------------------------------------------------------------------------
    def _commit(self, batches: list[ColumnarBatch]) -> None:
        raise NotImplementedError

    def _stored_keys(self, keys: list[tuple[str, int]]) -> dict[tuple[str, int], str | None]:
        """The pairs among ``keys`` already stored, each with its fingerprint (None: stored before there was one)."""
        raise NotImplementedError

    def _failure_hint(self, exc: BaseException) -> str:
        return ""

    def _housekeeping(self, retention: bool, trim: bool) -> None:
        raise NotImplementedError

    def _task_argument(self) -> Any:
        raise NotImplementedError

    def _close_engine(self) -> None:
        raise NotImplementedError

    # ---- the public write path ---------------------------------------------------------------------------
    def submit(self, batch: ColumnarBatch | pb.TelemetryBatch) -> Future:
        """Queue a batch (a message is checked first: BatchError); the future resolves to a
        :class:`WriteResult` once it is committed.

        Blocks while the queue is full, which pushes back on the senders instead of growing memory.
        """
        if self._closed:
            raise StoreClosed("the store is closed")
        pending = _Pending(batch if isinstance(batch, ColumnarBatch) else from_message(batch))
        self._queue.put(pending)
        return pending.future

    def sole_writer(self) -> bool:
        """Whether this store is the only one writing to its database, so that only sequences at or below an
        agent's last one seen here can be stored already (the others need no lookup). False where other
        collectors write to the same database (a ClickHouse server)."""
        return True

    def write(self, batch: ColumnarBatch | pb.TelemetryBatch, timeout: float | None = None) -> WriteResult:
        """Store one batch and wait for its commit (tests, simple tools)."""
        return self.submit(batch).result(timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Return once every batch queued before this call is committed."""
        self.run_write(lambda _: None, timeout)

    def run_write(self, fn: Callable[[Any], Any], timeout: float | None = None) -> Any:
        """Run ``fn(engine connection)`` on the writer thread, between batch groups, and return its result."""
        if self._closed:
            raise StoreClosed("the store is closed")
        task = _Task(fn)
        self._queue.put(task)
        return task.future.result(timeout)

    def _retention_cutoff_ms(self, now_ms: int | None = None) -> int:
        """Rows older than this (epoch ms) are past ``retention_days`` at ``now_ms`` (default now)."""
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        return now_ms - int((self.retention_days or 0) * 86_400_000)

    def queue_depth(self) -> int:
        """Batches and tasks waiting for the writer."""
        return self._queue.qsize()

    def close(self) -> None:
        """Commit everything queued, stop the writer and close the engine."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._writer.join()
        self._close_engine()

    # ---- the writer thread ---------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        next_retention = time.monotonic() + self._retention_interval_s
        next_trim = time.monotonic() + self._span_trim_interval_s
        stopping = False
        last_commit, last_size = 0.0, 0  # when the previous group was committed, and its size
        while not stopping:
            try:
                first = [self._queue.get(timeout=max(0.01, min(next_retention, next_trim) - time.monotonic()))]
            except queue.Empty:
                first = []
            group: list = []
            items = first + list(self._drain())
            if last_size > 1 and all(isinstance(item, _Pending) for item in items):
                items += self._held(last_commit + self.linger_s)
            for item in items:
                if item is _STOP:
                    stopping = True
                elif isinstance(item, _Task):
                    self._write_group(group)
                    group = []
                    _resolve(item.future, item.fn, self._task_argument())
                else:
                    group.append(item)
            self._write_group(group)
            if group:
                last_commit, last_size = time.monotonic(), len(group)
            if stopping:
                break
            retention, trim = time.monotonic() >= next_retention, time.monotonic() >= next_trim
            if retention:
                next_retention = time.monotonic() + self._retention_interval_s
            if trim:
                next_trim = time.monotonic() + self._span_trim_interval_s
            if retention or trim:
                try:
                    self._housekeeping(retention, trim)
                except Exception:  # a failed clean-up must not stop ingest; it is retried next interval
                    log.exception("store housekeeping (retention, span trimming) failed")

    def _drain(self) -> Iterable:
        for _ in range(self._max_group - 1):
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return

    def _held(self, until: float) -> list:
        """More items while they keep coming (none for a quarter of the linger ends the wait), until ``until``
        (monotonic) at the latest; a task or the stop ends the wait too (it runs at once, after the batches
        before it)."""
        held: list = []
        while (left := until - time.monotonic()) > 0:
            try:
                held.append(self._queue.get(timeout=min(left, self.linger_s / 4)))
            except queue.Empty:
                break
            if not isinstance(held[-1], _Pending):
                break
        return held

    def _write_group(self, group: list[_Pending]) -> None:
        if not group:
            return
        started = time.perf_counter()
        try:
            results, fresh = self._deduplicate(group)
            self._commit([p.batch for p in fresh])
        except Exception as exc:
            if len(group) > 1:  # find the batch that cannot be stored so it does not fail the others
                log.warning("storing a group of %d batches failed (%s); storing them one by one", len(group), exc)
                for p in group:
                    self._write_group([p])
                return
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.error("batch %d of agent %s cannot be stored: %s%s", group[0].batch.sequence,
                      group[0].batch.agent_id, first_line, self._failure_hint(exc))
            _settle(group[0].future, exception=exc)
            return
        duplicates = sum(isinstance(r, WriteResult) and r.duplicate for r in results)
        self.counters.committed([p.batch for p in fresh], duplicates, time.perf_counter() - started)
        for p in fresh:
            self._last_sequence[p.batch.agent_id] = max(self._last_sequence.get(p.batch.agent_id, 0), p.batch.sequence)
        for p, result in zip(group, results):
            if isinstance(result, AgentIdConflict):
                _settle(p.future, exception=result)
            else:
                _settle(p.future, result)

    def _deduplicate(self, group: list[_Pending]) -> tuple[list[WriteResult | AgentIdConflict], list[_Pending]]:
        """Mark batches stored before, or earlier in the same group, as duplicates; return the rest to write.

        A stored (agent, sequence) whose fingerprint differs from the batch's is not a resend but another
        agent's batch under the same id (a copied spool or VM image): it gets :class:`AgentIdConflict`, so the
        server refuses it instead of acknowledging data it did not store."""
        sole = self.sole_writer()
        maybe_stored = [p for p in group
                        if not sole or p.batch.sequence <= self._last_sequence.get(p.batch.agent_id, 0)]
        stored = self._stored_keys([(p.batch.agent_id, p.batch.sequence) for p in maybe_stored])
        results: list[WriteResult | AgentIdConflict] = []
        fresh = []
        for p in group:
            key = (p.batch.agent_id, p.batch.sequence)
            duplicate = key in stored
            mark = fingerprint(p.batch)
            if duplicate and stored[key] is not None and mark != stored[key]:
                results.append(AgentIdConflict(*key))
                continue
            stored.setdefault(key, mark)
            results.append(WriteResult(key[0], key[1], duplicate))
            if not duplicate:
                fresh.append(p)
        return results, fresh


def fingerprint(batch: ColumnarBatch) -> str:
    """What ``batch`` held, in brief (:attr:`ColumnarBatch.fingerprint`): equal for a resend, different for
    another agent's batch under the same (agent id, sequence)."""
    return batch.fingerprint


def _resolve(future: Future, fn: Callable, *args: Any) -> None:
    try:
        _settle(future, fn(*args))
    except Exception as exc:
        _settle(future, exception=exc)


def _settle(future: Future, result: Any = None, exception: BaseException | None = None) -> None:
    """Resolve ``future`` unless its waiter cancelled it (a client that went away): the writer must go on."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled: what it waited for is committed all the same
        pass
