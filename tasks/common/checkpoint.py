"""Checkpoints written atomically (temp file + rename), keeping ``last.pt`` and ``best.pt``."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .fileio import atomic_write


def atomic_save(obj, path: str | os.PathLike) -> None:
    """Write ``obj`` with ``torch.save`` to a temp file in the same folder, fsync it, then rename it into
    place (:func:`tasks.common.fileio.atomic_write`). A crash mid-write leaves the previous checkpoint intact.
    """

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            torch.save(obj, f)

    atomic_write(path, write, fsync=True)


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {path} does not exist; pass the path of a last.pt / best.pt written by train.py "
            f"(they live in <run_dir>/checkpoints/)"
        )
    return torch.load(path, map_location=map_location, weights_only=False)


def model_weights(state: dict, prefer: str = "ema") -> dict:
    """The model state dict of a ``train.py`` checkpoint: the EMA weights when ``prefer="ema"`` and the
    checkpoint has them (:class:`tasks.common.ema.ModelEMA` keeps the averaged model under ``module.``),
    else the raw ``state["model"]``."""
    if prefer == "ema" and state.get("ema"):
        return {k.removeprefix("module."): v for k, v in state["ema"].items() if k.startswith("module.")}
    return state["model"]


class CheckpointManager:
    """Saves ``last.pt`` every time and ``best.pt`` when the monitored metric improves."""

    def __init__(self, directory: str | os.PathLike, monitor: str | None = None, mode: str = "max"):
        if mode not in ("max", "min"):
            raise ValueError(f"checkpoint mode must be max or min, got {mode!r}")
        self.dir = Path(directory)
        self.monitor = monitor
        self.mode = mode
        self.best: float | None = None

    @property
    def last_path(self) -> Path:
        return self.dir / "last.pt"

    @property
    def best_path(self) -> Path:
        return self.dir / "best.pt"

    def is_better(self, value: float) -> bool:
        if self.best is None:
            return True
        return value > self.best if self.mode == "max" else value < self.best

    def save(self, state: dict, metrics: dict | None = None) -> bool:
        """Save ``last.pt``; also ``best.pt`` when ``metrics[monitor]`` improved. Returns whether it did."""
        state = dict(state, best_metric=self.best)
        improved = False
        if metrics is not None and self.monitor and self.monitor in metrics:
            value = float(metrics[self.monitor])
            if self.is_better(value):
                self.best = value
                state["best_metric"] = value
                improved = True
        atomic_save(state, self.last_path)
        if improved:
            atomic_save(state, self.best_path)
        return improved
