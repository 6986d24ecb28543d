"""``trainer.init_from``: start a run from another run's model weights (not its optimizer, schedule or step).

Used to fine-tune a converted / distilled model (``tasks/conversion/distill.py`` writes a checkpoint in the
format of ``train.py``; docs/conversion.md):

    python train.py task=mnist attn=mhla trainer.init_from=<run folder or checkpoint> trainer.max_steps=300

The weights must fit the model this run builds exactly (every parameter and buffer, same shapes): a mismatch
is an error that names the keys. The checkpoint's raw weights are used (``state["model"]``, not its EMA). When
the attention stored in the checkpoint's config differs from this run's, the run says so (it still loads: the
weights decide). ``trainer.resume`` wins over ``init_from`` (a resumed run loads its own checkpoint after
this).
"""

from __future__ import annotations

import torch.nn as nn

from .checkpoint import find_checkpoint, load_run_checkpoint, run_config
from .config import ConfigError, model_attention


def init_model_from(model: nn.Module, path, attention: dict | None = None, map_location="cpu") -> list[str]:
    """Load the model weights of the ``train.py`` checkpoint (or run folder) ``path`` into ``model``; returns
    the lines to print. ``attention``: this run's attention options (its :class:`mhla.registry.ResolvedAttention`'s
    ``options``, resolved once at the start of the run), to compare with the checkpoint's."""
    ckpt = find_checkpoint(path)
    state = load_run_checkpoint(ckpt, map_location=map_location)
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"trainer.init_from={path}: the checkpoint's weights do not fit this run's model (missing: "
            f"{sorted(missing)[:6]}{'...' if len(missing) > 6 else ''}; unexpected: {sorted(unexpected)[:6]}"
            f"{'...' if len(unexpected) > 6 else ''}); build the same model and attention as the checkpoint")
    lines = [f"init_from: model weights of {ckpt} (its step {state['step']}); optimizer, schedule and step "
             "start fresh"]
    if attention is not None:
        ours = dict(attention)
        try:
            theirs = model_attention(run_config(state))
        except (ConfigError, KeyError, AttributeError):
            theirs = ours
        if theirs != ours:
            lines.append(f"WARNING: init_from: the checkpoint's attention {theirs} differs from this run's "
                         f"{ours}")
    return lines
