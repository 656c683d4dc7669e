"""Rule baseline after DCGM health checks (nvml-and-dcgm.md §7): a health state per GPU with reasons.

The rules read the same feature rows as the model (models/features.py), so they run over a whole
recording at once and are evaluated as a predictor beside the model (a score per feature row), and they
run live on the latest row of each GPU. Windows are the feature windows (1 h) rather than DCGM's 60 s.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from gpuwatch.models.features import features

OK, WARN, FAIL = "ok", "warn", "fail"
_SEVERITY = {WARN: 0.5, FAIL: 1.0}


def pcie_replay_limit_per_min(gen: pd.Series, width: pd.Series) -> pd.Series:
    """DCGM's PCIe replay limit: ceil(rate per lane x lanes), 0.96/lane at Gen4, 1.92/lane at Gen5."""
    per_lane = np.where(gen >= 5, 1.92, 0.96)
    return pd.Series(np.ceil(per_lane * width.fillna(16).to_numpy()), index=gen.index)


@dataclass(frozen=True)
class Rule:
    name: str
    severity: str
    reason: str
    test: Callable[[pd.DataFrame], pd.Series]


RULES: tuple[Rule, ...] = (
    Rule("dbe", FAIL, "uncorrectable ECC error in the last hour", lambda f: f["dbe_d1h"] > 0),
    Rule("remap_failure", FAIL, "row-remap failure (RMA path)", lambda f: f["remap_failure"] > 0),
    Rule("nvlink_replay", FAIL, "NVLink replay/recovery errors", lambda f: f["nvlink_replay_d1h"] >= 1),
    Rule("nvlink_crc_storm", FAIL, "NVLink CRC errors >= 100/s", lambda f: f["nvlink_crc_d1h"] >= 100 * 3600),
    Rule("fatal_xid", FAIL, "fatal hardware XID in the last hour", lambda f: f["xid_fatal_1h"] > 0),
    Rule("remap_uncorrectable", WARN, "512 or more rows remapped for uncorrectable errors",
         lambda f: f["remap_uncorrectable"] >= 512),
    Rule("remap_pending", WARN, "row remap or page retirement pending",
         lambda f: (f["remap_pending"] > 0) | (f["retired_pending"] > 0)),
    Rule("pcie_replay", WARN, "PCIe replay rate over the DCGM limit",
         lambda f: f["pcie_replay_d1h"] / 60 > pcie_replay_limit_per_min(f["pcie_gen"], f["pcie_width"])),
    Rule("pcie_downgrade", WARN, "PCIe link below its maximum width or generation",
         lambda f: (f["pcie_width_ratio"] < 1) | (f["pcie_gen_ratio"] < 1)),
    Rule("nvlink_crc", WARN, "NVLink CRC errors", lambda f: f["nvlink_crc_d1h"] >= 1),
    Rule("thermal_violation", WARN, "thermal violation time grew", lambda f: f["throttle_thermal_d1h"] > 0),
    Rule("power_violation", WARN, "power violation time grew", lambda f: f["throttle_power_d1h"] > 0),
    Rule("warn_xid", WARN, "XID 31/32/43/63/94 in the last hour",
         lambda f: (f["xid_precursor_1h"] > 0) | (f["xid_app_1h"] > 0)),
)


def rule_findings(feats: pd.DataFrame) -> pd.DataFrame:
    """One boolean column per rule, one row per feature row."""
    return pd.DataFrame({r.name: r.test(feats).fillna(False).astype(bool).to_numpy() for r in RULES},
                        index=feats.index)


def rule_scores(feats: pd.DataFrame) -> np.ndarray:
    """Baseline score per feature row: the worst severity (warn 0.5, fail 1), plus 0.01 per extra finding."""
    found = rule_findings(feats)
    sev = np.array([_SEVERITY[r.severity] for r in RULES])
    worst = (found.to_numpy() * sev).max(axis=1) if len(RULES) else np.zeros(len(feats))
    return worst + 0.01 * np.maximum(found.sum(axis=1).to_numpy() - 1, 0)


def states(feats: pd.DataFrame) -> pd.DataFrame:
    """node, gpu_index, t_ms, state ('ok'/'warn'/'fail') and reasons (list of str) per feature row."""
    found = rule_findings(feats)
    reasons = [[r.reason for r, hit in zip(RULES, row) if hit] for row in found.to_numpy()]
    score = rule_scores(feats)
    state = np.where(score >= 1.0, FAIL, np.where(score >= 0.5, WARN, OK))
    return pd.DataFrame({"node": feats["node"].to_numpy(), "gpu_index": feats["gpu_index"].to_numpy(),
                         "t_ms": feats["t_ms"].to_numpy(), "state": state, "reasons": reasons})


def health(samples: pd.DataFrame, events: pd.DataFrame, *, at: int | pd.Timestamp) -> pd.DataFrame:
    """Health of every GPU at ``at`` from its recent samples and events (pass >= 24 h of history)."""
    return states(features(samples, events, at=at))

