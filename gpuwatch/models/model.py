"""The failure model as a file: load, save, score, and the top signals behind a score.

A model file is a skops archive of a plain dict: the calibrated classifier plus its metadata (features,
horizon, training range, threshold, metrics, fleet reference statistics). skops loads only the types in
TRUSTED_TYPES, so a model file cannot run arbitrary code the way a pickle can.
"""
from __future__ import annotations

import importlib.abc
import os
import sys
import zipfile
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from gpuwatch.core.errors import UserError

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


def save_model(model: dict, path: str | os.PathLike) -> None:
    sio = _skops_io()
    sio.dump(model, path, compression=zipfile.ZIP_DEFLATED, compresslevel=9)


def load_model(path: str | os.PathLike | None = None) -> dict:
    """Load a model file (the shipped simulated-fleet model when ``path`` is None)."""
    sio = _skops_io()
    p = Path(path) if path is not None else default_model_path()
    if not p.is_file():
        raise UserError(f"{p}: no such model file")
    try:
        untrusted = [t for t in sio.get_untrusted_types(file=p) if t not in TRUSTED_TYPES]
    except Exception as exc:  # skops raises several types for a file that is not an archive
        raise UserError(f"{p}: not a skops model file: {exc}") from None
    if untrusted:
        raise UserError(f"{p}: model file contains types gpuwatch does not trust: {untrusted}")
    model = sio.load(p, trusted=TRUSTED_TYPES)
    if not isinstance(model, dict) or model.get("format") != MODEL_FORMAT:
        raise UserError(f"{p}: not a gpuwatch failure model")
    if model.get("version", 0) > MODEL_VERSION:
        raise UserError(f"{p}: model version {model['version']} is newer than this gpuwatch reads")
    return model


def _matrix(model: dict, feats: pd.DataFrame) -> np.ndarray:
    missing = [c for c in model["features"] if c not in feats.columns]
    if missing:
        raise UserError(f"feature rows lack columns the model needs: {missing}")
    return feats[model["features"]].to_numpy(dtype=float)


def score(model: dict, feats: pd.DataFrame) -> np.ndarray:
    """Calibrated probability of a fault within the model's horizon, one per feature row."""
    if feats.empty:
        return np.zeros(0)
    return model["estimator"].predict_proba(_matrix(model, feats))[:, 1]


def top_signals(model: dict, feats: pd.DataFrame, k: int = 3) -> list[list[dict[str, Any]]]:
    """Per row, the ``k`` features furthest from the healthy fleet, weighted by their importance.

    contribution = importance x |value - healthy median| / healthy spread. A plain, explainable
    ranking of "what looks abnormal and matters", not an exact attribution of the model's score.
    """
    x = _matrix(model, feats)
    ref = model["reference"]
    median, spread = np.array(ref["median"]), np.array(ref["spread"])
    weight = np.clip(np.array(model["importance"]), 0.0, None)
    contrib = np.nan_to_num(np.abs(x - median) / spread) * weight
    top = np.argsort(-contrib, axis=1)[:, :k]
    names = model["features"]
    return [[{"signal": names[j], "value": float(x[i, j]), "fleet_median": float(median[j]),
              "contribution": round(float(contrib[i, j]), 4)} for j in top[i] if contrib[i, j] > 0]
            for i in range(len(x))]
