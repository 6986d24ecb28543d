"""Recurrent decoding of causal MHLA: one token per call (:func:`mhla_decode_step`), in plain PyTorch.

A step adds the token to the state's running summary of the current block and reads the mixed prefix of
the finished blocks, which is computed once when the token opens a block and then cached in the state
(:class:`~mhla.ops.mhla.state.MHLAState`). With compact mixing rows (:class:`~mhla.ops.mhla.state.MixingRows`)
the state keeps the blocks of their window and one folded sum: cost O(D * Dv) per token, plus
O(window * D * Dv) at a block boundary, and constant memory at any length. With a dense mixing matrix it keeps
every block (O(i * D * Dv) at the boundary of block ``i``). The outputs equal
:func:`mhla.ops.mhla_attention` (``causal=True``) on the same tokens.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .state import MHLAState, MixingRows, check_causal, fold_blocks, rewindow, row_coefficients


def mhla_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor | MixingRows,
    state: MHLAState,
    *,
    normalize="paper",
    eps: float = 1e-6,
):
    """One decoding step: consume a single token per sequence and return its output and the new state.

    Args:
        q, k: ``[B, 1, H, D]``; v: ``[B, 1, H, Dv]``.
        mixing: ``[M, M]`` or ``[H, M, M]`` with at least ``state.current_block + 1`` rows (values checked on
            every call); or :class:`MixingRows` covering row ``state.current_block`` (values not checked here:
            :meth:`mhla.mixing.MixingMatrix.causal_rows` keeps them nonnegative).
        state: the state after the tokens so far (from :func:`init_state` or a prefill), with summaries in
            the accumulation dtype of ``q`` (fp32 for fp16 / bf16 / fp32, fp64 for fp64). A state that keeps
            every block is folded to the window of compact rows on the first step.
        normalize, eps: as :func:`mhla.ops.mhla_attention` (``eps`` a positive float).
    Returns:
        ``(o: [B, 1, H, Dv], new_state)``. Cost O(D * Dv) per token, plus one re-mix of the kept blocks when
        the token opens a block (then cached in the state).
    """
    if not isinstance(state, MHLAState):
        raise ValueError(
            f"state must be an MHLAState (from init_state or a prefill's output_final_state=True), "
            f"got {type(state).__name__}"
        )
    C = state.block_size
    compact = isinstance(mixing, MixingRows)
    mode = check_causal(q, k, v, mixing, C, normalize=normalize, eps=eps, state=state,
                        check_values=not compact)
    if q.shape[1] != 1:
        raise ValueError(f"mhla_decode_step takes one token (T = 1), got T = {q.shape[1]}")
    H = q.shape[2]
    acc = state.current_summary.dtype
    i = state.current_block
    if compact:
        state = rewindow(state, mixing.window)
        mix = mixing.to(acc)
        diag, _, _, far = mix.rows(i, i + 1)  # [H or 1, 1]
        diag = diag[:, 0]
    else:
        mix = mixing.to(acc)
        mix_h = mix if mix.dim() == 3 else mix.unsqueeze(0)
        diag = mix_h[:, i, i]

    prefix_s, prefix_z = state.prefix_summary, state.prefix_key_sum
    if prefix_s is None or state.num_tokens % C == 0:  # opening a new block: re-mix the kept ones
        if compact:
            ids = torch.tensor(state.kept_block_ids(), dtype=torch.long, device=q.device)
            coeff = row_coefficients(mix, i, 1, ids)[:, 0].expand(H, -1)  # [H, n_kept]
        else:
            coeff = mix_h[:, i, :i].expand(H, -1)  # [H, i]
        prefix_s = torch.einsum("hj,bhjde->bhde", coeff, state.block_summaries)
        prefix_z = torch.einsum("hj,bhjd->bhd", coeff, state.block_key_sums)
        if compact and state.num_folded_blocks:
            f = far.view(1, -1, 1)  # [1, H or 1, 1]
            prefix_s = prefix_s + f.unsqueeze(-1) * state.far_summary
            prefix_z = prefix_z + f * state.far_key_sum

    qt, kt, vt = (x[:, 0].to(acc) for x in (q, k, v))  # [B, H, d]
    cur_s = state.current_summary + kt.unsqueeze(-1) * vt.unsqueeze(-2)
    cur_z = state.current_key_sum + kt
    diag = diag.view(1, -1, 1, 1)  # [1, H or 1, 1, 1]
    summary = prefix_s + diag * cur_s
    out = torch.einsum("bhd,bhde->bhe", qt, summary)
    if mode == "paper":
        den = torch.einsum("bhd,bhd->bh", qt, prefix_z + diag[..., 0] * cur_z)
        out = out / (den.unsqueeze(-1) + eps)

    n = state.num_tokens + 1
    if n % C == 0:  # the block is finished: keep it (fold one that leaves the window), start an empty one
        s, z, far_s, far_z = fold_blocks(state, cur_s.unsqueeze(2), cur_z.unsqueeze(2), n // C)
        new_state = replace(
            state,
            block_summaries=s,
            block_key_sums=z,
            far_summary=far_s,
            far_key_sum=far_z,
            current_summary=torch.zeros_like(cur_s),
            current_key_sum=torch.zeros_like(cur_z),
            num_tokens=n,
            prefix_summary=None,
            prefix_key_sum=None,
        )
    else:
        new_state = replace(
            state,
            current_summary=cur_s,
            current_key_sum=cur_z,
            num_tokens=n,
            prefix_summary=prefix_s,
            prefix_key_sum=prefix_z,
        )
    return out.unsqueeze(1).to(v.dtype), new_state
