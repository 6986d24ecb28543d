"""The mix of the block summaries, ``P_i = sum_b coeff[i, b] S_b``, for the Triton paths of MHLA.

Between the kernels of :mod:`.chunk` every form mixes the block summaries ``S_b [D, Dv]`` (and key sums
``z_b [D]``) over the blocks. Two mixers compute it, forward and backward, on summaries laid out as
``x [B, H, N, *feat]`` (``N`` columns: a state's columns, then the call's ``NB`` blocks):

* :class:`DenseMix`: a coefficient matrix ``coeff [G, NB, N]`` (``G`` = 1 shared or ``H`` per head), as a
  Triton GEMM (``tl.dot``: TF32 for half inputs, exact fp32 for fp32 inputs, :func:`.utils.dot_precision`).
  Causal: row ``i`` reads the columns ``b < first + i`` only, and the tiles above the diagonal are skipped
  (half the FLOPs); a non-finite summary is zeroed in the product and marks the rows after it, so it never
  reaches an earlier row (:func:`mhla.ops.utils.causal_product`'s convention, without its host sync).
  Cost ``O(NB * N * D * Dv)`` per head: quadratic in ``T`` by construction.
* :class:`BandedMix`: compact causal rows (:class:`mhla.ops.mhla.state.MixingRows`, window
  ``(head, recent)``). Row ``i`` reads its ``head`` first blocks and its ``recent`` latest blocks by their own
  coefficients and the sum of every other earlier block, ``F_i``, by one shared one:

      P_i = sum_{b < head} head[i, b] S_b + sum_{d < recent} recent[i, d] S_{i-1-d} + far[i] F_i,
      F_i = sum_{head <= b < i - recent} S_b                 (an exclusive prefix sum over the blocks)

  (the ``recent`` terms for blocks ``>= head`` only). Fused kernels (:mod:`.banded`): one walk over row tiles
  of ``Tr >= recent`` blocks, each tile's band a GEMM on its own and the previous tile of blocks, the far part
  a running sum; its torch reference: the head part one batched GEMM, the recent part a banded GEMM on the
  same tiles, the far part one ``cumsum``. Cost ``O(NB * (head + recent) * D * Dv)`` per head: linear in
  ``T``. A state's columns join in block order: its kept head blocks, its folded sum (one column that is part
  of every row's ``F_i``), its kept recent blocks.

Both mixers keep a causal sum causal whatever the values: a NaN or inf in column ``b`` reaches the rows
after it only. Backward: :meth:`DenseMix.backward` runs two more GEMM kernels (``dx = coeff^T dP``,
``dcoeff = dP x^T`` summed over the batch, and over the heads when shared); :meth:`BandedMix.backward` runs
two more kernels (:mod:`.banded`: the coefficient gradients, then ``dx``; its reference recomputes the forward
under autograd).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...utils import causal_product
from .banded import banded_mix, banded_mix_backward, fused_supported
from .utils import autotune, autotune_configs, device_helper, next_pow2

# ------------------------------------------------------------------------------------------- GEMM kernels

_BIG: tl.constexpr = tl.constexpr(2**30)  # "no non-finite column yet"
_MIX_KEY = ["F1", "F2", "CAUSAL", "BM", "BK", "BN", "FT", "W_ONCE"]


@device_helper
def _part(i_n, NF1, X1, X2, P1, P2, F1, F2, BN: tl.constexpr):
    """Feature tile ``i_n`` of the two parts laid end to end (part 1's ``NF1`` tiles, then part 2's): the part's
    ``X`` and ``P`` base pointers, its feature count, and the tile's first feature."""
    if i_n < NF1:
        x, p, F, f0 = X1, P1, F1, i_n * BN
    else:
        x, p, F, f0 = X2, P2, F2, (i_n - NF1) * BN
    return x, p, F, f0


@triton.autotune(configs=autotune_configs(), key=_MIX_KEY)
@triton.jit
def _mix_fwd_kernel(
    W, X1, P1, X2, P2, NB, N, F1, F2, H, stride_wg, stride_wr, stride_wc, COL0,
    BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, FT: tl.constexpr, W_ONCE: tl.constexpr,
    CAUSAL: tl.constexpr, PREC: tl.constexpr,
):
    """``P[bh, i, f] = sum_b W[g, i, b] X[bh, b, f]`` for ``FT`` tiles ``[BM, BN]``; program ``(i_m, i_t, bh)``.

    Two parts in one launch (the summaries ``S`` and the key sums ``z``): ``X1 [B*H, N, F1]`` -> ``P1 [B*H, NB,
    F1]`` and ``X2 [B*H, N, F2]`` -> ``P2`` (``F2 = 0``: none), contiguous, fp32 or all in one half dtype
    (opt-in half summaries: loaded as fp32, rounded at the store); their feature tiles are numbered
    end to end and program ``i_t`` owns tiles ``i_t * FT ..``. ``W [G, NB, N]`` in any float dtype (read as fp32),
    strides ``stride_wg`` (0 when shared; ``g = bh % H``), ``stride_wr``, ``stride_wc``. ``W_ONCE`` (``N <=
    BK``): the program loads its ``[BM, BK]`` coefficient tile once for all its feature tiles. ``CAUSAL``: row
    ``i`` reads ``b < i + COL0`` only; the loop stops at the last column the tile's rows read, non-finite values
    of ``X`` are zeroed in the product and mark the rows after their column NaN.
    """
    i_m, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = i_m * BM + tl.arange(0, BM)
    w_base = W + (i_bh % H).to(tl.int64) * stride_wg
    NF1 = tl.cdiv(F1, BN)
    NF = NF1 + tl.cdiv(F2, BN)
    k_end = N
    if CAUSAL:
        k_end = tl.minimum(N, COL0 + i_m * BM + BM - 1)  # the last row of the tile reads b < its index + COL0
    w_once = tl.zeros([BM, BK], dtype=tl.float32)
    if W_ONCE:
        cols = tl.arange(0, BK)
        w_mask = (rows < NB)[:, None] & (cols < N)[None, :]
        if CAUSAL:
            w_mask = w_mask & (cols[None, :] < rows[:, None] + COL0)
        w_once = tl.load(w_base + rows[:, None].to(tl.int64) * stride_wr + cols[None, :] * stride_wc,
                         mask=w_mask, other=0.0).to(tl.float32)
    for it in range(FT):
        i_n = i_t * FT + it
        if i_n < NF:
            X, P, F, f0 = _part(i_n, NF1, X1, X2, P1, P2, F1, F2, BN)
            feats = f0 + tl.arange(0, BN)
            x_base = X + i_bh.to(tl.int64) * N * F
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            first_bad = tl.full([BN], _BIG, dtype=tl.int32)
            for k0 in range(0, k_end, BK):
                cols = k0 + tl.arange(0, BK)
                if W_ONCE:
                    w = w_once
                else:
                    w_mask = (rows < NB)[:, None] & (cols < N)[None, :]
                    if CAUSAL:
                        w_mask = w_mask & (cols[None, :] < rows[:, None] + COL0)
                    w = tl.load(w_base + rows[:, None].to(tl.int64) * stride_wr + cols[None, :] * stride_wc,
                                mask=w_mask, other=0.0).to(tl.float32)
                x = tl.load(x_base + cols[:, None].to(tl.int64) * F + feats[None, :],
                            mask=(cols < N)[:, None] & (feats < F)[None, :], other=0.0).to(tl.float32)
                if CAUSAL:  # 0 * nan = nan: multiply the finite values only, remember where the others are
                    finite = tl.abs(x) < float("inf")
                    first_bad = tl.minimum(first_bad, tl.min(tl.where(finite, _BIG, cols[:, None]), axis=0))
                    x = tl.where(finite, x, 0.0)
                acc += tl.dot(w, x, input_precision=PREC)
            if CAUSAL:
                acc = tl.where(first_bad[None, :] < rows[:, None] + COL0, float("nan"), acc)
            tl.store(P + i_bh.to(tl.int64) * NB * F + rows[:, None].to(tl.int64) * F + feats[None, :], acc,
                     mask=(rows < NB)[:, None] & (feats < F)[None, :])


@triton.autotune(configs=autotune_configs(), key=_MIX_KEY)
@triton.jit
def _mix_bwd_dx_kernel(
    W, dP1, dX1, dP2, dX2, NB, N, F1, F2, H, stride_wg, stride_wr, stride_wc, COL0,
    BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, FT: tl.constexpr, W_ONCE: tl.constexpr,
    CAUSAL: tl.constexpr, PREC: tl.constexpr,
):
    """``dX[bh, b, f] = sum_i W[g, i, b] dP[bh, i, f]`` for ``FT`` tiles ``[BK, BN]``; program ``(i_k, i_t, bh)``.

    Parts, ``FT`` and strides as ``_mix_fwd_kernel``; ``W_ONCE`` (``NB <= BM``): the ``[BK, BM]`` coefficient
    tile is loaded once. ``CAUSAL``: only the rows ``i > b - COL0`` read column ``b``; the loop starts at the
    first of them (with ``W_ONCE`` at row 0: one step, masked).
    """
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = i_k * BK + tl.arange(0, BK)
    w_base = W + (i_bh % H).to(tl.int64) * stride_wg
    NF1 = tl.cdiv(F1, BN)
    NF = NF1 + tl.cdiv(F2, BN)
    i_start = 0
    if CAUSAL:
        if not W_ONCE:
            i_start = tl.maximum(0, i_k * BK - COL0 + 1)
    wt_once = tl.zeros([BK, BM], dtype=tl.float32)
    if W_ONCE:
        rows = tl.arange(0, BM)
        w_mask = (rows < NB)[None, :] & (cols < N)[:, None]
        if CAUSAL:
            w_mask = w_mask & (cols[:, None] < rows[None, :] + COL0)
        wt_once = tl.load(w_base + rows[None, :].to(tl.int64) * stride_wr + cols[:, None] * stride_wc,
                          mask=w_mask, other=0.0).to(tl.float32)  # [BK, BM]
    for it in range(FT):
        i_n = i_t * FT + it
        if i_n < NF:
            dP, dX, F, f0 = _part(i_n, NF1, dP1, dP2, dX1, dX2, F1, F2, BN)
            feats = f0 + tl.arange(0, BN)
            dp_base = dP + i_bh.to(tl.int64) * NB * F
            acc = tl.zeros([BK, BN], dtype=tl.float32)
            for i0 in range(i_start, NB, BM):
                rows = i0 + tl.arange(0, BM)
                if W_ONCE:
                    wt = wt_once
                else:
                    w_mask = (rows < NB)[None, :] & (cols < N)[:, None]
                    if CAUSAL:
                        w_mask = w_mask & (cols[:, None] < rows[None, :] + COL0)
                    wt = tl.load(w_base + rows[None, :].to(tl.int64) * stride_wr + cols[:, None] * stride_wc,
                                 mask=w_mask, other=0.0).to(tl.float32)  # [BK, BM]
                dp = tl.load(dp_base + rows[:, None].to(tl.int64) * F + feats[None, :],
                             mask=(rows < NB)[:, None] & (feats < F)[None, :], other=0.0)
                acc += tl.dot(wt, dp, input_precision=PREC)
            tl.store(dX + i_bh.to(tl.int64) * N * F + cols[:, None].to(tl.int64) * F + feats[None, :], acc,
                     mask=(cols < N)[:, None] & (feats < F)[None, :])


# 4 warps only: the causal variant spills 8 bytes at 8 warps x 2 stages on sm_90; sm_80: 2 stages only (with both
# parts it spills at 3 there, results/bench/kernel_resources.md)
@autotune(key=["F1", "F2", "CAUSAL", "BM", "BK", "BN"], warps=(4,), sm80=[(4, 2)])
@triton.jit
def _mix_bwd_dw_kernel(
    X1, dP1, X2, dP2, dW, NB, N, F1, F2, H, MEMBERS, STEP, SPLIT, COL0,
    BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
):
    """Partial ``dW[s, g, i, b] = sum_{n = s, s + SPLIT, ..} sum_f dP[bh, i, f] X[bh, b, f]``, ``bh = n * STEP
    + g`` (``MEMBERS`` summaries per coefficient group: the batch, times the heads when shared), over the
    features of both parts (``X1, dP1``: ``F1``; ``X2, dP2``: ``F2``, 0 for none).

    Program ``(tile, g * SPLIT + s)`` owns the ``[BM, BK]`` tile ``tile`` of ``[NB, N]``. ``CAUSAL``: entries
    ``b >= i + COL0`` are 0, and a tile holding only those reads nothing.
    """
    i_t, i_gs = tl.program_id(0), tl.program_id(1)
    n_k = tl.cdiv(N, BK)
    i_m, i_k = i_t // n_k, i_t % n_k
    g, s = i_gs // SPLIT, i_gs % SPLIT
    rows = i_m * BM + tl.arange(0, BM)
    cols = i_k * BK + tl.arange(0, BK)
    n_end = MEMBERS
    if CAUSAL:
        n_end = tl.where(i_k * BK >= COL0 + i_m * BM + BM - 1, 0, MEMBERS)  # the tile is above the diagonal
    acc = tl.zeros([BM, BK], dtype=tl.float32)
    for n in range(s, n_end, SPLIT):
        bh = (n * STEP + g).to(tl.int64)
        for f0 in range(0, F1, BN):
            feats = f0 + tl.arange(0, BN)
            dp = tl.load(dP1 + bh * NB * F1 + rows[:, None].to(tl.int64) * F1 + feats[None, :],
                         mask=(rows < NB)[:, None] & (feats < F1)[None, :], other=0.0)
            x = tl.load(X1 + bh * N * F1 + cols[:, None].to(tl.int64) * F1 + feats[None, :],
                        mask=(cols < N)[:, None] & (feats < F1)[None, :], other=0.0).to(tl.float32)
            acc += tl.dot(dp, tl.trans(x), input_precision=PREC)
        for f0 in range(0, F2, BN):
            feats = f0 + tl.arange(0, BN)
            dp = tl.load(dP2 + bh * NB * F2 + rows[:, None].to(tl.int64) * F2 + feats[None, :],
                         mask=(rows < NB)[:, None] & (feats < F2)[None, :], other=0.0)
            x = tl.load(X2 + bh * N * F2 + cols[:, None].to(tl.int64) * F2 + feats[None, :],
                        mask=(cols < N)[:, None] & (feats < F2)[None, :], other=0.0).to(tl.float32)
            acc += tl.dot(dp, tl.trans(x), input_precision=PREC)
    if CAUSAL:  # a select, not a product: a non-finite later column stays out of the kept entries
        acc = tl.where(cols[None, :] < rows[:, None] + COL0, acc, 0.0)
    base = dW + ((s * (tl.num_programs(1) // SPLIT) + g).to(tl.int64) * NB) * N
    tl.store(base + rows[:, None].to(tl.int64) * N + cols[None, :], acc,
             mask=(rows < NB)[:, None] & (cols < N)[None, :])


# -------------------------------------------------------------------------------------------- GEMM host

#: the coefficient matrix is held in registers (loaded once per program) when its blocks fit one tile
W_ONCE_MAX = 64
#: feature tiles per program when the coefficients are held (their loads amortised over this many tiles)
W_ONCE_TILES = 8


def _tiles(NB: int, N: int, F: int, kind: str = "fwd") -> tuple[int, int, int]:
    """``(BM, BK, BN)`` of the ``kind`` kernel (``"fwd"``, ``"dx"``, ``"dw"``): rows, columns (blocks) and
    features per tile; every one >= 16 (``tl.dot``).

    When both ``NB`` and ``N`` fit :data:`W_ONCE_MAX`, ``fwd`` and ``dx`` take one tile of rows and one of
    columns (the coefficients read once per program, :func:`w_once`). Otherwise the tile that sets the re-reads
    is widened: ``fwd`` rows of up to 128 (the summaries are re-read once per row tile), ``dx`` columns of up
    to 64 (``dP`` is re-read once per column tile). ``dw`` keeps ``[64, 32]`` (``[64, 64]`` spills registers on
    sm_80 at 4 warps, results/bench/kernel_resources.md)."""
    BN = min(64, max(16, next_pow2(F)))
    if kind != "dw" and w_once(NB, N):
        return max(16, next_pow2(NB)), max(16, next_pow2(N)), BN
    BM = min(128 if kind == "fwd" else 64, max(16, next_pow2(NB)))
    BK = min(64 if kind == "dx" else 32, max(16, next_pow2(N)))
    return BM, BK, BN


def w_once(NB: int, N: int) -> bool:
    """Whether the mix kernels hold the coefficient tile for all their feature tiles (one row and one column
    tile: ``NB, N <= W_ONCE_MAX``)."""
    return max(NB, N) <= W_ONCE_MAX


def feature_tiles_per_program(NB: int, N: int) -> int:
    return W_ONCE_TILES if w_once(NB, N) else 1


#: programs the coefficient-gradient kernel aims for (about two per SM of an H100): the sum over the batch
#: and heads is split into that many partial sums when the tiles alone are fewer
_TARGET_PROGRAMS = 256


def _strides(coeff: torch.Tensor) -> tuple[int, int, int]:
    """``(stride_wg, stride_wr, stride_wc)`` of ``coeff [G, NB, N]``: the group stride 0 when shared."""
    return (coeff.stride(0) if coeff.shape[0] > 1 else 0), coeff.stride(1), coeff.stride(2)


def _summaries(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernels read it: contiguous, fp32 or a half dtype (opt-in half summaries,
    :data:`.utils.SUMMARY_DTYPE_ENV`; the kernels load it as fp32)."""
    return (x if x.dtype in (torch.float32, torch.float16, torch.bfloat16) else x.float()).contiguous()


def mix_gemm_parts(coeff: torch.Tensor, xs: list, *, causal: bool, first: int = 0,
                   precision: str = "ieee", out_dtype: torch.dtype = torch.float32) -> list:
    """``P[bh, i] = sum_b coeff[g, i, b] x[bh, b]`` for one or two ``x`` (summaries and key sums) in one launch
    of ``_mix_fwd_kernel`` on the GPU's matrix units.

    Args:
        coeff: ``[G, NB, N]`` (``G`` = 1 shared, or ``H``), any float dtype and strides (read as fp32 in the
            kernel: no cast, no copy); xs: one or two ``[B, H, N, F]`` fp32 (or None for an absent second).
        causal: row ``i`` reads the columns ``b < first + i`` only (whatever ``coeff`` holds elsewhere), and a
            non-finite ``x[b, f]`` makes ``P[i, f]`` NaN for the rows ``i`` after it, never before.
        precision: ``tl.dot``'s ``input_precision`` (:func:`.utils.dot_precision`).
        out_dtype: of ``P`` (fp32, or a half dtype for opt-in half summaries; fp32 accumulation, rounded at
            the store). The two parts must share a dtype (the kernel picks a part's pointers in a branch).
    Returns:
        ``[P [B, H, NB, F]`` in ``out_dtype`` per ``x`` (None for None)].
    """
    parts = [x for x in xs if x is not None]
    assert 1 <= len(parts) <= 2
    x1 = _summaries(parts[0])
    x2 = _summaries(parts[1]) if len(parts) > 1 else None
    B, H, N, F1 = x1.shape
    F2 = 0 if x2 is None else x2.shape[-1]
    G, NB, _ = coeff.shape
    p1 = torch.empty(B, H, NB, F1, device=x1.device, dtype=out_dtype)
    p2 = None if x2 is None else torch.empty(B, H, NB, F2, device=x1.device, dtype=out_dtype)
    BM, BK, BN = _tiles(NB, N, max(F1, F2), "fwd")
    FT = feature_tiles_per_program(NB, N)
    NF = triton.cdiv(F1, BN) + triton.cdiv(F2, BN)
    _mix_fwd_kernel[(triton.cdiv(NB, BM), triton.cdiv(NF, FT), B * H)](
        coeff, x1, p1, x1 if x2 is None else x2, p1 if p2 is None else p2, NB, N, F1, F2, H, *_strides(coeff),
        first, BM=BM, BK=BK, BN=BN, FT=FT, W_ONCE=w_once(NB, N), CAUSAL=causal, PREC=precision,
    )
    out = iter([p1, p2])
    return [None if x is None else next(out) for x in xs]


def mix_gemm(coeff: torch.Tensor, x: torch.Tensor, *, causal: bool, first: int = 0,
             precision: str = "ieee") -> torch.Tensor:
    """:func:`mix_gemm_parts` of one ``x [B, H, N, F]``: ``P [B, H, NB, F]`` fp32."""
    return mix_gemm_parts(coeff, [x], causal=causal, first=first, precision=precision)[0]


def mix_gemm_parts_backward(coeff: torch.Tensor, xs: list, dps: list, *, causal: bool, first: int = 0,
                            precision: str = "ieee", need_dcoeff: bool = True):
    """Backward of :func:`mix_gemm_parts`: ``([dx [B, H, N, F]] per x, dcoeff [G, NB, N] fp32)``, ``dcoeff`` the
    sum over the parts of ``dP x^T`` summed over the batch, and over the heads when ``G == 1`` (zero where
    ``causal`` reads nothing; None unless ``need_dcoeff``). One launch of ``_mix_bwd_dx_kernel`` and one of
    ``_mix_bwd_dw_kernel`` for both parts."""
    keep = [n for n, x in enumerate(xs) if x is not None]
    assert 1 <= len(keep) <= 2
    x1, dp1 = _summaries(xs[keep[0]]), dps[keep[0]].float().contiguous()
    two = len(keep) > 1
    x2 = _summaries(xs[keep[1]]) if two else x1
    dp2 = dps[keep[1]].float().contiguous() if two else dp1
    B, H, N, F1 = x1.shape
    F2 = x2.shape[-1] if two else 0
    G, NB, _ = coeff.shape
    BM, BK, BN = _tiles(NB, N, max(F1, F2), "dx")
    FT = feature_tiles_per_program(NB, N)
    NF = triton.cdiv(F1, BN) + triton.cdiv(F2, BN)
    dx1 = torch.empty(B, H, N, F1, device=x1.device, dtype=torch.float32)
    dx2 = torch.empty(B, H, N, F2, device=x1.device, dtype=torch.float32) if two else dx1
    _mix_bwd_dx_kernel[(triton.cdiv(N, BK), triton.cdiv(NF, FT), B * H)](
        coeff, dp1, dx1, dp2, dx2, NB, N, F1, F2, H, *_strides(coeff), first,
        BM=BM, BK=BK, BN=BN, FT=FT, W_ONCE=w_once(NB, N), CAUSAL=causal, PREC=precision,
    )
    dxs = [None] * len(xs)
    dxs[keep[0]] = dx1
    if two:
        dxs[keep[1]] = dx2
    if not need_dcoeff:
        return dxs, None
    members, step = (B, H) if G > 1 else (B * H, 1)
    BM, BK, BN = _tiles(NB, N, max(F1, F2), "dw")
    tiles = triton.cdiv(NB, BM) * triton.cdiv(N, BK)
    split = max(1, min(members, _TARGET_PROGRAMS // (tiles * G)))
    dW = torch.empty(split, G, NB, N, device=x1.device, dtype=torch.float32)
    _mix_bwd_dw_kernel[(tiles, G * split)](
        x1, dp1, x2, dp2, dW, NB, N, F1, F2, H, members, step, split, first,
        BM=BM, BK=BK, BN=BN, CAUSAL=causal, PREC=precision,
    )
    return dxs, dW.sum(0)


def mix_gemm_backward(coeff: torch.Tensor, x: torch.Tensor, dP: torch.Tensor, *, causal: bool, first: int = 0,
                      precision: str = "ieee", need_dcoeff: bool = True):
    """Backward of :func:`mix_gemm`: ``dx [B, H, N, F]`` and ``dcoeff [G, NB, N]`` (``dP x^T`` summed over the
    batch, and over the heads when ``G == 1``; zero where ``causal`` reads nothing; None unless
    ``need_dcoeff``)."""
    (dx,), dcoeff = mix_gemm_parts_backward(coeff, [x], [dP], causal=causal, first=first, precision=precision,
                                            need_dcoeff=need_dcoeff)
    return dx, dcoeff


# ------------------------------------------------------------------------------------------------ mixers


def _flat(x: torch.Tensor | None) -> torch.Tensor | None:
    """``[B, H, N, *feat]`` -> ``[B, H, N, prod(feat)]``."""
    return None if x is None else x.reshape(*x.shape[:3], -1)


@dataclass(frozen=True)
class DenseMix:
    """The mix by a coefficient matrix ``coeff [G, NB, N]`` (:func:`mix_gemm`); ``coefficients = (coeff,)``.

    ``causal``: row ``i`` reads the columns before ``first + i`` (``first``: the state's columns, before
    row 0's own block). ``precision``: of the GEMM (:func:`.utils.dot_precision` of the input dtype).
    """

    causal: bool
    first: int = 0
    precision: str = "ieee"
    p_dtype: torch.dtype = torch.float32  # of the mixed summaries P and key sums p

    def mix(self, coefficients, xs):
        """``xs``: summaries ``[B, H, N, *feat]`` (or None) -> mixed ``[B, H, NB, *feat]`` (or None); the two
        parts (summaries and key sums) in one launch (:func:`mix_gemm_parts`)."""
        (coeff,) = coefficients
        if all(x is None for x in xs):
            return [None] * len(xs)
        ps = mix_gemm_parts(coeff, [_flat(x) for x in xs], causal=self.causal, first=self.first,
                            precision=self.precision, out_dtype=self.p_dtype)
        return [None if x is None else p.view(*x.shape[:2], -1, *x.shape[3:]) for x, p in zip(xs, ps)]

    def backward(self, coefficients, xs, dps, need_dcoeff: bool):
        """Gradients of :meth:`mix`: ``(dxs, dcoefficients)`` (``dcoefficients`` None unless ``need_dcoeff``)."""
        (coeff,) = coefficients
        if all(x is None for x in xs):
            return [None] * len(xs), None
        dxs, dcoeff = mix_gemm_parts_backward(coeff, [_flat(x) for x in xs],
                                              [None if dp is None else _flat(dp) for dp in dps],
                                              causal=self.causal, first=self.first, precision=self.precision,
                                              need_dcoeff=need_dcoeff)
        dxs = [None if x is None else dx.view(x.shape) for x, dx in zip(xs, dxs)]
        return dxs, (None if dcoeff is None else (dcoeff,))


def band_tile(recent: int) -> int:
    """Rows per tile of the banded part of :class:`BandedMix`: a power of two ``>= recent`` (and >= 16), so
    that a tile's rows read only its own and the previous tile's blocks."""
    return max(16, next_pow2(recent))


@dataclass(frozen=True)
class BandedMix:
    """The mix by compact causal rows (:class:`mhla.ops.mhla.state.MixingRows`) in linear time.

    ``coefficients = (head [G, NB, window[0]], recent [G, NB, window[1]], far [G, NB])`` of the call's rows
    ``first .. first + NB - 1`` (:meth:`MixingRows.rows`). The summaries' columns, in block order: the state's
    ``kept_head`` first blocks, its folded far sum when ``folded``, its ``kept_recent`` latest finished blocks
    (:func:`mhla.ops.mhla.state.kept_blocks`), then the call's ``rows`` blocks (``first`` = the state's
    finished blocks).

    :meth:`mix` and :meth:`backward` run the fused kernels of :mod:`.banded` (one launch forward; one backward,
    and a torch sum of its partial coefficient gradients) when :meth:`fused` says they cover the call (summaries
    in fp32 / fp16 / bf16, ``window`` within :data:`.banded.MAX_HEAD` / :data:`.banded.MAX_RECENT`); otherwise, and
    in :meth:`mix_reference` / :meth:`backward_reference`, the torch reference (``_mix_finite`` under
    :func:`~mhla.ops.utils.causal_product`). ``precision``: ``tl.dot``'s input precision in the forward and dx
    kernels (``tf32x3``: about fp32 accuracy on the tensor cores; :mod:`.banded`). ``p_dtype``: the dtype the
    causal Function stores the call's block summaries in (fp32, or the input's with the opt-in
    ``MHLA_SUMMARY_DTYPE=input``, which :func:`~.causal.mhla_causal_triton` sets; ``P`` follows them, the
    gradients stay fp32).
    """

    window: tuple[int, int]
    first: int = 0
    kept_head: int = 0
    folded: bool = False
    kept_recent: int = 0
    rows: int = 1
    precision: str = "tf32x3"
    p_dtype: torch.dtype = torch.float32

    @property
    def state_columns(self) -> int:
        return self.kept_head + int(self.folded) + self.kept_recent

    def _mix_finite(self, head, recent, far, x):
        """:meth:`mix` of one ``x [B, H, L, F]`` whose values are finite."""
        B, H, _, F = x.shape
        NB, first, kr = self.rows, self.first, self.kept_recent
        n_head, n_recent = self.window
        dev = x.device
        row = torch.arange(NB, device=dev)
        P = x.new_zeros(B, H, NB, F)
        # head: the first blocks by their index (kept by the state, or this call's blocks), b < i only
        nh = max(0, min(n_head, first + NB - 1))
        if nh:
            b = torch.arange(nh, device=dev)
            pos = torch.where(b < self.kept_head, b, self.state_columns + b - first)
            w = torch.where(b[None, :] < first + row[:, None], head[..., :nh], 0.0)  # [G, NB, nh]
            P = P + torch.matmul(w, x[:, :, pos])
        # recent: block i - 1 - d by distance, for the blocks past the head. Z holds the blocks from Tr - kr
        # before the call's first one; row r's own block is Z[Tr + r], and tile t of Tr rows reads the Z tiles
        # t and t + 1.
        if n_recent:
            Tr = band_tile(n_recent)
            NT = triton.cdiv(NB, Tr)
            tail = x[:, :, self.state_columns - kr:]  # [B, H, kr + NB, F]
            Z = torch.nn.functional.pad(tail, (0, 0, Tr - kr, (NT + 1) * Tr - (Tr - kr) - tail.shape[2]))
            Zt = Z.view(B, H, NT + 1, Tr, F)
            w = self._band(recent, Tr, NT)  # [G, NT, Tr, 2 Tr]
            band = torch.matmul(w[..., :Tr], Zt[:, :, :NT]) + torch.matmul(w[..., Tr:], Zt[:, :, 1:])
            P = P + band.reshape(B, H, NT * Tr, F)[:, :, :NB]
        # far: the blocks head <= b < i - recent (the folded sum among them) through one prefix sum
        lo = self.kept_head + min(max(n_head - first, 0), NB)  # columns of the head blocks
        hi = (self.state_columns - kr + (row + kr - n_recent).clamp(0, kr + NB)).clamp(min=lo)
        prefix = torch.cat([x.new_zeros(B, H, 1, F), x[:, :, lo:].cumsum(2)], dim=2)  # sums of x[lo:lo+j]
        return P + far.unsqueeze(-1) * prefix[:, :, hi - lo]

    def _band(self, recent: torch.Tensor, Tr: int, NT: int) -> torch.Tensor:
        """The recent coefficients as ``[G, NT, Tr, 2 Tr]``: tile ``t``, row ``a`` (row ``r = t Tr + a``) on the
        ``2 Tr`` blocks of Z tiles ``t`` and ``t + 1``; block ``i - 1 - d`` is column ``Tr + a - 1 - d``."""
        G, NB, n_recent = recent.shape
        dev = recent.device
        r = torch.arange(NT * Tr, device=dev)[:, None]
        d = torch.arange(n_recent, device=dev)[None, :]
        b = self.first + r - 1 - d  # the block read
        valid = (r < NB) & (b >= self.window[0]) & (b >= 0)
        src = torch.where(valid, torch.nn.functional.pad(recent, (0, 0, 0, NT * Tr - NB)), 0.0)
        col = (Tr + r % Tr - 1 - d).expand(G, -1, -1)
        w = recent.new_zeros(G, NT * Tr, 2 * Tr).scatter(-1, col, src)
        return w.view(G, NT, Tr, 2 * Tr)

    def _mix_one(self, coefficients, x):
        head, recent, far = (c.to(x.dtype) for c in coefficients)
        flat = _flat(x)
        P = causal_product(lambda y: self._mix_finite(head, recent, far, y), flat, 2, strict=True, lazy=False)
        return P.view(*x.shape[:2], self.rows, *x.shape[3:])

    def fused(self, xs) -> bool:
        """Whether :meth:`mix` / :meth:`backward` run the kernels of :mod:`.banded`
        (:func:`.banded.fused_supported`: the summaries' dtype and the window), not the torch reference."""
        dtypes = {x.dtype for x in xs if x is not None}
        return len(dtypes) == 1 and fused_supported(self.window, dtypes.pop())

    def _kernel_layout(self) -> dict:
        return dict(window=self.window, first=self.first, kept_head=self.kept_head, folded=self.folded,
                    kept_recent=self.kept_recent, rows=self.rows, precision=self.precision)

    def mix(self, coefficients, xs):
        """``xs``: summaries ``[B, H, N, *feat]`` (``N = state_columns + rows``, or None) -> mixed
        ``[B, H, rows, *feat]`` (or None); both parts in one kernel launch (:func:`.banded.banded_mix`)."""
        if all(x is None for x in xs):
            return [None] * len(xs)
        if not self.fused(xs):
            return self.mix_reference(coefficients, xs)
        ps = banded_mix(coefficients, [_flat(x) for x in xs], **self._kernel_layout())
        return [None if x is None else p.view(*x.shape[:2], self.rows, *x.shape[3:]) for x, p in zip(xs, ps)]

    def backward(self, coefficients, xs, dps, need_dcoeff: bool):
        """Gradients of :meth:`mix`: ``(dxs, dcoefficients)`` (``dcoefficients = (dhead, drecent, dfar)`` in the
        coefficients' dtypes, None unless ``need_dcoeff``), by :func:`.banded.banded_mix_backward`."""
        if all(x is None for x in xs):
            return [None] * len(xs), None
        if not self.fused(xs):
            return self.backward_reference(coefficients, xs, dps, need_dcoeff)
        dxs, dcs = banded_mix_backward(coefficients, [_flat(x) for x in xs],
                                       [None if dp is None else _flat(dp) for dp in dps],
                                       need_dcoeff=need_dcoeff, **self._kernel_layout())
        dxs = [None if x is None else dx.view(x.shape) for x, dx in zip(xs, dxs)]
        if dcs is not None:
            dcs = tuple(d.to(c.dtype) for d, c in zip(dcs, coefficients))
        return dxs, dcs

    def mix_reference(self, coefficients, xs):
        """:meth:`mix` in torch ops (``_mix_finite`` under :func:`~mhla.ops.utils.causal_product`)."""
        return [None if x is None else self._mix_one(coefficients, x) for x in xs]

    def backward_reference(self, coefficients, xs, dps, need_dcoeff: bool):
        """Gradients of :meth:`mix_reference`, by running it again under autograd (it is linear in the blocks)."""
        keep = [n for n, x in enumerate(xs) if x is not None]
        with torch.enable_grad():
            xs_ = [xs[n].detach().requires_grad_() for n in keep]
            cs_ = [c.detach().requires_grad_(need_dcoeff) for c in coefficients]
            outs = [self._mix_one(cs_, x) for x in xs_]
        inputs = xs_ + (cs_ if need_dcoeff else [])
        grads = torch.autograd.grad(outs, inputs, [dps[n] for n in keep], allow_unused=True)
        dxs = [None] * len(xs)
        for n, g in zip(keep, grads[:len(keep)]):
            dxs[n] = torch.zeros_like(xs[n]) if g is None else g
        if not need_dcoeff:
            return dxs, None
        dcs = tuple(torch.zeros_like(c) if g is None else g for c, g in zip(cs_, grads[len(keep):]))
        return dxs, dcs


__all__ = ["BandedMix", "DenseMix", "band_tile", "mix_gemm", "mix_gemm_backward", "mix_gemm_parts",
           "mix_gemm_parts_backward"]
