"""Data sets for ``neoflow train``: scikit-learn's 8x8 digits, or arrays from an ``.npz`` file."""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neoflow.errors import InputError
from neoflow.ir.op import Tensor


@dataclass(frozen=True)
class Dataset:
    """Training and test arrays: samples along axis 0, integer or float labels."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def _split(name: str, x: np.ndarray, y: np.ndarray, seed: int, test_fraction: float) -> Dataset:
    order = np.random.default_rng(seed).permutation(len(x))
    cut = len(x) - round(len(x) * test_fraction)
    train, test = order[:cut], order[cut:]
    return Dataset(name, x[train], y[train], x[test], y[test])


def load_dataset(source: str | os.PathLike, seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """``"digits"`` (scikit-learn's 1797 8x8 digit images, pixels scaled to
    [0, 1], a seeded 80/20 split) or an ``.npz`` file holding ``x`` and ``y``
    (and optionally ``x_test``/``y_test``; else a seeded split)."""
    if os.fspath(source) == "digits":
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            raise InputError(
                "the digits data set ships with scikit-learn, which is not installed (pip install scikit-learn)"
            ) from None
        digits = load_digits()
        return _split(
            "digits", (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int64), seed, test_fraction
        )
    path = Path(source)
    if not path.is_file():
        raise InputError(f"no such data set: '{source}' (give 'digits' or an .npz file with arrays x and y)")
    try:
        with np.load(path, allow_pickle=False) as arrays:
            data = {k: arrays[k] for k in arrays.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise InputError(f"cannot read '{path}' as an .npz file: {err}") from None
    for key in ("x", "y"):
        if key not in data:
            raise InputError(f"'{path}' has no array '{key}' (it has: {', '.join(data) or 'none'})")
    for key, value in data.items():
        if value.dtype.kind not in "biuf" or value.ndim == 0:
            raise InputError(
                f"'{path}': array '{key}' holds {value.dtype} values of shape {list(value.shape)}; "
                "samples are arrays of numbers"
            )
    if len(data["x"]) != len(data["y"]):
        raise InputError(f"'{path}': x has {len(data['x'])} samples but y has {len(data['y'])}")
    if "x_test" in data and "y_test" in data:
        return Dataset(path.name, data["x"], data["y"], data["x_test"], data["y_test"])
    return _split(path.name, data["x"], data["y"], seed, test_fraction)


def fit_samples(x: np.ndarray, tensor: Tensor, source: str) -> np.ndarray:
    """Reshape samples ``x[N, ...]`` to the per-sample shape of input ``tensor``
    (``[B, ...]``), which must hold the same number of values."""
    sample = tensor.shape[1:]
    per_sample = int(np.prod(x.shape[1:]))
    if per_sample != int(np.prod(sample)):
        raise InputError(
            f"the data's samples have shape {list(x.shape[1:])} ({per_sample} values) but the model's input "
            f"'{source}' takes samples of shape {list(sample)}"
        )
    return x.reshape(len(x), *sample)
