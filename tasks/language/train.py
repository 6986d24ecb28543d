"""Entry point of the language-modelling task (called by the top-level ``train.py``)."""

from __future__ import annotations

from tasks.common.trainer import Trainer

from .task import LanguageModelingTask


def run(cfg, run_dir) -> dict:
    return Trainer(cfg, LanguageModelingTask(cfg), run_dir).fit()
