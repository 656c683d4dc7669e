"""Rule baseline after DCGM health checks (docs/background.md §3): a health state per GPU with reasons, and a
continuous rule score that can be tuned to an alert budget like the model.

Each rule is a DCGM health threshold applied to a *rate over a window* (the feature windows, 1 h) rather
than to a cumulative count: the ratio of the observed rate to DCGM's limit (PCIe replays per minute over
ceil(rate/lane x lanes), NVLink CRC errors per minute, violation seconds per minute, ...). A ratio of 1 is
DCGM's WARN (or FAIL) line. The rule score is the largest log2 ratio over the rules (FAIL rules count 8x),
squashed to (0, 1): one threshold on it scales every DCGM limit by the same factor, which is how the
baseline is tuned to the same false-alarm budget as the model (models/evaluate.py), so that beating it
means something. The rules read the same feature rows as the model (models/features.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from gpuwatch.core.vocabulary import FAIL, OK, WARN
from gpuwatch.models.features import features, pcie_replay_limit_per_min

__all__ = ["RULES", "health", "pcie_replay_limit_per_min", "rule_ratios", "rule_scores", "states"]

#: log2 bonus of a FAIL rule: a FAIL finding at its limit scores like a WARN finding 8x over its limit.
_FAIL_BONUS = 3.0
_FLOOR = -20.0  # log2 ratio of "nothing found"


def _per_min(f: pd.DataFrame, short: str) -> pd.Series:
    """Growth per minute over the last hour of a counter feature (features keep log1p of the growth)."""
    return np.expm1(f[f"{short}_log1h"]) / 60


@dataclass(frozen=True)
class Rule:
    name: str
    severity: str
    reason: str
    ratio: Callable[[pd.DataFrame], pd.Series]  # observed rate / DCGM limit; >= 1 is a finding


RULES: tuple[Rule, ...] = (
    Rule("dbe", FAIL, "uncorrectable ECC error in the last hour", lambda f: np.expm1(f["dbe_log1h"])),
    Rule("remap_failure", FAIL, "row-remap failure (RMA path)", lambda f: f["remap_failure"]),
    Rule("nvlink_replay", FAIL, "NVLink replay/recovery errors", lambda f: np.expm1(f["nvlink_replay_log1h"])),
    Rule("nvlink_crc_storm", FAIL, "NVLink CRC errors >= 100/s", lambda f: _per_min(f, "nvlink_crc") / 6000),
    Rule("fatal_xid", FAIL, "fatal hardware XID in the last hour", lambda f: f["xid_fatal_1h"]),
    Rule("remap_pending", WARN, "row remap or page retirement pending",
         lambda f: np.maximum(f["remap_pending"].fillna(0), f["retired_pending"].fillna(0))),
    Rule("pcie_replay", WARN, "PCIe replay rate over the DCGM limit", lambda f: f["pcie_replay_over_limit"] * 1.0001),
    Rule("pcie_downgrade", WARN, "PCIe link below its maximum width or generation",
         lambda f: 2.0 ** (8 * (1 - np.fmin(f["pcie_width_ratio"], f["pcie_gen_ratio"]).fillna(1)))
         * (np.fmin(f["pcie_width_ratio"], f["pcie_gen_ratio"]).fillna(1) < 1)),
    Rule("nvlink_crc", WARN, "NVLink CRC errors (per minute)", lambda f: _per_min(f, "nvlink_crc")),
    Rule("thermal_violation", WARN, "thermal violation time grew", lambda f: _per_min(f, "throttle_thermal")),
    Rule("power_violation", WARN, "power violation time grew", lambda f: _per_min(f, "throttle_power")),
    Rule("warn_xid", WARN, "XID 31/32/43/63/92 in the last hour",
         lambda f: f["xid_precursor_1h"] + f["xid_app_1h"]),
)


def rule_ratios(feats: pd.DataFrame) -> pd.DataFrame:
    """One column per rule: observed rate over DCGM's limit (0 where nothing is seen)."""
    return pd.DataFrame({r.name: pd.Series(r.ratio(feats), index=feats.index).fillna(0.0).astype(float).to_numpy()
                         for r in RULES}, index=feats.index)


def rule_scores(feats: pd.DataFrame) -> np.ndarray:
    """Baseline score per feature row in (0, 1): sigmoid of the largest log2(ratio) (+3 for FAIL rules)."""
    ratios = rule_ratios(feats).to_numpy()
    with np.errstate(divide="ignore"):
        log_ratio = np.maximum(np.log2(ratios), _FLOOR)
    bonus = np.array([_FAIL_BONUS if r.severity == FAIL else 0.0 for r in RULES])
    raw = (log_ratio + bonus).max(axis=1) if len(feats) else np.zeros(0)
    return 1.0 / (1.0 + np.exp(-raw))


def states(feats: pd.DataFrame) -> pd.DataFrame:
    """node, gpu_index, t_ms, state ('ok'/'warn'/'fail') and reasons (list of str) per feature row: DCGM's own
    limits (ratio >= 1), untuned."""
    found = rule_ratios(feats).to_numpy() >= 1.0
    reasons = [[r.reason for r, hit in zip(RULES, row) if hit] for row in found]
    fail = np.array([r.severity == FAIL for r in RULES])
    state = np.where((found & fail).any(axis=1), FAIL, np.where(found.any(axis=1), WARN, OK))
    return pd.DataFrame({"node": feats["node"].to_numpy(), "gpu_index": feats["gpu_index"].to_numpy(),
                         "t_ms": feats["t_ms"].to_numpy(), "state": state, "reasons": reasons})


def health(samples: pd.DataFrame, events: pd.DataFrame, *, at: int | pd.Timestamp) -> pd.DataFrame:
    """Health of every GPU at ``at`` from its recent samples and events (pass >= 24 h of history)."""
    return states(features(samples, events, at=at))
