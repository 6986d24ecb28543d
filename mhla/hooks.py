"""Training hooks that a model's modules provide: a training loop (the trainer, :func:`mhla.distill.distill_attention`)
knows no attention, only these names.

A module (anywhere in the model) may define:

* ``optim_group``: a class attribute naming the optimizer group of its OWN parameters (not its children's); the
  group's settings are ``optim.<group>_lr_scale`` (x the base lr, default 1), ``optim.<group>_weight_decay``
  (default 0) and ``optim.<group>_freeze_steps`` (lr 0 for that many steps, default 0). MHLA's mixing matrix
  (:class:`mhla.mixing.MixingMatrix`) is in the group ``"mixing"``.
* ``after_optimizer_step()``: called after every optimizer step (MHLA: clip the mixing matrix to [0, 1]).
* ``logged_matrices() -> {kind: tensor [R, C] or [H, R, C]}``: matrices logged as heatmaps at each evaluation, as
  ``<kind>/<name of the module's parent>`` (MHLA: ``mixing/blocks.0.attn``).
* ``regularization_loss() -> tensor or None``: a term added to the training loss after each micro-batch's forward
  (the write gate's budget, :class:`mhla.layers.WriteGate`); the module forgets it once read.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def optim_groups(model: nn.Module) -> dict[int, str]:
    """``{id(parameter): group}`` for the parameters whose module names an ``optim_group``."""
    return {id(p): m.optim_group for m in model.modules() if getattr(m, "optim_group", None)
            for p in m.parameters(recurse=False)}


def module_hooks(model: nn.Module, hook_name: str):
    """``(module name, bound hook)`` of every module below ``model`` (not ``model`` itself) that defines a callable
    ``hook_name``, in module order."""
    for name, m in model.named_modules():
        hook = getattr(m, hook_name, None)
        if callable(hook) and m is not model:
            yield name, hook


def after_optimizer_step(model: nn.Module) -> None:
    """Call every module's ``after_optimizer_step`` hook."""
    for _, hook in module_hooks(model, "after_optimizer_step"):
        hook()


@torch.no_grad()
def logged_matrices(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{"<kind>/<parent module name>": matrix}`` of every module's ``logged_matrices`` hook."""
    out = {}
    for name, hook in module_hooks(model, "logged_matrices"):
        for kind, w in hook().items():
            out[f"{kind}/{name.rpartition('.')[0] or name}"] = w
    return out


def regularization_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of every module's ``regularization_loss`` hook (None when no module gives one)."""
    terms = [term for _, hook in module_hooks(model, "regularization_loss") if (term := hook()) is not None]
    return torch.stack(terms).sum() if terms else None
