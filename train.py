#!/usr/bin/env python
"""Train any task x model x attention:  python train.py task=imagenet model=deit_t attn=mhla

With no arguments it trains the embedded default (MNIST, a small ViT with MHLA, on the CPU). Configs live
in ``configs/`` (Hydra); every run ends by printing its final metrics on one line: ``final: top1=...``.

Resume: ``python train.py <same overrides> trainer.resume=<run folder>`` continues that run in its folder.
Ctrl-C (SIGINT) and SIGTERM save ``last.pt`` at the step reached and exit with code 130 / 143.
"""

from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

ROOT = os.path.dirname(os.path.abspath(__file__))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tasks.common.config import attention_line, register_resolvers, validate_config  # noqa: E402
from tasks.common.logger import run_log  # noqa: E402
from tasks.common.task import task_class  # noqa: E402
from tasks.common.trainer import Trainer, TrainingInterrupted  # noqa: E402

register_resolvers()  # ${launch_time:...}, ${launch_id:} and ${resume_run_dir:...} in hydra.run.dir


def run(cfg: DictConfig, run_dir: str) -> dict:
    """Validate the composed config, then train the Task class it names (``task.target``) with the Trainer. The
    run's attention is resolved once, here (``validate_config``), and handed to the task."""
    attention = validate_config(cfg)
    print(attention_line(attention), flush=True)
    metrics = Trainer(cfg, task_class(cfg)(cfg, attention), run_dir).fit()
    line = " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
    print(f"final: {line}", flush=True)
    run_log().info(f"final: {line}")
    return metrics


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    run_dir = HydraConfig.get().runtime.output_dir
    if cfg.get("print_config", False):
        print(OmegaConf.to_yaml(cfg, resolve=True))
    try:
        metrics = run(cfg, run_dir)
    except TrainingInterrupted as e:  # SIGINT / SIGTERM: last.pt is saved; exit as the signal would (130 / 143)
        sys.exit(e.exit_code)
    monitor = cfg.task.get("monitor")
    return metrics.get(monitor) if monitor else None


if __name__ == "__main__":
    main()
