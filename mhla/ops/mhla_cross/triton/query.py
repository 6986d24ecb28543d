"""The query side of MHLA cross-attention as one fused Triton kernel, with its autograd Function.

Given the mixed key summaries of every query block (``P [B, H, Mq, D, Dv]``, ``Pz [B, H, Mq, D]``, fp32, from
the torch steps of :mod:`mhla.ops.mhla_cross.chunk`), the kernel computes for every query ``t`` of block ``i``

    n_t = q_t^T P_i            d_t = q_t . Pz_i + eps            o_t = n_t / d_t     (normalize; else o_t =
    n_t)

in one pass over the feature tiles, without writing the per-token products. Program ``(i_v, i_blk * NC + i_c,
b * H + h)`` owns value tile ``i_v`` of chunk ``i_c`` (``BT`` queries) of query block ``i_blk``; blocks follow
:mod:`mhla.ops.mhla_cross.blocks` (block ``i`` is ``ceil(i Tq / Mq) .. ceil((i + 1) Tq / Mq) - 1``), so any
``Tq`` works. Loads of half-precision ``q`` are cast to fp32; accumulation is fp32; the output has ``o``'s
dtype.

Backward (torch, from the saved ``q``, ``P``, ``Pz``, ``o`` and ``d``; ``dn_t = do_t / d_t``,
``dd_t = -(do_t . o_t) / d_t``):

    dq_t  = P_i dn_t + Pz_i dd_t        dP_i = sum_{t in i} q_t dn_t^T        dPz_i = sum_{t in i} q_t dd_t

The gradients of ``P`` and ``Pz`` then flow through the torch mixing and key summaries by autograd.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...mhla.triton.utils import (
    INTERPRET_AT_IMPORT,
    INTERPRETER_USABLE,
    SUPPORTED_DTYPES,
    autotune_configs,
    dot_precision,
    feature_tile,
    next_pow2,
)
from ..chunk import from_blocks, to_blocks

QUERY_TILE = 32  # queries per program (at most; a block smaller than that uses the next power of two, >= 16)


def available() -> bool:
    """True when the kernel can launch here: CUDA, or built for the CPU interpreter (``TRITON_INTERPRET=1``
    set before triton was first imported)."""
    return INTERPRETER_USABLE or torch.cuda.is_available()


@triton.autotune(configs=autotune_configs(), key=["D", "Dv", "BT", "BK", "BV", "NORMALIZE"])
@triton.jit
def _cross_query_kernel(
    q, P, Pz, o, den,
    Tq, H, D, Dv, Mq, NC, eps,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NORMALIZE: tl.constexpr, PREC: tl.constexpr,
):
    i_v, i_tc, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_blk, i_c = i_tc // NC, i_tc % NC
    i_b, i_h = i_bh // H, i_bh % H
    start = (i_blk * Tq + Mq - 1) // Mq
    end = ((i_blk + 1) * Tq + Mq - 1) // Mq
    t = start + i_c * BT + tl.arange(0, BT)
    valid = t < end
    t = tl.where(valid, t, 0)
    q_base = q + (i_b.to(tl.int64) * Tq * H + i_h) * D
    o_base = o + (i_b.to(tl.int64) * Tq * H + i_h) * Dv
    n_blk = i_bh.to(tl.int64) * Mq + i_blk
    dv = i_v * BV + tl.arange(0, BV)
    num = tl.zeros([BT, BV], dtype=tl.float32)
    dsum = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(D, BK)):
        dk = i_k * BK + tl.arange(0, BK)
        qt = tl.load(q_base + t[:, None].to(tl.int64) * H * D + dk[None, :],
                     mask=valid[:, None] & (dk < D)[None, :], other=0.0).to(tl.float32)
        p = tl.load(P + n_blk * D * Dv + dk[:, None] * Dv + dv[None, :],
                    mask=(dk < D)[:, None] & (dv < Dv)[None, :], other=0.0)
        num += tl.dot(qt, p, input_precision=PREC)
        if NORMALIZE:
            pz = tl.load(Pz + n_blk * D + dk, mask=dk < D, other=0.0)
            dsum += tl.sum(qt * pz[None, :], axis=1)
    if NORMALIZE:
        d = dsum + eps
        num = num / d[:, None]
        if i_v == 0:
            tl.store(den + i_bh.to(tl.int64) * Tq + t, d, mask=valid)
    tl.store(o_base + t[:, None].to(tl.int64) * H * Dv + dv[None, :], num.to(o.dtype.element_ty),
             mask=valid[:, None] & (dv < Dv)[None, :])


def query_forward(q: torch.Tensor, P: torch.Tensor, Pz: torch.Tensor, *, normalize: bool, eps: float,
                  out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the kernel: ``q [B, Tq, H, D]`` (contiguous), ``P [B, H, Mq, D, Dv]``, ``Pz [B, H, Mq, D]``
    (fp32, contiguous) -> ``(o [B, Tq, H, Dv] in out_dtype, d [B*H, Tq] fp32 or None)``."""
    B, Tq, H, D = q.shape
    Mq, Dv = P.shape[2], P.shape[-1]
    cmax = -(-Tq // Mq)
    BT = min(QUERY_TILE, max(16, next_pow2(cmax)))
    NC = triton.cdiv(cmax, BT)
    BK, BV = feature_tile(D), feature_tile(Dv)
    o = torch.empty(B, Tq, H, Dv, device=q.device, dtype=out_dtype)
    den = torch.empty(B * H, Tq, device=q.device, dtype=torch.float32) if normalize else o.new_empty(1)
    grid = (triton.cdiv(Dv, BV), Mq * NC, B * H)
    _cross_query_kernel[grid](q, P, Pz if normalize else P, o, den, Tq, H, D, Dv, Mq, NC, float(eps),
                              BT=BT, BK=BK, BV=BV, NORMALIZE=normalize, PREC=dot_precision(q.dtype))
    return o, (den if normalize else None)


class CrossQueryFunction(torch.autograd.Function):
    """``o = query side(q, P, Pz)`` (module docstring): forward on the kernel, backward in torch."""

    @staticmethod
    def forward(ctx, q, P, Pz, normalize: bool, eps: float, out_dtype: torch.dtype):
        q = q.contiguous()
        P, Pz = P.float().contiguous(), Pz.float().contiguous()
        o, den = query_forward(q, P, Pz, normalize=normalize, eps=eps, out_dtype=out_dtype)
        ctx.save_for_backward(q, P, Pz, o, den)
        ctx.normalize = normalize
        return o

    @staticmethod
    def backward(ctx, do):
        q, P, Pz, o, den = ctx.saved_tensors
        B, Tq, H, _ = q.shape
        Mq = P.shape[2]
        dn = do.float()
        dd = None
        if ctx.normalize:
            d = den.view(B, H, Tq).transpose(1, 2).unsqueeze(-1)  # [B, Tq, H, 1]
            dn = dn / d
            dd = -(dn * o.float()).sum(-1, keepdim=True)  # -(do . o) / d
        qb, valid, position = to_blocks(q.float(), Mq)
        dnb, _, _ = to_blocks(dn, Mq)
        if valid is not None:  # repeated slots must not count twice in the block sums
            qb = torch.where(valid[None, :, :, None, None], qb, 0.0)
        dP = torch.einsum("bichd,biche->bhide", qb, dnb)
        dq = torch.einsum("biche,bhide->bichd", dnb, P)
        dPz = None
        if ctx.normalize:
            ddb, _, _ = to_blocks(dd, Mq)
            dPz = torch.einsum("bichd,bich->bhid", qb, ddb.squeeze(-1))
            dq = dq + ddb * Pz.permute(0, 2, 1, 3).unsqueeze(2)
        else:
            dPz = torch.zeros_like(Pz)
        return from_blocks(dq, position).to(q.dtype), dP, dPz, None, None, None


def query_output_triton(q: torch.Tensor, P: torch.Tensor, Pz: torch.Tensor, *, normalize: bool = True,
                        eps: float = 1e-6, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The query side on the kernel; ``q`` fp16 / bf16 / fp32 (fp64 is the torch path's). Under the CPU
    interpreter bf16 is computed in fp32 (numpy has no bf16) and the output cast back."""
    out_dtype = out_dtype or q.dtype
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the Triton kernel takes fp16 / bf16 / fp32 queries, got {q.dtype}")
    if not INTERPRET_AT_IMPORT and not q.is_cuda:
        raise ValueError("backend='triton' runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1 set "
                         f"before import); got tensors on {q.device}")
    kernel_dtype = out_dtype
    if INTERPRET_AT_IMPORT and torch.bfloat16 in (q.dtype, out_dtype):
        q, kernel_dtype = q.float(), torch.float32
    return CrossQueryFunction.apply(q, P, Pz, bool(normalize), float(eps), kernel_dtype).to(out_dtype)
