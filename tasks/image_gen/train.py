"""Entry point of the image generation task (called by the top-level ``train.py``)."""

from __future__ import annotations

from tasks.common.trainer import Trainer

from .task import ImageGenTask


def run(cfg, run_dir) -> dict:
    return Trainer(cfg, ImageGenTask(cfg), run_dir).fit()
