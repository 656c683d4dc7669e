"""When a risk score turns into an alert, and when the alert ends: one rule for live alerts and evaluation.

An alert fires when the risk reaches ``threshold`` and resolves once the risk has stayed below
``resolve_fraction`` x threshold for ``keep_firing_for_s`` (hysteresis plus Prometheus-style
keep_firing_for), so a GPU whose degradation goes on keeps one alert until it fails or recovers instead of
lapsing and firing again. A fault of the GPU ends its alert (the GPU failed; the next alert is a new one).
The threshold may change from one observation to the next: with an alert budget it is recalibrated on the
fleet's recent scores (models/calibration.py). The alert engine (collector/alerts.py) steps the policy per
observation; the evaluation and `gpuwatch score` (models/alerting.py) apply the same rule to whole score
series at once.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

#: Degradation of a failing GPU comes and goes over hours (a precursor's errors arrive in bursts); an
#: alert survives that long below its resolve level before it counts as recovered.
KEEP_FIRING_FOR_S = 4 * 3600.0


@dataclass(frozen=True)
class AlertPolicy:
    threshold: float
    resolve_fraction: float = 0.5
    keep_firing_for_s: float = KEEP_FIRING_FOR_S

    @property
    def resolve_below(self) -> float:
        return self.threshold * self.resolve_fraction

    def with_threshold(self, threshold: float) -> AlertPolicy:
        """The same policy at a recalibrated threshold."""
        return replace(self, threshold=float(threshold))

    def step(self, active: bool, risk: float, now_ms: int, last_high_ms: int | None) -> tuple[bool, int | None]:
        """(active, last_high_ms) after one observation; ``last_high_ms`` = last time risk was not below resolve."""
        if risk >= self.resolve_below:
            last_high_ms = now_ms
        if risk >= self.threshold:
            return True, last_high_ms
        if active and (last_high_ms is None or now_ms - last_high_ms >= self.keep_firing_for_s * 1000):
            return False, last_high_ms
        return active, last_high_ms

    def active_mask(self, t_ms: np.ndarray, risk: np.ndarray, restart: np.ndarray,
                    threshold: np.ndarray | None = None) -> np.ndarray:
        """Alert state per row of score series sorted by time; ``restart`` marks each series' first row (a new
        GPU, a gap, or the first row after a fault), which ends any alert. ``threshold`` gives each row's
        threshold (default: the policy's), as :meth:`step` would see it row by row."""
        thr = np.full(len(risk), self.threshold) if threshold is None else np.asarray(threshold, float)
        high = risk >= thr * self.resolve_fraction
        segment = np.cumsum(restart)
        last_high = pd.Series(np.where(high, t_ms, np.nan)).groupby(segment).ffill().to_numpy()
        resolved = ~high & (np.isnan(last_high) | (t_ms - last_high >= self.keep_firing_for_s * 1000))
        state = np.where(risk >= thr, 1.0, np.where(resolved, 0.0, np.nan))
        state[restart & np.isnan(state)] = 0.0
        return pd.Series(state).ffill().to_numpy() == 1.0
