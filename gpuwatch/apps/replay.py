"""Replay: a recording turned back into the TelemetryBatches an agent would have sent, streamed into a collector.

One synthetic agent per node sends its batches in time order over the collector's real Ingest stream, so
storage, breakdowns and scoring see exactly what they see live. The agent id is derived from the recording, so
a replay that is interrupted and run again stores nothing twice: the collector's (agent_id, sequence)
deduplication answers the batches it already has as duplicates. :func:`replay_into_store` hands the same
batches, serialized and decoded by the collector's own Ingest decoder (the same checks and refusals), to a
collector store's writer (the same grouped commits and deduplication): `--offline`
(gpuwatch.apps.replay_offline) needs no network. The commands are in gpuwatch.apps.recording_cli.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pandas as pd

from gpuwatch.collector import client
from gpuwatch.core.errors import UserError
from gpuwatch.core.batch_tables import DEFAULT_TICKS_PER_BATCH, TimedBatch, frames_batches
from gpuwatch.core.progress import Progress
from gpuwatch.core.recording import Recording
from gpuwatch.v1 import telemetry_pb2 as pb


# ------------------------------------------------------------------------------ recording -> batches
def recording_id(rec: Recording) -> str:
    """A stable short id of a recording: the same recording always replays under the same agent ids.

    Built from what identifies the capture (writer, start time, resolution, writer details such as the
    simulator's seed), not from the path or the end time, so a moved or grown recording keeps its id.
    """
    m = rec.manifest
    key = json.dumps([m.get("source"), m.get("start_ms"), m.get("resolution_s"), m.get("extra")], sort_keys=True,
                     default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def replay_agent_id(node: str, rec_id: str) -> str:
    return f"replay-{node}-{rec_id}"


def node_batches(rec: Recording, node: str, *, agent_id: str, ticks_per_batch: int = DEFAULT_TICKS_PER_BATCH,
                 extra_spans: pd.DataFrame | None = None) -> Iterator[TimedBatch]:
    """The node's recorded rows as batches (see :func:`gpuwatch.core.batch_tables.frames_batches`); ``extra_spans`` are
    spans without a recorded node that this node's batches carry."""
    where = [("node", "==", node)]
    spans = rec.table("spans", filters=where)
    if extra_spans is not None:
        spans = pd.concat([spans, extra_spans], ignore_index=True)
    yield from frames_batches(
        node, agent_id, gpu_samples=rec.table("gpu_samples", filters=where),
        host_samples=rec.table("host_samples", filters=where), events=rec.table("events", filters=where),
        spans=spans, gpus=rec.table("gpus", filters=where), ticks_per_batch=ticks_per_batch)


def recording_batches(rec: Recording, *, ticks_per_batch: int = DEFAULT_TICKS_PER_BATCH,
                      in_time_order: bool = False) -> Iterator[TimedBatch]:
    """Every node's batches: node after node, or (``in_time_order``, for paced replay) merged by time.

    Node after node holds one node's rows in memory at a time; time order holds every node's.
    Spans recorded without a known node travel with the first node's batches.
    """
    rec_id = recording_id(rec)
    nodes = sorted(n for n in rec.manifest.get("nodes") or [] if n)  # earlier writers listed "" for node-less spans
    orphans = rec.table("spans")
    orphans = orphans[~orphans["node"].isin(nodes)]
    if not nodes and len(orphans):
        raise UserError(f"{rec.path}: spans without any node name; replay needs a node to send them from")
    per_node = [node_batches(rec, node, agent_id=replay_agent_id(node, rec_id), ticks_per_batch=ticks_per_batch,
                             extra_spans=orphans if i == 0 and len(orphans) else None)
                for i, node in enumerate(nodes)]
    if in_time_order:
        yield from heapq.merge(*per_node, key=lambda tb: tb.ts_ms)
    else:
        for batches in per_node:
            yield from batches


# ----------------------------------------------------------------------------------- streaming
@dataclass
class ReplayResult:
    """What a replay sent, per node, and how the collector answered."""

    recording: str
    recording_id: str
    batches: int = 0
    duplicates: int = 0
    seconds: float = 0.0
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)

    def count(self, batch: pb.TelemetryBatch) -> int:
        """Count a batch sent; return its GPU samples."""
        node = self.nodes.setdefault(batch.node.node, {
            "agent_id": batch.agent_id, "batches": 0, "gpu_samples": 0, "host_samples": 0, "events": 0, "spans": 0})
        samples = sum(len(s.ts_ms) for s in batch.samples)
        node["batches"] += 1
        node["gpu_samples"] += samples
        node["host_samples"] += len(batch.host.ts_ms)
        node["events"] += len(batch.events)
        node["spans"] += len(batch.spans.start_us)
        return samples

    def as_dict(self) -> dict[str, Any]:
        return {"recording": self.recording, "recording_id": self.recording_id, "batches": self.batches,
                "stored": self.batches - self.duplicates, "duplicates": self.duplicates,
                "seconds": round(self.seconds, 3), "nodes": self.nodes}


def replay(rec: Recording, channel: grpc.Channel, *, speed: float | None = None,
           ticks_per_batch: int = DEFAULT_TICKS_PER_BATCH, window: int = 64, quiet: bool = False) -> ReplayResult:
    """Stream the recording's batches to the collector behind ``channel`` and wait for every ack.

    ``speed`` paces the batches by their recorded times (2.0: twice real time); None sends as fast as
    the collector acknowledges. A batch the collector refuses ends the replay with a UserError; what was
    acknowledged before stays stored, and running the replay again resumes without duplicates.
    """
    _check_speed(speed)
    result = ReplayResult(str(rec.path), recording_id(rec))
    sent_samples: deque[int] = deque()  # per batch sent and not yet acknowledged, for progress in samples
    started = time.monotonic()

    def send() -> Iterator[pb.TelemetryBatch]:
        for tb in _paced(recording_batches(rec, ticks_per_batch=ticks_per_batch, in_time_order=speed is not None),
                         speed, started):
            sent_samples.append(result.count(tb.batch))
            yield tb.batch

    with Progress("replay", total=rec.rows("gpu_samples"), unit="samples", quiet=quiet) as progress:
        try:
            for ack in client.stream_batches(channel, send(), window=window):
                result.batches += 1
                result.duplicates += ack.duplicate
                progress.advance(sent_samples.popleft())
        except grpc.RpcError as exc:
            raise _refused(result, exc.details(), exc.code().name) from None
    result.seconds = time.monotonic() - started
    return result


def replay_into_store(rec: Recording, store: Any, *, speed: float | None = None,
                      ticks_per_batch: int = DEFAULT_TICKS_PER_BATCH, group: int = 64,
                      quiet: bool = False) -> ReplayResult:
    """Offline replay: what :func:`replay` streams, stored as the collector's Ingest would store it, minus the
    network. Each batch goes through the bytes the agent would send and the collector's own decoder
    (:func:`gpuwatch.collector.ingest_service.decode_batch`: the same checks and refusals), then to ``store``'s writer
    (grouped commits, deduplication by agent and sequence) and is counted when committed, as an ack.

    Offline the network only costs: a channel, a server event loop and acks, all taking the GIL from the
    batch building. A commit has a fixed cost (a transaction and its log write) that batches trickling in one
    at a time would pay each time, so batches are handed to the writer ``group`` at a time (one commit each;
    one by one when paced by ``speed``) and the next group is built while the writer commits the last one.
    A refused batch ends the replay with the same UserError as :func:`replay`, after the batches before it
    are committed.
    """
    from gpuwatch.collector.ingest_service import BatchRejected, decode_batch, store_failure

    _check_speed(speed)
    result = ReplayResult(str(rec.path), recording_id(rec))
    built: list[tuple[Any, int]] = []  # decoded batches not yet handed to the writer, with their GPU samples
    submitted: deque[tuple[Any, int, Any]] = deque()  # (batch, GPU samples, commit future) not yet counted
    started = time.monotonic()
    with Progress("replay", total=rec.rows("gpu_samples"), unit="samples", quiet=quiet) as progress:
        def settle(keep: int) -> None:
            """Count committed batches in order, waiting while more than ``keep`` are not committed."""
            while submitted and (len(submitted) > keep or submitted[0][2].done()):
                batch, samples, commit = submitted.popleft()
                try:
                    ack = commit.result()
                except Exception as exc:
                    raise store_failure(exc, batch) from None
                result.batches += 1
                result.duplicates += ack.duplicate
                progress.advance(samples)

        def hand_over() -> None:
            submitted.extend((batch, samples, store.submit(batch)) for batch, samples in built)
            built.clear()

        try:
            for tb in _paced(recording_batches(rec, ticks_per_batch=ticks_per_batch, in_time_order=speed is not None),
                             speed, started):
                samples = result.count(tb.batch)
                try:
                    built.append((decode_batch(tb.batch.SerializeToString()), samples))
                except BatchRejected:
                    hand_over()  # the batches before it are stored and acknowledged first (or one of them fails)
                    settle(keep=0)
                    raise
                if len(built) >= group or speed is not None:
                    settle(keep=group)  # the group handed over last may still be committing
                    hand_over()
            hand_over()
            settle(keep=0)
        except BatchRejected as exc:
            raise _refused(result, exc.message, exc.code.name) from None
    result.seconds = time.monotonic() - started
    return result


def _check_speed(speed: float | None) -> None:
    if speed is not None and speed <= 0:
        raise UserError(f"--speed {speed:g}: must be > 0 (times real time)")


def _paced(timed: Iterator[TimedBatch], speed: float | None, started: float) -> Iterator[TimedBatch]:
    """``timed`` as it comes, or with ``speed`` each batch held back until its recorded time (after the first
    batch's), divided by ``speed``, has passed since ``started`` (monotonic)."""
    first_ms = None
    for tb in timed:
        if speed is not None:
            first_ms = tb.ts_ms if first_ms is None else first_ms
            delay = started + (tb.ts_ms - first_ms) / 1000 / speed - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # pacing to recorded time, not waiting for a result
        yield tb


def _refused(result: ReplayResult, details: str, code: str) -> UserError:
    return UserError(f"the collector refused the replay after {result.batches} acknowledged batches: {details} "
                     f"({code}); run the replay again to resume")
