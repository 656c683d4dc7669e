"""Training the failure classifier: gradient boosting with class weights, calibrated on a later block.

Rows are split in time (labels.time_split): the classifier learns on the train block, is calibrated
(Platt sigmoid: it keeps the ranking fine-grained where isotonic steps would merge scores) on the
validation block. The alert threshold is chosen by cost: the break-even precision of an extra checkpoint
(models/advisor.py), raised if needed until the validation false-alarm rate fits a budget. The test block
is left for `gpuwatch evaluate`.
"""
from __future__ import annotations

import time

import numpy as np
import pandas as pd
from sklearn.calibration import CalibratedClassifierCV
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.frozen import FrozenEstimator
from sklearn.inspection import permutation_importance

from gpuwatch import __version__
from gpuwatch.errors import UserError
from gpuwatch.models.advisor import break_even_precision_checkpoint, job_mtbf_s, young_interval_s
from gpuwatch.models.dataset import Dataset
from gpuwatch.models.evaluate import metrics, scored_block, threshold_for_false_alarms
from gpuwatch.models.features import feature_names
from gpuwatch.models.labels import Split, in_block, time_split
from gpuwatch.models.model import MODEL_FORMAT, MODEL_VERSION, score
from gpuwatch.progress import Progress

DEFAULT_FALSE_ALARM_BUDGET = 2.0  # per 1,000 GPU-days, on the validation block
#: Alert when P(fault within the horizon) beats the break-even precision of a 5-min extra checkpoint for a
#: 16,384-GPU job at the Llama 3 failure rate (Young interval 43 min): p > 2 C_p / T ~ 0.23.
COST_THRESHOLD = break_even_precision_checkpoint(300, young_interval_s(300, job_mtbf_s(16384)))
MAX_POSITIVE_WEIGHT = 50.0
AMBIGUOUS_BEFORE_FAULT_S = 24 * 3600


def _usable(rows: pd.DataFrame, block: tuple[int, int], horizon_s: float) -> pd.DataFrame:
    """Uncensored rows of a block, without the ambiguous negatives of a GPU already on its way to a fault.

    Rows between one horizon and ``AMBIGUOUS_BEFORE_FAULT_S`` before a fault are labelled negative, yet the
    GPU is degrading then; fitting on them teaches the model to ignore the signs it should raise. They are
    left out of fitting and calibration only; evaluation scores every row.
    """
    until = rows["next_fault_ms"].to_numpy() - rows["t_ms"].to_numpy()
    ambiguous = (until > horizon_s * 1000) & (until <= AMBIGUOUS_BEFORE_FAULT_S * 1000)
    return rows[in_block(rows, block) & ~rows["censored"].to_numpy() & ~ambiguous]


#: What train_model does, in order (its progress counts them).
STAGES = ("fit", "calibrate", "importance", "threshold")


def train_model(ds: Dataset, *, false_alarm_budget: float = DEFAULT_FALSE_ALARM_BUDGET, seed: int = 0,
                description: str = "", quiet: bool = False) -> dict:
    """Fit, calibrate and pick the threshold; returns the model dict that save_model writes. Progress by
    stage (STAGES) on a terminal unless ``quiet``."""
    split = time_split(ds.source.start_ms, ds.source.end_ms, horizon_s=ds.horizon_s)
    names = feature_names()
    train, val = (_usable(ds.rows, block, ds.horizon_s) for block in (split.train, split.validation))
    for block, rows in (("train", train), ("validation", val)):
        if rows["label"].sum() < 2 or (rows["label"] == 0).sum() < 2:
            raise UserError(f"{ds.source.path}: the {block} block has {int(rows['label'].sum())} positive rows; "
                            "need faults in it (more data, or simulate with a higher --fault-rate-multiplier)")
    with Progress("train", total=len(STAGES), unit="stages", quiet=quiet) as progress:
        started = time.monotonic()
        y = train["label"].to_numpy()
        pos_weight = min(MAX_POSITIVE_WEIGHT, (y == 0).sum() / max(y.sum(), 1))
        clf = HistGradientBoostingClassifier(max_iter=200, learning_rate=0.08, max_leaf_nodes=15,
                                             min_samples_leaf=40, l2_regularization=1.0,
                                             class_weight={0: 1.0, 1: pos_weight}, random_state=seed)
        clf.fit(train[names].to_numpy(float), y)
        progress.advance()
        calibrated = CalibratedClassifierCV(FrozenEstimator(clf), method="sigmoid")
        calibrated.fit(val[names].to_numpy(float), val["label"].to_numpy())
        progress.advance()
        model = {
            "format": MODEL_FORMAT, "version": MODEL_VERSION, "gpuwatch_version": __version__,
            "estimator": calibrated, "features": names, "horizon_s": ds.horizon_s, "warning_s": ds.warning_s,
            "step_s": ds.step_s, "description": description,
            "training": {"source": str(ds.source.path), "fingerprint": ds.source.fingerprint,
                         "train_ms": list(split.train), "validation_ms": list(split.validation),
                         "test_ms": list(split.test), "rows": len(train), "positives": int(y.sum())},
            "reference": _reference(train, names),
            "importance": _importance(calibrated, val, names, seed),
        }
        progress.advance()
        block = scored_block(ds.rows, ds.episodes, score(model, ds.rows), split.validation,
                             horizon_s=ds.horizon_s, warning_s=ds.warning_s, step_s=ds.step_s)
        model["threshold"] = max(COST_THRESHOLD, threshold_for_false_alarms(block, false_alarm_budget))
        model["validation_metrics"] = metrics(block, model["threshold"])
        model["training"]["seconds"] = round(time.monotonic() - started, 1)
        progress.advance()
    return model


def _reference(train: pd.DataFrame, names: list[str]) -> dict:
    """Healthy-fleet median and spread per feature (for top_signals)."""
    healthy = train.loc[train["label"] == 0, names]
    median = healthy.median().fillna(0.0)
    q = healthy.quantile([0.05, 0.95])
    spread = (q.loc[0.95] - q.loc[0.05]).fillna(0.0)
    spread = spread.where(spread > 0, healthy.std().fillna(0.0)).where(lambda s: s > 0, 1.0)
    return {"median": median.tolist(), "spread": spread.tolist()}


def _importance(est: CalibratedClassifierCV, val: pd.DataFrame, names: list[str], seed: int) -> list[float]:
    """Permutation importance (drop in average precision) on a sample of the validation block."""
    pos = val[val["label"] == 1]
    neg = val[val["label"] == 0].sample(min(len(val) - len(pos), 20 * len(pos) + 2000), random_state=seed)
    sample = pd.concat([pos, neg])
    r = permutation_importance(est, sample[names].to_numpy(float), sample["label"].to_numpy(),
                               scoring="average_precision", n_repeats=2, random_state=seed)
    return np.round(r.importances_mean, 6).tolist()


def split_of(model: dict) -> Split:
    t = model["training"]
    return Split(tuple(t["train_ms"]), tuple(t["validation_ms"]), tuple(t["test_ms"]))
