"""`gpuwatch replay`, `import` and `export`: recordings in and out of the live pipeline.

Replay turns a recording back into the TelemetryBatches an agent would have sent (one synthetic agent per
node, sequences in time order) and streams them over the collector's real Ingest stream, so storage,
breakdowns and scoring see exactly what they see live. The agent id is derived from the recording, so a
replay that is interrupted and run again stores nothing twice: the collector's (agent_id, sequence)
deduplication answers the batches it already has as duplicates. `--offline` needs no network: it hands the
same batches, serialized and decoded by the collector's own Ingest decoder (the same checks and refusals),
to a collector store's writer (the same grouped commits and deduplication), then runs the collector's scorer
and jobs monitor over the stored range and reports what it stored and computed.

The ``import`` (gpuwatch.apps.importer) and ``export`` (gpuwatch.apps.export) commands live here too,
because all three move recordings and share their flags and output.
"""
from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import msgspec
import pandas as pd

from gpuwatch.apps.commandline import (add_client_security_arguments, client_security, format_cell, format_table,
                                       result_command, time_flag)
from gpuwatch.collector import client
from gpuwatch.core.errors import UserError
from gpuwatch.core.batch_tables import DEFAULT_TICKS_PER_BATCH, TimedBatch, frames_batches
from gpuwatch.core.progress import Progress
from gpuwatch.core.recording import Recording, open_recording
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
    (:func:`gpuwatch.collector.server.decode_batch`: the same checks and refusals), then to ``store``'s writer
    (grouped commits, deduplication by agent and sequence) and is counted when committed, as an ack.

    Offline the network only costs: a channel, a server event loop and acks, all taking the GIL from the
    batch building. A commit has a fixed cost (a transaction and its log write) that batches trickling in one
    at a time would pay each time, so batches are handed to the writer ``group`` at a time (one commit each;
    one by one when paced by ``speed``) and the next group is built while the writer commits the last one.
    A refused batch ends the replay with the same UserError as :func:`replay`, after the batches before it
    are committed.
    """
    from gpuwatch.collector.server import BatchRejected, decode_batch, store_failure

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


# --------------------------------------------------------------------------------- offline results
def replay_offline(path: str | Path, *, db: str | Path | None = None, speed: float | None = None,
                   ticks_per_batch: int = DEFAULT_TICKS_PER_BATCH, model_path: str | None = None,
                   score_interval_s: float | None = None, quiet: bool = False) -> dict[str, Any]:
    """Replay into a collector store opened here (``db``, else a temporary one; see :func:`replay_into_store`)
    and report what it stored and computed: the replay counts plus ``store`` (see :func:`store_results`) and
    ``scoring`` (see :func:`score_replayed`, with the model at ``model_path``, default the shipped one)."""
    from gpuwatch.collector.assembly import failure_model
    from gpuwatch.collector.store import open_store

    rec = open_recording(path)
    with tempfile.TemporaryDirectory(prefix="gpuwatch-replay-") as tmp:
        store = open_store(str(db or Path(tmp) / "replay.duckdb"))
        try:
            result = replay_into_store(rec, store, speed=speed, ticks_per_batch=ticks_per_batch,
                                       quiet=quiet).as_dict()
            store.flush()
            result["store"] = store_results(store)
            m = rec.manifest
            if m.get("start_ms") is not None:
                with Progress("loading the failure model", total=1, unit="models", quiet=quiet) as progress:
                    model = failure_model(model_path)
                    progress.advance()
                started = time.monotonic()
                result["scoring"] = score_replayed(store, int(m["start_ms"]), int(m["end_ms"]),
                                                   model=model, interval_s=score_interval_s, quiet=quiet)
                result["scoring"]["seconds"] = round(time.monotonic() - started, 3)
        finally:
            store.close()
    return result


def store_results(store: Any) -> dict[str, Any]:
    """What the collector holds after a replay: per node counts, and each job's efficiency breakdown
    computed by the collector's own Breakdown handler over the stored probe spans."""
    from gpuwatch.collector.breakdowns import BreakdownService
    from gpuwatch.efficiency.result import Analysis
    from gpuwatch.v1 import query_pb2 as q

    counts = store.event_counts_by_node()
    nodes = [{"node": r["node"], "gpus": r["gpus"], "samples": r["samples"], "events": int(counts.get(r["node"], 0)),
              "agent_id": r["agent_id"], "last_sequence": r["last_sequence"]} for r in store.nodes()]
    service = BreakdownService()
    breakdowns: dict[str, dict[str, Any]] = {}
    for job_id in store.span_job_ids():
        try:
            found = Analysis.from_json(json.loads(service.breakdown(q.BreakdownRequest(job_id=job_id), store).json))
        except UserError as exc:
            breakdowns[job_id] = {"error": str(exc)}
            continue
        breakdowns[job_id] = {"ranks": found.job.ranks, "window_us": found.job.window_us,
                              "breakdown_fraction": found.job.breakdown_fraction,
                              "lost_gpu_hours": found.job.lost_gpu_hours,
                              "stragglers": [msgspec.structs.asdict(s) for s in found.stragglers]}
    return {"nodes": nodes, "breakdowns": breakdowns}


def score_replayed(store: Any, start_ms: int, end_ms: int, *, model: dict | None, interval_s: float | None = None,
                   quiet: bool = False) -> dict[str, Any]:
    """Run the collector's scorer and jobs monitor over the replayed time range as they would have run live;
    return the last round's GPU scores (at ``end_ms``), the highest risk each GPU reached, the GPUs failed at the
    end, and every alert raised (firing or resolved).

    Default (``interval_s`` None): GPUs are scored at every step of the model in one vectorised pass
    (:func:`gpuwatch.collector.scoring.score_history`, the times the evaluation scores at) and the jobs monitor
    runs once per step; with ``interval_s``, one live scorer round every ``interval_s`` of recorded time, each
    re-reading its day of history (exact live cadence, much slower)."""
    from gpuwatch.collector.alert_hub import list_alerts
    from gpuwatch.collector.assembly import build_engines
    from gpuwatch.collector.failed import failed_gpus
    from gpuwatch.collector.scoring import observation, score_history
    from gpuwatch.models.features import DEFAULT_STEP_S
    from gpuwatch.v1 import query_pb2 as q

    if interval_s is not None and interval_s <= 0:
        raise UserError(f"--score-interval {interval_s:g}: must be > 0 seconds")
    step_s = interval_s or (int(model["step_s"]) if model else DEFAULT_STEP_S)
    engines = build_engines(model=model, score_interval_s=step_s, jobs_interval_s=step_s)
    engines.drive(store)
    hub, scorer, monitor = engines.hub, engines.scorer, engines.jobs
    rounds = list(range(start_ms + int(step_s * 1000), end_ms, int(step_s * 1000))) + [end_ms]
    peak: dict[str, float] = {}

    def keep_peak(gpus: list[dict[str, Any]]) -> None:
        for g in gpus:
            if g["risk"] is not None:
                key = f"{g['node']}/{g['gpu_index']}"
                peak[key] = max(peak.get(key, 0.0), g["risk"])

    try:
        with Progress("scoring", total=len(rounds), unit="rounds", quiet=quiet) as progress:
            if interval_s is None:
                def steps() -> Iterator[tuple[int, list]]:
                    for now_ms, gpus in score_history(store, model, start_ms, end_ms):
                        keep_peak(gpus)
                        progress.advance()
                        yield now_ms, [observation(g, now_ms) for g in gpus if g["risk"] is not None]

                hub.observe_risk_rounds(steps())
            else:
                for now_ms in rounds[:-1]:
                    keep_peak(scorer.score_once(now_ms))
                    progress.advance()
        has_spans = store.count("spans") > 0
        with Progress("jobs", total=len(rounds) if has_spans else 0, unit="rounds", quiet=quiet) as progress:
            for now_ms in rounds if has_spans else ():
                monitor.check_once(now_ms * 1000.0)
                progress.advance()
        gpus = scorer.score_once(end_ms)  # the last round: exactly what the collector shows at the end
        keep_peak(gpus)
    finally:
        engines.stop()
    alerts = json.loads(list_alerts(q.AlertsRequest(include_resolved=True), store).json)
    failed = [{"node": f.node, "gpu_index": f.gpu_index, "since_ms": f.since_ms, "reason": f.reason}
              for f in failed_gpus(store, end_ms).values()]
    return {"model": bool(model), "rounds": len(rounds), "gpus": gpus, "peak_risk": peak, "failed": failed,
            "alerts": alerts}


# ------------------------------------------------------------------------------------------ CLI
def _replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="recording directory (gpuwatch agent --record, simulate, import, export)")
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--speed", type=float, metavar="X", help="pace by recorded time, X times real time")
    pace.add_argument("--fast", action="store_true", help="as fast as the collector acknowledges (default)")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--collector", metavar="ADDR", help="stream into the collector at HOST:PORT")
    target.add_argument("--offline", action="store_true",
                        help="replay into a collector started here and print its results (default)")
    p.add_argument("--db", help="with --offline: keep the store in this DuckDB file (default: a temporary one)")
    p.add_argument("--model", help="with --offline: failure model for scoring (default: the shipped model)")
    p.add_argument("--score-interval", type=float, default=None, metavar="S",
                   help="with --offline: score GPUs every S seconds of recorded time, each round re-reading its day "
                        "of history as live (default: every step of the model in one pass, as the evaluation)")
    p.add_argument("--ticks-per-batch", type=int, default=DEFAULT_TICKS_PER_BATCH, metavar="N",
                   help=f"sample timestamps per batch (default {DEFAULT_TICKS_PER_BATCH})")
    add_client_security_arguments(p.add_argument_group("with --collector: its TLS and token"))


def _run_replay(args: argparse.Namespace) -> dict[str, Any]:
    if args.ticks_per_batch < 1:
        raise UserError(f"--ticks-per-batch {args.ticks_per_batch}: must be >= 1")
    if args.collector is None:
        return replay_offline(args.path, db=args.db, speed=args.speed, ticks_per_batch=args.ticks_per_batch,
                              model_path=args.model, score_interval_s=args.score_interval, quiet=args.quiet)
    if args.db or args.model:
        raise UserError("--db and --model are for --offline; with --collector the collector keeps its own store "
                        "and scores with its own model")
    rec = open_recording(args.path)
    ch = client.channel(args.collector, timeout=5.0, security=client_security(args))
    try:
        return replay(rec, ch, speed=args.speed, ticks_per_batch=args.ticks_per_batch, quiet=args.quiet).as_dict()
    finally:
        ch.close()


def _import_arguments(p: argparse.ArgumentParser) -> None:
    from gpuwatch.apps.importer import FORMATS

    from gpuwatch.apps.fault_log import TIME_UNITS

    p.add_argument("files", nargs="+", metavar="FILE", help="CSV or Parquet telemetry files, or fault logs")
    p.add_argument("--out", required=True, help="recording directory to write (new or empty)")
    p.add_argument("--format", choices=(*FORMATS, "faults"), default="auto",
                   help="wide: one column per field; long: metric/value rows (dcgm-exporter via Prometheus); "
                   "faults: a fault log (node, GPU, time, kind or XID, end; CSV, Parquet, JSON, JSON lines)")
    faults = p.add_argument_group("fault logs (--format faults): the fleet the log covers")
    faults.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    faults.add_argument("--nodes", type=int,
                        help="nodes in the fleet, with those that never failed (default: the nodes in the log)")
    faults.add_argument("--start", help="start of the period, and time 0 of relative times (ISO 8601 date or "
                        "time; default: the first fault, or 2000-01-01 for relative times)")
    end = faults.add_mutually_exclusive_group()
    end.add_argument("--end", help="end of the period (default: the last time in the log)")
    end.add_argument("--days", type=float, help="length of the period in days from --start")
    faults.add_argument("--time-unit", choices=TIME_UNITS, default="auto",
                        help="numeric times are offsets from --start in this unit (auto: days when too small "
                        "for epoch times, else epoch seconds or ms)")
    p.add_argument("--node-column", help="column naming the node (default: node, Hostname, hostname, instance)")
    p.add_argument("--gpu-column", help="column with the GPU index (default: gpu_index, gpu)")
    p.add_argument("--time-column", help="column with the time (default: ts, timestamp, time)")


def _run_import(args: argparse.Namespace) -> dict[str, Any]:
    from gpuwatch.apps.importer import Columns, import_files

    if args.format == "faults":
        from gpuwatch.apps.fault_log import import_fault_log

        return import_fault_log(args.files, args.out, gpus_per_node=args.gpus_per_node, nodes=args.nodes,
                                start=args.start, end=args.end, days=args.days, time_unit=args.time_unit,
                                node_column=args.node_column, gpu_column=args.gpu_column,
                                time_column=args.time_column)
    columns = Columns(node=args.node_column, gpu=args.gpu_column, time=args.time_column)
    return import_files(args.files, args.out, fmt=args.format, columns=columns, quiet=args.quiet)


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", required=True, help="collector DuckDB store (of a stopped collector, or a copy)")
    p.add_argument("--out", required=True, help="recording directory to write (new or empty)")
    p.add_argument("--since", dest="since_ms", type=time_flag("--since"),
                   help="from this time: 15m, 2h, 7d (ago), ISO 8601 time or epoch ms")
    p.add_argument("--until", dest="until_ms", type=time_flag("--until"), help="up to this time (same forms)")


def _run_export(args: argparse.Namespace) -> dict[str, Any]:
    from gpuwatch.apps.export import export_store

    return export_store(args.db, args.out, since_ms=args.since_ms, until_ms=args.until_ms, quiet=args.quiet)


def format_result(result: dict[str, Any]) -> str:
    """A result as text: its scalar entries, then one aligned table per list or mapping of rows; the
    collector's side of an offline replay (``store``, ``scoring``) as sections of their own."""
    lines = [f"{k}: {format_cell(v)}" for k, v in result.items() if not isinstance(v, (dict, list))]
    for key, value in result.items():
        if key in _SECTIONS and isinstance(value, dict):
            lines += [_SECTIONS[key], format_result(value).rstrip()]
        elif isinstance(value, dict) and value:
            rows = [{"name": k, **(v if isinstance(v, dict) else {"value": v})} for k, v in value.items()]
            lines += [f"{key}:", format_table(rows).rstrip()]
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            lines += [f"{key}:", format_table(value).rstrip()]
        elif isinstance(value, list):
            lines.append(f"{key}: {', '.join(map(format_cell, value)) or '(none)'}")
    return "\n".join(lines) + "\n"


_SECTIONS = {"store": "stored by the collector:", "scoring": "scored over the replayed time range:"}

REPLAY = result_command(_replay_arguments, _run_replay, format_result)
IMPORT = result_command(_import_arguments, _run_import, format_result)
EXPORT = result_command(_export_arguments, _run_export, format_result)
