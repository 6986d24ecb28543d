"""MHLA in chunked PyTorch: the non-causal form and the causal (chunkwise) form with a recurrent state.

These are the ``backend="torch"`` paths of :func:`mhla.ops.mhla_attention` (which validates the inputs and
dispatches here) and the fallback of the Triton backend (float64, ``normalize="official"``). Layout
``[B, T, H, D]``; summaries accumulate in fp32 for half inputs (fp64 for fp64), outputs have ``v``'s dtype.

Non-causal (the reference fast path; O(T d^2 + M^2 d^2)), :func:`mhla_noncausal_torch`. With tokens in
block-major order and ``T = M * C`` (C = block_size):

    S_b = sum_{s in b} k_s v_s^T     [D, Dv]        z_b = sum_{s in b} k_s     [D]
    S~_i = sum_b mixing[i, b] S_b                   z~_i = sum_b mixing[i, b] z_b
    o_t = q_t^T S~_i / (q_t . z~_i + eps)           for t in block i

Causal, :func:`mhla_causal_torch`. Blocks are contiguous chunks of ``C = block_size`` tokens; the last one
may be partial. A query ``t`` in block ``i`` reads

    o_t = q_t^T ( sum_{b<i} mixing[i, b] S_b  +  mixing[i, i] * sum_{s in i, s<=t} k_s v_s^T )
          / ( q_t . (sum_{b<i} mixing[i, b] z_b  +  mixing[i, i] * sum_{s in i, s<=t} k_s) + eps )

(the denominator only when normalizing). ``mixing`` is read as lower-triangular: entries above the
diagonal are ignored. Its row ``i`` must exist for every block the sequence touches. A call may continue
an :class:`~mhla.ops.mhla.state.MHLAState` (chunked prefill) and return the state after its tokens
(docs/method.md#decoding-state). ``mixing`` may also be :class:`~mhla.ops.mhla.state.MixingRows`, the compact
rows of the call's blocks: the state then keeps the blocks of their window and one folded sum, which every
block reads as one more column with the rows' shared coefficient.

Causality holds whatever the values: a NaN or inf in token ``s`` reaches the outputs ``t >= s`` only. The
masked terms of a causal sum are never multiplied in (``0 * nan`` is ``nan``); see
:func:`mhla.ops.utils.causal_product`.
"""

from __future__ import annotations

import torch

from ...layouts import ceil_div
from ..utils import accumulation_dtype, causal_product, check_mixing, normalizer_mode
from .state import (
    MHLAState,
    MixingRows,
    check_rows,
    check_state,
    check_window,
    init_state,
    rewindow,
    row_coefficients,
    state_after_chunk,
)


def _mix(mixing: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Apply ``mixing`` ([M, M] or [H, M, M]) over the block axis of ``x: [B, H, M, F]`` -> ``[B, H, M, F]``."""
    return torch.matmul(mixing, x)  # [M, M] and [H, M, M] both broadcast over [B, H, M, F]


def mhla_noncausal_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor,
    block_size: int,
    *,
    normalize="paper",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Non-causal MHLA.

    Args:
        q, k: ``[B, T, H, D]`` (nonnegative features); v: ``[B, T, H, Dv]``; ``T = M * block_size``.
        mixing: ``[M, M]`` or ``[H, M, M]``.
        normalize: "paper" / True, "none" / False, or "official" (the release's vision normalizer).
    Returns:
        ``[B, T, H, Dv]`` in the dtype of ``v``.

    With the paper's normalizer, ``v`` is extended by a column of ones so that one matmul chain yields
    both the numerator ``q S~`` and the denominator ``q z~`` (``z_b`` is the last column of ``S_b``).
    """
    mode = normalizer_mode(normalize)
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    M, C = T // block_size, block_size
    acc = accumulation_dtype(q.dtype)

    def blocks(x):  # [B, T, H, d] -> [B, H, M, C, d]
        return x.to(acc).reshape(B, M, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    mix = mixing.to(acc)
    if mix.dim() == 3:
        mix = mix.unsqueeze(0)  # [1, H, M, M] broadcasts over the batch
    if mode == "paper":
        vb = torch.cat([vb, torch.ones_like(vb[..., :1])], dim=-1)  # [.., C, Dv + 1]
    E = vb.shape[-1]
    summaries = torch.matmul(kb.transpose(-1, -2), vb)  # S_b (and z_b): [B, H, M, D, E]
    mixed = _mix(mix, summaries.reshape(B, H, M, D * E)).reshape(B, H, M, D, E)  # S~_i
    out = torch.matmul(qb, mixed)  # [B, H, M, C, E]
    if mode == "paper":
        out = out[..., :Dv] / (out[..., Dv:] + eps)
    elif mode == "official":
        key_sums = kb.sum(-2)  # z_b: [B, H, M, D]
        own = torch.matmul(qb, key_sums.unsqueeze(-1)).squeeze(-1)  # q_{b,w} . z_b: [B, H, M, C]
        out = out / (_mix(mix, own).unsqueeze(-1) + eps)
    return out.permute(0, 2, 3, 1, 4).reshape(B, T, H, Dv).to(v.dtype)


def _mix_rows(mixing: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """Strictly-lower-triangular coefficients of the block rows ``first .. first + n - 1`` over the columns
    ``0 .. first + n - 1``: ``[H or 1, n, first + n]`` with entry ``mixing[r, c]`` where ``c < r`` else 0."""
    mix = mixing if mixing.dim() == 3 else mixing.unsqueeze(0)
    keep = torch.ones(n, first + n, dtype=torch.bool, device=mix.device).tril(first - 1)
    return torch.where(keep, mix[:, first:first + n, :first + n], 0.0)


#: a call with compact mixing rows runs in pieces of at most this many blocks, each continuing the state of
#: the one before: its work is then O(T * (window + SEGMENT_BLOCKS)) per head, linear in T, where one piece
#: would mix every block of the call with every earlier one.
SEGMENT_BLOCKS = 64


def mhla_causal_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor | MixingRows,
    block_size: int,
    *,
    normalize="paper",
    eps: float = 1e-6,
    initial_state: MHLAState | None = None,
    output_final_state: bool = False,
):
    """Causal chunkwise MHLA over a chunk of tokens, optionally continuing from ``initial_state``.

    Args:
        q, k: ``[B, T, H, D]``; v: ``[B, T, H, Dv]``; any ``T >= 1``.
        mixing: ``[M, M]`` or ``[H, M, M]`` with ``M >= ceil((P + T) / block_size)``, where ``P`` is the
            number of tokens already in ``initial_state`` (0 without one); or :class:`MixingRows` covering the
            blocks ``P // block_size .. ceil((P + T) / block_size) - 1`` (the state then keeps the blocks of
            their window and folds the others, :class:`MHLAState`).
        initial_state: state after ``P`` tokens (``P`` need not be a multiple of the block size).
        output_final_state: also return the state after ``P + T`` tokens.
    Returns:
        ``o: [B, T, H, Dv]`` (dtype of v), or ``(o, state)`` when ``output_final_state``.

    The work is O(T * min(C, T)) per head for the intra-block scores, whatever the block size ``C``: a block
    longer than the chunk is not padded to its full length. No input checks beyond the state and the mixing
    shape and rows (:func:`mhla.ops.mhla_attention` validates, values included).
    """
    mode = normalizer_mode(normalize)
    if mode == "official":
        raise ValueError("normalize='official' is the release's non-causal vision normalizer only")
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    C = block_size
    acc = accumulation_dtype(q.dtype)
    compact = isinstance(mixing, MixingRows)
    if initial_state is None:
        state = init_state(B, H, D, Dv, C, device=q.device, dtype=acc,
                           window=mixing.window if compact else None)
    else:
        check_state(initial_state, q, v, C)
        check_window(initial_state, mixing)
        state = rewindow(initial_state, mixing.window) if compact else initial_state
    P = state.num_tokens
    first_block, offset = divmod(P, C)
    total_blocks = ceil_div(P + T, C)
    # shape and rows only: the values were checked once by mhla_attention, and a variable-length call runs
    # this once per length bucket (a full-matrix scan per call was most of its per-call cost)
    if compact:
        check_rows(mixing, H, first_block, total_blocks, check_values=False)
    else:
        check_mixing(mixing, H, total_blocks, check_values=False)
    cut = 0
    if offset and offset + T > C:
        # The chunk starts inside a block and runs past it: finish that block first, so that below a chunk
        # either starts on a block boundary or lies inside one block.
        cut = C - offset
    elif compact and total_blocks - first_block > SEGMENT_BLOCKS:
        cut = SEGMENT_BLOCKS * C
    if cut:
        kw = dict(normalize=mode, eps=eps)
        o1, mid = mhla_causal_torch(q[:, :cut], k[:, :cut], v[:, :cut], mixing, C, initial_state=state,
                                    output_final_state=True, **kw)
        rest = mhla_causal_torch(q[:, cut:], k[:, cut:], v[:, cut:], mixing, C, initial_state=mid,
                                 output_final_state=output_final_state, **kw)
        if output_final_state:
            return torch.cat([o1, rest[0]], dim=1), rest[1]
        return torch.cat([o1, rest], dim=1)

    # Lay the chunk out on `nb` blocks of L tokens, zero padding behind (zero keys and values contribute
    # nothing to any summary). L = C, or just the T tokens when they all fall in one block: the work is
    # O(T L) whatever the block size. The `offset` tokens of the first block seen before live in the state.
    nb = ceil_div(offset + T, C)
    L = C if nb > 1 else T
    pad = nb * L - T

    def blocks(x):
        x = x.to(acc)
        if pad:
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
        return x.reshape(B, nb, L, H, x.shape[-1]).transpose(2, 3)  # [B, nb, H, L, d]

    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    # Without an initial state nothing is carried in: the state's terms (zeros) are left out, not added.
    carry = initial_state is not None
    mix = mixing.to(acc)
    if compact:
        diag = mix.rows(first_block, first_block + nb)[0].transpose(0, 1)  # [nb, H or 1]: mixing[i, i]
    else:
        mix_h = mix if mix.dim() == 3 else mix.unsqueeze(0)
        own = mix_h[:, first_block:first_block + nb, first_block:first_block + nb]
        diag = torch.diagonal(own, dim1=1, dim2=2).transpose(0, 1)  # [nb, H or 1]: mixing[i, i]

    # Summaries of the chunk's blocks; the first also holds the state's running sum for that block.
    chunk_summaries = torch.einsum("bnhcd,bnhce->bnhde", kb, vb)
    chunk_key_sums = kb.sum(3)
    if carry:
        chunk_summaries = torch.cat(
            [chunk_summaries[:, :1] + state.current_summary.unsqueeze(1), chunk_summaries[:, 1:]], dim=1
        )
        chunk_key_sums = torch.cat(
            [chunk_key_sums[:, :1] + state.current_key_sum.unsqueeze(1), chunk_key_sums[:, 1:]], dim=1
        )
    # The columns every block of the chunk may read: the state's kept blocks (and its folded sum), then the
    # chunk's own blocks.
    prev_s, prev_z = state.block_summaries, state.block_key_sums
    if compact:
        ids = torch.tensor(state.kept_block_ids() + list(range(first_block, first_block + nb)),
                           device=q.device)
        coeff = row_coefficients(mix, first_block, nb, ids)  # [H or 1, nb, n_kept + nb]
        if state.num_folded_blocks:  # the folded blocks: one column, read with the shared coefficient
            n_prev = prev_s.shape[2]
            far = mix.rows(first_block, first_block + nb)[3].unsqueeze(-1)
            coeff = torch.cat([coeff[..., :n_prev], far, coeff[..., n_prev:]], dim=-1)
            prev_s = torch.cat([prev_s, state.far_summary.unsqueeze(2)], dim=2)
            prev_z = torch.cat([prev_z, state.far_key_sum.unsqueeze(2)], dim=2)
    else:
        coeff = _mix_rows(mix, first_block, nb)
    coeff = coeff.expand(H, -1, -1)  # [H, nb, n_all]
    if prev_s.shape[2]:
        all_summaries = torch.cat([prev_s.transpose(1, 2), chunk_summaries], dim=1)
        all_key_sums = torch.cat([prev_z.transpose(1, 2), chunk_key_sums], dim=1)
    else:
        all_summaries, all_key_sums = chunk_summaries, chunk_key_sums

    # The causal sums below are dense products that also multiply the masked (zero) weights by later values;
    # one host sync says whether every value is finite, and only then are the products taken as they are
    # (else :func:`causal_product` keeps a non-finite value from reaching earlier outputs).
    paper = mode == "paper"
    finite = not torch.compiler.is_compiling() and bool(torch.isfinite(
        all_summaries.detach().sum() + vb.detach().sum() + (all_key_sums.detach().sum() if paper else 0)))

    def causal(product, x, dim, strict=False):
        return product(x) if finite else causal_product(product, x, dim, strict=strict, lazy=False)

    # Inter-block term: every block reads the strictly earlier blocks through its row of the mixing.
    def mix_earlier(spec, x):  # x: [B, n_all, H, ...] -> [B, nb, H, ...], block i reads blocks j < i
        return causal(lambda y: torch.einsum(spec, coeff, y), x, 1, strict=True)

    prefix = mix_earlier("hij,bjhde->bihde", all_summaries)
    out = torch.einsum("bnhcd,bnhde->bnhce", qb, prefix)

    # Intra-block term, causal inside the block, scaled by the diagonal coefficient.
    causal_mask = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    scores = torch.where(causal_mask, torch.einsum("bnhcd,bnhsd->bnhcs", qb, kb), 0.0)
    diag_b = diag.view(1, nb, -1, 1)  # broadcast over [B, nb, H, L]
    intra = causal(lambda x: torch.einsum("bnhcs,bnhse->bnhce", scores, x), vb, 3)
    if carry:  # tokens of the first block that were consumed before this call live in the state's running sum
        carried = torch.einsum("bhcd,bhde->bhce", qb[:, 0], state.current_summary)
        intra = torch.cat([intra[:, :1] + carried.unsqueeze(1), intra[:, 1:]], dim=1)
    out = out + diag_b.unsqueeze(-1) * intra

    if paper:
        prefix_z = mix_earlier("hij,bjhd->bihd", all_key_sums)
        den = torch.einsum("bnhcd,bnhd->bnhc", qb, prefix_z)
        intra_z = scores.sum(-1)
        if carry:
            carried_z = torch.einsum("bhcd,bhd->bhc", qb[:, 0], state.current_key_sum)
            intra_z = torch.cat([intra_z[:, :1] + carried_z.unsqueeze(1), intra_z[:, 1:]], dim=1)
        den = den + diag_b * intra_z
        out = out / (den.unsqueeze(-1) + eps)

    o = out.transpose(2, 3).reshape(B, nb * L, H, Dv)[:, :T].to(v.dtype)
    if not output_final_state:
        return o

    summaries, key_sums = chunk_summaries.transpose(1, 2), chunk_key_sums.transpose(1, 2)  # [B, H, nb, ...]
    new_state = state_after_chunk(state, summaries, key_sums, P + T)
    return o, new_state
