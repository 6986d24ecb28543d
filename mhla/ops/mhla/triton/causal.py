"""Causal (chunkwise) MHLA with Triton kernels: forward, backward and a recurrent state (autograd.Function).

Blocks are contiguous runs of ``C`` tokens (the last may be partial); the kernels cut each block into
chunks of ``BT`` tokens (:func:`mhla.ops.mhla.triton.utils.chunk_tile`; any ``C`` works, a partial last chunk
is masked). For token ``t`` in chunk ``j`` of block ``i``, with ``m = Mix[i, i]``:

    P_i = sum_{b < i} Mix[i, b] S_b                         mixed prefix of the earlier blocks  (:mod:`.mix`)
    R_j = sum_{s in block i, before chunk j} k_s v_s^T      running sum of the block            (kernel)
    o_t = [q_t^T (P_i + m R_j) + m sum_{s in chunk j, s <= t} (q_t . k_s) v_s] / d_t
    d_t =  q_t . (p_i + m r_j) + m sum_{s in chunk j, s <= t}  q_t . k_s  + eps   ("none": d_t = 1)

(``p``, ``r``: the same sums over ``k_s`` alone). This equals the definition
``o_t = sum_{s <= t} Mix[b(t), b(s)] (q_t . k_s) v_s / (sum_{s <= t} Mix[b(t), b(s)] q_t . k_s + eps)``.

Backward (``dn_t = do_t / d_t``, ``dd_t = -(do_t . o_t) / d_t``; the kernels are in
:mod:`mhla.ops.mhla.triton.chunk`):

    dP_i = sum_{t in i} q_t dn_t^T              dR_j = sum_{t in block i, after chunk j} q_t dn_t^T
    dS_b = sum_{i > b} Mix[i, b] dP_i           (+ the gradient of a returned state's summaries)
    dMix[i, b] = <dP_i, S_b> + <dp_i, z_b>      (b < i)
    dMix[i, i] = sum_{j in i} <q_j^T dn_j, R_j> + <q_j^T dd_j, r_j> + sum_{s <= t in j} (q_t . k_s) dA[t, s]
    dq, dk, dv: see :mod:`mhla.ops.mhla.triton.chunk` (``dA[t, s] = dn_t . v_s + dd_t``).

State (chunked prefill): a call may continue after ``P`` tokens summarised in an
:class:`mhla.ops.MHLAState`: the ``first = P // C`` finished block summaries join the mix as extra
columns, and the running summary of the unfinished block seeds block 0's running sum ``R`` (and ``S``).
The first ``P % C`` positions of block 0 are empty. The Function returns this call's block summaries so
the backend can assemble the final state; gradients flow through the state in both directions.

The mix (``P_i``, ``dS_b``, ``dMix[i, b]``) is a mixer of :mod:`.mix`: a dense matrix's strictly-lower rows as a
GEMM kernel (:class:`~.mix.DenseMix`, quadratic in the blocks), or compact :class:`~mhla.ops.MixingRows`
in linear time (:class:`~.mix.BandedMix`).
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from .chunk import (
    Geometry,
    bwd_block_grads,
    bwd_dqk,
    bwd_dv,
    fwd_block_summaries,
    fwd_output,
    mixing_3d,
)
from .banded import fused_supported
from .mix import DenseMix
from .utils import dot_precision, summary_dtype


def _causal_coefficients(mix: torch.Tensor, first: int, NB: int):
    """The mixing rows of this call's blocks and their diagonal, as views of a dense ``mix [1 or H, M, M]``.

    Returns ``coeff [1 or H, NB, first + NB]`` = ``Mix[first + i, b]`` (all columns: :class:`~.mix.DenseMix`
    reads the strictly-lower ones only, ``b < first + i``, and its gradient is zero elsewhere) and
    ``mdiag [1 or H, NB]`` = ``Mix[first + i, first + i]``. Views: no copy, no gather (without a state and
    with ``M = NB`` the first is ``mix`` itself); autograd carries their gradients back to ``mix``.
    """
    rows = mix[:, first:first + NB]
    return rows[:, :, :first + NB], torch.diagonal(rows[:, :, first:first + NB], dim1=-2, dim2=-1)


class MHLACausalFunction(torch.autograd.Function):
    """Causal chunkwise MHLA with fused Triton kernels (module docstring for the math).

    Inputs: ``q, k [B, T, H, D]``, ``v [B, T, H, Dv]``; the mixing of this call's ``NB`` blocks as
    ``mdiag [1 or H, NB]`` (the diagonal: any float dtype and strides) and a ``mixer`` of :mod:`.mix` with its
    ``coefficients`` (the trailing tensors; e.g. :class:`~.mix.DenseMix`: ``coeff [1 or H, NB, first + NB]``,
    row ``i`` on the ``first`` state columns then the call's blocks); optional state tensors (fp32): ``state_s [B, H, first,
    D, Dv]``, ``state_z [B, H, first, D]`` (the summaries the state's columns hold: its kept blocks and
    folded sum, in the mixer's column order), ``cur_s [B, H, D, Dv]``, ``cur_z [B, H, D]`` (running sums of
    the unfinished block, ``offset`` tokens of it seen). ``keep_z``: compute the key sums even without the
    normalizer (a state needs them).

    Returns ``o [B, T, H, Dv]`` (dtype of v), and this call's block summaries ``S [B, H, NB, D, Dv]`` and
    ``Z [B, H, NB, D]`` (fp32; block 0 includes ``cur_s``; ``Z`` is empty when neither normalizing nor
    ``keep_z``).
    """

    @staticmethod
    def forward(ctx, q, k, v, mdiag, state_s, state_z, cur_s, cur_z, mixer, block_size: int, first: int,
                offset: int, normalize: bool, eps: float, keep_z: bool, *coefficients):
        ctx.set_materialize_grads(False)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        g = Geometry.make(q, v, block_size, offset)
        B, H, NB, D, Dv = g.B, g.H, g.NB, g.D, g.Dv
        has_init = cur_s is not None
        store_z = normalize or keep_z
        # mdiag and the coefficients stay as given (views of the mixing, any float dtype): the kernels read
        # them by their strides as fp32, so the forward launches no cast and no copy
        has_r = g.NC > 1 or has_init  # with one chunk per block and no state, R is zero
        if has_init:
            cur_s = cur_s.float().contiguous()
            cur_z = cur_z.float().contiguous()
        s_dtype = mixer.p_dtype  # opt-in half summaries (MHLA_SUMMARY_DTYPE=input), without a state
        S, Z, R, Rz = fwd_block_summaries(k, v, g, has_r=has_r, store_z=store_z, cur_s=cur_s, cur_z=cur_z,
                                          s_dtype=s_dtype)
        S = S.view(B, H, NB, D, Dv)
        Z = Z.view(B, H, NB, D) if store_z else None
        S_all, Z_all = S, Z
        if first > 0:
            S_all = torch.cat([state_s.float(), S], dim=2)
            Z_all = torch.cat([state_z.float(), Z], dim=2) if store_z else None
        P, Pz = mixer.mix(coefficients, [S_all, Z_all if normalize else None])
        P = P.reshape(g.BH, NB, D, Dv).contiguous()
        Pz = Pz.reshape(g.BH, NB, D).contiguous() if normalize else None
        o, den = fwd_output(q, k, v, P, Pz, R, Rz if normalize else None, mdiag, g, causal=True,
                            normalize=normalize, eps=eps, out_dtype=v.dtype)
        ctx.save_for_backward(q, k, v, o, mdiag, S_all, Z_all, P, Pz, R, Rz, den, *coefficients)
        ctx.g, ctx.normalize, ctx.first, ctx.has_init, ctx.mixer = g, normalize, first, has_init, mixer
        ctx.eps = eps
        Z_out = Z if store_z else S.new_zeros(0)
        return o, S, Z_out

    @staticmethod
    def backward(ctx, do, dS_out, dZ_out):
        q, k, v, o, mdiag, S_all, Z_all, P, Pz, R, Rz, den, *coefficients = ctx.saved_tensors
        g, normalize, first, has_init = ctx.g, ctx.normalize, ctx.first, ctx.has_init
        B, H, NB, D, Dv = g.B, g.H, g.NB, g.D, g.Dv
        if do is None:
            do = torch.zeros_like(o)
        do = do.contiguous()
        if not normalize:
            Rz = None
        # eps0 >= 0: block 0 has no mixed prefix (no state columns), its m_0 gradient in closed form (chunk.py)
        eps0 = ctx.eps if normalize and first == 0 else -1.0
        dP, dPz, dR, dRz, dm_r, delta = bwd_block_grads(q, do, o, den, R, Rz, g, normalize=normalize, eps0=eps0)
        need_dcoeff = any(ctx.needs_input_grad[_N_ARGS:])
        (dS_all, dZ_all), dcoeffs = ctx.mixer.backward(
            coefficients, [S_all, Z_all if normalize else None],
            [dP.view(B, H, NB, D, Dv), dPz.view(B, H, NB, D) if normalize else None], need_dcoeff,
        )
        dS = dS_all[:, :, first:]
        if dS_out is not None:
            dS = dS + dS_out
        dS = dS.contiguous()
        dZ = dZ_all[:, :, first:] if normalize else None
        if dZ_out is not None and dZ_out.numel():
            dZ = dZ_out if dZ is None else dZ + dZ_out
        # The kernels add dZ to dk only under the normalizer; a key-sum gradient that comes from a returned
        # state alone ("none") is added below in torch.
        dZ_kernel = dZ.contiguous().view(g.BH, NB, D) if normalize else None

        dS_k = dS.view(g.BH, NB, D, Dv)
        dv = bwd_dv(q, k, do, den, dS_k, dR, mdiag, g, causal=True, normalize=normalize, out_dtype=v.dtype)
        dq, dk, dm_i = bwd_dqk(q, k, v, do, den, delta, P, Pz, R, Rz, dS_k, dZ_kernel, dR, dRz, mdiag, g,
                               causal=True, normalize=normalize, out_dtype=q.dtype, eps0=eps0)
        if not normalize and dZ is not None:
            blk = (torch.arange(g.T, device=q.device) + g.OFFSET) // g.C  # block of each token
            dk = (dk.float() + dZ.permute(0, 2, 1, 3)[:, blk]).to(q.dtype)

        # Mixing: the coefficients from the mixer, the diagonal from the kernels.
        dmdiag = None
        if ctx.needs_input_grad[3]:
            dm = dm_i if dm_r is None else dm_i + dm_r  # [B*H, NB]
            dmdiag = dm.view(B, H, NB).sum(0)
            if mdiag.shape[0] == 1:
                dmdiag = dmdiag.sum(0, keepdim=True)

        d_state_s = d_state_z = d_cur_s = d_cur_z = None
        if first > 0:
            d_state_s = dS_all[:, :, :first]
            d_state_z = dZ_all[:, :, :first] if normalize else None
        if has_init:
            # cur_s seeds block 0's summary (-> dS[:, :, 0]) and every running sum R_j of block 0
            # (-> m_0 * sum_{j in block 0} q_j^T dn_j = m_0 * dP_0).
            m0 = mdiag[:, 0].view(1, -1, 1, 1)
            d_cur_s = dS[:, :, 0] + m0 * dP.view(B, H, NB, D, Dv)[:, :, 0]
            if dZ is not None:
                d_cur_z = dZ[:, :, 0]
                if normalize:
                    d_cur_z = d_cur_z + m0[..., 0] * dPz.view(B, H, NB, D)[:, :, 0]
        if dcoeffs is None:
            dcoeffs = (None,) * len(coefficients)
        return (dq, dk, dv, dmdiag, d_state_s, d_state_z, d_cur_s, d_cur_z,
                None, None, None, None, None, None, None, *dcoeffs)


_N_ARGS = 15  # inputs of MHLACausalFunction.forward before the mixer's coefficients


def mhla_causal_triton(q, k, v, mixing, block_size: int, *, normalize: bool = True, eps: float = 1e-6,
                       state=None, keep_z: bool = False, mix=None):
    """Causal MHLA on the Triton kernels (no input checks; see :func:`mhla.ops.mhla_attention`).

    ``q, k: [B, T, H, D]``, ``v: [B, T, H, Dv]``; ``mixing``: dense ``[M, M]`` / ``[H, M, M]``, or None with
    ``mix``; ``state``: None or ``(state_s, state_z, cur_s, cur_z, num_tokens)``, ``state_s`` holding
    every finished block (dense mixing) or the state's columns (with ``mix``).
    ``mix``: ``(mixer, mdiag, coefficients)`` of :class:`MHLACausalFunction` built by the caller (compact
    mixing rows: :class:`~.mix.BandedMix`; ``state_s`` then holds the columns it reads first). Returns
    ``(o, S, Z)`` as
    :class:`MHLACausalFunction`. When the call lies inside one block the kernels tile only its ``T`` tokens,
    not the whole block (a block far longer than the call is cheap).
    """
    state_s = state_z = cur_s = cur_z = None
    first = offset = 0
    if state is not None:
        state_s, state_z, cur_s, cur_z, num_tokens = state
        first, offset = divmod(num_tokens, block_size)
    NB = triton.cdiv(offset + q.shape[1], block_size)
    columns = 0 if state_s is None else state_s.shape[2]
    # opt-in half summaries (MHLA_SUMMARY_DTYPE=input): without a state only (a state's summaries are fp32)
    s_dtype = summary_dtype(q.dtype) if state is None and not keep_z else torch.float32
    if mix is None:
        coeff, mdiag = _causal_coefficients(mixing_3d(mixing), first, NB)
        mixer = DenseMix(causal=True, first=columns, precision=dot_precision(q.dtype), p_dtype=s_dtype)
        coefficients = (coeff,)
    else:
        mixer, mdiag, coefficients = mix
        if fused_supported(mixer.window, s_dtype):  # else fp32: the mixer's torch reference keeps them
            mixer = dataclasses.replace(mixer, p_dtype=s_dtype)
    if offset + q.shape[1] <= block_size:  # one block: its earlier tokens are in cur_s, its later ones absent
        block_size, offset = q.shape[1], 0
    return MHLACausalFunction.apply(q, k, v, mdiag, state_s, state_z, cur_s, cur_z, mixer, block_size,
                                    columns, offset, bool(normalize), float(eps), bool(keep_z), *coefficients)


__all__ = ["MHLACausalFunction", "mhla_causal_triton"]
