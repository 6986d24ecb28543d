"""Causal (chunkwise) MHLA in plain PyTorch, with a recurrent state for chunked prefill and decoding.

Blocks are contiguous chunks of ``C = block_size`` tokens; the last one may be partial. A query ``t`` in
block ``i`` reads

    o_t = q_t^T ( sum_{b<i} mixing[i, b] S_b  +  mixing[i, i] * sum_{s in i, s<=t} k_s v_s^T )
          / ( q_t . (sum_{b<i} mixing[i, b] z_b  +  mixing[i, i] * sum_{s in i, s<=t} k_s) + eps )

(the denominator only when normalizing). ``mixing`` is read as lower-triangular: entries above the
diagonal are ignored. Its row ``i`` must exist for every block the sequence touches.

State (:class:`MHLAState`): the summaries of every *finished* block (each one is needed separately,
because every later block mixes them with its own row of coefficients), the running summary of the
current block, and the number of tokens seen. Memory is O(T / C * D * Dv), cost per decoded token
O(D * Dv), plus one re-mix O(i * D * Dv) at each block boundary (docs/method.md#decoding-state).

Causality holds whatever the values: a NaN or inf in token ``s`` reaches the outputs ``t >= s`` only. The
masked terms of a causal sum are never multiplied in (``0 * nan`` is ``nan``); see :func:`causal_product`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..layouts import ceil_div
from .validation import accumulation_dtype, check_causal, check_mixing, check_state, normalizer_mode


@dataclass
class MHLAState:
    """Recurrent state of causal MHLA after ``num_tokens`` tokens (all summaries fp32 or fp64).

    Attributes:
        block_summaries: ``[B, H, N, D, Dv]`` S_b of the ``N = num_tokens // block_size`` finished blocks.
        block_key_sums: ``[B, H, N, D]`` z_b of the finished blocks.
        current_summary: ``[B, H, D, Dv]`` running S of the current (unfinished) block.
        current_key_sum: ``[B, H, D]`` running z of the current block.
        num_tokens: tokens consumed so far.
        block_size: chunk length C the state was built with.
        prefix_summary / prefix_key_sum: cache of ``sum_{b<i} mixing[i, b] S_b`` (and z) for the current
            block ``i``, filled by :func:`mhla_decode_step` at a block boundary. It assumes the mixing
            matrix does not change during decoding; :func:`mhla_causal_torch` never reads it.

    Variable-length calls (``mhla_attention(..., cu_seqlens=...)``) take and return one state per sequence: a
    list of ``N`` ``MHLAState`` of batch 1, since the sequences may have consumed different numbers of tokens.
    """

    block_summaries: torch.Tensor
    block_key_sums: torch.Tensor
    current_summary: torch.Tensor
    current_key_sum: torch.Tensor
    num_tokens: int
    block_size: int
    prefix_summary: torch.Tensor | None = None
    prefix_key_sum: torch.Tensor | None = None

    @property
    def num_finished_blocks(self) -> int:
        return self.block_summaries.shape[2]

    @property
    def current_block(self) -> int:
        """Index of the block the next token falls in."""
        return self.num_tokens // self.block_size

    def detach(self) -> "MHLAState":
        """A copy cut from the autograd graph (for truncated backprop through time)."""
        d = {
            f: (getattr(self, f).detach() if isinstance(getattr(self, f), torch.Tensor) else getattr(self, f))
            for f in self.__dataclass_fields__
        }
        return MHLAState(**d)

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.block_summaries, self.block_key_sums, self.current_summary, self.current_key_sum)
        )


def init_state(
    batch: int,
    heads: int,
    dk: int,
    dv: int,
    block_size: int,
    *,
    device=None,
    dtype: torch.dtype = torch.float32,
) -> MHLAState:
    """An empty state (no tokens seen). ``dtype`` is the accumulation dtype (fp32, or fp64 for tests)."""
    z = dict(device=device, dtype=dtype)
    return MHLAState(
        block_summaries=torch.zeros(batch, heads, 0, dk, dv, **z),
        block_key_sums=torch.zeros(batch, heads, 0, dk, **z),
        current_summary=torch.zeros(batch, heads, dk, dv, **z),
        current_key_sum=torch.zeros(batch, heads, dk, **z),
        num_tokens=0,
        block_size=block_size,
    )


def causal_product(product, x: torch.Tensor, dim: int, *, strict: bool = False, lazy: bool = True):
    """``product(x)`` for a causal sum over the positions ``dim`` of ``x``, whatever ``x`` holds.

    ``product`` is a dense matmul such as ``y_i = sum_j w_ij x_j`` with ``w_ij = 0`` for ``j > i`` (``j >= i``
    when ``strict``), and its output positions are the last ``n`` positions of ``x``. The matmul also
    multiplies the zero weights by the later ``x_j``, and ``0 * nan = nan``: a NaN or inf would reach every
    earlier output. So the product runs on ``x`` with its non-finite entries set to 0, and the outputs that
    read one (elementwise in the other dims) are set to NaN.

    ``lazy``: first test whether ``x`` is finite through its sum (one reduction and a host sync; an
    overflowing sum only takes the exact path) and then skip the masking.
    """
    if lazy and not torch.compiler.is_compiling() and torch.isfinite(x.detach().sum()):
        return product(x)
    finite = torch.isfinite(x)
    count = (~finite).cumsum(dim, dtype=torch.int32)  # non-finite entries at positions <= i
    if strict:
        count = count - (~finite).int()
    out = product(torch.where(finite, x, 0.0))
    n = out.shape[dim]
    return torch.where(count.narrow(dim, x.shape[dim] - n, n) > 0, float("nan"), out)


def _mix_rows(mixing: torch.Tensor, rows: torch.Tensor, cols: int) -> torch.Tensor:
    """Strictly-lower-triangular coefficients for global block rows ``rows`` over columns ``0..cols-1``.

    Returns ``[H or 1, len(rows), cols]`` with entry ``mixing[r, c]`` where ``c < r`` else 0.
    """
    mix = mixing if mixing.dim() == 3 else mixing.unsqueeze(0)
    keep = torch.arange(cols, device=mix.device).unsqueeze(0) < rows.unsqueeze(1)
    return torch.where(keep, mix[:, rows, :cols], 0.0)


def mhla_causal_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor,
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
            number of tokens already in ``initial_state`` (0 without one).
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
    if initial_state is None:
        state = init_state(B, H, D, Dv, C, device=q.device, dtype=acc)
    else:
        check_state(initial_state, q, v, C)
        state = initial_state
    P = state.num_tokens
    first_block, offset = divmod(P, C)
    total_blocks = ceil_div(P + T, C)
    # shape and rows only: the values were checked once by mhla_attention, and a variable-length call runs
    # this once per length bucket (a full-matrix scan per call was most of its per-call cost)
    check_mixing(mixing, H, total_blocks, check_values=False)
    if offset and offset + T > C:
        # The chunk starts inside a block and runs past it: finish that block first, so that below a chunk
        # either starts on a block boundary or lies inside one block.
        head = C - offset
        kw = dict(normalize=mode, eps=eps)
        o1, mid = mhla_causal_torch(q[:, :head], k[:, :head], v[:, :head], mixing, C, initial_state=state,
                                    output_final_state=True, **kw)
        rest = mhla_causal_torch(q[:, head:], k[:, head:], v[:, head:], mixing, C, initial_state=mid,
                                 output_final_state=output_final_state, **kw)
        if output_final_state:
            return torch.cat([o1, rest[0]], dim=1), rest[1]
        return torch.cat([o1, rest], dim=1)

    # Lay the chunk out on `nb` blocks of L tokens, zero padding behind (zero keys and values contribute
    # nothing to any summary). L = C, or just the T tokens when they all fall in one block: the work is
    # O(T L) whatever the block size. The `offset` tokens of the first block seen before live in the state.
    nb = ceil_div(offset + T, C)
    L = C if nb > 1 else T

    def blocks(x):
        x = torch.nn.functional.pad(x.to(acc), (0, 0, 0, 0, 0, nb * L - T))
        return x.reshape(B, nb, L, H, x.shape[-1]).transpose(2, 3)  # [B, nb, H, L, d]

    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    mix = mixing.to(acc)
    mix_h = mix if mix.dim() == 3 else mix.unsqueeze(0)
    rows = torch.arange(first_block, first_block + nb, device=q.device)
    diag = mix_h[:, rows, rows].transpose(0, 1)  # [nb, H or 1]: mixing[i, i]

    # Summaries of the chunk's blocks; the first also holds the state's running sum for that block.
    chunk_summaries = torch.einsum("bnhcd,bnhce->bnhde", kb, vb)
    chunk_key_sums = kb.sum(3)
    chunk_summaries = torch.cat(
        [chunk_summaries[:, :1] + state.current_summary.unsqueeze(1), chunk_summaries[:, 1:]], dim=1
    )
    chunk_key_sums = torch.cat(
        [chunk_key_sums[:, :1] + state.current_key_sum.unsqueeze(1), chunk_key_sums[:, 1:]], dim=1
    )
    all_summaries = torch.cat([state.block_summaries.transpose(1, 2), chunk_summaries], dim=1)
    all_key_sums = torch.cat([state.block_key_sums.transpose(1, 2), chunk_key_sums], dim=1)

    # Inter-block term: every block reads the strictly earlier blocks through its row of the mixing.
    coeff = _mix_rows(mix, rows, first_block + nb).expand(H, -1, -1)  # [H, nb, n_all]

    def mix_earlier(spec, x):  # x: [B, n_all, H, ...] -> [B, nb, H, ...], block i reads blocks j < i
        return causal_product(lambda y: torch.einsum(spec, coeff, y), x, 1, strict=True)

    prefix = mix_earlier("hij,bjhde->bihde", all_summaries)
    out = torch.einsum("bnhcd,bnhde->bnhce", qb, prefix)

    # Intra-block term, causal inside the block, scaled by the diagonal coefficient.
    causal_mask = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    scores = torch.where(causal_mask, torch.einsum("bnhcd,bnhsd->bnhcs", qb, kb), 0.0)
    diag_b = diag.view(1, nb, -1, 1)  # broadcast over [B, nb, H, L]
    intra = causal_product(lambda x: torch.einsum("bnhcs,bnhse->bnhce", scores, x), vb, 3)
    # Tokens of the first block that were consumed before this call live in the state's running sum.
    carried = torch.einsum("bhcd,bhde->bhce", qb[:, 0], state.current_summary)
    intra = torch.cat([intra[:, :1] + carried.unsqueeze(1), intra[:, 1:]], dim=1)
    out = out + diag_b.unsqueeze(-1) * intra

    if mode == "paper":
        prefix_z = mix_earlier("hij,bjhd->bihd", all_key_sums)
        den = torch.einsum("bnhcd,bnhd->bnhc", qb, prefix_z)
        intra_z = scores.sum(-1)
        carried_z = torch.einsum("bhcd,bhd->bhc", qb[:, 0], state.current_key_sum)
        intra_z = torch.cat([intra_z[:, :1] + carried_z.unsqueeze(1), intra_z[:, 1:]], dim=1)
        den = den + diag_b * intra_z
        out = out / (den.unsqueeze(-1) + eps)

    o = out.transpose(2, 3).reshape(B, nb * L, H, Dv)[:, :T].to(v.dtype)
    if not output_final_state:
        return o

    end = P + T
    finished = end // C
    n_all = first_block + nb
    if finished == n_all:  # the chunk ended exactly on a block boundary
        cur_s = torch.zeros_like(state.current_summary)
        cur_z = torch.zeros_like(state.current_key_sum)
    else:
        cur_s, cur_z = all_summaries[:, -1], all_key_sums[:, -1]
    new_state = MHLAState(
        block_summaries=all_summaries[:, :finished].transpose(1, 2),
        block_key_sums=all_key_sums[:, :finished].transpose(1, 2),
        current_summary=cur_s,
        current_key_sum=cur_z,
        num_tokens=end,
        block_size=C,
    )
    return o, new_state


def mhla_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor,
    state: MHLAState,
    *,
    normalize="paper",
    eps: float = 1e-6,
):
    """One decoding step: consume a single token per sequence and return its output and the new state.

    Args:
        q, k: ``[B, 1, H, D]``; v: ``[B, 1, H, Dv]``.
        mixing: ``[M, M]`` or ``[H, M, M]`` with at least ``state.current_block + 1`` rows.
        state: the state after the tokens so far (from :func:`init_state` or a prefill), with summaries in
            the accumulation dtype of ``q`` (fp32 for fp16 / bf16 / fp32, fp64 for fp64).
        normalize, eps: as :func:`mhla.ops.mhla_attention` (``eps`` a positive float).
    Returns:
        ``(o: [B, 1, H, Dv], new_state)``. Cost O(D * Dv) per token, plus O(i * D * Dv) to re-mix the
        finished blocks when the token opens block ``i`` (then cached in the state).
    """
    if not isinstance(state, MHLAState):
        raise ValueError(
            f"state must be an MHLAState (from init_state or a prefill's output_final_state=True), "
            f"got {type(state).__name__}"
        )
    C = state.block_size
    mode = check_causal(q, k, v, mixing, C, normalize=normalize, eps=eps, state=state)
    if q.shape[1] != 1:
        raise ValueError(f"mhla_decode_step takes one token (T = 1), got T = {q.shape[1]}")
    H = q.shape[2]
    acc = state.current_summary.dtype
    i = state.current_block
    mix = mixing.to(acc)
    mix_h = mix if mix.dim() == 3 else mix.unsqueeze(0)

    prefix_s, prefix_z = state.prefix_summary, state.prefix_key_sum
    if prefix_s is None or state.num_tokens % C == 0:  # opening a new block: re-mix the finished ones
        coeff = mix_h[:, i, :i].expand(H, -1)  # [H, i]
        prefix_s = torch.einsum("hj,bhjde->bhde", coeff, state.block_summaries)
        prefix_z = torch.einsum("hj,bhjd->bhd", coeff, state.block_key_sums)

    qt, kt, vt = (x[:, 0].to(acc) for x in (q, k, v))  # [B, H, d]
    cur_s = state.current_summary + kt.unsqueeze(-1) * vt.unsqueeze(-2)
    cur_z = state.current_key_sum + kt
    diag = mix_h[:, i, i].view(1, -1, 1, 1)  # [1, H or 1, 1, 1]
    summary = prefix_s + diag * cur_s
    out = torch.einsum("bhd,bhde->bhe", qt, summary)
    if mode == "paper":
        den = torch.einsum("bhd,bhd->bh", qt, prefix_z + diag[..., 0] * cur_z)
        out = out / (den.unsqueeze(-1) + eps)

    n = state.num_tokens + 1
    if n % C == 0:  # the block is finished: append it and start an empty one
        new_state = MHLAState(
            block_summaries=torch.cat([state.block_summaries, cur_s.unsqueeze(2)], dim=2),
            block_key_sums=torch.cat([state.block_key_sums, cur_z.unsqueeze(2)], dim=2),
            current_summary=torch.zeros_like(cur_s),
            current_key_sum=torch.zeros_like(cur_z),
            num_tokens=n,
            block_size=C,
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
