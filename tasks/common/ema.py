"""Exponential moving average of model weights (kept in fp32, updated after each optimizer step)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn


class ModelEMA(nn.Module):
    """``ema = decay * ema + (1 - decay) * model`` for parameters and floating-point buffers (as timm's model
    EMA, which DeiT uses; constant buffers such as position tables stay constant), other buffers are copied.

    ``warmup``: use ``min(decay, (1 + step) / (10 + step))`` early on so the average is not dominated by
    the random initialisation in short runs.
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999, warmup: bool = True):
        super().__init__()
        self.module = copy.deepcopy(model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.decay = decay
        self.warmup = warmup
        self.register_buffer("num_updates", torch.zeros((), dtype=torch.long))

    def current_decay(self) -> float:
        n = int(self.num_updates)
        return min(self.decay, (1 + n) / (10 + n)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        d = self.current_decay()
        model_params = dict(model.named_parameters())
        for name, p in self.module.named_parameters():
            p.lerp_(model_params[name].detach().to(p.dtype), 1.0 - d)
        model_buffers = dict(model.named_buffers())
        for name, b in self.module.named_buffers():
            if b.is_floating_point():
                b.lerp_(model_buffers[name].detach().to(b.dtype), 1.0 - d)
            else:
                b.copy_(model_buffers[name])
        self.num_updates += 1
