"""Fused Triton kernels of the banded mix (:class:`~.mix.BandedMix`): compact causal rows in linear time.

The summaries ``x [B*H, N, F]`` (``N`` = the state's columns ``SC`` then the call's ``NB`` blocks, ``F`` = ``D*Dv``
for ``S`` or ``D`` for ``z``) are mixed by rows ``i = first + r`` (``r < NB``) of a causal matrix in the compact
form of :class:`mhla.ops.mhla.state.MixingRows` (window ``(n_head, n_recent)``)::

    P_r = sum_{h < n_head, h < i} head[r, h] x_h + sum_{d < n_recent} recent[r, d] x_{i-1-d} + far[r] F_i
    F_i = sum_{n_head <= b < i - n_recent} x_b                   (the far blocks; recent terms for b >= n_head)

**Layout of the walk.** Rows are cut in tiles of ``TR = band_tile(n_recent)`` (a power of two ``>= n_recent``, >=
16). ``Z`` is the sequence of the kept recent state columns and the call's blocks, ``TR - kept_recent`` empty
positions first, so that Z position ``p`` is block ``first - TR + p`` (column ``SC - TR + p``) and Z tile ``t + 1``
holds row tile ``t``'s own blocks. Row tile ``t`` reads Z tiles ``t`` and ``t + 1`` (its ``2 TR`` latest blocks)
through one ``[TR, 2 TR]`` coefficient tile ``W``: ``recent[r, d]`` at distance ``d = TR + a - 1 - c < n_recent``,
``far[r]`` at larger distances (the far blocks inside the window), 0 after the row's own block. The far blocks
before Z tile ``t`` are one running sum ``C_t`` (the folded state column, then every Z tile as the walk passes it),
so

    P_tile = W[:, :TR] @ Z_t + W[:, TR:] @ Z_{t+1} + far[:, None] * C_t + head_tile @ X_head

with ``X_head [NHP, BN]`` (the first blocks) held in registers. Z positions of head blocks (``b < n_head``) enter
the band and the far sum as zeros.

**Kernels.** One program per (feature tile of ``BN = 128`` features, batch x head); the two parts (summaries and
key sums) in one launch, their feature tiles numbered end to end. Three launches per call and its backward, and a
torch sum:

* ``_banded_fwd_kernel``: walks the row tiles in order, reading every summary once (the previous Z tile stays in
  registers) and writing ``P`` once.
* ``_banded_bwd_scan_kernel`` (backward pass 1, forward walk): the first non-finite column per feature (``FB``,
  for the dx kernel) and, with ``NEED_DW``, this program's part of the coefficient gradients, ``dP_r . x_b``
  summed over its features: ``G = dP_t @ [Z_t, Z_{t+1}]^T``, whose diagonals are ``drecent``, ``dP_t . C_t`` plus
  ``G`` on the far columns ``dfar``, ``dP_t @ X_head^T`` ``dhead``; stored as a partial sum ``[programs, NB,
  n_head + n_recent + 1]`` that torch sums over the programs of a coefficient group (one launch). The Gram
  matrices reduce over chunks of ``KC = 16`` features loaded from memory (a dot over all ``BN`` features holds
  its whole operand rows in every warp: it spills), so each Z tile but the first is read twice here.
* ``_banded_bwd_dx_kernel`` (pass 2, backward walk): ``dx``, the transposed mix: ``W^T dP`` per tile, the suffix
  sum of ``far[r] dP_r`` over the later tiles for the far blocks, and ``head^T dP`` accumulated in registers (a
  head block's gradient is complete once the walk reaches its tile).

Bytes (fp32 summaries, the training call): forward ``x`` and ``P`` once, backward ``x`` about twice, ``dP`` twice,
``dx`` once; the coefficients once per program and pass, and the partial gradients written and summed once, each
``(1 + n_recent + n_head) / BN`` of the summaries (1/4 for the LM's window (0, 31)).
:func:`mhla.ops.mhla.triton.traffic.banded_kernel_traffic` counts them exactly.

**Precision.** ``tl.dot`` of the forward and dx kernels at ``precision`` (:class:`~.mix.BandedMix`'s, default
``tf32x3``: about fp32 accuracy on the tensor cores; ``ieee`` there spills); the scan kernel's small Gram dots
in exact fp32 (``ieee``, :data:`SCAN_PRECISION`).

**Non-finite summaries** (as :func:`mhla.ops.utils.causal_product` with ``strict=True``): a NaN or inf in column
``c`` is read as 0, and ``P[r]`` of every row after it (``SC + r > c``) is NaN for that feature; backward, ``dP`` of
those rows is dropped (so ``dx`` of a non-finite entry is 0). The walks carry the first non-finite column per
feature: no host synchronisation.

Covered: every column layout of :class:`~.mix.BandedMix` (the training call, and a state's kept head, folded and
kept recent columns), ``n_head <= MAX_HEAD`` and ``n_recent <= MAX_RECENT`` (register tiles), summaries in fp32,
fp16 or bf16 (fp32 accumulation), coefficients in any float dtype (read as fp32). Anything else is
:meth:`~.mix.BandedMix`'s torch reference (:func:`fused_supported`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import autotune_configs, device_helper, next_pow2

_BIG: tl.constexpr = tl.constexpr(2**30)  # "no non-finite column yet"

#: The largest windows the kernels hold in registers (head blocks ``X_head [16, BN]``; band tiles of 16 or 32 rows):
#: every variant of these compiles without spilling registers on sm_90 and sm_80 (compile_check); band tiles of 64
#: rows spill, so ``n_recent > 32`` takes the torch reference.
MAX_HEAD = 16
MAX_RECENT = 32
#: Features per program (the coefficients, read once per program, cost ``(1 + n_recent + n_head) / FEATURE_TILE`` of
#: the summaries' bytes; so do the partial coefficient gradients).
FEATURE_TILE = 128
#: Features per dot of the coefficient-gradient Gram matrices (``_banded_bwd_scan_kernel``'s ``KC``)
SCAN_CHUNK = 16
#: their ``tl.dot`` precision: exact fp32 (on the CUDA cores; chunks of 32 features keep its registers in bounds)
SCAN_PRECISION = "ieee"
_KEY = ["F1", "F2", "TR", "NHP", "BN", "HAS_HEAD", "FOLDED"]


def band_tile(recent: int) -> int:
    """Rows per band tile: a power of two ``>= recent`` (and >= 16), so that a tile's rows read only its own and
    the previous tile's blocks (:func:`.mix.band_tile` is the same)."""
    return max(16, next_pow2(recent))


def fused_supported(window: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether the kernels run this mix: summaries in fp32 / fp16 / bf16 and a window whose head and band tiles fit
    the registers (``n_head <= MAX_HEAD``, ``n_recent <= MAX_RECENT``). Otherwise the torch reference runs."""
    return dtype in (torch.float32, torch.float16, torch.bfloat16) and window[0] <= MAX_HEAD \
        and window[1] <= MAX_RECENT


def banded_tiles(window: tuple[int, int], F: int) -> tuple[int, int, int]:
    """``(TR, NHP, BN)``: band tile rows, head blocks held (a power of two >= 16), features per program (``F`` the
    widest part's features)."""
    return band_tile(window[1]), max(16, next_pow2(window[0])), min(FEATURE_TILE, max(16, next_pow2(F)))


# ------------------------------------------------------------------------------------------------ helpers


@device_helper
def _feature_part(i_f, NF1, X1, X2, Y1, Y2, Z1, Z2, F1, F2, BN: tl.constexpr):
    """Feature tile ``i_f`` of the two parts laid end to end: the part's three base pointers, its feature count
    and the tile's first feature."""
    if i_f < NF1:
        x, y, z, F, f0 = X1, Y1, Z1, F1, i_f * BN
    else:
        x, y, z, F, f0 = X2, Y2, Z2, F2, (i_f - NF1) * BN
    return x, y, z, F, f0


@device_helper
def _band_coefficients(RECENT, FAR, r, rmask, s_rr, s_rc, s_fr, NREC, TR: tl.constexpr):
    """The coefficient tile of rows ``r`` (``[TR]``) on the previous and own Z tiles: ``(wa, wb, far)``, ``wa [TR,
    TR]`` on the previous tile (distance ``TR + a - 1 - c``, every entry read), ``wb [TR, TR]`` on the own tile
    (distance ``a - 1 - c``, zero from the own block on), ``far [TR]``; rows past ``NB`` are zero."""
    a = tl.arange(0, TR)
    c = tl.arange(0, TR)
    far = tl.load(FAR + r * s_fr, mask=rmask, other=0.0).to(tl.float32)
    da = TR - 1 + a[:, None] - c[None, :]
    wa = tl.load(RECENT + r[:, None] * s_rr + da * s_rc, mask=rmask[:, None] & (da < NREC), other=0.0)
    wa = tl.where(da < NREC, wa.to(tl.float32), far[:, None])
    db = a[:, None] - 1 - c[None, :]
    wb = tl.load(RECENT + r[:, None] * s_rr + db * s_rc, mask=rmask[:, None] & (db >= 0) & (db < NREC),
                 other=0.0)
    wb = tl.where(db < NREC, wb.to(tl.float32), far[:, None])
    wb = tl.where(db >= 0, wb, 0.0)
    return wa, wb, far


@device_helper
def _state_scan(x_base, feats, fmask, F, SC, FOLD_COL, TR: tl.constexpr, BN: tl.constexpr,
                FOLDED: tl.constexpr):
    """Over the state's columns ``0 .. SC - 1``: the first non-finite one per feature (``[BN]`` int32, ``_BIG``
    for none) and the folded far sum (column ``FOLD_COL``, 0 without; a non-finite value read as 0)."""
    fb = tl.full([BN], _BIG, dtype=tl.int32)
    c0 = tl.zeros([BN], dtype=tl.float32)
    for s0 in range(0, SC, TR):
        cols = s0 + tl.arange(0, TR)
        xs = tl.load(x_base + cols[:, None].to(tl.int64) * F + feats[None, :],
                     mask=(cols < SC)[:, None] & fmask[None, :], other=0.0).to(tl.float32)
        finite = tl.abs(xs) < float("inf")
        fb = tl.minimum(fb, tl.min(tl.where(finite, _BIG, cols[:, None]), axis=0))
        if FOLDED:
            c0 += tl.sum(tl.where((cols == FOLD_COL)[:, None] & finite, xs, 0.0), axis=0)
    return fb, c0


@device_helper
def _head_rows(x_base, feats, fmask, F, N, SC, FIRST, KH, NHEAD, NHP: tl.constexpr):
    """``X_head [NHP, BN]``: the first ``n_head`` blocks (kept by the state: columns ``h < KH``; else the call's
    blocks) that exist, non-finite values read as 0."""
    h = tl.arange(0, NHP)
    hcol = tl.where(h < KH, h, SC + h - FIRST)
    hmask = (h < NHEAD) & (hcol < N)
    xh = tl.load(x_base + hcol[:, None].to(tl.int64) * F + feats[None, :], mask=hmask[:, None] & fmask[None, :],
                 other=0.0).to(tl.float32)
    return tl.where(tl.abs(xh) < float("inf"), xh, 0.0)


@device_helper
def _first_z_tile(x_base, feats, fmask, F, SC, KR, FIRST, NHEAD, TR: tl.constexpr):
    """Z tile 0 (``[TR, BN]``): the state's ``KR`` kept recent blocks at its end, zeros before; head blocks and
    non-finite values as 0."""
    p = tl.arange(0, TR)
    col = SC - TR + p
    z = tl.load(x_base + col[:, None].to(tl.int64) * F + feats[None, :],
                mask=(p >= TR - KR)[:, None] & fmask[None, :], other=0.0).to(tl.float32)
    keep = (tl.abs(z) < float("inf")) & (FIRST - TR + p >= NHEAD)[:, None]
    return tl.where(keep, z, 0.0)


# ------------------------------------------------------------------------------------------------ kernels


@triton.autotune(configs=autotune_configs(warps=(8,)), key=_KEY)
@triton.jit
def _banded_fwd_kernel(
    X1, P1, X2, P2, HEAD, RECENT, FAR,
    NB, N, F1, F2, H, FIRST, SC, KH, KR, FOLD_COL, NHEAD, NREC,
    s_hg, s_hr, s_hc, s_rg, s_rr, s_rc, s_fg, s_fr,
    TR: tl.constexpr, NHP: tl.constexpr, BN: tl.constexpr, HAS_HEAD: tl.constexpr, FOLDED: tl.constexpr,
    PREC: tl.constexpr,
):
    """``P [B*H, NB, F]`` of the banded mix (module docstring) for one feature tile of one (batch, head): program
    ``(feature tile, bh)``. ``X [B*H, N, F]`` contiguous (fp32 or a half dtype, read as fp32; ``P`` in its dtype);
    coefficients ``head [G, NB, n_head]``, ``recent [G, NB, n_recent]``, ``far [G, NB]`` by their strides (group
    stride 0 when shared, ``g = bh % H``)."""
    i_f, i_bh = tl.program_id(0), tl.program_id(1)
    NF1 = tl.cdiv(F1, BN)
    X, P, _unused, F, f0 = _feature_part(i_f, NF1, X1, X2, P1, P2, P1, P2, F1, F2, BN)
    feats = f0 + tl.arange(0, BN)
    fmask = feats < F
    bh = i_bh.to(tl.int64)
    x_base = X + bh * N * F
    p_base = P + bh * NB * F
    g = (i_bh % H).to(tl.int64)
    head_base, recent_base, far_base = HEAD + g * s_hg, RECENT + g * s_rg, FAR + g * s_fg
    a = tl.arange(0, TR)
    h = tl.arange(0, NHP)

    fb, C = _state_scan(x_base, feats, fmask, F, SC, FOLD_COL, TR, BN, FOLDED)
    xh = tl.zeros([NHP, BN], dtype=tl.float32)
    if HAS_HEAD:
        xh = _head_rows(x_base, feats, fmask, F, N, SC, FIRST, KH, NHEAD, NHP)
    z_prev = _first_z_tile(x_base, feats, fmask, F, SC, KR, FIRST, NHEAD, TR)
    for t in range(0, tl.cdiv(NB, TR)):
        r = t * TR + a
        rmask = r < NB
        z = tl.load(x_base + (SC + r)[:, None].to(tl.int64) * F + feats[None, :],
                    mask=rmask[:, None] & fmask[None, :], other=0.0).to(tl.float32)
        finite = tl.abs(z) < float("inf")
        fb = tl.minimum(fb, tl.min(tl.where(finite, _BIG, (SC + r)[:, None]), axis=0))
        z = tl.where(finite & (FIRST + r >= NHEAD)[:, None], z, 0.0)
        wa, wb, far = _band_coefficients(recent_base, far_base, r, rmask, s_rr, s_rc, s_fr, NREC, TR)
        acc = tl.dot(wa, z_prev, input_precision=PREC)
        acc += tl.dot(wb, z, input_precision=PREC)
        acc += far[:, None] * C[None, :]
        if HAS_HEAD:
            hc = tl.load(head_base + r[:, None] * s_hr + h[None, :] * s_hc,
                         mask=rmask[:, None] & (h < NHEAD)[None, :] & (h[None, :] < (FIRST + r)[:, None]),
                         other=0.0).to(tl.float32)
            acc += tl.dot(hc, xh, input_precision=PREC)
        acc = tl.where(fb[None, :] < (SC + r)[:, None], float("nan"), acc)
        tl.store(p_base + r[:, None].to(tl.int64) * F + feats[None, :], acc.to(P.dtype.element_ty),
                 mask=rmask[:, None] & fmask[None, :])
        C += tl.sum(z_prev, axis=0)
        z_prev = z


@triton.autotune(configs=autotune_configs(warps=(4,), stages=(3,)), key=_KEY + ["NEED_DW", "KC"])
@triton.jit
def _banded_bwd_scan_kernel(
    X1, dP1, X2, dP2, FB, DW,
    NB, N, F1, F2, H, FIRST, SC, KH, KR, FOLD_COL, NHEAD, NREC, K,
    TR: tl.constexpr, NHP: tl.constexpr, BN: tl.constexpr, HAS_HEAD: tl.constexpr, FOLDED: tl.constexpr,
    NEED_DW: tl.constexpr, PREC: tl.constexpr, KC: tl.constexpr,
):
    """Backward pass 1 (forward walk) for one feature tile of one (batch, head): the first non-finite column of
    each feature, ``FB [B*H, tiles * BN]`` int32 (``_BIG`` for none; program ``bh * tiles + feature tile``, ``tiles``
    the grid's first dimension), and with ``NEED_DW`` this program's partial coefficient gradients ``DW [B*H *
    tiles, NB, K]`` fp32 (``K = n_head + n_recent + 1``: head, recent, far; every entry written), from ``X [B*H,
    N, F]`` and ``dP [B*H, NB, F]`` (fp32 or a half dtype).

    Each row tile's Gram matrices (``dP_t`` against its two Z tiles and the head blocks) reduce over the features
    in chunks of ``KC`` loaded from memory (a dot over all ``BN`` features at once holds its whole operand rows in
    every warp: hundreds of registers), so the previous Z tile is read again, not carried; the far sum ``C`` and
    the first non-finite column are carried per chunk as ``[BN / KC, KC]``."""
    NCH: tl.constexpr = BN // KC
    i_f, i_bh = tl.program_id(0), tl.program_id(1)
    NF1 = tl.cdiv(F1, BN)
    X, dP, _unused, F, f0 = _feature_part(i_f, NF1, X1, X2, dP1, dP2, dP1, dP2, F1, F2, BN)
    feats = f0 + tl.arange(0, BN)
    fmask = feats < F
    bh = i_bh.to(tl.int64)
    x_base = X + bh * N * F
    dp_base = dP + bh * NB * F
    prog = bh * tl.num_programs(0) + i_f
    dw_base = DW + prog * NB * K
    a = tl.arange(0, TR)
    c = tl.arange(0, TR)
    h = tl.arange(0, NHP)
    ch = tl.arange(0, NCH)
    kc = tl.arange(0, KC)

    fb_all, c_all = _state_scan(x_base, feats, fmask, F, SC, FOLD_COL, TR, BN, FOLDED)
    fb2 = tl.reshape(fb_all, [NCH, KC])  # per chunk of features
    c2 = tl.reshape(c_all, [NCH, KC])
    hcol = tl.where(h < KH, h, SC + h - FIRST)
    hmask = (h < NHEAD) & (hcol < N)
    for t in range(0, tl.cdiv(NB, TR)):
        r = t * TR + a
        rmask = r < NB
        pz = t * TR + a  # Z positions of the previous tile (block FIRST - TR + pz, column SC - TR + pz)
        ga = tl.zeros([TR, TR], dtype=tl.float32)
        gb = tl.zeros([TR, TR], dtype=tl.float32)
        dh = tl.zeros([TR, NHP], dtype=tl.float32)
        dfar = tl.zeros([TR], dtype=tl.float32)
        for j in range(0, NCH):
            fj = f0 + j * KC + kc
            fmj = fj < F
            sel = ch[:, None] == j
            fbj = tl.min(tl.where(sel, fb2, _BIG), axis=0)
            z = tl.load(x_base + (SC + r)[:, None].to(tl.int64) * F + fj[None, :],
                        mask=rmask[:, None] & fmj[None, :], other=0.0).to(tl.float32)
            finite = tl.abs(z) < float("inf")
            fbj = tl.minimum(fbj, tl.min(tl.where(finite, _BIG, (SC + r)[:, None]), axis=0))
            fb2 = tl.where(sel, fbj[None, :], fb2)
            if NEED_DW:
                z = tl.where(finite & (FIRST + r >= NHEAD)[:, None], z, 0.0)
                zp = tl.load(x_base + (SC - TR + pz)[:, None].to(tl.int64) * F + fj[None, :],
                             mask=((pz >= TR - KR) & (pz < TR + NB))[:, None] & fmj[None, :],
                             other=0.0).to(tl.float32)
                zp = tl.where((tl.abs(zp) < float("inf")) & (FIRST - TR + pz >= NHEAD)[:, None], zp, 0.0)
                dp = tl.load(dp_base + r[:, None].to(tl.int64) * F + fj[None, :],
                             mask=rmask[:, None] & fmj[None, :], other=0.0).to(tl.float32)
                dp = tl.where(fbj[None, :] < (SC + r)[:, None], 0.0, dp)
                ga += tl.dot(dp, tl.trans(zp), input_precision=PREC)  # row a on the previous tile's block c
                gb += tl.dot(dp, tl.trans(z), input_precision=PREC)  # on the own tile's
                cj = tl.sum(tl.where(sel, c2, 0.0), axis=0)
                dfar += tl.sum(dp * cj[None, :], axis=1)
                c2 = tl.where(sel, (cj + tl.sum(zp, axis=0))[None, :], c2)
                if HAS_HEAD:
                    xh = tl.load(x_base + hcol[:, None].to(tl.int64) * F + fj[None, :],
                                 mask=hmask[:, None] & fmj[None, :], other=0.0).to(tl.float32)
                    xh = tl.where(tl.abs(xh) < float("inf"), xh, 0.0)
                    dh += tl.dot(dp, tl.trans(xh), input_precision=PREC)
        if NEED_DW:
            da = TR - 1 + a[:, None] - c[None, :]
            db = a[:, None] - 1 - c[None, :]
            dfar += tl.sum(tl.where(da >= NREC, ga, 0.0), axis=1) + tl.sum(tl.where(db >= NREC, gb, 0.0), axis=1)
            row_base = dw_base + r[:, None] * K
            tl.store(row_base + NHEAD + da, ga, mask=rmask[:, None] & (da < NREC))
            tl.store(row_base + NHEAD + db, gb, mask=rmask[:, None] & (db >= 0) & (db < NREC))
            tl.store(dw_base + r * K + NHEAD + NREC, dfar, mask=rmask)
            if HAS_HEAD:
                dh = tl.where(h[None, :] < (FIRST + r)[:, None], dh, 0.0)
                tl.store(row_base + h[None, :], dh, mask=rmask[:, None] & (h < NHEAD)[None, :])
    tl.store(FB + prog * BN + (ch * KC)[:, None] + kc[None, :], fb2, mask=(f0 + (ch * KC)[:, None] + kc[None, :]) < F)


@triton.autotune(configs=autotune_configs(warps=(8,)), key=_KEY)
@triton.jit
def _banded_bwd_dx_kernel(
    dP1, dX1, dP2, dX2, FB, HEAD, RECENT, FAR,
    NB, N, F1, F2, H, FIRST, SC, KH, KR, FOLD_COL, NHEAD, NREC,
    s_hg, s_hr, s_hc, s_rg, s_rr, s_rc, s_fg, s_fr,
    TR: tl.constexpr, NHP: tl.constexpr, BN: tl.constexpr, HAS_HEAD: tl.constexpr, FOLDED: tl.constexpr,
    PREC: tl.constexpr,
):
    """Backward pass 2 (backward walk) for one feature tile of one (batch, head): ``dX [B*H, N, F]`` (its dtype),
    the transposed mix of ``dP [B*H, NB, F]`` with the rows after a non-finite column (``FB`` of
    ``_banded_bwd_scan_kernel``) dropped."""
    i_f, i_bh = tl.program_id(0), tl.program_id(1)
    NF1 = tl.cdiv(F1, BN)
    dP, dX, _unused, F, f0 = _feature_part(i_f, NF1, dP1, dP2, dX1, dX2, dX1, dX2, F1, F2, BN)
    feats = f0 + tl.arange(0, BN)
    fmask = feats < F
    bh = i_bh.to(tl.int64)
    dp_base = dP + bh * NB * F
    dx_base = dX + bh * N * F
    g = (i_bh % H).to(tl.int64)
    head_base, recent_base, far_base = HEAD + g * s_hg, RECENT + g * s_rg, FAR + g * s_fg
    a = tl.arange(0, TR)
    h = tl.arange(0, NHP)
    NT = tl.cdiv(NB, TR)
    fb = tl.load(FB + (bh * tl.num_programs(0) + i_f) * BN + tl.arange(0, BN), mask=fmask, other=_BIG)

    S = tl.zeros([BN], dtype=tl.float32)  # sum of far[r] dP_r over the row tiles after the next one
    dc_next = tl.zeros([BN], dtype=tl.float32)  # that sum over the next row tile
    q = tl.zeros([TR, BN], dtype=tl.float32)  # the next row tile's band part of this tile's own blocks
    hacc = tl.zeros([NHP, BN], dtype=tl.float32)  # head^T dP over the row tiles walked so far
    for tt in range(0, NT):
        t = NT - 1 - tt
        r = t * TR + a
        rmask = r < NB
        dp = tl.load(dp_base + r[:, None].to(tl.int64) * F + feats[None, :],
                     mask=rmask[:, None] & fmask[None, :], other=0.0).to(tl.float32)
        dp = tl.where(fb[None, :] < (SC + r)[:, None], 0.0, dp)
        wa, wb, far = _band_coefficients(recent_base, far_base, r, rmask, s_rr, s_rc, s_fr, NREC, TR)
        dz = tl.dot(tl.trans(wb), dp, input_precision=PREC) + q + S[None, :]
        dz = tl.where((FIRST + r >= NHEAD)[:, None], dz, 0.0)
        if HAS_HEAD:
            hc = tl.load(head_base + r[:, None] * s_hr + h[None, :] * s_hc,
                         mask=rmask[:, None] & (h < NHEAD)[None, :] & (h[None, :] < (FIRST + r)[:, None]),
                         other=0.0).to(tl.float32)
            hacc += tl.dot(tl.trans(hc), dp, input_precision=PREC)
            sel = tl.where(h[None, :] == (FIRST + r)[:, None], 1.0, 0.0)  # own blocks that are head blocks
            dz += tl.dot(sel, hacc, input_precision=PREC)
        tl.store(dx_base + (SC + r)[:, None].to(tl.int64) * F + feats[None, :], dz.to(dX.dtype.element_ty),
                 mask=rmask[:, None] & fmask[None, :])
        q = tl.dot(tl.trans(wa), dp, input_precision=PREC)
        S += dc_next
        dc_next = tl.sum(far[:, None] * dp, axis=0)
    # the state's columns: kept recent (Z tile 0), folded (every row's far sum), kept head
    p = tl.arange(0, TR)
    dz = tl.where((FIRST - TR + p >= NHEAD)[:, None], q + S[None, :], 0.0)
    tl.store(dx_base + (SC - TR + p)[:, None].to(tl.int64) * F + feats[None, :], dz.to(dX.dtype.element_ty),
             mask=(p >= TR - KR)[:, None] & fmask[None, :])
    if FOLDED:
        tl.store(dx_base + FOLD_COL * F + feats, (S + dc_next).to(dX.dtype.element_ty), mask=fmask)
    if HAS_HEAD:
        tl.store(dx_base + h[:, None].to(tl.int64) * F + feats[None, :], hacc.to(dX.dtype.element_ty),
                 mask=(h < KH)[:, None] & fmask[None, :])


# --------------------------------------------------------------------------------------------------- host


def _coefficient_args(head, recent, far) -> tuple:
    """Strides ``(s_hg, s_hr, s_hc, s_rg, s_rr, s_rc, s_fg, s_fr)``; a group stride is 0 when shared."""
    def grp(t):
        return t.stride(0) if t.shape[0] > 1 else 0
    return (grp(head), head.stride(1), head.stride(2), grp(recent), recent.stride(1), recent.stride(2),
            grp(far), far.stride(1))


def _pointers(head, recent, far) -> tuple:
    """The coefficient tensors as kernel pointers: an empty window part (no head or recent blocks, never loaded)
    passes ``far`` instead of a tensor without storage."""
    return tuple(t if t.numel() else far for t in (head, recent)) + (far,)


def _layout(window, first, kept_head, folded, kept_recent, NB) -> dict:
    """The integer arguments shared by both kernels."""
    sc = kept_head + int(folded) + kept_recent
    return dict(NB=NB, FIRST=first, SC=sc, KH=kept_head, KR=kept_recent, FOLD_COL=kept_head,
                NHEAD=window[0], NREC=window[1])


def _parts(xs: list) -> tuple:
    keep = [n for n, x in enumerate(xs) if x is not None]
    assert 1 <= len(keep) <= 2
    return keep


def banded_mix(coefficients, xs: list, *, window, first: int, kept_head: int, folded: bool, kept_recent: int,
               rows: int, precision: str = "tf32x3") -> list:
    """``P [B, H, rows, F]`` (dtype of ``x``) of each ``x [B, H, N, F]`` (or None), both parts in one launch of
    ``_banded_fwd_kernel``. ``coefficients = (head [G, rows, n_head], recent [G, rows, n_recent], far [G, rows])``
    (any float dtype and strides, read as fp32); the column layout as :class:`~.mix.BandedMix`."""
    head, recent, far = coefficients
    keep = _parts(xs)
    x1 = xs[keep[0]].contiguous()
    x2 = xs[keep[1]].contiguous() if len(keep) > 1 else None
    assert x2 is None or x2.dtype == x1.dtype
    B, H, N, F1 = x1.shape
    F2 = 0 if x2 is None else x2.shape[-1]
    TR, NHP, BN = banded_tiles(window, max(F1, F2))
    p1 = torch.empty(B, H, rows, F1, device=x1.device, dtype=x1.dtype)
    p2 = None if x2 is None else torch.empty(B, H, rows, F2, device=x1.device, dtype=x1.dtype)
    lay = _layout(window, first, kept_head, folded, kept_recent, rows)
    NF = triton.cdiv(F1, BN) + triton.cdiv(F2, BN)
    _banded_fwd_kernel[(NF, B * H)](
        x1, p1, x1 if x2 is None else x2, p1 if p2 is None else p2, *_pointers(head, recent, far),
        lay["NB"], N, F1, F2, H, lay["FIRST"], lay["SC"], lay["KH"], lay["KR"], lay["FOLD_COL"], lay["NHEAD"],
        lay["NREC"], *_coefficient_args(head, recent, far),
        TR=TR, NHP=NHP, BN=BN, HAS_HEAD=window[0] > 0, FOLDED=bool(folded), PREC=precision,
    )
    out = iter([p1, p2])
    return [None if x is None else next(out) for x in xs]


def banded_mix_backward(coefficients, xs: list, dps: list, *, window, first: int, kept_head: int, folded: bool,
                        kept_recent: int, rows: int, need_dcoeff: bool, precision: str = "tf32x3"):
    """Gradients of :func:`banded_mix`: ``(dxs, dcoefficients)``, ``dxs`` per ``x`` (None for None) in fp32,
    ``dcoefficients = (dhead, drecent, dfar)`` fp32 (summed over the batch, and the heads when shared) or None
    unless ``need_dcoeff``. Both parts in one launch of ``_banded_bwd_scan_kernel`` (non-finite columns, partial
    coefficient gradients) and one of ``_banded_bwd_dx_kernel``; with ``need_dcoeff`` one torch sum of the
    partial sums."""
    head, recent, far = coefficients
    keep = _parts(xs)
    x1, dp1 = xs[keep[0]].contiguous(), dps[keep[0]].contiguous()
    two = len(keep) > 1
    x2 = xs[keep[1]].contiguous() if two else x1
    dp2 = dps[keep[1]].contiguous() if two else dp1
    B, H, N, F1 = x1.shape
    F2 = x2.shape[-1] if two else 0
    G = far.shape[0]
    TR, NHP, BN = banded_tiles(window, max(F1, F2))
    NF = triton.cdiv(F1, BN) + triton.cdiv(F2, BN)
    K = window[0] + window[1] + 1
    lay = _layout(window, first, kept_head, folded, kept_recent, rows)
    ints = (lay["NB"], N, F1, F2, H, lay["FIRST"], lay["SC"], lay["KH"], lay["KR"], lay["FOLD_COL"], lay["NHEAD"],
            lay["NREC"])
    meta = dict(TR=TR, NHP=NHP, BN=BN, HAS_HEAD=window[0] > 0, FOLDED=bool(folded))
    fb = torch.empty(B * H * NF, BN, device=x1.device, dtype=torch.int32)
    dw = torch.empty(B * H * NF, rows, K, device=x1.device, dtype=torch.float32) if need_dcoeff else fb
    kc = min(BN, SCAN_CHUNK) if need_dcoeff else BN  # without the Gram matrices: whole tiles
    _banded_bwd_scan_kernel[(NF, B * H)](x1, dp1, x2, dp2, fb, dw, *ints, K, NEED_DW=bool(need_dcoeff),
                                         PREC=SCAN_PRECISION, KC=kc, **meta)
    dx1 = torch.empty_like(x1, dtype=torch.float32)  # gradients in fp32 (half summaries included)
    dx2 = torch.empty_like(x2, dtype=torch.float32) if two else dx1
    _banded_bwd_dx_kernel[(NF, B * H)](dp1, dx1, dp2, dx2, fb, *_pointers(head, recent, far), *ints,
                                       *_coefficient_args(head, recent, far), PREC=precision, **meta)
    dxs = [None] * len(xs)
    dxs[keep[0]] = dx1
    if two:
        dxs[keep[1]] = dx2
    if not need_dcoeff:
        return dxs, None
    dw = dw.view(B, H, NF, rows, K)
    dw = dw.sum((0, 2)) if G > 1 else dw.sum((0, 1, 2)).unsqueeze(0)  # [G, rows, K]
    nh, nr = window
    return dxs, (dw[..., :nh], dw[..., nh:nh + nr], dw[..., nh + nr])


__all__ = ["MAX_HEAD", "MAX_RECENT", "band_tile", "banded_mix", "banded_mix_backward", "banded_tiles",
           "fused_supported"]
