"""Gated linear attention, one token at a time: the reference the chunked form is tested against."""

from __future__ import annotations

import torch


def gla_reference(q, k, v, log_a, scale: float | None = None):
    """Reference GLA, one token at a time. ``q, k, log_a: [B, T, H, Dk]``, ``v: [B, T, H, Dv]`` -> ``[B, T, H, Dv]``.

    ``S_t = diag(exp(log_a_t)) S_{t-1} + k_t^T v_t``;  ``o_t = (scale * q_t) S_t`` (scale default ``Dk^-1/2``).
    """
    B, T, H, Dk = q.shape
    scale = Dk ** -0.5 if scale is None else scale
    S = q.new_zeros(B, H, Dk, v.shape[-1])
    out = []
    for t in range(T):
        S = S * log_a[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        out.append(torch.einsum("bhd,bhde->bhe", q[:, t] * scale, S))
    return torch.stack(out, dim=1)
