"""MHLA cross-attention in PyTorch, in three steps (docs/cross_attention.md#method):

    S_j  = sum_{s in key block j} m_s k_s v_s^T      z_j = sum_{s in j} m_s k_s          (key side)
    S~_i = sum_j mixing[i, j] S_j                     z~_i = sum_j mixing[i, j] z_j       (mixing)
    o_t  = q_t^T S~_i / (q_t . z~_i + eps)            for every query t in block i        (query side)

Cost ``O(Tk D Dv + Mq Mk D Dv + Tq D Dv)`` per head and memory ``O((Mq + Mk) D Dv)`` beside the inputs: no
``Tq x Tk`` matrix. Blocks follow :mod:`.blocks` (contiguous, balanced; a plain reshape when ``M`` divides the
length, else a gather into ``[M, ceil(T / M)]`` slots). Half-precision inputs accumulate in fp32; the output
has the dtype of ``v``.
"""

from __future__ import annotations

import torch

from ..utils import accumulation_dtype
from .blocks import block_gather


def to_blocks(x: torch.Tensor,
              num_blocks: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``x [B, T, H, F]`` -> ``(blocks [B, M, C, H, F], valid [M, C] or None, position [T] or None)``;
    ``valid`` / ``position`` are None when ``M`` divides ``T`` (a view). Slots past a block's end hold a copy
    of its last token (see :func:`.blocks.block_gather`); :func:`from_blocks` takes the layout back."""
    B, T = x.shape[:2]
    if T % num_blocks == 0:
        return x.view(B, num_blocks, T // num_blocks, *x.shape[2:]), None, None
    index, valid, position = block_gather(T, num_blocks, x.device)
    return x[:, index], valid, position


def from_blocks(xb: torch.Tensor, position: torch.Tensor | None) -> torch.Tensor:
    """Inverse of :func:`to_blocks`: ``[B, M, C, H, F]`` -> ``[B, T, H, F]``."""
    flat = xb.flatten(1, 2)
    return flat if position is None else flat[:, position]


def key_summaries(k: torch.Tensor, v: torch.Tensor, num_blocks: int,
                  key_padding_mask: torch.Tensor | None = None,
                  dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block summaries of the keys: ``S [B, H, Mk, D, Dv]`` and ``z [B, H, Mk, D]`` in ``dtype`` (default: the
    accumulation dtype of ``k``). ``key_padding_mask [B, Tk]`` (True: a real key): masked keys contribute
    nothing (selected out, so a NaN in a padded position stays out)."""
    dtype = dtype or accumulation_dtype(k.dtype)
    k, v = k.to(dtype), v.to(dtype)
    if key_padding_mask is not None:
        k = torch.where(key_padding_mask[:, :, None, None], k, 0.0)
        v = torch.where(key_padding_mask[:, :, None, None], v, 0.0)
    kb, valid, _ = to_blocks(k, num_blocks)
    vb, _, _ = to_blocks(v, num_blocks)
    if valid is not None:  # the repeated slots count once: zero their keys
        kb = torch.where(valid[None, :, :, None, None], kb, 0.0)
    return torch.einsum("bjchd,bjche->bhjde", kb, vb), kb.sum(2).transpose(1, 2)


def mix_summaries(mixing: torch.Tensor, S: torch.Tensor,
                  z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``mixing [Mq, Mk]`` or ``[H, Mq, Mk]`` over ``S [B, H, Mk, D, Dv]``, ``z [B, H, Mk, D]`` ->
    ``S~ [B, H, Mq, D, Dv]``, ``z~ [B, H, Mq, D]``."""
    mix = mixing.to(S.dtype)
    if mix.dim() == 2:
        return torch.einsum("ij,bhjde->bhide", mix, S), torch.einsum("ij,bhjd->bhid", mix, z)
    return torch.einsum("hij,bhjde->bhide", mix, S), torch.einsum("hij,bhjd->bhid", mix, z)


def query_output(q: torch.Tensor, P: torch.Tensor, Pz: torch.Tensor, *, normalize: bool = True,
                 eps: float = 1e-6) -> torch.Tensor:
    """The query side: ``q [B, Tq, H, D]`` reads the mixed summaries of its block, ``P [B, H, Mq, D, Dv]``,
    ``Pz [B, H, Mq, D]`` -> ``o [B, Tq, H, Dv]`` in ``P``'s dtype."""
    qb, _, position = to_blocks(q.to(P.dtype), P.shape[2])
    out = torch.einsum("bichd,bhide->biche", qb, P)
    if normalize:
        out = out / (torch.einsum("bichd,bhid->bich", qb, Pz).unsqueeze(-1) + eps)
    return from_blocks(out, position)


def mhla_cross_torch(q, k, v, mixing, *, key_padding_mask=None, normalize: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """MHLA cross-attention on the torch path; arguments and shapes as :func:`mhla.ops.mhla_cross_attention`
    (no input checks)."""
    S, z = key_summaries(k, v, mixing.shape[-1], key_padding_mask)
    P, Pz = mix_summaries(mixing, S, z)
    return query_output(q, P, Pz, normalize=normalize, eps=eps).to(v.dtype)
