"""Checkpoint advisor: how often to checkpoint given the failure rate, and what a failure predictor changes.

Formulas from docs/background.md §5: Young (1974) and Daly (2006) intervals from the job's MTBF M and
checkpoint cost C; with a predictor of recall r, precision p and proactive action cost C_p (Aupy et al.,
JPDC 2014) the interval becomes sqrt(2MC/(1-r)); an alert is worth acting on iff its precision beats a
break-even value, which is the natural alert threshold for a calibrated risk score.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gpuwatch.core import events as event_kinds
from gpuwatch.models.faults import LLAMA3_FAULTS_PER_GPU_HOUR
from gpuwatch.models.reliability import GPU_FAULTS_PER_GPU_HOUR, logged_episodes

#: What a rate counts (``rate.counts`` of `gpuwatch advise`).
ALL_INTERRUPTIONS = "all interruptions"
GPU_FAULTS = "GPU faults"
WHY_ALL = ("a checkpoint protects against every interruption that stops the job, not only GPU faults: Llama 3 "
           "counted 1.97e-5 per GPU-hour (0.47 per 1,000 GPU-days) of all causes, where GPU faults alone are "
           "about 0.145 (Titan 0.149, StepFun 0.142); a failure predictor sees only the GPU share")

#: Recalls `gpuwatch advise` always tabulates (docs/background.md §5).
DEFAULT_RECALLS = (0.0, 0.5, 0.8, 0.9)


def job_mtbf_s(n_gpus: int, faults_per_gpu_hour: float = LLAMA3_FAULTS_PER_GPU_HOUR) -> float:
    """Mean time between failures of a job on ``n_gpus`` GPUs (independent failures), seconds."""
    if n_gpus <= 0 or faults_per_gpu_hour <= 0:
        raise ValueError("n_gpus and faults_per_gpu_hour must be positive")
    return 3600.0 / (n_gpus * faults_per_gpu_hour)


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young: T = sqrt(2 C M)."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly: T = sqrt(2CM)[1 + sqrt(C/2M)/3 + (C/2M)/9] - C for C < 2M, else M."""
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2 * mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_s


def predicted_interval_s(checkpoint_s: float, mtbf_s: float, recall: float) -> float:
    """With a predictor catching a share ``recall`` of failures: T* = sqrt(2 M C / (1 - r))."""
    if not 0 <= recall < 1:
        raise ValueError("recall must be in [0, 1)")
    return math.sqrt(2 * mtbf_s * checkpoint_s / (1 - recall))


def waste(checkpoint_s: float, interval_s: float, mtbf_s: float, *, recall: float = 0.0, precision: float = 1.0,
          action_s: float = 0.0, downtime_s: float = 0.0, restart_s: float = 0.0) -> float:
    """Share of time lost: C/T + (1-r)(T/2 + D + R)/M + r C_p/(p M)."""
    lost = (1 - recall) * (interval_s / 2 + downtime_s + restart_s) / mtbf_s
    alerts = recall * action_s / (precision * mtbf_s) if recall else 0.0
    return checkpoint_s / interval_s + lost + alerts


def break_even_precision_checkpoint(action_s: float, interval_s: float) -> float:
    """An extra checkpoint on alert saves ~T/2 per true alert: worth it iff p > 2 C_p / T."""
    return 2 * action_s / interval_s


def break_even_precision_drain(action_s: float, interval_s: float, downtime_s: float, restart_s: float) -> float:
    """Draining on alert saves T/2 + D + R per true alert: worth it iff p > C_p / (T/2 + D + R)."""
    return action_s / (interval_s / 2 + downtime_s + restart_s)


@dataclass(frozen=True)
class Advice:
    mtbf_s: float
    young_interval_s: float
    daly_interval_s: float
    waste: float
    interval_with_predictor_s: float
    waste_with_predictor: float
    break_even_precision_checkpoint: float
    break_even_precision_drain: float

    def as_dict(self) -> dict:
        return asdict(self)


def advise(n_gpus: int, checkpoint_s: float, *, faults_per_gpu_hour: float = LLAMA3_FAULTS_PER_GPU_HOUR,
           recall: float = 0.0, precision: float = 1.0, action_s: float = 300.0, downtime_s: float = 600.0,
           restart_s: float = 300.0) -> Advice:
    """Checkpoint interval and waste for a job, without and with a predictor of the given recall/precision."""
    m = job_mtbf_s(n_gpus, faults_per_gpu_hour)
    young = young_interval_s(checkpoint_s, m)
    with_pred = predicted_interval_s(checkpoint_s, m, recall)
    return Advice(
        mtbf_s=m,
        young_interval_s=young,
        daly_interval_s=daly_interval_s(checkpoint_s, m),
        waste=waste(checkpoint_s, young, m),
        interval_with_predictor_s=with_pred,
        waste_with_predictor=waste(checkpoint_s, with_pred, m, recall=recall, precision=precision, action_s=action_s),
        break_even_precision_checkpoint=break_even_precision_checkpoint(action_s, young),
        break_even_precision_drain=break_even_precision_drain(action_s, young, downtime_s, restart_s),
    )


def observed_faults(path: str) -> dict[str, Any]:
    """GPU fault episodes, all episodes (with an imported fault log's other causes) and GPU-hours of exposure
    (each GPU's first to last sample) in a recording or DuckDB store."""
    from gpuwatch.core.recording import open_recording
    from gpuwatch.models.dataset import RecordingSource, open_source
    from gpuwatch.models.faults import fault_events

    gpu, other, gpu_ms = 0, 0, 0
    source = open_source(path)
    for _, samples, events in source.chunks():
        telemetry = events[events["kind"] != event_kinds.FAULT]
        gpu += len(fault_events(telemetry, samples))
        if len(samples):
            ts = samples.groupby(["node", "gpu_index"])["ts"].agg(["min", "max"])
            gpu_ms += int((ts["max"] - ts["min"]).dt.total_seconds().sum() * 1000)
    if isinstance(source, RecordingSource):  # an imported fault log: its faults with their cause
        logged = logged_episodes(open_recording(source.path).table(
            "events", ["node", "gpu_index", "ts", "kind", "attrs"], [("kind", "=", event_kinds.FAULT)]))
        gpu += int(logged["gpu"].sum())
        other += int((~logged["gpu"].astype(bool)).sum())
    return {"gpu": gpu, "all": gpu + other, "gpu_hours": gpu_ms / 3_600_000}


def _observed_rate(data: str) -> dict[str, Any]:
    """The rate a recording or store shows: every interruption where an imported fault log names causes other
    than the GPU, else GPU faults (all that telemetry can see); the published Llama 3 rate if none at all."""
    counts = observed_faults(data)
    hours = counts["gpu_hours"]
    if not counts["all"] or not hours:
        return {"faults_per_gpu_hour": LLAMA3_FAULTS_PER_GPU_HOUR, "fault_episodes": 0, "gpu_hours": round(hours, 1),
                "source": f"published Llama 3 rate: no fault episodes in {data}", "counts": ALL_INTERRUPTIONS,
                "why": WHY_ALL}
    rate: dict[str, Any] = {"source": f"observed in {data}", "gpu_hours": round(hours, 1),
                            "gpu_fault_episodes": counts["gpu"], "gpu_faults_per_gpu_hour": counts["gpu"] / hours}
    if counts["all"] > counts["gpu"]:
        return {"faults_per_gpu_hour": counts["all"] / hours, "fault_episodes": counts["all"], **rate,
                "counts": ALL_INTERRUPTIONS, "why": "the fault log names every cause that took a node out, and a "
                "checkpoint protects against all of them"}
    return {"faults_per_gpu_hour": counts["gpu"] / hours, "fault_episodes": counts["gpu"], **rate,
            "counts": GPU_FAULTS, "why": "the data shows GPU faults only; interruptions from networks, hosts and "
            "software come on top (Llama 3 saw about 3x the GPU fault rate), so the interval is an upper bound"}


def model_recall() -> float | None:
    """The shipped model's event recall on its validation block, if the model is there."""
    from gpuwatch.models.model import default_model_path, load_model

    if not default_model_path().is_file():
        return None
    return float(load_model(None).validation_metrics["event_recall"])


def advice_table(n_gpus: int, checkpoint_s: float, *, failure_rate: float | None = None, data: str | None = None,
                 recalls: Sequence[float] = ()) -> dict:
    """What `gpuwatch advise` reports: the rate and where it came from, Young/Daly intervals and waste, and the
    interval and waste a predictor of each recall allows (0, 0.5, 0.8, 0.9, ``recalls`` and the model's)."""
    if failure_rate is not None:
        rate: dict[str, Any] = {"faults_per_gpu_hour": failure_rate, "source": "given", "counts": "as given"}
    elif data is not None:
        rate = _observed_rate(data)
    else:
        rate = {"faults_per_gpu_hour": LLAMA3_FAULTS_PER_GPU_HOUR, "source": "published Llama 3 rate",
                "counts": ALL_INTERRUPTIONS, "why": WHY_ALL}
    if rate["counts"] == ALL_INTERRUPTIONS:
        rate["gpu_fault_share"] = round(min(1.0, rate.get("gpu_faults_per_gpu_hour", GPU_FAULTS_PER_GPU_HOUR)
                                            / rate["faults_per_gpu_hour"]), 3)
    m = job_mtbf_s(n_gpus, rate["faults_per_gpu_hour"])
    young = young_interval_s(checkpoint_s, m)
    model_r = model_recall()
    rows = []
    for r in sorted(set(DEFAULT_RECALLS) | set(recalls) | ({model_r} if model_r is not None else set())):
        t = predicted_interval_s(checkpoint_s, m, r)
        rows.append({"recall": r, "interval_s": t, "waste": waste(checkpoint_s, t, m, recall=r),
                     **({"model": True} if r == model_r else {})})
    return {"gpus": n_gpus, "checkpoint_s": checkpoint_s, "rate": rate, "mtbf_s": m, "young_interval_s": young,
            "daly_interval_s": daly_interval_s(checkpoint_s, m), "waste": waste(checkpoint_s, young, m),
            "by_recall": rows}
