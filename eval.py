#!/usr/bin/env python
"""Evaluate a checkpoint written by train.py:  python eval.py ckpt=outputs/.../checkpoints/best.pt

The run's resolved config is stored in the checkpoint; command-line overrides (e.g. ``data.root=...``,
``data.eval_batch_size=...``, ``trainer.device=cuda``) are applied on top, with Hydra's rule: a misspelled key
is an error (``+key=value`` adds a key). Uses the EMA weights when the checkpoint has them (``use_ema=false``
for the raw weights). Prints ``final: top1=... top5=...``. A file that is not a checkpoint of ``train.py`` gives
"not a checkpoint of this project: PATH".

The task is the class the stored config names in ``task.target``, picked as ``train.py`` picks it
(:func:`tasks.common.trainer.task_class`). Checkpoints written before that key name their task by
``task.module`` only: :data:`tasks.common.trainer.LEGACY_TASK_MODULES` maps those; else pass
``+task.target=...``.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def load_run(ckpt_path: str, overrides: list[str] | None = None, use_ema: bool = True):
    """``(cfg, task, model, dist_info)`` of a ``train.py`` checkpoint: the run's stored config with
    ``overrides`` on top, its task (the class ``task.target`` names, as in ``train.py``:
    :func:`tasks.common.trainer.task_class`), and the model with the EMA (``use_ema``) or raw weights, in eval
    mode."""
    from omegaconf import OmegaConf  # noqa: PLC0415

    from tasks.common.checkpoint import load_run_checkpoint, model_weights  # noqa: PLC0415
    from tasks.common.config import apply_overrides, check_eval_batch_size  # noqa: PLC0415
    from tasks.common.distributed import setup_distributed  # noqa: PLC0415
    from tasks.common.trainer import task_class  # noqa: PLC0415

    state = load_run_checkpoint(ckpt_path)
    cfg = OmegaConf.create(state["config"])
    apply_overrides(cfg, overrides or [])  # a misspelled key is an error, as in train.py
    check_eval_batch_size(cfg)
    task = task_class(cfg)(cfg)
    info = setup_distributed(cfg.trainer.get("device", "auto"))
    model = task.build_model()
    model.load_state_dict(model_weights(state, "ema" if use_ema else "model"))
    model.to(info.device).eval()
    return cfg, task, model, info


def evaluate_checkpoint(ckpt_path: str, overrides: list[str] | None = None, use_ema: bool = True) -> dict:
    from torch.utils.data import DataLoader  # noqa: PLC0415

    from tasks.common.data import ResumableSampler  # noqa: PLC0415
    from tasks.common.progress import ProgressLoader  # noqa: PLC0415
    from tasks.common.trainer import _precision_context, cap_num_workers  # noqa: PLC0415

    cfg, task, model, info = load_run(ckpt_path, overrides, use_ema)
    _, eval_ds = task.build_datasets()
    bs = int(cfg.data.get("eval_batch_size") or cfg.data.batch_size)
    sampler = ResumableSampler(len(eval_ds), bs, rank=info.rank, world_size=info.world_size, shuffle=False,
                               drop_last=False)
    loader = DataLoader(eval_ds, batch_size=bs, sampler=sampler, collate_fn=task.collate,
                        num_workers=cap_num_workers(int(cfg.trainer.get("num_workers", 0)))[0])
    precision = cfg.trainer.get("precision", "auto")
    precision = ("bf16" if info.device.type == "cuda" else "fp32") if precision == "auto" else precision
    with _precision_context(precision, info.device):
        return task.evaluate(model, ProgressLoader(loader, "eval", enabled=info.is_main), info.device, info)


def main(argv: list[str]) -> int:
    ckpt = next((a.split("=", 1)[1] for a in argv if a.startswith("ckpt=")), None)
    if ckpt is None:
        print("usage: python eval.py ckpt=PATH [use_ema=false] [key=value ...]", file=sys.stderr)
        return 2
    use_ema = not any(a.lower() in ("use_ema=false", "use_ema=0") for a in argv)
    overrides = [a for a in argv if not a.startswith(("ckpt=", "use_ema="))]
    from tasks.common.checkpoint import NotACheckpointError  # noqa: PLC0415
    from tasks.common.config import ConfigError  # noqa: PLC0415

    try:
        metrics = evaluate_checkpoint(ckpt, overrides, use_ema)
    except (ConfigError, NotACheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("final: " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
