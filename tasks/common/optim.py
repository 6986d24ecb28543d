"""Optimizer and learning-rate schedule shared by the tasks."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from mhla.hooks import optim_groups


# Weight decay of a module's own optimizer group when ``optim.<group>_weight_decay`` is not set; for MHLA's mixing
# matrix that is ``optim.mixing_weight_decay`` (configs/optim/adamw.yaml). 0, not the base weight decay: the paper
# does not say, and the matrix is a handful of nonnegative, row-normalised coefficients per layer, like the norms,
# biases and position tables that get no decay; decay would pull every coefficient toward 0, which the paper's
# normaliser (and the LM's output RMSNorm) cancels within a row, so it only shrinks the matrix toward the clamp's
# floor. The authors' release puts the matrix in its decayed parameter group (weight decay 0.05):
# ``optim.mixing_weight_decay=0.05`` runs that (docs/decisions.md#mixing-matrix-weight-decay).
GROUP_WEIGHT_DECAY = 0.0


def group_settings(cfg, group: str) -> dict:
    """``optim.<group>_lr_scale`` (default 1), ``_weight_decay`` (default :data:`GROUP_WEIGHT_DECAY`, 0) and
    ``_freeze_steps`` (default 0), validated."""
    scale = float(cfg.get(f"{group}_lr_scale", 1.0))
    if not scale >= 0:
        raise ValueError(f"optim.{group}_lr_scale must be >= 0, got {scale}")
    freeze = cfg.get(f"{group}_freeze_steps", 0) or 0
    if isinstance(freeze, bool) or not isinstance(freeze, int) or freeze < 0:
        raise ValueError(f"optim.{group}_freeze_steps must be an integer >= 0, got {freeze!r}")
    decay = cfg.get(f"{group}_weight_decay", GROUP_WEIGHT_DECAY)
    decay = GROUP_WEIGHT_DECAY if decay is None else float(decay)
    if not decay >= 0:
        raise ValueError(f"optim.{group}_weight_decay must be >= 0, got {decay}")
    return {"lr_scale": scale, "weight_decay": decay, "freeze_steps": freeze}


def param_groups(model: nn.Module, weight_decay: float, cfg=None) -> list[dict]:
    """AdamW groups: weights with decay; biases, norms and position tables without; and one group for each
    ``optim_group`` that the model's modules name (:mod:`mhla.hooks`; MHLA's mixing matrix: "mixing"),
    with the settings of :func:`group_settings` read from ``cfg`` (the ``optim`` config).

    Each group carries ``lr_scale``, which :func:`build_optimizer` multiplies into its lr (the scheduler scales
    every group alike), and ``freeze_steps``: :func:`build_scheduler` holds that group's lr at 0 for its first
    ``freeze_steps`` steps. A named group is left out when the model has no trainable parameter in it.
    """
    owner = optim_groups(model)
    decay, no_decay, named = [], [], {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in owner:
            named.setdefault(owner[id(p)], []).append(p)
        elif p.ndim <= 1 or "pos_embed" in name or name.endswith(".bias"):
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "lr_scale": 1.0, "freeze_steps": 0},
        {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0, "freeze_steps": 0},
    ]
    for group, params in named.items():
        groups.append({"params": params, "name": group, **group_settings(cfg or {}, group)})
    return groups


def build_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """``cfg``: name (adamw), lr, weight_decay, betas, eps, and the settings of the modules' optimizer groups
    (``<group>_lr_scale``, ``<group>_weight_decay``, ``<group>_freeze_steps``; MHLA: ``mixing_lr_scale``, ...)."""
    name = cfg.get("name", "adamw")
    if name != "adamw":
        raise ValueError(f"optim.name={name!r} is not supported; use adamw")
    for key in cfg:  # every group's settings are validated, also when the model has no such group
        if str(key).endswith("_lr_scale"):
            group_settings(cfg, str(key)[: -len("_lr_scale")])
    groups = param_groups(model, cfg.weight_decay, cfg)
    for g in groups:
        g["lr"] = cfg.lr * g["lr_scale"]
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=tuple(cfg.get("betas", (0.9, 0.999))),
        eps=cfg.get("eps", 1e-8),
    )


def cosine_with_warmup(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the base lr: linear warmup from 0, then cosine down to ``min_ratio``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int, steps_per_epoch: int):
    """Per-step schedule. ``cfg``: name (cosine | constant), warmup_steps or warmup_epochs, min_lr_ratio.

    A group with ``freeze_steps`` (see :func:`param_groups`) gets lr 0 before that step and the schedule after it.
    """
    name = cfg.get("name", "cosine")
    warmup = cfg.get("warmup_steps") or int(round(cfg.get("warmup_epochs", 0) * steps_per_epoch))
    warmup = min(warmup, max(0, total_steps - 1))
    if name == "cosine":
        fn = lambda s: cosine_with_warmup(s, total_steps, warmup, cfg.get("min_lr_ratio", 0.0))  # noqa: E731
    elif name == "constant":
        fn = lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0  # noqa: E731
    else:
        raise ValueError(f"sched.name={name!r} is not supported; use cosine or constant")
    fns = [fn if not g.get("freeze_steps") else _frozen_for(g["freeze_steps"], fn) for g in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fns)


def _frozen_for(steps: int, fn):
    """``fn`` with a multiplier of 0 for its first ``steps`` steps."""
    return lambda s: 0.0 if s < steps else fn(s)
