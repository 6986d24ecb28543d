"""The dense definition of MHLA: the test oracle and the source of attention maps for analysis.

Everything here materialises the full ``T x T`` effective attention matrix, so it costs O(T^2) memory.
It is written to read like docs/method.md#mixing-matrix, not to be fast.

Effective weight of query ``t`` on key ``s`` (blocks ``i = b(t)``, ``j = b(s)``, ``b(t) = t // block_size``):

    W[t, s] = mixing[i, j] * (q_t . k_s)          (and 0 for s > t when causal)
    o_t     = sum_s W[t, s] v_s / (sum_s W[t, s] + eps)      (normalize=True)
    o_t     = sum_s W[t, s] v_s                               (normalize=False)
"""

from __future__ import annotations

import torch

from ...layouts import ceil_div
from ..utils import causal_product, check_block_size, check_eps, check_mixing, check_qkv, normalizer_mode


def _per_head_mixing(mixing: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[M, M]`` or ``[H, M, M]`` -> ``[H, M, M]``."""
    return mixing.unsqueeze(0).expand(num_heads, -1, -1) if mixing.dim() == 2 else mixing


def mhla_effective_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    mixing: torch.Tensor,
    block_size: int,
    *,
    causal: bool = False,
) -> torch.Tensor:
    """Unnormalised effective attention weights.

    Args:
        q, k: ``[B, T, H, D]`` feature-mapped queries and keys, block-major order.
        mixing: ``[M, M]`` or ``[H, M, M]``.
    Returns:
        ``W``: ``[B, H, T, T]`` with ``W[b, h, t, s] = mixing[h, b(t), b(s)] * q_t . k_s`` (causal-masked).
    """
    T, H = q.shape[1], q.shape[2]
    blocks = torch.arange(T, device=q.device) // block_size
    mix = _per_head_mixing(mixing, H).to(q.dtype)
    token_mix = mix[:, blocks][:, :, blocks]  # [H, T, T]
    scores = torch.einsum("bthd,bshd->bhts", q, k)
    weights = scores * token_mix.unsqueeze(0)
    if causal:  # a select, not a product: 0 * nan would carry a non-finite k_s to the queries t < s
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        weights = torch.where(mask, weights, 0.0)
    return weights


def mhla_attention_matrix(
    q: torch.Tensor,
    k: torch.Tensor,
    mixing: torch.Tensor,
    block_size: int,
    *,
    causal: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Row-normalised effective attention matrix ``A = W / (W.sum(-1) + eps)``: ``[B, H, T, T]``."""
    w = mhla_effective_weights(q, k, mixing, block_size, causal=causal)
    return w / (w.sum(-1, keepdim=True) + eps)


def mhla_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor,
    block_size: int,
    *,
    causal: bool = False,
    normalize=True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """MHLA from the dense definition (see the module docstring). Shapes as ``mhla_attention``.

    Causal: output ``t`` depends on the tokens ``s <= t`` only, whatever their values (a NaN or inf in a
    later ``k_s`` or ``v_s`` leaves it unchanged).

    ``normalize="official"`` reproduces the authors' release's vision normalizer (non-causal only): the
    denominator of query ``t`` (block ``i``, position ``w`` inside its block) is
    ``sum_j mixing[i, j] * (q_{j, w} . z_j) + eps``, where ``q_{j, w}`` is the query at the *same position
    of block j* and ``z_j`` the key sum of block j. Its rows do not sum to 1 (docs/method.md#vision-normaliser).
    """
    check_qkv(q, k, v)
    check_block_size(block_size)
    check_eps(eps)
    mode = normalizer_mode(normalize)
    B, T, H, D = q.shape
    nb = ceil_div(T, block_size)
    check_mixing(mixing, H, nb, square_size=None if causal else nb)
    if not causal and T % block_size:
        raise ValueError(f"non-causal MHLA needs T ({T}) to be a multiple of block_size ({block_size})")
    w = mhla_effective_weights(q, k, mixing, block_size, causal=causal)
    if causal:  # W[t, s] = 0 for s > t, and 0 * nan = nan: see causal_product
        out = causal_product(lambda x: torch.einsum("bhts,bshe->bthe", w, x), v, 1)
    else:
        out = torch.einsum("bhts,bshe->bthe", w, v)
    if mode == "paper":
        out = out / (w.sum(-1).transpose(1, 2).unsqueeze(-1) + eps)
    elif mode == "official":
        if causal:
            raise ValueError("normalize='official' is the release's vision (non-causal) normalizer")
        mix = _per_head_mixing(mixing, H).to(q.dtype)
        qb = q.reshape(B, nb, block_size, H, D)
        zb = k.reshape(B, nb, block_size, H, D).sum(2)  # [B, nb, H, D]
        qz = torch.einsum("bjwhd,bjhd->bjwh", qb, zb)  # q_{j,w} . z_j
        den = torch.einsum("hij,bjwh->biwh", mix, qz) + eps
        out = out / den.reshape(B, T, H, 1)
    return out
