"""The failure model: a typed object (:class:`FailureModel`) to score and explain with, and its file.

A model file is a skops archive of a plain dict (:meth:`FailureModel.to_dict`): the calibrated classifier
plus its metadata (features, horizon, training range, threshold, metrics, fleet reference statistics). The
dict, not the class, is the file format, so files stay readable whatever this module's classes become.
skops loads only the types in TRUSTED_TYPES, so a model file cannot run arbitrary code the way a pickle can.
"""
from __future__ import annotations

import importlib.abc
import numbers
import os
import sys
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

import numpy as np
import pandas as pd

from gpuwatch import __version__
from gpuwatch.core.errors import UserError
from gpuwatch.models.policy import AlertPolicy

MODEL_FORMAT = "gpuwatch-failure-model"
MODEL_VERSION = 1
#: Every type a gpuwatch model file may contain (checked on load; anything else is refused).
TRUSTED_TYPES: list[str] = [
    "sklearn.calibration.CalibratedClassifierCV",
    "sklearn.calibration._CalibratedClassifier",
    "sklearn.calibration._SigmoidCalibration",
    "sklearn.frozen._frozen.FrozenEstimator",
    "sklearn.isotonic.IsotonicRegression",
    "sklearn.ensemble._hist_gradient_boosting.gradient_boosting.HistGradientBoostingClassifier",
    "sklearn.ensemble._hist_gradient_boosting.binning._BinMapper",
    "sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor",
    "sklearn._loss.loss.HalfBinomialLoss",
    "sklearn._loss.link.LogitLink",
    "sklearn._loss.link.Interval",
    "sklearn._loss._loss.CyHalfBinomialLoss",
    "numpy.dtype",
    "builtins.slice",
    "collections.OrderedDict",
]


def default_model_path() -> Path:
    return Path(str(resources.files("gpuwatch.models") / "data" / "default_model.skops"))


def _skops_io() -> Any:
    """skops.io, imported on first use: it imports all of sklearn (~2.4 s), which the collector's start,
    its CLI help and the commands that never load a model should not pay.

    skops lists sklearn's types by importing every sklearn module, and sklearn's array-API shims import
    each array library that happens to be installed (torch: +3 s and +400 MB on a node that has it). A
    model file holds numpy arrays only, so those libraries are hidden for the import; the walk skips a
    module that fails to import."""
    hidden = _HideModules(("torch", "cupy", "jax", "dask")) if "torch" not in sys.modules else None
    if hidden:
        sys.meta_path.insert(0, hidden)
    try:
        import skops.io
    finally:
        if hidden:
            sys.meta_path.remove(hidden)
    return skops.io


class _HideModules(importlib.abc.MetaPathFinder):
    """An import finder that makes ``names`` (and their submodules) fail to import while it is installed."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname.split(".")[0] in self.names:
            raise ImportError(f"{fullname} is not needed to load a model")
        return None


def save_model(model: FailureModel, path: str | os.PathLike[str]) -> None:
    sio = _skops_io()
    sio.dump(model.to_dict(), path, compression=zipfile.ZIP_DEFLATED, compresslevel=9)


def load_model(path: str | os.PathLike[str] | None = None) -> FailureModel:
    """Load a model file (the shipped simulated-fleet model when ``path`` is None)."""
    sio = _skops_io()
    p = Path(path) if path is not None else default_model_path()
    if not p.is_file():
        raise UserError(f"{p}: no such model file")
    try:
        untrusted = [t for t in sio.get_untrusted_types(file=p) if t not in TRUSTED_TYPES]
    except Exception as exc:  # skops raises several types for a file that is not an archive
        raise UserError(f"{p}: not a skops model file: {_one_line(exc)}") from None
    if untrusted:
        raise UserError(f"{p}: model file contains types gpuwatch does not trust: {untrusted}")
    try:
        stored = sio.load(p, trusted=TRUSTED_TYPES)
    except Exception as exc:  # a damaged archive passes the type listing and fails here
        raise UserError(f"{p}: not a skops model file: {_one_line(exc)}") from None
    return FailureModel.from_dict(stored, source=str(p))


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


@runtime_checkable
class Classifier(Protocol):
    """What a model's estimator does for gpuwatch (a calibrated scikit-learn classifier)."""

    def predict_proba(self, x: np.ndarray) -> np.ndarray: ...


def probabilities(estimator: Classifier, features: Sequence[str], feats: pd.DataFrame) -> np.ndarray:
    """Calibrated probability of a fault within the horizon, one per feature row, from ``estimator`` reading the
    columns ``features`` (training scores with it before the model's threshold exists)."""
    if feats.empty:
        return np.zeros(0)
    return np.asarray(estimator.predict_proba(_matrix(features, feats))[:, 1], dtype=float)


def _matrix(features: Sequence[str], feats: pd.DataFrame) -> np.ndarray:
    missing = [c for c in features if c not in feats.columns]
    if missing:
        raise UserError(f"feature rows lack columns the model needs: {missing}")
    return np.asarray(feats[list(features)].to_numpy(dtype=float))


@dataclass(frozen=True)
class TrainingRecord:
    """Where a model was trained and on what (the file's ``training`` entry, shown by `gpuwatch train`).

    ``fingerprint`` identifies the training data: `gpuwatch evaluate` on the same data judges the test block
    only (``test_ms``), since the rest was learnt from. The blocks are half-open [lo, hi) in epoch ms.
    """

    source: str
    fingerprint: str
    train_ms: tuple[int, int]
    validation_ms: tuple[int, int]
    test_ms: tuple[int, int]
    rows: int
    positives: int
    #: Features left out because the training data gave them no information (fields never recorded, constant).
    dropped_features: tuple[str, ...] = ()
    false_alarm_budget: float | None = None  # absent from files older than the budget option
    seconds: float | None = None
    #: What was learnt from beside the data (`gpuwatch train --prior`); None in files from before the option,
    #: which then keep their stored dict as it was.
    prior: str | None = None
    #: Weight of each row of the data against the prior's (1 without a prior); None as ``prior``.
    site_weight: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The stored (and JSON) form: plain lists and numbers."""
        return {"source": self.source, "fingerprint": self.fingerprint, "train_ms": list(self.train_ms),
                "validation_ms": list(self.validation_ms), "test_ms": list(self.test_ms), "rows": self.rows,
                "positives": self.positives, "dropped_features": list(self.dropped_features),
                "false_alarm_budget": self.false_alarm_budget, "seconds": self.seconds,
                **({} if self.prior is None else {"prior": self.prior, "site_weight": self.site_weight})}

    @classmethod
    def from_dict(cls, stored: Mapping[str, Any]) -> TrainingRecord:
        return cls(source=_get(stored, "source", str), fingerprint=_get(stored, "fingerprint", str),
                   train_ms=_block(stored, "train_ms"), validation_ms=_block(stored, "validation_ms"),
                   test_ms=_block(stored, "test_ms"), rows=_integer(stored, "rows"),
                   positives=_integer(stored, "positives"),
                   dropped_features=tuple(_names(stored, "dropped_features") if "dropped_features" in stored else ()),
                   false_alarm_budget=_optional_number(stored, "false_alarm_budget"),
                   seconds=_optional_number(stored, "seconds"),
                   prior=_get(stored, "prior", str) if "prior" in stored else None,
                   site_weight=_optional_number(stored, "site_weight"))


@dataclass(frozen=True)
class FailureModel:
    """A trained failure model: the classifier, the feature columns it reads, the time scales it was trained at,
    its start threshold and what to explain a score with.

    A model file stores :meth:`to_dict` (a plain dict, so files from every gpuwatch version read alike);
    :func:`load_model` checks it and builds this object.
    """

    estimator: Classifier
    #: The feature columns (models/features.py) the estimator reads, in its order.
    features: tuple[str, ...]
    horizon_s: float  # a score is the probability of a fault within this long ...
    warning_s: float  # ... and later than this (the time an operator needs to act)
    step_s: int  # one feature row per GPU per step
    #: The alert threshold chosen on the validation blocks for the training budget: the start value of the
    #: online budget calibration (models/calibration.py).
    threshold: float
    #: The rule baseline's threshold for the same budget on the same data (for `gpuwatch evaluate`); None in
    #: files older than the baseline.
    baseline_threshold: float | None
    #: Healthy-fleet median and spread per feature, and the permutation importance per feature (top_signals).
    healthy_median: tuple[float, ...]
    healthy_spread: tuple[float, ...]
    importance: tuple[float, ...]
    training: TrainingRecord
    #: predictor_metrics (models/evaluate.py) at ``threshold`` on the first training set's validation block.
    validation_metrics: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""
    gpuwatch_version: str = __version__

    def risk(self, feats: pd.DataFrame) -> np.ndarray:
        """Calibrated probability of a fault within the model's horizon, one per feature row."""
        return probabilities(self.estimator, self.features, feats)

    def alert_policy(self) -> AlertPolicy:
        """The alert rule at the model's start threshold."""
        return AlertPolicy(self.threshold)

    def top_signals(self, feats: pd.DataFrame, k: int = 3) -> list[list[dict[str, Any]]]:
        """Per row, the ``k`` features furthest from the healthy fleet, weighted by their importance.

        contribution = importance x |value - healthy median| / healthy spread. A plain, explainable
        ranking of "what looks abnormal and matters", not an exact attribution of the model's score.
        """
        x = _matrix(self.features, feats)
        median, spread = np.array(self.healthy_median), np.array(self.healthy_spread)
        weight = np.clip(np.array(self.importance), 0.0, None)
        contrib = np.nan_to_num(np.abs(x - median) / spread) * weight
        top = np.argsort(-contrib, axis=1)[:, :k]
        names = self.features
        return [[{"signal": names[j], "value": float(x[i, j]), "fleet_median": float(median[j]),
                  "contribution": round(float(contrib[i, j]), 4)} for j in top[i] if contrib[i, j] > 0]
                for i in range(len(x))]

    def to_dict(self) -> dict[str, Any]:
        """The stored form (a model file holds this dict; its keys are the file format)."""
        return {
            "format": MODEL_FORMAT, "version": MODEL_VERSION, "gpuwatch_version": self.gpuwatch_version,
            "estimator": self.estimator, "features": list(self.features), "horizon_s": self.horizon_s,
            "warning_s": self.warning_s, "step_s": self.step_s, "description": self.description,
            "training": self.training.to_dict(),
            "reference": {"median": list(self.healthy_median), "spread": list(self.healthy_spread)},
            "importance": list(self.importance), "threshold": self.threshold,
            "baseline_threshold": self.baseline_threshold, "validation_metrics": dict(self.validation_metrics),
        }

    @classmethod
    def from_dict(cls, stored: object, *, source: str) -> FailureModel:
        """The model a stored dict describes; a UserError naming ``source`` and what is wrong when it is not a
        gpuwatch failure model this version reads."""
        if not isinstance(stored, dict) or stored.get("format") != MODEL_FORMAT:
            raise UserError(f"{source}: not a gpuwatch failure model")
        version = stored.get("version", 0)
        if isinstance(version, int) and version > MODEL_VERSION:
            raise UserError(f"{source}: model version {version} is newer than this gpuwatch reads")
        try:
            return cls._from_stored(stored)
        except _Malformed as exc:
            raise UserError(f"{source}: not a gpuwatch failure model: {exc}") from None

    @classmethod
    def _from_stored(cls, stored: Mapping[str, Any]) -> FailureModel:
        estimator = stored.get("estimator")
        if not isinstance(estimator, Classifier):
            raise _Malformed("'estimator' is missing or not a classifier")
        features = _names(stored, "features")
        reference = _get(stored, "reference", dict)
        per_feature = {"median": _numbers(reference, "median"), "spread": _numbers(reference, "spread"),
                       "importance": _numbers(stored, "importance")}
        for key, values in per_feature.items():
            if len(values) != len(features):
                raise _Malformed(f"{len(values)} {key} values for {len(features)} features")
        metrics = stored.get("validation_metrics") or {}
        if not isinstance(metrics, dict):
            raise _Malformed("'validation_metrics' is not a dict")
        return cls(estimator=estimator, features=tuple(features), horizon_s=_number(stored, "horizon_s"),
                   warning_s=_number(stored, "warning_s"), step_s=_integer(stored, "step_s"),
                   threshold=_number(stored, "threshold"),
                   baseline_threshold=_optional_number(stored, "baseline_threshold"),
                   healthy_median=tuple(per_feature["median"]), healthy_spread=tuple(per_feature["spread"]),
                   importance=tuple(per_feature["importance"]),
                   training=TrainingRecord.from_dict(_get(stored, "training", dict)),
                   validation_metrics=metrics, description=str(stored.get("description") or ""),
                   gpuwatch_version=str(stored.get("gpuwatch_version") or ""))


class _Malformed(ValueError):
    """A stored model entry that is missing or of the wrong type (the message names it)."""


_T = TypeVar("_T")


def _wrong(key: str, value: object, expected: str) -> _Malformed:
    return _Malformed(f"{key!r} is {'missing' if value is None else 'a ' + type(value).__name__}, expected {expected}")


def _get(stored: Mapping[str, Any], key: str, kind: type[_T]) -> _T:
    value = stored.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise _wrong(key, value, kind.__name__)
    return value


def _number(stored: Mapping[str, Any], key: str) -> float:
    """A stored number as it was stored (an int stays an int: JSON output shows it as before)."""
    value = stored.get(key)
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise _wrong(key, value, "a number")
    return cast(float, value)  # numbers.Real: int, float and numpy's scalars


def _optional_number(stored: Mapping[str, Any], key: str) -> float | None:
    return None if stored.get(key) is None else _number(stored, key)


def _integer(stored: Mapping[str, Any], key: str) -> int:
    value = stored.get(key)
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise _wrong(key, value, "an integer")
    return int(value)


def _numbers(stored: Mapping[str, Any], key: str) -> list[float]:
    values = _get(stored, key, list)
    if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
        raise _Malformed(f"{key!r} holds values that are not numbers")
    return [float(v) for v in values]


def _names(stored: Mapping[str, Any], key: str) -> list[str]:
    values = _get(stored, key, list)
    if not all(isinstance(v, str) for v in values):
        raise _Malformed(f"{key!r} holds values that are not names")
    return values


def _block(stored: Mapping[str, Any], key: str) -> tuple[int, int]:
    values = _get(stored, key, list)
    if len(values) != 2 or not all(isinstance(v, numbers.Integral) for v in values):
        raise _Malformed(f"{key!r} is not a [start, end) pair of epoch milliseconds")
    return int(values[0]), int(values[1])
