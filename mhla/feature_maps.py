"""Feature maps phi applied to queries and keys before linear attention / MHLA.

MHLA and normalised linear attention need nonnegative features (the denominator ``q . z`` must stay
positive); ``identity`` is only for attentions that normalise differently (InLine).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F


def relu_feature(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``relu(x) + eps`` (the paper's default; nonnegative, strictly positive)."""
    return F.relu(x) + eps


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """``elu(x) + 1`` (MALA, RALA; strictly positive)."""
    return F.elu(x) + 1.0


def identity_feature(x: torch.Tensor) -> torch.Tensor:
    """``x`` unchanged (InLine); NOT nonnegative, so not for normalised MHLA."""
    return x


def softplus_feature(x: torch.Tensor) -> torch.Tensor:
    """``softplus(x)`` (strictly positive, smooth)."""
    return F.softplus(x)


def focused_feature(x: torch.Tensor, p: float = 3.0, eps: float = 1e-6) -> torch.Tensor:
    """FLatten's focused map (BASELINES.md section 1): ``y = relu(x) + eps``, then ``(||y|| / ||y^p||) y^p``.

    The norm is taken over the last dim; FLatten applies it to the full ``C``-dim vector before the head
    split, so call it on ``[..., C]``. Computed in fp32; nonnegative.
    """
    y = (F.relu(x) + eps).float()
    yp = y**p
    scale = y.norm(dim=-1, keepdim=True) / yp.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    return (yp * scale).to(x.dtype)


FEATURE_MAPS: dict[str, Callable[..., torch.Tensor]] = {
    "relu": relu_feature,
    "elu": elu_plus_one,
    "elu+1": elu_plus_one,
    "identity": identity_feature,
    "softplus": softplus_feature,
    "focused": focused_feature,
}

NONNEGATIVE = {"relu", "elu", "elu+1", "softplus", "focused"}


def get_feature_map(name: str, **kwargs) -> Callable[[torch.Tensor], torch.Tensor]:
    """The feature map called ``name`` (``kwargs`` bound with ``functools.partial``)."""
    try:
        fn = FEATURE_MAPS[name]
    except KeyError:
        raise ValueError(f"unknown feature map {name!r}; choose one of {sorted(FEATURE_MAPS)}") from None
    return functools.partial(fn, **kwargs) if kwargs else fn
