"""Softmax attention from its definition, ``softmax(q k^T * scale) v``: the test oracle, O(T^2)."""

from __future__ import annotations

import torch


def softmax_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention written out. ``q: [B, Tq, H, D]``, ``k: [B, T, H, D]``, ``v: [B, T, H, Dv]`` ->
    ``[B, Tq, H, Dv]``; ``scale`` defaults to ``D ** -0.5``; ``causal``: query ``t`` reads keys ``s <= t``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    if causal:
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhts,bshe->bthe", scores.softmax(-1), v)
