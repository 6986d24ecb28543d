"""Checkpoints written atomically (temp file + rename), keeping ``last.pt`` and ``best.pt``.

:func:`load_run_checkpoint` reads a checkpoint of ``train.py`` and says "not a checkpoint of this project: PATH"
for anything else (empty, text, foreign files); :func:`find_checkpoint` turns a run folder into its ``last.pt``.

Besides :data:`RUN_CHECKPOINT_KEYS`, the trainer's checkpoints hold the optimizer, scheduler, EMA, RNG states, the
run's facts (``run``) and ``wandb_run_id`` (the W&B run to continue on resume; None without W&B).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch
from omegaconf import OmegaConf

from .config import upgrade_config

from .fileio import atomic_write


def atomic_save(obj, path: str | os.PathLike) -> None:
    """Write ``obj`` with ``torch.save`` to a temp file in the same folder, fsync it, then rename it into
    place (:func:`tasks.common.fileio.atomic_write`). A crash mid-write leaves the previous checkpoint intact.
    """

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            torch.save(obj, f)

    atomic_write(path, write, fsync=True)


#: what every checkpoint that the trainer writes holds (it also holds optimizer, scheduler, rng, ...)
RUN_CHECKPOINT_KEYS = ("model", "step", "config")


class NotACheckpointError(ValueError):
    """A file that is not a checkpoint written by ``train.py``."""


def load_checkpoint(path: str | os.PathLike, map_location="cpu", mmap: bool = False):
    """``torch.load`` of ``path``, with a clear error for a missing file or one that does not unpickle. ``mmap``:
    map the file's tensors instead of reading them (the ranks of an FSDP run each open the whole checkpoint)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {path} does not exist; pass the path of a last.pt / best.pt written by train.py "
            f"(they live in <run_dir>/checkpoints/)"
        )
    try:
        return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    except (EOFError, pickle.UnpicklingError, RuntimeError, ValueError, ImportError, AttributeError,
            UnicodeDecodeError) as e:
        reason = "an empty file" if path.stat().st_size == 0 else f"{type(e).__name__}: {e}"
        raise NotACheckpointError(f"not a checkpoint of this project: {path} ({reason})") from None


def load_run_checkpoint(path: str | os.PathLike, map_location="cpu", require: tuple[str, ...] = (),
                        mmap: bool = False) -> dict:
    """A checkpoint written by ``train.py`` (a dict with ``model``, ``step``, ``config`` and the keys in
    ``require``, e.g. ``optimizer`` to resume); raises :class:`NotACheckpointError` for anything else."""
    state = load_checkpoint(path, map_location=map_location, mmap=mmap)
    keys = RUN_CHECKPOINT_KEYS + tuple(require)
    missing = [k for k in keys if k not in state] if isinstance(state, dict) else None
    if missing is None or missing:
        what = f"a {type(state).__name__}" if missing is None else f"it has no {', '.join(missing)}"
        raise NotACheckpointError(f"not a checkpoint of this project: {path} ({what}; train.py writes "
                                  f"<run_dir>/checkpoints/last.pt and best.pt)")
    return state


def run_config(state: dict):
    """The resolved config stored in a ``train.py`` checkpoint, as an OmegaConf ``DictConfig``, in today's schema
    (a config written before the attention schema is mapped by :func:`tasks.common.config.upgrade_config`)."""
    return upgrade_config(OmegaConf.create(state["config"]))


def find_checkpoint(path: str | os.PathLike, which: str = "last") -> Path:
    """``path`` if it is a file; ``<path>/checkpoints/<which>.pt`` for a run folder; ``<path>/<which>.pt`` for
    its ``checkpoints/`` folder. Raises ``FileNotFoundError`` when there is none."""
    path = Path(path)
    if path.is_file():
        return path
    for candidate in (path / "checkpoints" / f"{which}.pt", path / f"{which}.pt"):
        if path.is_dir() and candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no checkpoint at {path}: pass a run folder of train.py (it holds "
                            f"checkpoints/{which}.pt) or a checkpoint file")


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

    def remove_stale_temp_files(self) -> list[Path]:
        """Delete the temp files (``.last.pt.<random>.tmp``, ``.best.pt.<random>.tmp``) that a save killed
        mid-write left in this folder; returns them. Call before the run saves anything."""
        stale = [p for name in ("last.pt", "best.pt") for p in self.dir.glob(f".{name}.*.tmp")]
        for p in stale:
            p.unlink(missing_ok=True)
        return stale

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
