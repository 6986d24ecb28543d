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

  (the ``recent`` terms for blocks ``>= head`` only). Torch ops: the head part is one batched GEMM, the recent
  part a banded GEMM on row tiles of ``Tr >= recent`` blocks (each tile reads its own and the previous tile
  of blocks), the far part one ``cumsum``. Cost ``O(NB * (head + recent) * D * Dv)`` per head: linear in
  ``T``. A state's columns join in block order: its kept head blocks, its folded sum (one column that is part
  of every row's ``F_i``), its kept recent blocks.

Both mixers keep a causal sum causal whatever the values: a NaN or inf in column ``b`` reaches the rows
after it only. Backward: :meth:`DenseMix.backward` runs two more GEMM kernels (``dx = coeff^T dP``,
``dcoeff = dP x^T`` summed over the batch, and over the heads when shared); :meth:`BandedMix.backward`
recomputes the (linear) banded forward under autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...utils import causal_product
from .utils import autotune_configs, next_pow2

# ------------------------------------------------------------------------------------------- GEMM kernels

_BIG: tl.constexpr = tl.constexpr(2**30)  # "no non-finite column yet"


@triton.autotune(configs=autotune_configs(), key=["F", "CAUSAL", "BM", "BK", "BN"])
@triton.jit
def _mix_fwd_kernel(
    W, X, P, NB, N, F, H, stride_wg, COL0,
    BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
):
    """``P[bh, i, f] = sum_b W[g, i, b] X[bh, b, f]`` for a ``[BM, BN]`` tile; program ``(i_m, i_n, bh)``.

    ``W [G, NB, N]`` (``g = bh % H``, head stride ``stride_wg``, 0 when shared), ``X [B*H, N, F]``,
    ``P [B*H, NB, F]``, fp32, contiguous. ``CAUSAL``: row ``i`` reads ``b < i + COL0`` only; the loop stops
    at the last column the tile's rows read, non-finite values of ``X`` are zeroed in the product and mark
    the rows after their column NaN.
    """
    i_m, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = i_m * BM + tl.arange(0, BM)
    feats = i_n * BN + tl.arange(0, BN)
    w_base = W + (i_bh % H).to(tl.int64) * stride_wg
    x_base = X + i_bh.to(tl.int64) * N * F
    k_end = N
    if CAUSAL:
        k_end = tl.minimum(N, COL0 + i_m * BM + BM - 1)  # the last row of the tile reads b < its index + COL0
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    first_bad = tl.full([BN], _BIG, dtype=tl.int32)
    for k0 in range(0, k_end, BK):
        cols = k0 + tl.arange(0, BK)
        w_mask = (rows < NB)[:, None] & (cols < N)[None, :]
        if CAUSAL:
            w_mask = w_mask & (cols[None, :] < rows[:, None] + COL0)
        w = tl.load(w_base + rows[:, None].to(tl.int64) * N + cols[None, :], mask=w_mask, other=0.0)
        x = tl.load(x_base + cols[:, None].to(tl.int64) * F + feats[None, :],
                    mask=(cols < N)[:, None] & (feats < F)[None, :], other=0.0)
        if CAUSAL:  # 0 * nan = nan: multiply the finite values only, remember where the others are
            finite = tl.abs(x) < float("inf")
            first_bad = tl.minimum(first_bad, tl.min(tl.where(finite, _BIG, cols[:, None]), axis=0))
            x = tl.where(finite, x, 0.0)
        acc += tl.dot(w, x, input_precision=PREC)
    if CAUSAL:
        acc = tl.where(first_bad[None, :] < rows[:, None] + COL0, float("nan"), acc)
    tl.store(P + i_bh.to(tl.int64) * NB * F + rows[:, None].to(tl.int64) * F + feats[None, :], acc,
             mask=(rows < NB)[:, None] & (feats < F)[None, :])


@triton.autotune(configs=autotune_configs(), key=["F", "CAUSAL", "BM", "BK", "BN"])
@triton.jit
def _mix_bwd_dx_kernel(
    W, dP, dX, NB, N, F, H, stride_wg, COL0,
    BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
):
    """``dX[bh, b, f] = sum_i W[g, i, b] dP[bh, i, f]`` for a ``[BK, BN]`` tile; program ``(i_k, i_n, bh)``.

    ``CAUSAL``: only the rows ``i > b - COL0`` read column ``b``; the loop starts at the first of them.
    """
    i_k, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = i_k * BK + tl.arange(0, BK)
    feats = i_n * BN + tl.arange(0, BN)
    w_base = W + (i_bh % H).to(tl.int64) * stride_wg
    dp_base = dP + i_bh.to(tl.int64) * NB * F
    i_start = 0
    if CAUSAL:
        i_start = tl.maximum(0, i_k * BK - COL0 + 1)
    acc = tl.zeros([BK, BN], dtype=tl.float32)
    for i0 in range(i_start, NB, BM):
        rows = i0 + tl.arange(0, BM)
        w_mask = (rows < NB)[None, :] & (cols < N)[:, None]
        if CAUSAL:
            w_mask = w_mask & (cols[:, None] < rows[None, :] + COL0)
        wt = tl.load(w_base + rows[None, :].to(tl.int64) * N + cols[:, None], mask=w_mask, other=0.0)  # [BK, BM]
        dp = tl.load(dp_base + rows[:, None].to(tl.int64) * F + feats[None, :],
                     mask=(rows < NB)[:, None] & (feats < F)[None, :], other=0.0)
        acc += tl.dot(wt, dp, input_precision=PREC)
    tl.store(dX + i_bh.to(tl.int64) * N * F + cols[:, None].to(tl.int64) * F + feats[None, :], acc,
             mask=(cols < N)[:, None] & (feats < F)[None, :])


# 4 warps only: the causal variant spills 8 bytes at 8 warps x 2 stages on sm_90 (results/bench/kernel_resources.md)
@triton.autotune(configs=autotune_configs(warps=(4,)), key=["F", "CAUSAL", "BM", "BK", "BN"])
@triton.jit
def _mix_bwd_dw_kernel(
    X, dP, dW, NB, N, F, H, MEMBERS, STEP, SPLIT, COL0,
    BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
):
    """Partial ``dW[s, g, i, b] = sum_{n = s, s + SPLIT, ..} sum_f dP[bh, i, f] X[bh, b, f]``, ``bh = n * STEP
    + g`` (``MEMBERS`` summaries per coefficient group: the batch, times the heads when shared).

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
        for f0 in range(0, F, BN):
            feats = f0 + tl.arange(0, BN)
            dp = tl.load(dP + bh * NB * F + rows[:, None].to(tl.int64) * F + feats[None, :],
                         mask=(rows < NB)[:, None] & (feats < F)[None, :], other=0.0)
            x = tl.load(X + bh * N * F + cols[:, None].to(tl.int64) * F + feats[None, :],
                        mask=(cols < N)[:, None] & (feats < F)[None, :], other=0.0)
            acc += tl.dot(dp, tl.trans(x), input_precision=PREC)
    if CAUSAL:  # a select, not a product: a non-finite later column stays out of the kept entries
        acc = tl.where(cols[None, :] < rows[:, None] + COL0, acc, 0.0)
    base = dW + ((s * (tl.num_programs(1) // SPLIT) + g).to(tl.int64) * NB) * N
    tl.store(base + rows[:, None].to(tl.int64) * N + cols[None, :], acc,
             mask=(rows < NB)[:, None] & (cols < N)[None, :])


# -------------------------------------------------------------------------------------------- GEMM host


def _tiles(NB: int, N: int, F: int) -> tuple[int, int, int]:
    """``(BM, BK, BN)``: rows, columns (blocks) and features per tile; every one >= 16 (``tl.dot``)."""
    return min(64, max(16, next_pow2(NB))), min(32, max(16, next_pow2(N))), min(64, max(16, next_pow2(F)))


#: programs the coefficient-gradient kernel aims for (about two per SM of an H100): the sum over the batch
#: and heads is split into that many partial sums when the tiles alone are fewer
_TARGET_PROGRAMS = 256


def mix_gemm(coeff: torch.Tensor, x: torch.Tensor, *, causal: bool, first: int = 0,
             precision: str = "ieee") -> torch.Tensor:
    """``P[bh, i] = sum_b coeff[g, i, b] x[bh, b]`` on the GPU's matrix units (``_mix_fwd_kernel``).

    Args:
        coeff: ``[G, NB, N]`` fp32 (``G`` = 1 shared, or ``H``); x: ``[B, H, N, F]`` fp32.
        causal: row ``i`` reads the columns ``b < first + i`` only (whatever ``coeff`` holds elsewhere), and a
            non-finite ``x[b, f]`` makes ``P[i, f]`` NaN for the rows ``i`` after it, never before.
        precision: ``tl.dot``'s ``input_precision`` (:func:`.utils.dot_precision`).
    Returns:
        ``P [B, H, NB, F]`` fp32.
    """
    B, H, N, F = x.shape
    G, NB, _ = coeff.shape
    coeff, x = coeff.float().contiguous(), x.float().contiguous()
    P = torch.empty(B, H, NB, F, device=x.device, dtype=torch.float32)
    BM, BK, BN = _tiles(NB, N, F)
    _mix_fwd_kernel[(triton.cdiv(NB, BM), triton.cdiv(F, BN), B * H)](
        coeff, x, P, NB, N, F, H, NB * N if G > 1 else 0, first,
        BM=BM, BK=BK, BN=BN, CAUSAL=causal, PREC=precision,
    )
    return P


def mix_gemm_backward(coeff: torch.Tensor, x: torch.Tensor, dP: torch.Tensor, *, causal: bool, first: int = 0,
                      precision: str = "ieee", need_dcoeff: bool = True):
    """Backward of :func:`mix_gemm`: ``dx [B, H, N, F]`` and ``dcoeff [G, NB, N]`` (``dP x^T`` summed over the
    batch, and over the heads when ``G == 1``; zero where ``causal`` reads nothing; None unless
    ``need_dcoeff``)."""
    B, H, N, F = x.shape
    G, NB, _ = coeff.shape
    coeff, x, dP = coeff.float().contiguous(), x.float().contiguous(), dP.float().contiguous()
    BM, BK, BN = _tiles(NB, N, F)
    dx = torch.empty(B, H, N, F, device=x.device, dtype=torch.float32)
    _mix_bwd_dx_kernel[(triton.cdiv(N, BK), triton.cdiv(F, BN), B * H)](
        coeff, dP, dx, NB, N, F, H, NB * N if G > 1 else 0, first,
        BM=BM, BK=BK, BN=BN, CAUSAL=causal, PREC=precision,
    )
    if not need_dcoeff:
        return dx, None
    members, step = (B, H) if G > 1 else (B * H, 1)
    tiles = triton.cdiv(NB, BM) * triton.cdiv(N, BK)
    split = max(1, min(members, _TARGET_PROGRAMS // (tiles * G)))
    dW = torch.empty(split, G, NB, N, device=x.device, dtype=torch.float32)
    _mix_bwd_dw_kernel[(tiles, G * split)](
        x, dP, dW, NB, N, F, H, members, step, split, first,
        BM=BM, BK=BK, BN=BN, CAUSAL=causal, PREC=precision,
    )
    return dx, dW.sum(0)


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

    def mix(self, coefficients, xs):
        """``xs``: summaries ``[B, H, N, *feat]`` (or None) -> mixed ``[B, H, NB, *feat]`` (or None)."""
        (coeff,) = coefficients
        return [None if x is None else mix_gemm(coeff, _flat(x), causal=self.causal, first=self.first,
                                                precision=self.precision).view(*x.shape[:2], -1, *x.shape[3:])
                for x in xs]

    def backward(self, coefficients, xs, dps, need_dcoeff: bool):
        """Gradients of :meth:`mix`: ``(dxs, dcoefficients)`` (``dcoefficients`` None unless ``need_dcoeff``)."""
        (coeff,) = coefficients
        dxs, dcoeff = [], None
        for x, dp in zip(xs, dps):
            if x is None:
                dxs.append(None)
                continue
            dx, dc = mix_gemm_backward(coeff, _flat(x), _flat(dp), causal=self.causal, first=self.first,
                                       precision=self.precision, need_dcoeff=need_dcoeff)
            dxs.append(dx.view(x.shape))
            if dc is not None:
                dcoeff = dc if dcoeff is None else dcoeff + dc
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
    """

    window: tuple[int, int]
    first: int = 0
    kept_head: int = 0
    folded: bool = False
    kept_recent: int = 0
    rows: int = 1

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

    def mix(self, coefficients, xs):
        """``xs``: summaries ``[B, H, N, *feat]`` (``N = state_columns + rows``, or None) -> mixed
        ``[B, H, rows, *feat]`` (or None)."""
        return [None if x is None else self._mix_one(coefficients, x) for x in xs]

    def backward(self, coefficients, xs, dps, need_dcoeff: bool):
        """Gradients of :meth:`mix`, by running it again under autograd (it is linear in the blocks)."""
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


__all__ = ["BandedMix", "DenseMix", "band_tile", "mix_gemm", "mix_gemm_backward"]
