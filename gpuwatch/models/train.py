"""Training the failure classifier: gradient boosting with class weights, calibrated on a later block.

Rows are split in time (labels.time_split): the classifier learns on the train block, is calibrated
(Platt sigmoid: it keeps the ranking fine-grained where isotonic steps would merge scores) on the
validation block. Training accepts any recording or store: features that the data cannot give (their
fields never recorded, always empty or constant) are left out of the model, and too few faults is an error
rather than a model that scores every GPU the same. Several data sets (fleets of different configurations)
can be trained on together; each is split in time on its own.

The saved threshold meets the false-alarm budget on the validation block of every training data set (the
highest of theirs: the worst fleet's); it is only the start value of
the online calibration (models/calibration.py) that live alerts and `gpuwatch score` use. The rule
baseline's threshold for the same budget is chosen on the training data too and saved beside it, so the
side-by-side evaluation never picks a threshold on the data it evaluates. The test block is left for
`gpuwatch evaluate`.
"""
from __future__ import annotations

import time
import warnings

import numpy as np
import pandas as pd
from sklearn.calibration import CalibratedClassifierCV
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.frozen import FrozenEstimator
from sklearn.inspection import permutation_importance

from gpuwatch.core.errors import UserError
from gpuwatch.core.settings import DEFAULT_FALSE_ALARM_BUDGET
from gpuwatch.models.dataset import Dataset
from gpuwatch.models.evaluate import block_faults, predictor_metrics, threshold_for_budget
from gpuwatch.models.features import feature_names, monotone_direction
from gpuwatch.models.labels import Split, in_block, time_split
from gpuwatch.models.model import FailureModel, TrainingRecord, probabilities
from gpuwatch.models.rules import rule_scores
from gpuwatch.core.progress import Progress

MAX_POSITIVE_WEIGHT = 50.0
AMBIGUOUS_BEFORE_FAULT_S = 24 * 3600
#: The classifier is fitted on "a fault within this long" (or the horizon, if longer): a 1-h horizon at a
#: 10-min step leaves about six positive rows per fault, too few to learn a precursor's shape from; the
#: hours before give the rising part of it. Calibration and thresholds still use the horizon's own labels.
FIT_HORIZON_S = 3 * 3600
#: Fewer fault episodes than this in the train block (or none in validation) cannot be learned from.
MIN_TRAIN_FAULTS = 3


def fit_labels(rows: pd.DataFrame, horizon_s: float, warning_s: float) -> np.ndarray:
    """1 where a fault of the GPU starts in (t + warning, t + max(horizon, FIT_HORIZON_S)], else 0."""
    until = rows["next_fault_ms"].to_numpy() - rows["t_ms"].to_numpy()
    return ((until > warning_s * 1000) & (until <= max(horizon_s, FIT_HORIZON_S) * 1000)).astype(np.int8)


def _usable(rows: pd.DataFrame, block: tuple[int, int], horizon_s: float) -> pd.DataFrame:
    """Uncensored rows of a block, without the ambiguous negatives of a GPU already on its way to a fault.

    Rows between ``horizon_s`` (the fit horizon when fitting) and ``AMBIGUOUS_BEFORE_FAULT_S`` before a fault
    are labelled negative, yet the GPU is degrading then; fitting on them teaches the model to ignore the
    signs it should raise. They are left out of fitting and calibration only; evaluation scores every row.
    """
    until = rows["next_fault_ms"].to_numpy() - rows["t_ms"].to_numpy()
    ambiguous = (until > horizon_s * 1000) & (until <= AMBIGUOUS_BEFORE_FAULT_S * 1000)
    return rows[in_block(rows, block) & ~rows["censored"].to_numpy() & ~ambiguous]


def informative_features(train: pd.DataFrame, names: list[str]) -> tuple[list[str], list[str]]:
    """(kept, dropped): a feature that is always missing or constant in the train block carries nothing."""
    x = train[names]
    dropped = [n for n in names if x[n].nunique(dropna=True) <= 1]
    return [n for n in names if n not in dropped], dropped


def _check_faults(ds: Dataset, split: Split) -> None:
    """A UserError naming the data when its blocks hold too few faults to learn from."""
    n_train = len(block_faults(ds.episodes, split.train, ds.horizon_s))
    n_val = len(block_faults(ds.episodes, split.validation, ds.horizon_s))
    if n_train < MIN_TRAIN_FAULTS or n_val < 1:
        raise UserError(f"{ds.source.path}: too few faults to learn from: {n_train} fault episodes in the training "
                        f"60% and {n_val} in the validation 20% (need >= {MIN_TRAIN_FAULTS} and >= 1; faults are "
                        "fatal XIDs 48/79/94/95/..., GPU lost, DBE, remap failure): give a longer recording or "
                        "more GPUs (or simulate with a higher --fault-rate-multiplier)")


#: What train_model does, in order (its progress counts them).
STAGES = ("fit", "calibrate", "importance", "threshold")


def train_model(data: Dataset | list[Dataset], *, false_alarm_budget: float = DEFAULT_FALSE_ALARM_BUDGET,
                seed: int = 0, description: str = "", quiet: bool = False, prior: list[Dataset] | None = None,
                prior_name: str = "none") -> FailureModel:
    """Fit, calibrate and pick the start threshold; returns the model that save_model writes. Progress
    by stage (STAGES) on a terminal unless ``quiet``.

    ``prior``: data sets learnt from beside ``data`` (simulated fleets: simulator/prior.py), named
    ``prior_name`` in the training record. ``data`` then need not hold enough faults on its own; its rows are
    weighted up to as much weight in all as the prior's (site_weight), and only the features it gives are used."""
    own = data if isinstance(data, list) else [data]
    sets = own + list(prior or [])
    splits = [time_split(ds.source.start_ms, ds.source.end_ms, horizon_s=ds.horizon_s) for ds in sets]
    for ds, split in zip(sets, splits) if not prior else ():
        _check_faults(ds, split)
    for ds in own if prior else ():  # the prior teaches the ranking; a fault-free recording is still no site data
        if ds.episodes.empty:
            raise UserError(f"{ds.source.path}: too few faults to learn from: no fault episode in it (need >= 1 "
                            "beside the simulated prior; faults are fatal XIDs 48/79/94/95/..., GPU lost, DBE, remap "
                            "failure): give a longer recording or more GPUs, or use the shipped model")
    blocks = [(_usable(ds.rows, sp.train, max(ds.horizon_s, FIT_HORIZON_S)).assign(
        fit_label=lambda r, ds=ds: fit_labels(r, ds.horizon_s, ds.warning_s)),
        _usable(ds.rows, sp.validation, ds.horizon_s)) for ds, sp in zip(sets, splits)]
    n_own = len(own)
    weight = site_weight(sum(len(t) + len(v) for t, v in blocks[:n_own]),
                         sum(len(t) + len(v) for t, v in blocks[n_own:]))
    train = pd.concat([t.assign(weight=weight if k < n_own else 1.0) for k, (t, _) in enumerate(blocks)],
                      ignore_index=True)
    val = pd.concat([v.assign(weight=weight if k < n_own else 1.0) for k, (_, v) in enumerate(blocks)],
                    ignore_index=True)
    for block, rows in (("train", train), ("validation", val)):
        if rows["label"].sum() < 2 or (rows["label"] == 0).sum() < 2:
            raise UserError(f"{sets[0].source.path}: the {block} block has {int(rows['label'].sum())} positive rows; "
                            "need faults in it (more data, or simulate with a higher --fault-rate-multiplier)")
    own_train = pd.concat([t for t, _ in blocks[:n_own]], ignore_index=True)
    # A feature the site's data cannot give is left out even where the prior gives it: at the site it would
    # always be missing, a case the prior never taught.
    names, dropped = informative_features(own_train, feature_names())
    if not names:
        raise UserError(f"{sets[0].source.path}: no feature varies in the training block (every telemetry field "
                        "the model reads is empty or constant there): nothing to learn warning signs from")
    with Progress("train", total=len(STAGES), unit="stages", quiet=quiet) as progress:
        started = time.monotonic()
        y, w = train["fit_label"].to_numpy(), train["weight"].to_numpy()
        pos_weight = min(MAX_POSITIVE_WEIGHT, w[y == 0].sum() / max(w[y == 1].sum(), 1e-9))
        clf = HistGradientBoostingClassifier(max_iter=200, learning_rate=0.08, max_leaf_nodes=15,
                                             min_samples_leaf=40, l2_regularization=1.0,
                                             class_weight={0: 1.0, 1: pos_weight}, random_state=seed,
                                             monotonic_cst=[monotone_direction(n) for n in names])
        clf.fit(train[names].to_numpy(float), y, sample_weight=w)
        progress.advance()
        calibrated = CalibratedClassifierCV(FrozenEstimator(clf), method="sigmoid")
        with warnings.catch_warnings():  # the weights are meant for the sigmoid alone: the classifier is fitted
            warnings.filterwarnings("ignore", message="Since FrozenEstimator does not appear to accept sample_weight")
            calibrated.fit(val[names].to_numpy(float), val["label"].to_numpy(),
                           sample_weight=val["weight"].to_numpy())
        progress.advance()
        first, split = sets[0], splits[0]
        reference = _reference(own_train, names)
        importance = _importance(calibrated, val, names, seed)
        progress.advance()
        val_scores = probabilities(calibrated, names, val)
        if np.ptp(val_scores) < 1e-9:
            raise UserError(f"{first.source.path}: the trained model scores every GPU the same "
                            f"({val_scores[0]:.3g}); the data holds no usable warning signs of its faults")
        # The start threshold of the worst training fleet: it holds until the online calibration has the new
        # fleet's own tail, and a fleet whose false-alarm tail is longer than the median one's overran the budget.
        threshold = float(np.max([threshold_for_budget(ds, probabilities(calibrated, names, ds.rows), sp.validation,
                                                       false_alarm_budget)
                                  for ds, sp in zip(sets, splits)]))
        baseline_threshold = float(np.median([
            threshold_for_budget(ds, rule_scores(ds.rows), sp.validation, false_alarm_budget)
            for ds, sp in zip(own, splits)]))  # the rules are not learnt: chosen on the site's data alone
        validation_metrics = predictor_metrics(first, probabilities(calibrated, names, first.rows), split.validation,
                                               threshold=threshold, budget=None)
        training = TrainingRecord(
            source=", ".join(str(ds.source.path) for ds in own),
            fingerprint="+".join(ds.source.fingerprint for ds in own), train_ms=split.train,
            validation_ms=split.validation, test_ms=split.test, rows=len(train), positives=int(y.sum()),
            dropped_features=tuple(dropped), false_alarm_budget=false_alarm_budget,
            seconds=round(time.monotonic() - started, 1), prior=prior_name, site_weight=round(weight, 3))
        model = FailureModel(
            estimator=calibrated, features=tuple(names), horizon_s=first.horizon_s, warning_s=first.warning_s,
            step_s=first.step_s, threshold=threshold, baseline_threshold=baseline_threshold,
            healthy_median=tuple(reference["median"]), healthy_spread=tuple(reference["spread"]),
            importance=tuple(importance), training=training, validation_metrics=validation_metrics,
            description=description)
        progress.advance()
    return model


def site_weight(own_rows: int, prior_rows: int) -> float:
    """Weight of each of the site's rows: the site as heavy in all as the prior (never below one row's weight),
    so a short recording is not drowned by the simulated fleets and a long one does not drown them."""
    return max(1.0, prior_rows / max(own_rows, 1))


def _reference(train: pd.DataFrame, names: list[str]) -> dict[str, list[float]]:
    """Healthy-fleet median and spread per feature (for top_signals)."""
    healthy = train.loc[train["fit_label"] == 0, names]
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
