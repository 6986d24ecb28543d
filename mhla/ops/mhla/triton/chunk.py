"""Chunked Triton kernels shared by the non-causal and the causal MHLA operators.

Both forms are written in one "chunked" formulation. Tokens are in block-major order; block ``i`` holds
``C = block_size`` tokens and is cut into ``NC = ceil(C / BT)`` chunks of ``BT`` tokens (the kernels'
token tile; the last chunk of a block is masked when ``BT`` does not divide ``C``). For a token ``t`` in
chunk ``j`` of block ``i``, with ``m_i`` a per-block scalar:

    h_j = P_i + m_i R_j                       [D, Dv]   (fp32)
    g_j = p_i + m_i r_j                       [D]       (fp32)
    n_t = q_t^T h_j + m_i sum_{s in chunk j, s <= t} (q_t . k_s) v_s               (numerator, [Dv])
    d_t = q_t . g_j + m_i sum_{s in chunk j, s <= t}  q_t . k_s  + eps             (denominator)
    o_t = n_t / d_t        ("paper")      or      o_t = n_t        ("none")

where

    S_b = sum_{s in b} k_s v_s^T,  z_b = sum_{s in b} k_s                           (block summaries)
    R_j = sum_{s in block i, chunk(s) < j} k_s v_s^T,  r_j likewise                 (running in-block sum)
    P_i = sum_b coeff[i, b] S_b,   p_i = sum_b coeff[i, b] z_b                      (mixed summaries)

* non-causal MHLA: ``coeff = mixing`` (all blocks), ``m_i = 0`` (no R, no intra-chunk term);
* causal MHLA:     ``coeff = strictly-lower part of mixing``, ``m_i = mixing[i, i]``.

Causal outputs depend on the earlier tokens only, whatever the later ones hold: the masks are selects
(``tl.where``), and the products that also run over masked terms (``tl.dot(A, v)`` inside a chunk, the mix
``coeff @ S`` over the blocks) take the finite values only and mark the outputs a NaN / inf reaches.

The M x M mix of the summaries (``P = coeff @ S``) runs between these kernels, as a GEMM kernel of
:mod:`.mix` (or, for compact causal rows, a banded mix in linear time). The kernels, with their grids:

forward
    ``fwd_block_summaries``  grid (NK*NV, NB, B*H): S_b, z_b per block, and R_j, r_j per chunk (causal).
    ``fwd_output``           grid (NV, NB*NC, B*H): o and the denominator d (kept for the backward); with
                             one K tile and no running sums grid (NV, NB, B*H), a program walking the chunks
                             of its block with the block's P read once.
    ``fwd_output_all_v``     causal, half inputs, one K tile and several V tiles (D 128; ``all_v_tiles``):
                             grid (1, NB*NC, B*H), a program walking its chunk's V tiles (q, k read once).
backward (``dn_t = do_t / d_t``, ``dd_t = -(do_t . o_t) / d_t``; "none": ``dn = do``, ``dd = 0``)
    ``bwd_block_grads``      grid (NK*NV, NB, B*H): dP_i = sum_{t in i} q_t dn_t^T, dp_i = sum q_t dd_t,
                             and delta_t = do_t . o_t (its V-tile-0 programs, stored for bwd_dqk),
                             dR_j = sum_{t in block i, chunk(t) > j} q_t dn_t^T (reverse scan), and the
                             R part of the gradient of m_i: sum_j <q^T dn, R_j> + <q^T dd, r_j>.
    (:mod:`.mix`)            dS = coeff^T dP, d coeff = dP S^T (the mixing gradient), dz likewise.
    ``bwd_dv``               grid (NV, NB*NC, B*H): dv_s = dH_j^T k_s + m_i sum_{t >= s} (q_t . k_s) dn_t
                             (``bwd_dv_all_v``: grid (1, NB*NC, B*H), as ``fwd_output_all_v``)
    ``bwd_dqk``              grid (NK, NB*NC, B*H):
                             dq_t = h_j dn_t + g_j dd_t + m_i sum_{s <= t} dA[t, s] k_s
                             dk_s = dH_j v_s + dh_j + m_i sum_{t >= s} dA[t, s] q_t
                             with dH_j = dS_i + m_i dR_j, dh_j = dz_i + m_i dr_j and
                             dA[t, s] = dn_t . v_s + dd_t; plus the intra-chunk part of the gradient of
                             m_i: sum_{s <= t} (q_t . k_s) dA[t, s] (one partial sum per K tile).

Layouts: q, k ``[B, T, H, D]``, v, o, do ``[B, T, H, Dv]`` (contiguous); summaries fp32 (``S``, ``z``, ``P``, ``p``:
in the input dtype with the opt-in ``MHLA_SUMMARY_DTYPE=input``, :func:`.utils.summary_dtype`, loaded as fp32)
``[B*H, NB, D, Dv]`` / ``[B*H, NB, D]``, running sums ``[B*H, NB*NC, D, Dv]``; d ``[B*H, T]``.
``OFFSET`` empty positions precede token 0 in the first block (a causal call that continues a state in
the middle of a block); those positions, and positions past ``T``, read as zeros.
All accumulation is fp32. Feature dims are tiled by ``BK`` / ``BV`` (powers of two, masked), so any head
dim works.
"""

# ruff: noqa: SIM102  (nested ifs: a compile-time flag outside, a runtime test inside)
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .mix import mix_gemm_parts, mix_gemm_parts_backward
from .utils import autotune, chunk_tile, device_helper, dot_precision, feature_tile
from .utils import feature_tile as _feature_tile_any_cap

_KEY = ["D", "Dv", "BT", "BK", "BV"]  # autotune key; each kernel adds its flags

#: Feature tiles of the "wide" kernels (:meth:`Geometry.wide`): at D 128 one tile of 128, so q, k, v, do are read
#: once. Only the variants that compile for sm_90 without spills and within its shared memory at 128 take it
#: (results/bench/kernel_resources.md): ``fwd_block_summaries`` and ``bwd_block_grads`` without running sums,
#: and the non-causal ``fwd_output`` and ``bwd_dv``; the causal ``fwd_output`` / ``bwd_dv`` (240 KB of shared
#: memory) and ``bwd_dqk`` (spills) keep tiles of at most 64.
WIDE_TILE = 128


@dataclass
class Geometry:
    """Sizes of one call. ``NB`` blocks of ``C`` tokens, each ``NC`` chunks of ``BT``; ``OFFSET`` empty
    positions before token 0 (causal continuation of a state)."""

    B: int
    T: int
    H: int
    D: int
    Dv: int
    C: int
    OFFSET: int
    NB: int
    NC: int
    BT: int
    BK: int
    BV: int

    @classmethod
    def make(cls, q: torch.Tensor, v: torch.Tensor, block_size: int, offset: int = 0) -> Geometry:
        B, T, H, D = q.shape
        Dv = v.shape[-1]
        NB = triton.cdiv(offset + T, block_size)
        BT = chunk_tile(block_size)
        return cls(B, T, H, D, Dv, block_size, offset, NB, triton.cdiv(block_size, BT), BT,
                   feature_tile(D), feature_tile(Dv))

    def wide(self) -> Geometry:
        """This geometry with feature tiles of up to :data:`WIDE_TILE` when ``D`` and ``Dv`` are at most that
        (the variants compile_check covers: one tile each at D 128); larger head dims keep their tiles. The
        buffers' layouts do not depend on the tiles, so each kernel may take its own."""
        if max(self.D, self.Dv) > WIDE_TILE:
            return self
        return replace(self, BK=_feature_tile_any_cap(self.D, max_tile=WIDE_TILE),
                       BV=_feature_tile_any_cap(self.Dv, max_tile=WIDE_TILE))

    def wide_k(self) -> Geometry:
        """This geometry with the K tile of :meth:`wide` and its own V tiles: the causal ``all_v`` kernels
        (:func:`all_v_tiles`), whose program walks the V tiles of its chunk, so ``q`` and ``k`` are read once."""
        return replace(self, BK=self.wide().BK)

    @property
    def NK(self) -> int:
        return triton.cdiv(self.D, self.BK)

    @property
    def NV(self) -> int:
        return triton.cdiv(self.Dv, self.BV)

    @property
    def NT(self) -> int:
        return self.NB * self.NC

    @property
    def BH(self) -> int:
        return self.B * self.H


# ------------------------------------------------------------------------------------------ helpers


@device_helper
def _row_offset(i_b, i_h, T, H, F):
    """Element offset of token 0 of batch ``i_b``, head ``i_h`` in a contiguous ``[B, T, H, F]`` tensor (int64:
    ``B * T * H * F`` may pass 2^31)."""
    return (i_b.to(tl.int64) * T * H + i_h) * F


@device_helper
def _chunk_tokens(i_blk, i_chunk, T, OFFSET, C, BT: tl.constexpr):
    """Token indices ``t`` ([BT], clamped to 0 where invalid) and validity of chunk ``i_chunk`` of block
    ``i_blk``: position ``pos`` inside the block, virtual position ``i_blk*C + pos``, token
    ``t = i_blk*C + pos - OFFSET``; valid when ``pos < C`` and ``0 <= t < T``."""
    pos = i_chunk * BT + tl.arange(0, BT)
    t = i_blk * C + pos - OFFSET
    valid = (pos < C) & (t >= 0) & (t < T)
    return tl.where(valid, t, 0), valid


@device_helper
def _load_tokens(ptr, t, valid, stride_t, i_f, F, BF: tl.constexpr):
    """``[BT, BF]`` tile of a ``[.., T, .., F]`` tensor (base ``ptr``), feature tile ``i_f``; zeros where
    invalid."""
    f = i_f * BF + tl.arange(0, BF)
    p = ptr + t[:, None].to(tl.int64) * stride_t + f[None, :]
    return tl.load(p, mask=valid[:, None] & (f < F)[None, :], other=0.0)


@device_helper
def _store_tokens(ptr, x, t, valid, stride_t, i_f, F, BF: tl.constexpr):
    f = i_f * BF + tl.arange(0, BF)
    p = ptr + t[:, None].to(tl.int64) * stride_t + f[None, :]
    tl.store(p, x.to(ptr.dtype.element_ty), mask=valid[:, None] & (f < F)[None, :])


@device_helper
def _summary_ptrs(ptr, n, i_k, i_v, D, Dv, BK: tl.constexpr, BV: tl.constexpr):
    """Pointers and mask of the ``[BK, BV]`` tile ``(i_k, i_v)`` of the ``D x Dv`` matrix number ``n`` of
    a ``[.., D, Dv]`` fp32 buffer."""
    dk = i_k * BK + tl.arange(0, BK)
    dv = i_v * BV + tl.arange(0, BV)
    p = ptr + n.to(tl.int64) * D * Dv + dk[:, None] * Dv + dv[None, :]
    return p, (dk < D)[:, None] & (dv < Dv)[None, :]


@device_helper
def _vector_ptrs(ptr, n, i_k, D, BK: tl.constexpr):
    """Pointers and mask of the ``[BK]`` tile ``i_k`` of the vector number ``n`` of a ``[.., D]`` buffer."""
    dk = i_k * BK + tl.arange(0, BK)
    return ptr + n.to(tl.int64) * D + dk, dk < D


# ------------------------------------------------------------------------------------------ forward


# sm_80: 8 warps x 3 stages only (the others spill there, results/bench/kernel_resources.md)
@autotune(key=_KEY + ["HAS_R", "HAS_INIT", "STORE_Z"], sm80=[(8, 3)])
@triton.jit
def _fwd_block_summaries_kernel(
    k, v, cur_s, cur_z, S, Z, R, Rz,
    T, H, D, Dv, OFFSET, C, NC, NB,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_R: tl.constexpr, HAS_INIT: tl.constexpr, STORE_Z: tl.constexpr, PREC: tl.constexpr,
):
    """Block summaries ``S_b = sum_{s in b} k_s v_s^T``, ``z_b = sum k_s`` (fp32).

    Program ``(i_kv, i_blk, i_bh)`` owns the ``[BK, BV]`` tile ``i_kv`` of block ``i_blk`` and walks its
    ``NC`` chunks in order; with ``HAS_R`` it stores the running sum *before* each chunk as ``R_j``
    (``r_j``). With ``HAS_INIT`` block 0 starts from the state's running summary ``cur_s`` / ``cur_z``
    (``[B*H, D, Dv]`` / ``[B*H, D]``). ``z`` is computed by the programs of the first V tile.
    """
    i_kv, i_blk, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NV = tl.cdiv(Dv, BV)
    i_k, i_v = i_kv // NV, i_kv % NV
    i_b, i_h = i_bh // H, i_bh % H
    stride_k, stride_v = H * D, H * Dv
    k_base = k + _row_offset(i_b, i_h, T, H, D)
    v_base = v + _row_offset(i_b, i_h, T, H, Dv)

    acc = tl.zeros([BK, BV], dtype=tl.float32)
    acc_z = tl.zeros([BK], dtype=tl.float32)
    if HAS_INIT:
        if i_blk == 0:
            p, msk = _summary_ptrs(cur_s, i_bh, i_k, i_v, D, Dv, BK, BV)
            acc += tl.load(p, mask=msk, other=0.0)
            pz, mz = _vector_ptrs(cur_z, i_bh, i_k, D, BK)
            acc_z += tl.load(pz, mask=mz, other=0.0)
    for i_c in range(NC):
        j = i_bh * NB * NC + i_blk * NC + i_c  # row of the running-sum buffers
        if HAS_R:
            p, msk = _summary_ptrs(R, j, i_k, i_v, D, Dv, BK, BV)
            tl.store(p, acc, mask=msk)
            if STORE_Z:
                if i_v == 0:
                    pz, mz = _vector_ptrs(Rz, j, i_k, D, BK)
                    tl.store(pz, acc_z, mask=mz)
        t, valid = _chunk_tokens(i_blk, i_c, T, OFFSET, C, BT)
        kt = _load_tokens(k_base, t, valid, stride_k, i_k, D, BK)  # [BT, BK]
        vt = _load_tokens(v_base, t, valid, stride_v, i_v, Dv, BV)  # [BT, BV]
        acc += tl.dot(tl.trans(kt), vt, input_precision=PREC)
        if STORE_Z:
            acc_z += tl.sum(kt.to(tl.float32), axis=0)
    p, msk = _summary_ptrs(S, i_bh * NB + i_blk, i_k, i_v, D, Dv, BK, BV)
    tl.store(p, acc, mask=msk)
    if STORE_Z:
        if i_v == 0:
            pz, mz = _vector_ptrs(Z, i_bh * NB + i_blk, i_k, D, BK)
            tl.store(pz, acc_z, mask=mz)


@device_helper
def _output_chunk(q_base, k_base, v_base, o_base, P, Pz, R, Rz, den, h_blk, g_blk, m, eps,
                  i_v, i_blk, i_c, i_bh, T, D, Dv, OFFSET, C, NC, NB, stride_k, stride_v,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CAUSAL: tl.constexpr, HAS_R: tl.constexpr,
                  NORMALIZE: tl.constexpr, ONE_K: tl.constexpr, PREC: tl.constexpr):
    """``o`` (and ``d``) of chunk ``i_c`` of block ``i_blk``, V tile ``i_v`` (``_fwd_output_kernel``). With
    ``ONE_K`` the block's ``P`` / ``p`` tiles are given (``h_blk`` / ``g_blk``), else loaded per K tile."""
    t, valid = _chunk_tokens(i_blk, i_c, T, OFFSET, C, BT)
    n_p = i_bh * NB + i_blk  # block row of P
    n_r = n_p * NC + i_c  # chunk row of R
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    dsum = tl.zeros([BT], dtype=tl.float32)
    A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(D, BK)):
        qt = _load_tokens(q_base, t, valid, stride_k, i_k, D, BK)  # [BT, BK]
        if ONE_K:
            h = h_blk
        else:
            p, msk = _summary_ptrs(P, n_p, i_k, i_v, D, Dv, BK, BV)
            h = tl.load(p, mask=msk, other=0.0).to(tl.float32)  # P: fp32, or the input dtype (opt-in)
        if HAS_R:
            p, msk = _summary_ptrs(R, n_r, i_k, i_v, D, Dv, BK, BV)
            h += m * tl.load(p, mask=msk, other=0.0)
        acc += tl.dot(qt.to(tl.float32), h, input_precision=PREC)
        if NORMALIZE:
            if ONE_K:
                g = g_blk
            else:
                pz, mz = _vector_ptrs(Pz, n_p, i_k, D, BK)
                g = tl.load(pz, mask=mz, other=0.0).to(tl.float32)
            if HAS_R:
                pz, mz = _vector_ptrs(Rz, n_r, i_k, D, BK)
                g += m * tl.load(pz, mask=mz, other=0.0)
            dsum += tl.sum(qt.to(tl.float32) * g[None, :], axis=1)
        if CAUSAL:
            kt = _load_tokens(k_base, t, valid, stride_k, i_k, D, BK)
            A += tl.dot(qt, tl.trans(kt), input_precision=PREC)  # A[t, s] = q_t . k_s
    if CAUSAL:
        causal_mask = tl.arange(0, BT)[:, None] >= tl.arange(0, BT)[None, :]
        A = tl.where(causal_mask, A, 0.0)
        vt = _load_tokens(v_base, t, valid, stride_v, i_v, Dv, BV).to(tl.float32)
        # The dot also multiplies the masked A[t, s] = 0 (s > t) by v_s, and 0 * nan = nan: use the finite
        # values only, and put NaN at the rows t >= s of a non-finite v_s.
        finite = tl.abs(vt) < float("inf")
        acc += m * tl.dot(A, tl.where(finite, vt, 0.0), input_precision=PREC)
        reached = tl.cumsum(tl.where(finite, 0, 1), axis=0) > 0
        acc = tl.where(reached, float("nan"), acc)
        if NORMALIZE:
            dsum += m * tl.sum(A, axis=1)
    if NORMALIZE:
        d = dsum + eps
        acc = acc / d[:, None]
        if i_v == 0:
            tl.store(den + i_bh.to(tl.int64) * T + t, d, mask=valid)
    _store_tokens(o_base, acc, t, valid, stride_v, i_v, Dv, BV)


# sm_80: 8 warps only (the causal variant with running sums and the normalizer spills at 4 warps there)
@autotune(key=_KEY + ["CAUSAL", "HAS_R", "NORMALIZE", "ONE_K"], sm80=[(8, 2), (8, 3)])
@triton.jit
def _fwd_output_kernel(
    q, k, v, P, Pz, R, Rz, mdiag, o, den,
    T, H, D, Dv, OFFSET, C, NC, NB, stride_mh, stride_mb, eps,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_R: tl.constexpr, NORMALIZE: tl.constexpr, ONE_K: tl.constexpr, PREC: tl.constexpr,
):
    """Output, one V tile: per chunk ``o = (q h_j + m tril(q k^T) v) / (q . g_j + m rowsum + eps)``.

    With ``ONE_K`` (``D <= BK``: one K tile; the host sets it only without running sums, whose loads would
    spill registers next to the held tile) program ``(i_v, i_blk, i_bh)`` loads block ``i_blk``'s mixed summary
    tile ``P`` (and ``p``) once and walks the block's ``NC`` chunks; otherwise program ``(i_v, j, i_bh)`` computes
    chunk ``j`` (block ``j // NC``), loading ``P`` per K tile. The K dimension is reduced in a loop over K tiles
    (:func:`_output_chunk`). ``mdiag``: ``[H or 1, NB]`` fp32 diagonal coefficients ``m_i`` (head stride
    ``stride_mh``). The V-tile-0 programs store the denominator ``d_t`` in ``den`` (``[B*H, T]``).
    """
    i_v, i_p, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    stride_k, stride_v = H * D, H * Dv
    q_base = q + _row_offset(i_b, i_h, T, H, D)
    k_base = k + _row_offset(i_b, i_h, T, H, D)
    v_base = v + _row_offset(i_b, i_h, T, H, Dv)
    o_base = o + _row_offset(i_b, i_h, T, H, Dv)
    i_blk = i_p // NC
    if ONE_K:
        i_blk = i_p
    m = 0.0
    if CAUSAL:
        m = tl.load(mdiag + i_h * stride_mh + i_blk * stride_mb).to(tl.float32)
    if ONE_K:  # the block's P tile (and p), read once for all its chunks
        p, msk = _summary_ptrs(P, i_bh * NB + i_blk, 0, i_v, D, Dv, BK, BV)
        h_blk = tl.load(p, mask=msk, other=0.0).to(tl.float32)
        g_blk = tl.zeros([BK], dtype=tl.float32)
        if NORMALIZE:
            pz, mz = _vector_ptrs(Pz, i_bh * NB + i_blk, 0, D, BK)
            g_blk = tl.load(pz, mask=mz, other=0.0).to(tl.float32)
        for i_c in range(NC):
            _output_chunk(q_base, k_base, v_base, o_base, P, Pz, R, Rz, den, h_blk, g_blk, m, eps,
                          i_v, i_blk, i_c, i_bh, T, D, Dv, OFFSET, C, NC, NB, stride_k, stride_v,
                          BT, BK, BV, CAUSAL, HAS_R, NORMALIZE, ONE_K, PREC)
    else:
        _output_chunk(q_base, k_base, v_base, o_base, P, Pz, R, Rz, den, 0.0, 0.0, m, eps,
                      i_v, i_blk, i_p % NC, i_bh, T, D, Dv, OFFSET, C, NC, NB, stride_k, stride_v,
                      BT, BK, BV, CAUSAL, HAS_R, NORMALIZE, ONE_K, PREC)


# Spill-free configs only (results/bench/kernel_resources.md): sm_90 8 warps (4 warps spill 12-112 B), sm_80 8 warps
# x 2 stages (3 stages spill 36 B without the normalizer)
@autotune(key=_KEY + ["HAS_R", "NORMALIZE"], warps=(8,), sm80=[(8, 2)])
@triton.jit
def _fwd_output_all_v_kernel(
    q, k, v, P, Pz, R, Rz, mdiag, o, den,
    T, H, D, Dv, OFFSET, C, NC, NB, stride_mh, stride_mb, eps,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_R: tl.constexpr, NORMALIZE: tl.constexpr, PREC: tl.constexpr,
):
    """Causal output of one chunk, every V tile: ``_fwd_output_kernel``'s causal form when one K tile holds the
    head dim (``D <= BK``) and ``Dv`` takes several V tiles (D 128: ``BK`` 128, ``BV`` 64).

    Program ``(0, j, i_bh)`` loads ``q``, ``k`` of chunk ``j`` once and forms ``A = tril(q k^T)`` and the
    denominator once, then each V tile adds ``q h_j`` and ``m A v``: ``q`` and ``k`` are read once instead of once
    per V tile, and ``A`` formed once. Same arguments as ``_fwd_output_kernel``.
    """
    j, i_bh = tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    i_blk, i_c = j // NC, j % NC
    stride_k, stride_v = H * D, H * Dv
    q_base = q + _row_offset(i_b, i_h, T, H, D)
    k_base = k + _row_offset(i_b, i_h, T, H, D)
    v_base = v + _row_offset(i_b, i_h, T, H, Dv)
    o_base = o + _row_offset(i_b, i_h, T, H, Dv)
    m = tl.load(mdiag + i_h * stride_mh + i_blk * stride_mb).to(tl.float32)
    t, valid = _chunk_tokens(i_blk, i_c, T, OFFSET, C, BT)
    n_p = i_bh * NB + i_blk  # block row of P
    n_r = n_p * NC + i_c  # chunk row of R
    qt = _load_tokens(q_base, t, valid, stride_k, 0, D, BK)  # [BT, BK]
    kt = _load_tokens(k_base, t, valid, stride_k, 0, D, BK)
    causal_mask = tl.arange(0, BT)[:, None] >= tl.arange(0, BT)[None, :]
    A = tl.where(causal_mask, tl.dot(qt, tl.trans(kt), input_precision=PREC), 0.0)  # A[t, s] = q_t . k_s
    q32 = qt.to(tl.float32)
    d = tl.full([BT], 1.0, dtype=tl.float32)
    if NORMALIZE:
        pz, mz = _vector_ptrs(Pz, n_p, 0, D, BK)
        g = tl.load(pz, mask=mz, other=0.0).to(tl.float32)
        if HAS_R:
            pz, mz = _vector_ptrs(Rz, n_r, 0, D, BK)
            g += m * tl.load(pz, mask=mz, other=0.0)
        d = tl.sum(q32 * g[None, :], axis=1) + m * tl.sum(A, axis=1) + eps
        tl.store(den + i_bh.to(tl.int64) * T + t, d, mask=valid)
    for i_v in range(tl.cdiv(Dv, BV)):
        p, msk = _summary_ptrs(P, n_p, 0, i_v, D, Dv, BK, BV)
        h = tl.load(p, mask=msk, other=0.0).to(tl.float32)
        if HAS_R:
            p, msk = _summary_ptrs(R, n_r, 0, i_v, D, Dv, BK, BV)
            h += m * tl.load(p, mask=msk, other=0.0)
        acc = tl.dot(q32, h, input_precision=PREC)
        vt = _load_tokens(v_base, t, valid, stride_v, i_v, Dv, BV).to(tl.float32)
        finite = tl.abs(vt) < float("inf")  # as _output_chunk: finite values in the dot, NaN where one reaches
        acc += m * tl.dot(A, tl.where(finite, vt, 0.0), input_precision=PREC)
        reached = tl.cumsum(tl.where(finite, 0, 1), axis=0) > 0
        acc = tl.where(reached, float("nan"), acc)
        if NORMALIZE:
            acc = acc / d[:, None]
        _store_tokens(o_base, acc, t, valid, stride_v, i_v, Dv, BV)


# ----------------------------------------------------------------------------------------- backward


@device_helper
def _load_den(den, i_bh, t, valid, T):
    """The denominators ``d_t`` of a chunk, ``[BT]`` fp32 from ``den [B*H, T]`` (1 where invalid)."""
    return tl.load(den + i_bh.to(tl.int64) * T + t, mask=valid, other=1.0)


@device_helper
def _output_delta(do0, do_base, o_base, t, valid, stride_v, Dv, BV: tl.constexpr):
    """``delta_t = do_t . o_t`` over all of ``Dv`` (``[BT]`` fp32), the normalizer's backward. ``do0``: the
    ``[BT, BV]`` tile 0 of ``do``, already loaded by the caller; the other V tiles of ``do`` and every tile of
    ``o`` are loaded here. Products and sum in fp32."""
    o0 = _load_tokens(o_base, t, valid, stride_v, 0, Dv, BV)
    delta = tl.sum(do0.to(tl.float32) * o0.to(tl.float32), axis=1)
    for i_w in range(1, tl.cdiv(Dv, BV)):
        dw = _load_tokens(do_base, t, valid, stride_v, i_w, Dv, BV).to(tl.float32)
        ow = _load_tokens(o_base, t, valid, stride_v, i_w, Dv, BV).to(tl.float32)
        delta += tl.sum(dw * ow, axis=1)
    return delta


# 8 warps only: with the fused delta the HAS_R + NORMALIZE variant spills at 4 warps on sm_90; sm_80: 1 stage (at
# 2 and 3 the normalizer variants spill there, results/bench/kernel_resources.md)
@autotune(key=_KEY + ["HAS_R", "NORMALIZE"], warps=(8,), sm80=[(8, 1)])
@triton.jit
def _bwd_block_grads_kernel(
    q, do, o, den, delta, R, Rz, dP, dPz, dR, dRz, dmr, eps0,
    T, H, D, Dv, OFFSET, C, NC, NB,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_R: tl.constexpr, NORMALIZE: tl.constexpr, PREC: tl.constexpr,
):
    """Per block ``i``: ``dP_i = sum_{t in i} q_t dn_t^T`` and ``dp_i = sum q_t dd_t`` (fp32).

    Program ``(i_kv, i_blk, i_bh)`` walks the chunks of its block backwards; with ``HAS_R`` it stores
    ``dR_j`` (the sum over the *later* chunks of the block) before adding chunk ``j``, and accumulates the
    R part of the gradient of ``m_i``, ``sum_j <G_j, R_j> + <g_j, r_j>`` with ``G_j = q_j^T dn_j``,
    ``g_j = q_j^T dd_j``: one partial sum per program, stored at ``dmr[i_kv, i_bh, i_blk]``.

    With ``NORMALIZE`` the programs of V tile 0 (the ones that form ``dp_i``, which needs ``dd``) compute
    ``delta_t = do_t . o_t`` over all V tiles (:func:`_output_delta`), and those of K tile 0 also store it in
    ``delta`` (``[B*H, T]``) for ``_bwd_dqk_kernel``: no separate pass over ``do`` and ``o``.
    """
    i_kv, i_blk, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NV = tl.cdiv(Dv, BV)
    i_k, i_v = i_kv // NV, i_kv % NV
    i_b, i_h = i_bh // H, i_bh % H
    stride_k, stride_v = H * D, H * Dv
    q_base = q + _row_offset(i_b, i_h, T, H, D)
    do_base = do + _row_offset(i_b, i_h, T, H, Dv)
    o_base = o + _row_offset(i_b, i_h, T, H, Dv)

    acc = tl.zeros([BK, BV], dtype=tl.float32)
    acc_z = tl.zeros([BK], dtype=tl.float32)
    dm = tl.zeros([BK], dtype=tl.float32)  # partial gradient of m_i, per feature row
    exact0 = (i_blk == 0) & (eps0 >= 0)  # block 0 without a mixed prefix: m_0's gradient in closed form
    keep_dd = tl.where(exact0, 0.0, 1.0)
    for i_rev in range(NC):
        i_c = NC - 1 - i_rev
        j = i_bh * NB * NC + i_blk * NC + i_c
        if HAS_R:
            p, msk = _summary_ptrs(dR, j, i_k, i_v, D, Dv, BK, BV)
            tl.store(p, acc, mask=msk)
            if NORMALIZE:
                if i_v == 0:
                    pz, mz = _vector_ptrs(dRz, j, i_k, D, BK)
                    tl.store(pz, acc_z, mask=mz)
        t, valid = _chunk_tokens(i_blk, i_c, T, OFFSET, C, BT)
        do_t = _load_tokens(do_base, t, valid, stride_v, i_v, Dv, BV)  # [BT, BV], input dtype
        dn = do_t.to(tl.float32)
        dd = tl.zeros([BT], dtype=tl.float32)
        if NORMALIZE:
            d = _load_den(den, i_bh, t, valid, T)
            if i_v == 0:  # delta first (before q is loaded): the o tiles live only here
                delta_j = _output_delta(do_t, do_base, o_base, t, valid, stride_v, Dv, BV)
                if i_k == 0:
                    tl.store(delta + i_bh.to(tl.int64) * T + t, delta_j, mask=valid)
                dd = -delta_j / d
            dn = dn / d[:, None]
        qt = _load_tokens(q_base, t, valid, stride_k, i_k, D, BK).to(tl.float32)
        G = tl.dot(tl.trans(qt), dn, input_precision=PREC)  # [BK, BV]
        acc += G
        if HAS_R:
            if NORMALIZE:
                if exact0:  # no prefix: sum_t (q_t^T dn_t eps / d_t) . R_j, no dd term (see _bwd_dqk_kernel)
                    G = tl.dot(tl.trans(qt), dn * (eps0 / d)[:, None], input_precision=PREC)
            p, msk = _summary_ptrs(R, j, i_k, i_v, D, Dv, BK, BV)
            dm += tl.sum(G * tl.load(p, mask=msk, other=0.0), axis=1)
        if NORMALIZE:
            if i_v == 0:
                gz = tl.sum(qt * dd[:, None], axis=0)  # [BK]
                if HAS_R:
                    pz, mz = _vector_ptrs(Rz, j, i_k, D, BK)
                    dm += gz * tl.load(pz, mask=mz, other=0.0) * keep_dd
                acc_z += gz
    p, msk = _summary_ptrs(dP, i_bh * NB + i_blk, i_k, i_v, D, Dv, BK, BV)
    tl.store(p, acc, mask=msk)
    if NORMALIZE:
        if i_v == 0:
            pz, mz = _vector_ptrs(dPz, i_bh * NB + i_blk, i_k, D, BK)
            tl.store(pz, acc_z, mask=mz)
    if HAS_R:
        tl.store(dmr + (i_kv * tl.num_programs(2) + i_bh) * NB + i_blk, tl.sum(dm, axis=0))


@autotune(key=_KEY + ["CAUSAL", "HAS_R", "NORMALIZE"])
@triton.jit
def _bwd_dv_kernel(
    q, k, do, den, dS, dR, mdiag, dv,
    T, H, D, Dv, OFFSET, C, NC, NB, stride_mh, stride_mb,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_R: tl.constexpr, NORMALIZE: tl.constexpr, PREC: tl.constexpr,
):
    """``dv_s = (dS_i + m_i dR_j)^T k_s + m_i sum_{t in chunk, t >= s} (q_t . k_s) dn_t``.

    Program ``(i_v, j, i_bh)``; reduces over K tiles. ``dS``: ``[B*H, NB, D, Dv]`` total gradient of the
    block summaries (mixing and, for a returned state, its own gradient), ``dR``: ``[B*H, NB*NC, D, Dv]``.
    """
    i_v, j, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_blk, i_c = j // NC, j % NC
    i_b, i_h = i_bh // H, i_bh % H
    stride_k, stride_v = H * D, H * Dv
    q_base = q + _row_offset(i_b, i_h, T, H, D)
    k_base = k + _row_offset(i_b, i_h, T, H, D)
    t, valid = _chunk_tokens(i_blk, i_c, T, OFFSET, C, BT)
    m = 0.0
    if CAUSAL:
        m = tl.load(mdiag + i_h * stride_mh + i_blk * stride_mb).to(tl.float32)
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    At = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(D, BK)):
        kt = _load_tokens(k_base, t, valid, stride_k, i_k, D, BK)  # [BT, BK]
        p, msk = _summary_ptrs(dS, i_bh * NB + i_blk, i_k, i_v, D, Dv, BK, BV)
        dH = tl.load(p, mask=msk, other=0.0)
        if HAS_R:
            p, msk = _summary_ptrs(dR, i_bh * NB * NC + j, i_k, i_v, D, Dv, BK, BV)
            dH += m * tl.load(p, mask=msk, other=0.0)
        acc += tl.dot(kt.to(tl.float32), dH, input_precision=PREC)
        if CAUSAL:
            qt = _load_tokens(q_base, t, valid, stride_k, i_k, D, BK)
            At += tl.dot(kt, tl.trans(qt), input_precision=PREC)  # At[s, t] = k_s . q_t
    if CAUSAL:
        At = tl.where(tl.arange(0, BT)[:, None] <= tl.arange(0, BT)[None, :], At, 0.0)
        do_base = do + _row_offset(i_b, i_h, T, H, Dv)
        dn = _load_tokens(do_base, t, valid, stride_v, i_v, Dv, BV).to(tl.float32)
        if NORMALIZE:
            dn = dn / tl.load(den + i_bh.to(tl.int64) * T + t, mask=valid, other=1.0)[:, None]
        acc += m * tl.dot(At, dn, input_precision=PREC)
    _store_tokens(dv + _row_offset(i_b, i_h, T, H, Dv), acc, t, valid, stride_v, i_v, Dv, BV)


# Spill-free configs only (results/bench/kernel_resources.md): sm_90 8 warps (4 warps spill 8-40 B), sm_80 4 warps x
# 2 stages (the others spill 8-32 B with the normalizer)
@autotune(key=_KEY + ["HAS_R", "NORMALIZE"], warps=(8,), sm80=[(4, 2)])
@triton.jit
def _bwd_dv_all_v_kernel(
    q, k, do, den, dS, dR, mdiag, dv,
    T, H, D, Dv, OFFSET, C, NC, NB, stride_mh, stride_mb,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_R: tl.constexpr, NORMALIZE: tl.constexpr, PREC: tl.constexpr,
):
    """Causal ``dv`` of one chunk, every V tile: ``_bwd_dv_kernel``'s causal form when one K tile holds the head
    dim (``D <= BK``) and ``Dv`` takes several V tiles (D 128: ``BK`` 128, ``BV`` 64).

    Program ``(0, j, i_bh)`` loads ``k``, ``q`` of chunk ``j`` once and forms ``A^T`` (``A^T[s, t] = k_s . q_t``,
    ``s <= t``) once, then each V tile adds ``k dH_j`` and ``m A^T dn``: ``q`` and ``k`` read once instead of once
    per V tile. Same arguments as ``_bwd_dv_kernel``.
    """
    j, i_bh = tl.program_id(1), tl.program_id(2)
    i_blk, i_c = j // NC, j % NC
    i_b, i_h = i_bh // H, i_bh % H
    stride_k, stride_v = H * D, H * Dv
    q_base = q + _row_offset(i_b, i_h, T, H, D)
    k_base = k + _row_offset(i_b, i_h, T, H, D)
    t, valid = _chunk_tokens(i_blk, i_c, T, OFFSET, C, BT)
    m = tl.load(mdiag + i_h * stride_mh + i_blk * stride_mb).to(tl.float32)
    kt = _load_tokens(k_base, t, valid, stride_k, 0, D, BK)  # [BT, BK]
    qt = _load_tokens(q_base, t, valid, stride_k, 0, D, BK)
    At = tl.where(tl.arange(0, BT)[:, None] <= tl.arange(0, BT)[None, :],
                  tl.dot(kt, tl.trans(qt), input_precision=PREC), 0.0)  # At[s, t] = k_s . q_t, s <= t
    k32 = kt.to(tl.float32)
    do_base = do + _row_offset(i_b, i_h, T, H, Dv)
    d = tl.full([BT], 1.0, dtype=tl.float32)
    if NORMALIZE:
        d = tl.load(den + i_bh.to(tl.int64) * T + t, mask=valid, other=1.0)
    for i_v in range(tl.cdiv(Dv, BV)):
        p, msk = _summary_ptrs(dS, i_bh * NB + i_blk, 0, i_v, D, Dv, BK, BV)
        dH = tl.load(p, mask=msk, other=0.0)
        if HAS_R:
            p, msk = _summary_ptrs(dR, i_bh * NB * NC + j, 0, i_v, D, Dv, BK, BV)
            dH += m * tl.load(p, mask=msk, other=0.0)
        acc = tl.dot(k32, dH, input_precision=PREC)
        dn = _load_tokens(do_base, t, valid, stride_v, i_v, Dv, BV).to(tl.float32) / d[:, None]
        acc += m * tl.dot(At, dn, input_precision=PREC)
        _store_tokens(dv + _row_offset(i_b, i_h, T, H, Dv), acc, t, valid, stride_v, i_v, Dv, BV)


# 8 warps: the causal variants spill at 4 warps on sm_90 (results/bench/kernel_resources.md). sm_90 also tunes over the
# V loop by half tiles (HALF_V at 8 x 2: 114-168 registers and 40-56 KB of shared memory against 161-229 and 80-112 KB;
# the non-causal variants, at 114-118, fit two programs per SM); sm_80 takes HALF_V only (the causal variants spill at
# full tiles there)
@autotune(key=_KEY + ["CAUSAL", "HAS_R", "NORMALIZE"],
          sm90=[(8, 2), (8, 2, {"HALF_V": True}), (8, 3, {"HALF_V": True})],
          sm80=[(8, 2, {"HALF_V": True}), (8, 3, {"HALF_V": True})])
@triton.jit
def _bwd_dqk_kernel(
    q, k, v, do, den, delta, P, Pz, R, Rz, dS, dSz, dR, dRz, mdiag, dq, dk, dmi, eps0,
    T, H, D, Dv, OFFSET, C, NC, NB, stride_mh, stride_mb,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_R: tl.constexpr, NORMALIZE: tl.constexpr, PREC: tl.constexpr,
    HALF_V: tl.constexpr = False,
):
    """``dq`` and ``dk`` of one chunk, one K tile (module docstring). Reduces over V tiles.

    With ``CAUSAL`` it also stores the intra-chunk part of the gradient of ``m_i`` restricted to this K
    tile, ``sum_{s <= t} (q_t . k_s)|_{K tile} dA[t, s]``, at ``dmi[i_k, i_bh, j]`` (the K tiles add up).
    ``HALF_V`` (an autotune config's, not the host's): the V loop steps by ``BV / 2`` (when that is at least 16),
    half the loop's live tiles and shared memory; the same loads and sums.
    """
    BVL: tl.constexpr = BV // 2 if HALF_V and BV >= 32 else BV  # the V loop's step
    i_k, j, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_blk, i_c = j // NC, j % NC
    i_b, i_h = i_bh // H, i_bh % H
    stride_k, stride_v = H * D, H * Dv
    qk_off = _row_offset(i_b, i_h, T, H, D)
    v_off = _row_offset(i_b, i_h, T, H, Dv)
    t, valid = _chunk_tokens(i_blk, i_c, T, OFFSET, C, BT)
    m = 0.0
    if CAUSAL:
        m = tl.load(mdiag + i_h * stride_mh + i_blk * stride_mb).to(tl.float32)
    n_p = i_bh * NB + i_blk
    n_r = i_bh * NB * NC + j

    dq_acc = tl.zeros([BT, BK], dtype=tl.float32)
    dk_acc = tl.zeros([BT, BK], dtype=tl.float32)
    dnv = tl.zeros([BT, BT], dtype=tl.float32)  # do_t . v_s (dn_t . v_s = do_t . v_s / d_t)
    dd = tl.zeros([BT], dtype=tl.float32)
    d = tl.full([BT], 1.0, dtype=tl.float32)
    if NORMALIZE:  # dn = do / d, dd = -(do . o) / d; delta = do . o from _bwd_block_grads_kernel
        d = _load_den(den, i_bh, t, valid, T)
        dd = -tl.load(delta + i_bh.to(tl.int64) * T + t, mask=valid, other=0.0) / d
    for i_v in range(tl.cdiv(Dv, BVL)):
        do_t = _load_tokens(do + v_off, t, valid, stride_v, i_v, Dv, BVL)  # [BT, BVL], input dtype
        v_t = _load_tokens(v + v_off, t, valid, stride_v, i_v, Dv, BVL)
        vt = v_t.to(tl.float32)
        p, msk = _summary_ptrs(P, n_p, i_k, i_v, D, Dv, BK, BVL)
        h = tl.load(p, mask=msk, other=0.0).to(tl.float32)
        p, msk = _summary_ptrs(dS, n_p, i_k, i_v, D, Dv, BK, BVL)
        dH = tl.load(p, mask=msk, other=0.0)
        if HAS_R:
            p, msk = _summary_ptrs(R, n_r, i_k, i_v, D, Dv, BK, BVL)
            h += m * tl.load(p, mask=msk, other=0.0)
            p, msk = _summary_ptrs(dR, n_r, i_k, i_v, D, Dv, BK, BVL)
            dH += m * tl.load(p, mask=msk, other=0.0)
        dq_acc += tl.dot(do_t.to(tl.float32), tl.trans(h), input_precision=PREC)  # rows times 1 / d_t below
        dk_acc += tl.dot(vt, tl.trans(dH), input_precision=PREC)
        if CAUSAL:
            dnv += tl.dot(do_t, tl.trans(v_t), input_precision=PREC)  # input dtype: exact products
    if NORMALIZE:
        dq_acc = dq_acc / d[:, None]  # dn_t = do_t / d_t
        pz, mz = _vector_ptrs(Pz, n_p, i_k, D, BK)
        g = tl.load(pz, mask=mz, other=0.0).to(tl.float32)
        pz, mz = _vector_ptrs(dSz, n_p, i_k, D, BK)
        dh = tl.load(pz, mask=mz, other=0.0)
        if HAS_R:
            pz, mz = _vector_ptrs(Rz, n_r, i_k, D, BK)
            g += m * tl.load(pz, mask=mz, other=0.0)
            pz, mz = _vector_ptrs(dRz, n_r, i_k, D, BK)
            dh += m * tl.load(pz, mask=mz, other=0.0)
        dq_acc += dd[:, None] * g[None, :]
        dk_acc += dh[None, :]
    if CAUSAL:  # only the causal part reads q and k, after the loop (nothing of them is live across it)
        qt = _load_tokens(q + qk_off, t, valid, stride_k, i_k, D, BK)  # [BT, BK]
        kt = _load_tokens(k + qk_off, t, valid, stride_k, i_k, D, BK)
        causal_mask = tl.arange(0, BT)[:, None] >= tl.arange(0, BT)[None, :]
        # this K tile's part of a_ts = q_t . k_s (s <= t), reduced to row sums first, so that the [BT, BT] A is
        # dead before dA's dots: dm = sum_ts a_ts dA[t, s] = sum_t (sum_s a_ts dnv_ts) / d_t + dd_t sum_s a_ts
        A = tl.where(causal_mask, tl.dot(qt, tl.trans(kt), input_precision=PREC), 0.0)
        a_dnv = tl.sum(A * dnv, axis=1) / d
        if NORMALIZE:
            dm = tl.sum(a_dnv + dd * tl.sum(A, axis=1))
            # Block 0 without a mixed prefix (eps0 >= 0: no state columns): o_t = m V_t / (m a_t + eps), and
            # d o_t / d m = eps V_t / d_t^2, i.e. dn_t . V_t * eps / d_t. The general form dn . V + dd a
            # cancels to it from terms ~1/m times larger, through delta = do . o of the *rounded* output
            # (fp16 / bf16): 1/m-amplified error when m_0 is small. So no dd term here.
            if (i_blk == 0) & (eps0 >= 0):
                dm = tl.sum(a_dnv * (eps0 / d))
        else:
            dm = tl.sum(a_dnv)
        tl.store(dmi + (i_k * tl.num_programs(2) + i_bh) * NB * NC + j, dm)
        dA = tl.where(causal_mask, dnv / d[:, None] + dd[:, None], 0.0)  # dA[t, s] = dn_t . v_s + dd_t, s <= t
        if kt.dtype == tl.bfloat16:
            # dA as two bf16 terms (hi + lo: 16 significant bits, more than TF32's 11) times the bf16 q / k: bf16
            # operands, half the registers of fp32 ones (sm_80 holds a whole operand tile per warp here)
            dA_hi = dA.to(tl.bfloat16)
            dA_lo = (dA - dA_hi.to(tl.float32)).to(tl.bfloat16)
            dq_acc += m * (tl.dot(dA_hi, kt) + tl.dot(dA_lo, kt))
            _store_tokens(dq + qk_off, dq_acc, t, valid, stride_k, i_k, D, BK)  # dq_acc is dead before dk's dots
            dk_acc += m * (tl.dot(tl.trans(dA_hi), qt) + tl.dot(tl.trans(dA_lo), qt))
        else:  # fp16 (whose range a gradient may leave) and fp32: TF32 / exact fp32 products
            dq_acc += m * tl.dot(dA, kt.to(tl.float32), input_precision=PREC)
            _store_tokens(dq + qk_off, dq_acc, t, valid, stride_k, i_k, D, BK)
            dk_acc += m * tl.dot(tl.trans(dA), qt.to(tl.float32), input_precision=PREC)
    else:
        _store_tokens(dq + qk_off, dq_acc, t, valid, stride_k, i_k, D, BK)
    _store_tokens(dk + qk_off, dk_acc, t, valid, stride_k, i_k, D, BK)


# ------------------------------------------------------------------------------------- host wrappers


def _f32(shape, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, device=like.device, dtype=torch.float32)


def _dummy(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(1, device=like.device, dtype=torch.float32)


def _diag_strides(mdiag: torch.Tensor | None) -> dict:
    """Head and block strides of the ``[H or 1, NB]`` diagonal coefficients (head stride 0 when shared by all
    heads): the kernels read a strided view, e.g. the diagonal of the mixing itself, in its own dtype."""
    if mdiag is None:
        return {"stride_mh": 0, "stride_mb": 0}
    return {"stride_mh": mdiag.stride(0) if mdiag.shape[0] > 1 else 0, "stride_mb": mdiag.stride(1)}


def _common(g: Geometry):
    return {"T": g.T, "H": g.H, "D": g.D, "Dv": g.Dv, "OFFSET": g.OFFSET, "C": g.C, "NC": g.NC, "NB": g.NB,
            "BT": g.BT, "BK": g.BK, "BV": g.BV}


#: Whether the causal ``fwd_output`` / ``bwd_dv`` may take their ``all_v`` kernels (:func:`all_v_tiles`); False runs
#: the per-V-tile kernels everywhere (scripts/probe_kernels.py times both on a GPU, the control of the choice).
ALL_V_KERNELS = True


def all_v_tiles(g: Geometry, dtype: torch.dtype) -> bool:
    """Whether the causal ``fwd_output`` / ``bwd_dv`` run their ``all_v`` kernels: half inputs (fp16 / bf16), one K
    tile of :meth:`Geometry.wide_k` holds the head dim and ``Dv`` takes several V tiles (D 128). fp32 inputs keep the
    per-V-tile kernels: their 128-wide fp32 tiles spill (1.4 KB on sm_90 at 8 warps; results/bench/kernel_resources.md
    holds the bf16 figures)."""
    return ALL_V_KERNELS and dtype.itemsize == 2 and g.NV > 1 and g.wide_k().NK == 1


def fwd_block_summaries(k, v, g: Geometry, *, has_r: bool, store_z: bool, cur_s=None, cur_z=None,
                        s_dtype: torch.dtype = torch.float32):
    """Run ``_fwd_block_summaries_kernel``.

    Returns ``S [B*H, NB, D, Dv]``, ``Z [B*H, NB, D]`` (or None), ``R [B*H, NB*NC, D, Dv]`` and
    ``Rz [B*H, NB*NC, D]`` (None without ``has_r``), fp32 except ``S``, ``Z`` in ``s_dtype`` (opt-in half
    summaries).
    """
    if not has_r:  # no running sums: the wide tiles (k and v read once at D 128)
        g = g.wide()
    S = torch.empty((g.BH, g.NB, g.D, g.Dv), device=k.device, dtype=s_dtype)  # the store rounds to s_dtype
    Z = torch.empty((g.BH, g.NB, g.D), device=k.device, dtype=s_dtype) if store_z else _dummy(k)
    R = _f32((g.BH, g.NT, g.D, g.Dv), k) if has_r else _dummy(k)
    Rz = _f32((g.BH, g.NT, g.D), k) if has_r and store_z else _dummy(k)
    has_init = cur_s is not None
    _fwd_block_summaries_kernel[(g.NK * g.NV, g.NB, g.BH)](
        k, v, cur_s if has_init else _dummy(k), cur_z if has_init else _dummy(k), S, Z, R, Rz,
        HAS_R=has_r, HAS_INIT=has_init, STORE_Z=store_z, PREC=dot_precision(k.dtype), **_common(g),
    )
    return S, (Z if store_z else None), (R if has_r else None), (Rz if has_r and store_z else None)


def fwd_output(q, k, v, P, Pz, R, Rz, mdiag, g: Geometry, *, causal: bool, normalize: bool, eps: float,
               out_dtype: torch.dtype):
    """Run ``_fwd_output_kernel`` (causal with :func:`all_v_tiles`: ``_fwd_output_all_v_kernel``). Returns
    ``o [B, T, H, Dv]`` (``out_dtype``) and ``den [B*H, T]`` fp32
    (None without the normalizer). ``mdiag`` (causal): ``[H or 1, NB]`` in any float dtype and strides (the
    kernels read it as fp32 by its head and block strides, e.g. the mixing's own diagonal; as ``bwd_dv``,
    ``bwd_dqk``)."""
    o = torch.empty(g.B, g.T, g.H, g.Dv, device=q.device, dtype=out_dtype)
    den = _f32((g.BH, g.T), q) if normalize else _dummy(q)
    has_r = R is not None
    args = (q, k, v, P, Pz if normalize else _dummy(q), R if has_r else _dummy(q),
            Rz if has_r and normalize else _dummy(q), mdiag if causal else _dummy(q), o, den)
    kw = dict(**_diag_strides(mdiag if causal else None), eps=eps, HAS_R=has_r, NORMALIZE=normalize,
              PREC=dot_precision(q.dtype))
    if causal and all_v_tiles(g, q.dtype):  # one K tile: a program per chunk walks the V tiles, q, k read once
        g = g.wide_k()
        _fwd_output_all_v_kernel[(1, g.NT, g.BH)](*args, **kw, **_common(g))
        return o, (den if normalize else None)
    if not causal:  # the wide tiles: q read once, and at D 128 one K tile, so P is read once per block
        g = g.wide()
    one_k = g.NK == 1 and not has_r  # a program per block, its P read once (else a program per chunk)
    _fwd_output_kernel[(g.NV, g.NB if one_k else g.NT, g.BH)](*args, **kw, CAUSAL=causal, ONE_K=one_k,
                                                                **_common(g))
    return o, (den if normalize else None)


def bwd_block_grads(q, do, o, den, R, Rz, g: Geometry, *, normalize: bool, eps0: float = -1.0):
    """Run ``_bwd_block_grads_kernel``. Returns ``dP, dPz, dR, dRz`` (fp32, shapes of ``P, Pz, R, Rz``;
    None where not used), ``dm_r [B*H, NB]``, the R part of the gradient of ``m_i`` (None without R), and
    ``delta [B*H, T]`` fp32, ``do_t . o_t`` (the normalizer's; None without it) for :func:`bwd_dqk`."""
    has_r = R is not None
    if not has_r:  # no running sums: the wide tiles (q and do read once at D 128)
        g = g.wide()
    dP = _f32((g.BH, g.NB, g.D, g.Dv), q)
    dPz = _f32((g.BH, g.NB, g.D), q) if normalize else _dummy(q)
    dR = _f32((g.BH, g.NT, g.D, g.Dv), q) if has_r else _dummy(q)
    dRz = _f32((g.BH, g.NT, g.D), q) if has_r and normalize else _dummy(q)
    dmr = _f32((g.NK * g.NV, g.BH, g.NB), q) if has_r else _dummy(q)
    delta = _f32((g.BH, g.T), q) if normalize else _dummy(q)
    _bwd_block_grads_kernel[(g.NK * g.NV, g.NB, g.BH)](
        q, do, o, den if normalize else _dummy(q), delta,
        R if has_r else _dummy(q), Rz if has_r and normalize else _dummy(q), dP, dPz, dR, dRz, dmr,
        float(eps0), HAS_R=has_r, NORMALIZE=normalize, PREC=dot_precision(q.dtype), **_common(g),
    )
    return (dP, dPz if normalize else None, dR if has_r else None, dRz if has_r and normalize else None,
            dmr.sum(0) if has_r else None, delta if normalize else None)


def bwd_dv(q, k, do, den, dS, dR, mdiag, g: Geometry, *, causal: bool, normalize: bool, out_dtype):
    """Run ``_bwd_dv_kernel`` (causal with :func:`all_v_tiles`: ``_bwd_dv_all_v_kernel``). Returns
    ``dv [B, T, H, Dv]``."""
    dv = torch.empty(g.B, g.T, g.H, g.Dv, device=q.device, dtype=out_dtype)
    has_r = dR is not None
    args = (q, k, do, den if normalize else _dummy(q), dS, dR if has_r else _dummy(q),
            mdiag if causal else _dummy(q), dv)
    kw = dict(**_diag_strides(mdiag if causal else None), HAS_R=has_r, NORMALIZE=normalize,
              PREC=dot_precision(q.dtype))
    if causal and all_v_tiles(g, q.dtype):  # one K tile: a program per chunk walks the V tiles, q, k read once
        g = g.wide_k()
        _bwd_dv_all_v_kernel[(1, g.NT, g.BH)](*args, **kw, **_common(g))
        return dv
    if not causal:  # the wide tiles: k read once at D 128
        g = g.wide()
    _bwd_dv_kernel[(g.NV, g.NT, g.BH)](*args, **kw, CAUSAL=causal, **_common(g))
    return dv


def bwd_dqk(q, k, v, do, den, delta, P, Pz, R, Rz, dS, dSz, dR, dRz, mdiag, g: Geometry, *,
            causal: bool, normalize: bool, out_dtype, eps0: float = -1.0):
    """Run ``_bwd_dqk_kernel``. Returns ``dq, dk [B, T, H, D]`` and ``dm_intra [B*H, NB]`` (the
    intra-chunk part of the gradient of ``m_i``; None when not causal)."""
    dq = torch.empty(g.B, g.T, g.H, g.D, device=q.device, dtype=out_dtype)
    dk = torch.empty_like(dq)
    has_r = R is not None
    dmi = _f32((g.NK, g.BH, g.NT), q) if causal else _dummy(q)
    d = _dummy(q)
    _bwd_dqk_kernel[(g.NK, g.NT, g.BH)](
        q, k, v, do, den if normalize else d, delta if normalize else d, P, Pz if normalize else d,
        R if has_r else d, Rz if has_r and normalize else d, dS, dSz if normalize else d,
        dR if has_r else d, dRz if has_r and normalize else d, mdiag if causal else d, dq, dk, dmi, float(eps0),
        **_diag_strides(mdiag if causal else None),
        CAUSAL=causal, HAS_R=has_r, NORMALIZE=normalize, PREC=dot_precision(q.dtype), **_common(g),
    )
    dm = dmi.sum(0).view(g.BH, g.NB, g.NC).sum(-1) if causal else None
    return dq, dk, dm


# --------------------------------------------------------------------------------- torch glue: the mix


def mix_summaries(coeff: torch.Tensor, S_all: torch.Tensor, Z_all: torch.Tensor | None, *,
                  precision: str = "ieee", p_dtype: torch.dtype = torch.float32):
    """``P_i = sum_b coeff[i, b] S_b`` and ``p_i`` from ``z_b``: one launch of the GEMM kernel of :mod:`.mix`
    (all blocks).

    Args:
        coeff: ``[H or 1, NB, N]``, any float dtype and strides (rows: this call's blocks; columns: all blocks
            summarised; the kernel reads it as fp32).
        S_all: ``[B, H, N, D, Dv]`` fp32; Z_all: ``[B, H, N, D]`` or None.
        precision: ``tl.dot``'s input precision (:func:`.utils.dot_precision` of the input dtype).
    Returns:
        ``P [B*H, NB, D, Dv]`` and ``Pz [B*H, NB, D]`` (None without Z), contiguous, in ``p_dtype``.
    """
    B, H, _, D, Dv = S_all.shape
    NB = coeff.shape[1]
    P, Pz = mix_gemm_parts(coeff, [S_all.reshape(B, H, -1, D * Dv), Z_all], causal=False, precision=precision,
                           out_dtype=p_dtype)
    return P.view(B * H, NB, D, Dv), (None if Pz is None else Pz.view(B * H, NB, D))


def mix_summaries_backward(coeff, S_all, Z_all, dP, dPz, *, need_dcoeff: bool = True, precision: str = "ieee"):
    """Backward of :func:`mix_summaries` (the GEMM kernels of :mod:`.mix`, both parts in one launch each).

    Returns ``dS_all [B, H, N, D, Dv]``, ``dZ_all [B, H, N, D]`` (None without Z) and
    ``dcoeff [H or 1, NB, N]`` fp32: ``dcoeff[i, b] = sum_batch <dP_i, S_b> + <dp_i, z_b>`` (summed over heads
    too when the coefficients are shared; None unless ``need_dcoeff``).
    """
    B, H, N, D, Dv = S_all.shape
    NB = coeff.shape[1]
    (dS_all, dZ_all), dcoeff = mix_gemm_parts_backward(
        coeff, [S_all.reshape(B, H, N, D * Dv), Z_all],
        [dP.reshape(B, H, NB, D * Dv), None if Z_all is None else dPz.reshape(B, H, NB, D)],
        causal=False, precision=precision, need_dcoeff=need_dcoeff)
    return dS_all.view(B, H, N, D, Dv), dZ_all, dcoeff


def mixing_3d(mixing: torch.Tensor) -> torch.Tensor:
    """``[M, M]`` or ``[H, M, M]`` -> ``[1 or H, M, M]``, a view in the mixing's own dtype (the kernels read
    it as fp32: no cast launch)."""
    return mixing.unsqueeze(0) if mixing.dim() == 2 else mixing


def mixing_grad_like(dmix3: torch.Tensor, ndim: int, dtype: torch.dtype) -> torch.Tensor:
    """A ``[1 or H, M, M]`` fp32 gradient in the rank (2 or 3) and dtype of the mixing matrix."""
    return (dmix3[0] if ndim == 2 else dmix3).to(dtype)
