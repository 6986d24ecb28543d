"""Plain linear attention from its dense definition (``W[t, s] = q_t . k_s``): the test oracle, O(T^2).

The M = 1 special case of MHLA's dense reference (:mod:`mhla.ops.mhla.naive`).
"""

from __future__ import annotations

import torch

from ..utils import causal_product


def linear_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    normalize: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Plain linear attention from its dense definition: ``W[t, s] = q_t . k_s``. Shapes as MHLA."""
    scores = torch.einsum("bthd,bshd->bhts", q, k)
    if causal:
        T = q.shape[1]
        mask = torch.ones(T, k.shape[1], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, 0.0)
        out = causal_product(lambda x: torch.einsum("bhts,bshe->bthe", scores, x), v, 1)
    else:
        out = torch.einsum("bhts,bshe->bthe", scores, v)
    if normalize:
        out = out / (scores.sum(-1).transpose(1, 2).unsqueeze(-1) + eps)
    return out


