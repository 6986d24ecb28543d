#!/usr/bin/env python
"""Evaluate a checkpoint written by train.py:  python eval.py ckpt=outputs/.../checkpoints/best.pt

The run's resolved config is stored in the checkpoint; command-line overrides (e.g. ``data.root=...``,
``data.eval_batch_size=...``, ``trainer.device=cuda``) are applied on top, with Hydra's rule: a misspelled key
is an error (``+key=value`` adds a key). Uses the EMA weights when the checkpoint has them (``use_ema=false``
for the raw weights). Prints ``final: top1=... top5=...``. A file that is not a checkpoint of ``train.py`` gives
"not a checkpoint of this project: PATH".

The task is the class the stored config names in ``task.target``, picked as ``train.py`` picks it
(:func:`tasks.common.task.task_class`); a config without it needs ``+task.target=...``. A config stored before
the attention schema (``attn.*`` for every model) is mapped once, by :func:`tasks.common.config.upgrade_config`.

This file is the command line; :mod:`tasks.common.evaluation` does the work (``load_run``,
``evaluate_checkpoint``), for scripts and tests too.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tasks.common.checkpoint import NotACheckpointError  # noqa: E402
from tasks.common.config import ConfigError  # noqa: E402
from tasks.common.evaluation import evaluate_checkpoint  # noqa: E402


def main(argv: list[str]) -> int:
    ckpt = next((a.split("=", 1)[1] for a in argv if a.startswith("ckpt=")), None)
    if ckpt is None:
        print("usage: python eval.py ckpt=PATH [use_ema=false] [key=value ...]", file=sys.stderr)
        return 2
    use_ema = not any(a.lower() in ("use_ema=false", "use_ema=0") for a in argv)
    overrides = [a for a in argv if not a.startswith(("ckpt=", "use_ema="))]
    try:
        metrics = evaluate_checkpoint(ckpt, overrides, use_ema)
    except (ConfigError, NotACheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("final: " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
