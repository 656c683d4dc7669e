"""Live scoring: from a GPU fleet's recent telemetry to risk, top signals and health state per GPU.

The collector calls this every scoring round with the last ``HISTORY_S`` of samples and events; it runs
the same feature function as training, so a live risk is what the evaluation measured.
"""
from __future__ import annotations

import pandas as pd

from gpuwatch.models.features import HISTORY_S, features
from gpuwatch.models.model import FailureModel
from gpuwatch.models.rules import states

__all__ = ["HISTORY_S", "assess"]


def assess(model: FailureModel, samples: pd.DataFrame, events: pd.DataFrame, *, at: int | pd.Timestamp,
           k_signals: int = 3) -> pd.DataFrame:
    """One row per GPU seen before ``at``: node, gpu_index, t_ms, job_id, risk, signals, state, reasons."""
    feats = features(samples, events, at=at, step_s=model.step_s)
    health = states(feats)
    return pd.DataFrame({
        "node": feats["node"].to_numpy(), "gpu_index": feats["gpu_index"].to_numpy(),
        "t_ms": feats["t_ms"].to_numpy(), "job_id": feats["job_id"].fillna("").to_numpy(),
        "risk": model.risk(feats), "signals": model.top_signals(feats, k_signals) if len(feats) else [],
        "state": health["state"].to_numpy(), "reasons": health["reasons"].to_numpy(),
    })
