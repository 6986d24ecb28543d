"""The dense definition of MHLA cross-attention: the test oracle (``O(Tq Tk)`` memory; written to be read,
not to be fast).

Effective weight of query ``t`` (block ``i = bq(t)``) on key ``s`` (block ``j = bk(s)``), blocks by
:mod:`.blocks` (``bq(t) = (t Mq) // Tq``, ``bk(s) = (s Mk) // Tk``) and ``m_s`` the key padding mask:

    W[t, s] = mixing[i, j] * (q_t . k_s) * m_s
    o_t     = sum_s W[t, s] v_s / (sum_s W[t, s] + eps)      (normalize=True)
    o_t     = sum_s W[t, s] v_s                               (normalize=False)

A masked key is removed with a select, not a product, so whatever it holds (NaN, inf) never reaches an output
or a gradient.
"""

from __future__ import annotations

import torch

from .blocks import block_ids


def mhla_cross_weights(q: torch.Tensor, k: torch.Tensor, mixing: torch.Tensor,
                       key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Unnormalised effective weights ``W [B, H, Tq, Tk]`` (module docstring). Shapes as
    :func:`mhla.ops.mhla_cross_attention`; no input checks."""
    Tq, H, Tk = q.shape[1], q.shape[2], k.shape[1]
    mix = mixing.unsqueeze(0).expand(H, -1, -1) if mixing.dim() == 2 else mixing
    Mq, Mk = mix.shape[-2:]
    token_mix = mix.to(q.dtype)[:, block_ids(Tq, Mq, q.device)][:, :, block_ids(Tk, Mk, q.device)]  # H Tq Tk
    if key_padding_mask is not None:  # (also before the product: its gradient for q reads k)
        k = torch.where(key_padding_mask[:, :, None, None], k, 0.0)
    w = torch.einsum("bthd,bshd->bhts", q, k) * token_mix.unsqueeze(0)
    if key_padding_mask is not None:
        w = torch.where(key_padding_mask[:, None, None, :], w, 0.0)
    return w


def mhla_cross_reference(q, k, v, mixing, *, key_padding_mask=None, normalize: bool = True,
                         eps: float = 1e-6) -> torch.Tensor:
    """MHLA cross-attention from the dense definition; arguments and shapes as
    :func:`mhla.ops.mhla_cross_attention` (no input checks: call it through ``backend="reference"``)."""
    w = mhla_cross_weights(q, k, mixing, key_padding_mask)
    if key_padding_mask is not None:
        v = torch.where(key_padding_mask[:, :, None, None], v, 0.0)
    out = torch.einsum("bhts,bshe->bthe", w, v)
    if normalize:
        out = out / (w.sum(-1).transpose(1, 2).unsqueeze(-1) + eps)
    return out
