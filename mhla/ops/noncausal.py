"""Non-causal MHLA in plain PyTorch (the reference fast path; O(T d^2 + M^2 d^2)).

With tokens in block-major order and ``T = M * C`` (C = block_size):

    S_b = sum_{s in b} k_s v_s^T     [D, Dv]        z_b = sum_{s in b} k_s     [D]
    S~_i = sum_b mixing[i, b] S_b                   z~_i = sum_b mixing[i, b] z_b
    o_t = q_t^T S~_i / (q_t . z~_i + eps)           for t in block i

Summaries are accumulated in fp32 whatever the input dtype; the output has the input dtype.
"""

from __future__ import annotations

import torch

from .validation import normalizer_mode


def _mix(mixing: torch.Tensor, x: torch.Tensor, pattern_tail: str) -> torch.Tensor:
    """Apply ``mixing`` ([M, M] or [H, M, M]) over the block axis (dim 1) of ``x: [B, M, H, ...]``."""
    if mixing.dim() == 2:
        return torch.einsum(f"ij,bjh{pattern_tail}->bih{pattern_tail}", mixing, x)
    return torch.einsum(f"hij,bjh{pattern_tail}->bih{pattern_tail}", mixing, x)


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
    """
    mode = normalizer_mode(normalize)
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    M = T // block_size
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    qb = q.reshape(B, M, block_size, H, D).to(acc)
    kb = k.reshape(B, M, block_size, H, D).to(acc)
    vb = v.reshape(B, M, block_size, H, Dv).to(acc)
    mix = mixing.to(acc)

    summaries = torch.einsum("bmchd,bmche->bmhde", kb, vb)  # S_b: [B, M, H, D, Dv]
    mixed = _mix(mix, summaries, "de")  # S~_i
    out = torch.einsum("bmchd,bmhde->bmche", qb, mixed)
    if mode == "paper":
        key_sums = kb.sum(2)  # z_b: [B, M, H, D]
        mixed_sums = _mix(mix, key_sums, "d")
        den = torch.einsum("bmchd,bmhd->bmch", qb, mixed_sums)
        out = out / (den.unsqueeze(-1) + eps)
    elif mode == "official":
        key_sums = kb.sum(2)
        own = torch.einsum("bmchd,bmhd->bmhc", qb, key_sums)  # q_{b,w} . z_b
        den = _mix(mix, own, "c").permute(0, 1, 3, 2)  # [B, M, C, H]
        out = out / (den.unsqueeze(-1) + eps)
    return out.reshape(B, T, H, Dv).to(v.dtype)
