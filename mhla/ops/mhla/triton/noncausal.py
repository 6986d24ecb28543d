"""Non-causal MHLA with Triton kernels: forward and backward (autograd.Function).

Math (tokens in block-major order, ``T = M * C``, token ``t`` in block ``i``):

    S_b = sum_{s in b} k_s v_s^T   [D, Dv]          z_b = sum_{s in b} k_s   [D]        (kernel)
    S~_i = sum_b Mix[i, b] S_b                      z~_i = sum_b Mix[i, b] z_b    (mix kernel, one launch)
    o_t = q_t^T S~_i / d_t,   d_t = q_t . z~_i + eps      ("none": o_t = q_t^T S~_i)  (kernel)

Backward, with ``dn_t = do_t / d_t`` and ``dd_t = -(do_t . o_t) / d_t``:

    dq_t   = S~_i dn_t + z~_i dd_t                                                      (kernel)
    dS~_i  = sum_{t in i} q_t dn_t^T,   dz~_i = sum_{t in i} q_t dd_t                   (kernel)
    dMix[i, b] = <dS~_i, S_b> + <dz~_i, z_b>     (summed over the batch, and heads if shared)
    dS_b   = sum_i Mix[i, b] dS~_i,     dz_b = sum_i Mix[i, b] dz~_i               (mix kernels)
    dk_s   = dS_b v_s + dz_b,           dv_s = dS_b^T k_s                               (kernels)

These are the ``m_i = 0`` case of the chunked kernels in :mod:`mhla.ops.mhla.triton.chunk`.
The release's ``normalize="official"`` form is not implemented here (the backend routes it to torch).
"""

from __future__ import annotations

import torch

from .chunk import (
    Geometry,
    bwd_block_grads,
    bwd_dqk,
    bwd_dv,
    fwd_block_summaries,
    fwd_output,
    mix_summaries,
    mix_summaries_backward,
    mixing_3d,
    mixing_grad_like,
)
from .utils import dot_precision, summary_dtype


class MHLANonCausalFunction(torch.autograd.Function):
    """``o = MHLA(q, k, v, mixing)`` (non-causal) with fused Triton kernels.

    Inputs: ``q, k [B, T, H, D]``, ``v [B, T, H, Dv]`` (fp16 / bf16 / fp32, one dtype), ``mixing``
    ``[M, M]`` or ``[H, M, M]`` with ``M = T / block_size``; ``normalize`` is a bool (the paper's
    denominator or none). Output ``[B, T, H, Dv]`` in the dtype of ``v``. Summaries ``S``, ``z``, ``P``, ``p`` in
    ``s_dtype`` (fp32 by default), the rest fp32.
    """

    @staticmethod
    def forward(ctx, q, k, v, mixing, block_size: int, normalize: bool, eps: float,
                s_dtype: torch.dtype = torch.float32):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        g = Geometry.make(q, v, block_size)
        B, H, NB, D, Dv = g.B, g.H, g.NB, g.D, g.Dv
        mix = mixing_3d(mixing)  # [1 or H, M, M]
        S, Z, _, _ = fwd_block_summaries(k, v, g, has_r=False, store_z=normalize, s_dtype=s_dtype)
        S = S.view(B, H, NB, D, Dv)
        Z = Z.view(B, H, NB, D) if normalize else None
        P, Pz = mix_summaries(mix, S, Z, precision=dot_precision(q.dtype), p_dtype=s_dtype)
        o, den = fwd_output(q, k, v, P, Pz, None, None, None, g, causal=False, normalize=normalize,
                            eps=eps, out_dtype=v.dtype)
        ctx.save_for_backward(q, k, v, o, mix, S, Z, P, Pz, den)
        ctx.g, ctx.normalize, ctx.mixing_meta = g, normalize, (mixing.dim(), mixing.dtype)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, mix, S, Z, P, Pz, den = ctx.saved_tensors
        g, normalize = ctx.g, ctx.normalize
        do = do.contiguous()
        dP, dPz, _, _, _, delta = bwd_block_grads(q, do, o, den, None, None, g, normalize=normalize)
        need_dmix = ctx.needs_input_grad[3]
        dS, dZ, dmix = mix_summaries_backward(mix, S, Z, dP, dPz, need_dcoeff=need_dmix,
                                              precision=dot_precision(q.dtype))
        dS = dS.reshape(g.BH, g.NB, g.D, g.Dv)
        dZ = dZ.reshape(g.BH, g.NB, g.D) if normalize else None
        dv = bwd_dv(q, k, do, den, dS, None, None, g, causal=False, normalize=normalize, out_dtype=v.dtype)
        dq, dk, _ = bwd_dqk(q, k, v, do, den, delta, P, Pz, None, None, dS, dZ, None, None, None, g,
                            causal=False, normalize=normalize, out_dtype=q.dtype)
        dmixing = mixing_grad_like(dmix, *ctx.mixing_meta) if need_dmix else None
        return dq, dk, dv, dmixing, None, None, None, None


def mhla_noncausal_triton(q, k, v, mixing, block_size: int, *, normalize: bool = True, eps: float = 1e-6):
    """Non-causal MHLA on the Triton kernels (no input checks; see :func:`mhla.ops.mhla_attention`). The
    summaries ``S``, ``z``, ``P``, ``p`` are fp32, or in the input dtype with ``MHLA_SUMMARY_DTYPE=input``
    (:func:`.utils.summary_dtype`)."""
    return MHLANonCausalFunction.apply(q, k, v, mixing, block_size, bool(normalize), float(eps),
                                       summary_dtype(q.dtype))


__all__ = ["MHLANonCausalFunction", "mhla_noncausal_triton"]
