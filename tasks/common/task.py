"""The interface between a task and the shared trainer: :class:`Task`, and :func:`task_class`, which finds the
subclass a run's config names (``task.target``).

A task is one :class:`Task` subclass and one ``configs/task/<name>.yaml`` (docs/adding_a_task.md). The trainer
(:class:`tasks.common.trainer.Trainer`) gets it made with the run's config and the run's attention, resolved once
(:attr:`Task.attention`: the one ``train.py`` resolved at start, else resolved from the config on first use),
then calls, in this order:

1. :meth:`Task.build_model` (once; the trainer moves it to the device, wraps it for DDP / FSDP, keeps its EMA),
   :meth:`Task.describe_model` for the log, and :meth:`Task.example_input` for the FLOP count;
2. :meth:`Task.build_datasets` (once): ``(train, eval)`` datasets whose samples :meth:`Task.collate` batches;
3. per micro-batch (``trainer.accumulate`` of them make one optimizer step; 1 unless the recipe's global batch
   needs more): :meth:`Task.on_batch` (to the device, batch-level augmentation), then
   :meth:`Task.training_loss` ``-> (loss, {name: value})``, which the trainer scales by 1 / accumulate,
   backpropagates and logs (the modules' ``after_optimizer_step`` hooks and the EMA run once per optimizer step);
4. every ``trainer.eval_every_steps`` steps (default: every epoch) and at the end: :meth:`Task.evaluate` on the
   eval loader ``-> {metric: value}``, on every rank (reduce across ranks with ``dist_info``); ``monitor`` /
   ``monitor_mode`` pick the metric that selects ``best.pt``;
5. at the end, on every rank: :meth:`Task.after_fit` (sample grids, extra metrics).

``eval.py`` and :func:`tasks.common.evaluation.load_run` rebuild a checkpoint's task the same way, from the
config stored in it.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn as nn

from mhla.registry import ResolvedAttention

from .config import ConfigError, resolve_run_attention
from .distributed import DistInfo


class Task:
    """What a task provides to the trainer. Subclasses override the methods below.

    ``monitor`` / ``monitor_mode``: the eval metric that selects ``best.pt``.
    """

    monitor: str = "loss"
    monitor_mode: str = "min"

    def __init__(self, cfg, attention: ResolvedAttention | None = None):
        self.cfg = cfg
        self._attention = attention

    @property
    def attention(self) -> ResolvedAttention:
        """The run's attention and cross-attention (``.cross``), resolved once: the one train.py resolved at
        start and passed in, else resolved from the config on first use
        (:func:`tasks.common.config.resolve_run_attention`)."""
        if self._attention is None:
            self._attention = resolve_run_attention(self.cfg)
        return self._attention

    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def build_datasets(self):
        """Return ``(train_dataset, eval_dataset)``; samples are what :meth:`collate` batches."""
        raise NotImplementedError

    def collate(self, samples):
        return torch.utils.data.default_collate(samples)

    def on_batch(self, batch, device):
        """Move a batch to ``device`` and apply batch-level augmentation (mixup, ...)."""
        return [b.to(device, non_blocking=True) if torch.is_tensor(b) else b for b in batch]

    def training_loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader, device, dist_info: DistInfo) -> dict:
        raise NotImplementedError

    def example_input(self, device):
        """An input for the FLOP counter (or None to skip counting)."""
        return None

    def describe_model(self, model: nn.Module) -> str:
        return type(model).__name__

    def after_fit(self, trainer, metrics: dict) -> dict:
        """Hook for task-specific end-of-run work (sample grids, ...), given the
        :class:`~tasks.common.trainer.Trainer` (not imported here: the trainer imports this module). Returns extra
        metrics, and
        :class:`~tasks.common.logger.Media` values (images, videos) that go to W&B as ``final/<name>``.

        Every rank calls it. Under FSDP the weights of ``trainer.model`` and ``trainer.ema.module`` are whole
        for its duration (:func:`tasks.common.fsdp.gathered`), so rank 0 may sample alone; a transformers
        ``generate`` there needs ``synced_gpus=False`` (it would wait for the other ranks at each token)."""
        return {}


def task_class(cfg) -> type[Task]:
    """The :class:`Task` subclass a run's config names in ``task.target`` (e.g.
    ``tasks.classification.task.ClassificationTask``; every ``configs/task/*.yaml`` sets it).

    ``train.py`` builds its run from it and ``eval.py`` a checkpoint's (from the config stored in it), so both
    pick the same class. A config without ``task.target`` is a :class:`ConfigError` that says how to name one.
    """
    target = cfg.task.get("target")
    if not target:
        raise ConfigError(
            "the config names no task class (no task.target); pass +task.target=<module>.<Task subclass>, e.g. "
            "+task.target=tasks.classification.task.ClassificationTask")
    module_name, _, name = str(target).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name, None) if module_name else None
    except ModuleNotFoundError as e:
        if not (e.name and module_name.startswith(e.name)):
            raise  # the module exists but one of its own imports is missing
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ConfigError(f"task.target={target} is not a Task subclass (module.ClassName, e.g. "
                          "tasks.classification.task.ClassificationTask)")
    return cls
