"""Softmax attention's entry point, :func:`softmax_attention`: PyTorch's SDPA with the ops' layout and
variable-length batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..utils import check_cu_seqlens, check_qkv, run_varlen


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention through ``torch.nn.functional.scaled_dot_product_attention``.

    Args:
        q: ``[B, Tq, H, D]``, k: ``[B, T, H, D]``, v: ``[B, T, H, Dv]`` (raw, not feature-mapped).
        scale: defaults to ``D ** -0.5``.
        cu_seqlens: causal only, without ``attn_mask``; ``[N + 1]`` offsets of ``N`` sequences packed as
            ``[1, total_T, ...]`` (:mod:`mhla.ops.utils.varlen`): every query reads the keys of its own
            sequence.
    Returns:
        ``[B, Tq, H, Dv]``. On CUDA, SDPA picks FlashAttention / memory-efficient kernels when it can.
    """
    check_qkv(q, k, v, same_length=False)
    if cu_seqlens is not None:
        if not causal or attn_mask is not None:
            raise ValueError("cu_seqlens (variable-length sequences) is for causal=True without attn_mask")
        check_qkv(q, k, v)
        check_cu_seqlens(cu_seqlens, q)

        def op(q, k, v, _state, _final):
            return softmax_attention(q, k, v, causal=True, scale=scale, dropout_p=dropout_p)

        return run_varlen(op, (q, k, v), cu_seqlens)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=causal,
        scale=scale,
    )
    return out.transpose(1, 2)
