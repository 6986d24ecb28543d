"""Entry point of the video generation task (called by the top-level ``train.py``)."""

from __future__ import annotations

from tasks.common.trainer import Trainer

from .task import VideoGenTask


def run(cfg, run_dir) -> dict:
    return Trainer(cfg, VideoGenTask(cfg), run_dir).fit()
