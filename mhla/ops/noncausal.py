"""Non-causal MHLA in plain PyTorch (the reference fast path; O(T d^2 + M^2 d^2)).

With tokens in block-major order and ``T = M * C`` (C = block_size):

    S_b = sum_{s in b} k_s v_s^T     [D, Dv]        z_b = sum_{s in b} k_s     [D]
    S~_i = sum_b mixing[i, b] S_b                   z~_i = sum_b mixing[i, b] z_b
    o_t = q_t^T S~_i / (q_t . z~_i + eps)           for t in block i

Summaries are accumulated in fp32 whatever the input dtype; the output has the input dtype.
"""

from __future__ import annotations

import torch

from .validation import accumulation_dtype, normalizer_mode


def _mix(mixing: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Apply ``mixing`` ([M, M] or [H, M, M]) over the block axis of ``x: [B, H, M, F]`` -> ``[B, H, M, F]``."""
    return torch.matmul(mixing, x)  # [M, M] and [H, M, M] both broadcast over [B, H, M, F]


def mhla_noncausal_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor,
    block_size: int,
    *,
    normalize="paper",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Non-causal MHLA.

    Args:
        q, k: ``[B, T, H, D]`` (nonnegative features); v: ``[B, T, H, Dv]``; ``T = M * block_size``.
        mixing: ``[M, M]`` or ``[H, M, M]``.
        normalize: "paper" / True, "none" / False, or "official" (the release's vision normalizer).
    Returns:
        ``[B, T, H, Dv]`` in the dtype of ``v``.

    With the paper's normalizer, ``v`` is extended by a column of ones so that one matmul chain yields
    both the numerator ``q S~`` and the denominator ``q z~`` (``z_b`` is the last column of ``S_b``).
    """
    mode = normalizer_mode(normalize)
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    M, C = T // block_size, block_size
    acc = accumulation_dtype(q.dtype)

    def blocks(x):  # [B, T, H, d] -> [B, H, M, C, d]
        return x.to(acc).reshape(B, M, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    mix = mixing.to(acc)
    if mix.dim() == 3:
        mix = mix.unsqueeze(0)  # [1, H, M, M] broadcasts over the batch
    if mode == "paper":
        vb = torch.cat([vb, torch.ones_like(vb[..., :1])], dim=-1)  # [.., C, Dv + 1]
    E = vb.shape[-1]
    summaries = torch.matmul(kb.transpose(-1, -2), vb)  # S_b (and z_b): [B, H, M, D, E]
    mixed = _mix(mix, summaries.reshape(B, H, M, D * E)).reshape(B, H, M, D, E)  # S~_i
    out = torch.matmul(qb, mixed)  # [B, H, M, C, E]
    if mode == "paper":
        out = out[..., :Dv] / (out[..., Dv:] + eps)
    elif mode == "official":
        key_sums = kb.sum(-2)  # z_b: [B, H, M, D]
        own = torch.matmul(qb, key_sums.unsqueeze(-1)).squeeze(-1)  # q_{b,w} . z_b: [B, H, M, C]
        out = out / (_mix(mix, own).unsqueeze(-1) + eps)
    return out.permute(0, 2, 3, 1, 4).reshape(B, T, H, Dv).to(v.dtype)
