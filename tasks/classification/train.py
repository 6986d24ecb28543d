"""Entry point of the classification task (called by the top-level ``train.py``)."""

from __future__ import annotations

from tasks.common.trainer import Trainer

from .task import ClassificationTask


def run(cfg, run_dir) -> dict:
    trainer = Trainer(cfg, ClassificationTask(cfg), run_dir)
    return trainer.fit()
