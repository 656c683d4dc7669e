"""When a risk score turns into an alert, and when the alert ends: one rule for live alerts and evaluation.

An alert fires when the risk reaches ``threshold`` and resolves once the risk has stayed below
``resolve_fraction`` x threshold for ``keep_firing_for_s`` (hysteresis plus Prometheus-style
keep_firing_for), so a GPU whose risk wavers around the threshold raises one alert, not many. The alert
engine (collector/alerts.py) steps it per observation; the evaluation (models/evaluate.py) applies the
same rule to whole score series at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd


@dataclass(frozen=True)
class AlertPolicy:
    threshold: float
    resolve_fraction: float = 0.5
    keep_firing_for_s: float = 7200.0

    @property
    def resolve_below(self) -> float:
        return self.threshold * self.resolve_fraction

    def step(self, active: bool, risk: float, now_ms: int, last_high_ms: int | None) -> tuple[bool, int | None]:
        """(active, last_high_ms) after one observation; ``last_high_ms`` = last time risk was not below resolve."""
        if risk >= self.resolve_below:
            last_high_ms = now_ms
        if risk >= self.threshold:
            return True, last_high_ms
        if active and (last_high_ms is None or now_ms - last_high_ms >= self.keep_firing_for_s * 1000):
            return False, last_high_ms
        return active, last_high_ms

    def active_mask(self, t_ms: np.ndarray, risk: np.ndarray, restart: np.ndarray) -> np.ndarray:
        """Alert state per row of score series sorted by time; ``restart`` marks each series' first row."""
        high = risk >= self.resolve_below
        segment = np.cumsum(restart)
        last_high = pd.Series(np.where(high, t_ms, np.nan)).groupby(segment).ffill().to_numpy()
        resolved = ~high & (np.isnan(last_high) | (t_ms - last_high >= self.keep_firing_for_s * 1000))
        state = np.where(risk >= self.threshold, 1.0, np.where(resolved, 0.0, np.nan))
        state[restart & np.isnan(state)] = 0.0
        return pd.Series(state).ffill().to_numpy() == 1.0
