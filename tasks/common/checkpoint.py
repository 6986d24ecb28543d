"""Checkpoints written atomically (temp file + rename), keeping ``last`` and ``best``, in one of two formats:

* ``last.pt`` / ``best.pt`` (one process, DDP): one ``torch.save`` file written by rank 0;
* ``last.dcp/`` / ``best.dcp/`` (FSDP): a ``torch.distributed.checkpoint`` (DCP) folder in which every rank
  writes its own shards of the model, optimizer and EMA tensors (``__<rank>_0.distcp``, indexed by
  ``.metadata``), plus :data:`TRAINER_STATE` (``trainer.pt``, rank 0: step, scheduler, RNG states, config,
  ...). The folder is written under a temp name and renamed into place
  (:meth:`CheckpointManager.save_sharded`).

:func:`load_checkpoint` reads either as the same dict (a DCP folder is assembled on one process into whole
tensors, in the layout a single process saves: :func:`load_sharded_checkpoint`), so ``eval.py``, the scripts
and a resume under another strategy read an FSDP run's checkpoint as any other. :func:`load_run_checkpoint`
reads a checkpoint of ``train.py`` and says "not a checkpoint of this project: PATH" for anything else (empty,
text, foreign files); :func:`find_checkpoint` turns a run folder into its ``last`` checkpoint.

Besides :data:`RUN_CHECKPOINT_KEYS`, the trainer's checkpoints hold the optimizer, scheduler, EMA, RNG states,
the run's facts (``run``), ``wandb_run_id`` (the W&B run to continue on resume; None without W&B) and
``segments`` (the processes that trained it so far, which the run record lists: ``tasks.common.records``).
"""

from __future__ import annotations

import os
import pickle
import shutil
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


#: the file of a DCP checkpoint folder that holds everything but the model, optimizer and EMA tensors
TRAINER_STATE = "trainer.pt"
#: the suffixes of the two formats (``last.pt``, ``last.dcp``)
SUFFIXES = (".pt", ".dcp")


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a DCP checkpoint folder written by the trainer (``.metadata`` and
    ``trainer.pt``)."""
    path = Path(path)
    return (path / ".metadata").is_file() and (path / TRAINER_STATE).is_file()


def optimizer_state_by_index(state: dict) -> dict:
    """An optimizer state dict keyed by parameter name (``get_optimizer_state_dict``'s layout: the groups'
    ``params`` are names, in the optimizer's order) keyed by parameter index instead, as
    ``optimizer.state_dict()`` keys it."""
    names = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: state["state"][name] for name in names if name in state["state"]},
            "param_groups": [{**g, "params": [index[name] for name in g["params"]]}
                             for g in state["param_groups"]]}


def load_sharded_checkpoint(path: str | os.PathLike) -> dict:
    """A DCP checkpoint folder of an FSDP run as the dict a single process saves: whole tensors on the CPU,
    the optimizer state keyed by parameter index, the EMA as ``num_updates`` and ``module.<name>``. Runs on
    one process (no process group needed) and holds the whole model, optimizer and EMA in memory."""
    from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # noqa: PLC0415

    path = Path(path)
    state = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)
    tensors: dict = {}
    # every tensor of the folder, whole (the "empty" planner reads what the metadata lists; what
    # dcp_to_torch_save does, without the file)
    _load_state_dict(tensors, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    state["model"] = tensors["model"]
    state["optimizer"] = optimizer_state_by_index(tensors["optimizer"])
    num_updates = state.pop("ema_num_updates", None)
    state["ema"] = None if num_updates is None else {
        "num_updates": num_updates, **{f"module.{k}": v for k, v in tensors["ema"].items()}}
    return state


def load_checkpoint(path: str | os.PathLike, map_location="cpu", mmap: bool = False):
    """``torch.load`` of ``path``, with a clear error for a missing file or one that does not unpickle; a DCP
    checkpoint folder (FSDP) is read by :func:`load_sharded_checkpoint` (its tensors on the CPU whatever
    ``map_location``). ``mmap``: map the file's tensors instead of reading them (the ranks of an FSDP run that
    resumes from a ``.pt`` each open the whole checkpoint)."""
    path = Path(path)
    if is_sharded_checkpoint(path):
        return load_sharded_checkpoint(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {path} does not exist; pass the path of a last.pt / best.pt (or, from an FSDP run, "
            f"last.dcp / best.dcp) written by train.py (they live in <run_dir>/checkpoints/)"
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
    """The resolved config stored in a ``train.py`` checkpoint, as an OmegaConf ``DictConfig``, in today's
    schema (a config written before the attention schema is mapped by
    :func:`tasks.common.config.upgrade_config`)."""
    return upgrade_config(OmegaConf.create(state["config"]))


def latest_checkpoint(directory: str | os.PathLike, which: str = "last") -> Path | None:
    """``<directory>/<which>.pt`` or ``<which>.dcp`` (a DCP folder), whichever exists (both: the newer, as
    after a run resumed under the other strategy); None when neither does."""
    found = [p for p in (Path(directory) / f"{which}{s}" for s in SUFFIXES)
             if p.is_file() or is_sharded_checkpoint(p)]
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None


def find_checkpoint(path: str | os.PathLike, which: str = "last") -> Path:
    """``path`` if it is a checkpoint (a file or a DCP folder); ``<path>/checkpoints/<which>.pt`` (or
    ``.dcp``) for a run folder; ``<path>/<which>.pt`` (``.dcp``) for its ``checkpoints/`` folder. Raises
    ``FileNotFoundError`` when there is none."""
    path = Path(path)
    if path.is_file() or is_sharded_checkpoint(path):
        return path
    for folder in (path / "checkpoints", path):
        if folder.is_dir() and (found := latest_checkpoint(folder, which)) is not None:
            return found
    raise FileNotFoundError(f"no checkpoint at {path}: pass a run folder of train.py (it holds "
                            f"checkpoints/{which}.pt, or {which}.dcp from an FSDP run) or a checkpoint")


def run_folder(checkpoint: str | os.PathLike) -> Path:
    """The run folder of a checkpoint that :func:`find_checkpoint` returned: ``<run>/checkpoints/<which>.pt``
    (or ``.dcp``) -> ``<run>``, where ``train.py`` keeps the run's ``run.json``."""
    return Path(checkpoint).parent.parent


def model_weights(state: dict, prefer: str = "ema") -> dict:
    """The model state dict of a ``train.py`` checkpoint: the EMA weights when ``prefer="ema"`` and the
    checkpoint has them (:class:`tasks.common.ema.ModelEMA` keeps the averaged model under ``module.``),
    else the raw ``state["model"]``."""
    if prefer == "ema" and state.get("ema"):
        return {k.removeprefix("module."): v for k, v in state["ema"].items() if k.startswith("module.")}
    return state["model"]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_folder(tmp: Path, final: Path) -> None:
    """Move the complete folder ``tmp`` to ``final``: the old ``final`` is renamed ``.<name>.old`` first and
    removed after (a crash between the two renames leaves it there, and
    :meth:`CheckpointManager.remove_stale_temp_files` puts it back)."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # the files of a DCP folder are never rewritten in place: a hard link is a copy
    except OSError:
        shutil.copy2(src, dst)


class CheckpointManager:
    """Saves ``last`` every time and ``best`` when the monitored metric improves: ``.pt`` files (:meth:`save`,
    rank 0) or, with ``sharded=True`` (FSDP), DCP folders (:meth:`save_sharded`, every rank)."""

    def __init__(self, directory: str | os.PathLike, monitor: str | None = None, mode: str = "max",
                 sharded: bool = False):
        if mode not in ("max", "min"):
            raise ValueError(f"checkpoint mode must be max or min, got {mode!r}")
        self.dir = Path(directory)
        self.monitor = monitor
        self.mode = mode
        self.best: float | None = None
        self.suffix = ".dcp" if sharded else ".pt"

    @property
    def last_path(self) -> Path:
        return self.dir / f"last{self.suffix}"

    def remove_stale_temp_files(self) -> list[Path]:
        """Delete the temp files (``.last.pt.<random>.tmp``, ``.best.pt.<random>.tmp``) and temp folders
        (``.last.dcp.step<N>.tmp``) that a save killed mid-write left in this folder, and the previous DCP
        folder (``.last.dcp.old``) a finished save had not removed yet (put back as ``last.dcp`` when that is
        missing: the save stopped between its renames); returns what it removed. Call before the run saves
        anything."""
        stale = [p for name in ("last", "best") for s in SUFFIXES for p in self.dir.glob(f".{name}{s}.*.tmp")]
        for p in stale:
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        for name in ("last.dcp", "best.dcp"):
            old = self.dir / f".{name}.old"
            if old.exists() and not (self.dir / name).exists():
                os.rename(old, self.dir / name)
            elif old.exists():
                shutil.rmtree(old)
                stale.append(old)
        return stale

    @property
    def best_path(self) -> Path:
        return self.dir / f"best{self.suffix}"

    def is_better(self, value: float) -> bool:
        if self.best is None:
            return True
        return value > self.best if self.mode == "max" else value < self.best

    def _improved(self, metrics: dict | None) -> bool:
        """Whether ``metrics[monitor]`` beats the best so far (then it becomes the best)."""
        if metrics is not None and self.monitor and self.monitor in metrics:
            value = float(metrics[self.monitor])
            if self.is_better(value):
                self.best = value
                return True
        return False

    def save(self, state: dict, metrics: dict | None = None) -> bool:
        """Save ``last.pt``; also ``best.pt`` when ``metrics[monitor]`` improved. Returns whether it did."""
        improved = self._improved(metrics)
        state = dict(state, best_metric=self.best)
        atomic_save(state, self.last_path)
        if improved:
            atomic_save(state, self.best_path)
        return improved

    def save_sharded(self, tensors: dict, state: dict, metrics: dict | None, step: int,
                     is_main: bool) -> bool:
        """Save ``last.dcp`` (and ``best.dcp`` when ``metrics[monitor]`` improved); every rank calls it (a
        collective). ``tensors``: the sharded state dicts (``model``, ``optimizer``, ``ema``: DTensors, each
        rank writes its shards with ``torch.distributed.checkpoint.save``); ``state``: the rest (rank 0 writes
        it as ``trainer.pt``). Written to ``.last.dcp.step<step>.tmp`` and renamed into place once complete;
        ``best.dcp`` is a copy (hard links) of it. Returns whether ``best`` was saved."""
        import torch.distributed as dist  # noqa: PLC0415
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        improved = self._improved(metrics)  # the same on every rank: the metrics are all-reduced
        tmp = self.dir / f".{self.last_path.name}.step{step}.tmp"  # one name that every rank agrees on
        dcp.save(tensors, checkpoint_id=tmp)  # returns once every rank's files and the metadata are written
        if is_main:
            atomic_save(dict(state, best_metric=self.best), tmp / TRAINER_STATE)
            _replace_folder(tmp, self.last_path)
            if improved:
                best_tmp = self.dir / f".{self.best_path.name}.step{step}.tmp"
                shutil.copytree(self.last_path, best_tmp, copy_function=_link_or_copy)
                _replace_folder(best_tmp, self.best_path)
        if dist.is_initialized():
            dist.barrier()  # no rank goes on (and may save again) before the folder is in place
        return improved
