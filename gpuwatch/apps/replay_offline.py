"""`gpuwatch replay --offline`: a recording replayed into a collector store opened here, then the collector's
scorer and jobs monitor run over the stored range, and a report of what it stored and computed."""
from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from gpuwatch.apps.replay import replay_into_store
from gpuwatch.collector.query_documents import alert_documents
from gpuwatch.core.errors import UserError
from gpuwatch.core.batch_tables import DEFAULT_TICKS_PER_BATCH
from gpuwatch.core.progress import Progress
from gpuwatch.core.recording import open_recording

if TYPE_CHECKING:  # loaded when a replay scores, not when the CLI starts
    from gpuwatch.models.model import FailureModel


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


def score_replayed(store: Any, start_ms: int, end_ms: int, *, model: FailureModel | None,
                   interval_s: float | None = None, quiet: bool = False) -> dict[str, Any]:
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
    step_s = interval_s or (model.step_s if model else DEFAULT_STEP_S)
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
    alerts = alert_documents(list_alerts(q.AlertsRequest(include_resolved=True), store))
    failed = [{"node": f.node, "gpu_index": f.gpu_index, "since_ms": f.since_ms, "reason": f.reason}
              for f in failed_gpus(store, end_ms).values()]
    return {"model": bool(model), "rounds": len(rounds), "gpus": gpus, "peak_risk": peak, "failed": failed,
            "alerts": alerts}
