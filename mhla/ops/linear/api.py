"""Plain linear attention with the ops' layout ``[batch, seq, heads, dim]``: non-causal, and the causal
chunkwise form with a state ``(S, z)`` and variable-length batches.

The baseline MHLA is compared with, and the M = 1 special case of MHLA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...layouts import ceil_div
from ..utils import (
    accumulation_dtype,
    causal_product,
    check_block_size,
    check_cu_seqlens,
    check_qkv,
    check_varlen_states,
    exclusive_cumsum,
    normalizer_mode,
    run_varlen,
)


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    normalize: bool = True,
    eps: float = 1e-6,
    chunk_size: int = 64,
    initial_state: tuple[torch.Tensor, torch.Tensor] | list | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Linear attention ``o_t = q_t^T sum_s k_s v_s^T / (q_t . sum_s k_s + eps)`` (s <= t when causal).

    Args:
        q: ``[B, Tq, H, D]``; k: ``[B, T, H, D]`` (feature-mapped, nonnegative when normalizing);
            v: ``[B, T, H, Dv]``. Non-causal allows ``Tq != T`` (e.g. class tokens reading a grid).
        chunk_size: chunk length of the causal chunkwise form (a speed knob; the result does not depend on it).
        initial_state: causal only; ``(S, z)`` with ``S: [B, H, D, Dv]`` and ``z: [B, H, D]``, the sums over
            the tokens before this call (chunked prefill / decoding).
        output_final_state: causal only; also return ``(S, z)`` after these tokens.
        cu_seqlens: causal only; ``[N + 1]`` offsets of ``N`` sequences packed as ``[1, total_T, ...]``
            (:mod:`mhla.ops.utils.varlen`), each computed as if alone. States are then per sequence: a list of
            ``N`` ``(S [1, H, D, Dv], z [1, H, D])`` (None entries start empty), in and out.
    Returns:
        ``[B, Tq, H, Dv]`` in the dtype of ``v`` (and the state when ``output_final_state``). Summaries
        accumulate in fp32 for half inputs.
    """
    check_qkv(q, k, v, same_length=causal)
    if cu_seqlens is not None:
        if not causal:
            raise ValueError("cu_seqlens (variable-length sequences) is for causal=True only")
        states = check_varlen_states(initial_state, len(check_cu_seqlens(cu_seqlens, q)))
        H, D, Dv, acc = q.shape[2], q.shape[3], v.shape[3], accumulation_dtype(q.dtype)

        def op(q, k, v, state, final):
            return linear_attention(q, k, v, causal=True, normalize=normalize, eps=eps, chunk_size=chunk_size,
                                    initial_state=state, output_final_state=final)

        def empty_state():
            return (q.new_zeros(1, H, D, Dv, dtype=acc), q.new_zeros(1, H, D, dtype=acc))

        return run_varlen(op, (q, k, v), cu_seqlens, initial_state=states, output_final_state=output_final_state,
                          empty_state=empty_state)
    if not causal and (initial_state is not None or output_final_state):
        raise ValueError("initial_state / output_final_state are for causal=True only")
    mode = normalizer_mode(normalize)
    if mode == "official":
        raise ValueError("normalize='official' applies to MHLA only")
    acc = accumulation_dtype(q.dtype)
    qa, ka, va = q.to(acc), k.to(acc), v.to(acc)
    if not causal:
        kv = torch.einsum("bshd,bshe->bhde", ka, va)
        out = torch.einsum("bthd,bhde->bthe", qa, kv)
        if mode == "paper":
            den = torch.einsum("bthd,bhd->bth", qa, ka.sum(1))
            out = out / (den.unsqueeze(-1) + eps)
        return out.to(v.dtype)

    check_block_size(chunk_size)
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    C = chunk_size
    n = ceil_div(T, C)
    pad = n * C - T

    def blocks(x):
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return x.reshape(B, n, C, H, x.shape[-1]).transpose(2, 3)  # [B, n, H, C, d]

    qb, kb, vb = blocks(qa), blocks(ka), blocks(va)
    if initial_state is None:
        s0 = torch.zeros(B, H, D, Dv, dtype=acc, device=q.device)
        z0 = torch.zeros(B, H, D, dtype=acc, device=q.device)
    else:
        s0, z0 = (t.to(acc) for t in initial_state)
        if s0.shape != (B, H, D, Dv) or z0.shape != (B, H, D):
            raise ValueError(
                f"linear attention state must be (S [B, H, D, Dv], z [B, H, D]) = "
                f"({(B, H, D, Dv)}, {(B, H, D)}), got ({tuple(s0.shape)}, {tuple(z0.shape)})"
            )
    summaries = torch.einsum("bnhcd,bnhce->bnhde", kb, vb)
    prefix = exclusive_cumsum(summaries, 1) + s0.unsqueeze(1)
    mask = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    scores = torch.einsum("bnhcd,bnhsd->bnhcs", qb, kb).masked_fill(~mask, 0.0)
    # causal_product: a non-finite later value must not reach earlier outputs through 0 * nan
    local = causal_product(lambda x: torch.einsum("bnhcs,bnhse->bnhce", scores, x), vb, 3)
    out = torch.einsum("bnhcd,bnhde->bnhce", qb, prefix) + local
    key_sums = kb.sum(3)
    if mode == "paper":
        prefix_z = exclusive_cumsum(key_sums, 1) + z0.unsqueeze(1)
        den = torch.einsum("bnhcd,bnhd->bnhc", qb, prefix_z) + scores.sum(-1)
        out = out / (den.unsqueeze(-1) + eps)
    out = out.transpose(2, 3).reshape(B, n * C, H, Dv)[:, :T].to(v.dtype)
    if output_final_state:
        return out, (s0 + summaries.sum(1), z0 + key_sums.sum(1))
    return out
