"""Feature maps phi applied elementwise to queries and keys ``[..., D]`` before linear attention / MHLA.

MHLA and normalised linear attention need nonnegative features (the weights ``phi(q) . phi(k)`` and the
denominator ``phi(q) . z`` must not be negative); :data:`NONNEGATIVE` lists the maps that guarantee it.
``identity`` is only for attentions that normalise differently (InLine, whose weights may be negative).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
import torch.nn.functional as F


def relu_feature(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``relu(x) + eps`` (the paper's default). Nonnegative (strictly positive for ``eps > 0``).

    ``x: [..., D]`` -> ``[..., D]``, same dtype.
    """
    return F.relu(x) + eps


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """``elu(x) + 1`` (MALA, RALA). Nonnegative (positive in exact arithmetic). ``[..., D]`` -> same."""
    return F.elu(x) + 1.0


def identity_feature(x: torch.Tensor) -> torch.Tensor:
    """``x`` unchanged (InLine). NOT nonnegative: not for normalised linear attention or MHLA."""
    return x


def softplus_feature(x: torch.Tensor) -> torch.Tensor:
    """``softplus(x)``: smooth, nonnegative. ``[..., D]`` -> ``[..., D]``."""
    return F.softplus(x)


def focused_feature(x: torch.Tensor, p: float = 3.0, eps: float = 1e-6) -> torch.Tensor:
    """FLatten's focused map (docs/baselines.md#flatten). Nonnegative.

    ``y = relu(x) + eps``, then ``f_p(y) = (||y|| / ||y^p||) * y^p`` (elementwise power, norms over the
    last dim): the norm of ``y`` is kept, its direction is pulled toward its largest coordinates.
    The caller picks the last dim: FLatten uses the full ``C``-dim vector before the head split.

    Computed in fp32 and returned in ``x.dtype``. The power is taken of ``y / max(y)`` (entries in
    ``(0, 1]``), which leaves ``f_p`` unchanged (it is invariant to the scale of ``y``) but cannot
    overflow for large inputs nor divide by an underflowed ``||y^p||``.

    Args:
        x: ``[..., D]``.
        p: focusing power (3 in all of FLatten's models).
        eps: added after the ReLU.
    """
    y = F.relu(x.float()) + eps
    u = (y / y.amax(dim=-1, keepdim=True)) ** p
    out = u * (y.norm(dim=-1, keepdim=True) / u.norm(dim=-1, keepdim=True))
    return out.to(x.dtype)


FEATURE_MAPS: dict[str, Callable[..., torch.Tensor]] = {
    "relu": relu_feature,
    "elu": elu_plus_one,
    "elu+1": elu_plus_one,
    "identity": identity_feature,
    "softplus": softplus_feature,
    "focused": focused_feature,
}

NONNEGATIVE = frozenset({"relu", "elu", "elu+1", "softplus", "focused"})


def get_feature_map(name: str, **kwargs) -> Callable[[torch.Tensor], torch.Tensor]:
    """The feature map called ``name``, with ``kwargs`` bound by ``functools.partial``.

    Example: ``get_feature_map("focused", p=3.0)``. Raises ``ValueError`` for an unknown name or a
    keyword the map does not take.
    """
    try:
        fn = FEATURE_MAPS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown feature map {name!r}; choose one of {', '.join(FEATURE_MAPS)}") from None
    if not kwargs:
        return fn
    allowed = [n for n in inspect.signature(fn).parameters if n != "x"]
    bad = sorted(set(kwargs) - set(allowed))
    if bad:
        raise ValueError(
            f"feature map {name!r} takes no option(s) {bad}; its options are {allowed or 'none'}"
        )
    return functools.partial(fn, **kwargs)
