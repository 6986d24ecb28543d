"""The recurrent state of causal MHLA (:class:`MHLAState`) and the checks of a call that continues one.

Every causal MHLA implementation (:mod:`.chunk`, :mod:`.decode`, :mod:`.triton`) and the entry point
(:mod:`.api`) take and return this state; it lives here, below all of them, so that none imports another
for it.

State: the summaries of every *finished* block (each one is needed separately, because every later block
mixes them with its own row of coefficients), the running summary of the current block, and the number of
tokens seen. Memory is O(T / C * D * Dv), cost per decoded token O(D * Dv), plus one re-mix O(i * D * Dv)
at each block boundary (SPEC.md section 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...layouts import ceil_div
from ..utils import accumulation_dtype, check_block_size, check_eps, check_mixing, check_qkv, normalizer_mode


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
            block ``i``, filled by :func:`~mhla.ops.mhla.decode.mhla_decode_step` at a block boundary. It
            assumes the mixing matrix does not change during decoding; the chunked form
            (:func:`~mhla.ops.mhla.chunk.mhla_causal_torch`) never reads it.

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


def check_state(state, q: torch.Tensor, v: torch.Tensor, block_size: int) -> None:
    """Check a causal state (:class:`mhla.ops.MHLAState`) can continue a call on ``q: [B, T, H, D]``,
    ``v: [B, T, H, Dv]`` with blocks of ``block_size`` tokens."""
    if not isinstance(state, MHLAState):
        raise ValueError(
            f"the causal state must be an MHLAState (from init_state or output_final_state=True), "
            f"got {type(state).__name__}"
        )
    if state.block_size != block_size:
        raise ValueError(f"state was built with block_size {state.block_size}, call uses {block_size}")
    acc = accumulation_dtype(q.dtype)
    for name in ("block_summaries", "block_key_sums", "current_summary", "current_key_sum"):
        t = getattr(state, name)
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        if got != acc:
            raise ValueError(
                f"state.{name} must be a {acc} tensor for {q.dtype} inputs (the ops accumulate in {acc}), "
                f"got {got}; build the state from inputs of the same dtype"
            )
    B, _, H, D = q.shape
    want = (B, H, D, v.shape[-1])
    got = tuple(state.current_summary.shape)
    if got != want:
        raise ValueError(f"state summary has shape {got}, expected [B, H, D, Dv] = {want}")
    finished = state.num_tokens // block_size
    if state.block_summaries.shape[2] != finished:
        raise ValueError(
            f"state has {state.block_summaries.shape[2]} finished blocks but {state.num_tokens} tokens "
            f"of {block_size} make {finished}"
        )


def check_causal(q, k, v, mixing, block_size, *, normalize, eps, state=None) -> str:
    """The checks of every causal entry point (``mhla_attention(causal=True)``, ``mhla_decode_step``).

    Args:
        q, k: ``[B, T, H, D]``; v: ``[B, T, H, Dv]``; mixing: ``[M, M]`` or ``[H, M, M]``.
        state: None, or the state the call continues (``M`` must then cover its tokens too).
    Returns:
        the normalizer mode, ``"paper"`` or ``"none"``.
    """
    check_qkv(q, k, v)
    check_block_size(block_size)
    check_eps(eps)
    mode = normalizer_mode(normalize)
    if mode == "official":
        raise ValueError("normalize='official' is the release's non-causal vision normalizer only")
    seen = 0
    if state is not None:
        check_state(state, q, v, block_size)
        seen = state.num_tokens
    check_mixing(mixing, q.shape[2], ceil_div(seen + q.shape[1], block_size))
    return mode
