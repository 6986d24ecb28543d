"""The recurrent state of causal MHLA (:class:`MHLAState`), the compact rows of a causal mixing matrix that a
bounded state reads (:class:`MixingRows`), and the checks of a call that continues a state.

Every causal MHLA implementation (:mod:`.chunk`, :mod:`.decode`, :mod:`.triton`) and the entry point
(:mod:`.api`) take and return this state; it lives here, below all of them, so that none imports another
for it.

State: the summaries of the finished blocks that the later rows of the mixing matrix still tell apart, one
*folded* sum of those they do not, the running summary of the current block, and the number of tokens seen
(docs/method.md#decoding-state).

* ``window=None`` (a dense mixing matrix ``[M, M]`` / ``[H, M, M]``): every finished block is kept, because a
  dense matrix may give every block its own coefficient in every later row. Memory O(T / C * D * Dv).
* ``window=(head, recent)`` (the compact rows of :class:`MixingRows`, from
  :meth:`mhla.mixing.MixingMatrix.causal_rows`): the first ``head`` and the last ``recent`` finished blocks
  are kept, every other finished block is added into ``far_summary``, because the rows give all of them one
  shared coefficient. Memory O((head + recent + 1) * D * Dv) at any length, the cost of a token O(D * Dv),
  plus O((head + recent) * D * Dv) when it opens a block.

The causal mixing rules of :mod:`mhla.mixing` all have this form with ``head + recent = M - 1`` (``M`` the
learned rows): ``relative``, ``window``, ``uniform_far``, ``sqrt_far`` and ``mass_matched`` give every block farther than
``M - 1`` back one coefficient per row (window ``(0, M - 1)``), ``last_row`` gives the first ``M - 1`` blocks
their own columns and every later block one (window ``(M - 1, 0)``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...layouts import ceil_div
from ..utils import accumulation_dtype, check_block_size, check_eps, check_mixing, check_qkv, normalizer_mode


def kept_blocks(finished: int, window: tuple[int, int] | None) -> tuple[int, int]:
    """How many of ``finished`` blocks a state with ``window`` keeps: ``(kh, kr)``, the first ``kh`` blocks
    and the last ``kr`` ones (``window=None``: all, as ``(finished, 0)``). The other ``finished - kh - kr``
    blocks, ``kh .. finished - kr - 1``, are folded."""
    if window is None:
        return finished, 0
    kh = min(finished, window[0])
    return kh, min(finished - kh, window[1])


def kept_block_ids(finished: int, window: tuple[int, int] | None) -> list[int]:
    """The block indices a state keeps after ``finished`` blocks, in order (:func:`kept_blocks`)."""
    kh, kr = kept_blocks(finished, window)
    return [*range(kh), *range(finished - kr, finished)]


@dataclass
class MHLAState:
    """Recurrent state of causal MHLA after ``num_tokens`` tokens (all summaries fp32 or fp64).

    Attributes:
        block_summaries: ``[B, H, N, D, Dv]`` S_b of the ``N`` kept finished blocks, in block order: all of
            the ``num_tokens // block_size`` finished blocks when ``window`` is None, else the first
            ``head`` and the last ``recent`` of them (:func:`kept_block_ids`).
        block_key_sums: ``[B, H, N, D]`` z_b of the kept blocks.
        current_summary: ``[B, H, D, Dv]`` running S of the current (unfinished) block.
        current_key_sum: ``[B, H, D]`` running z of the current block.
        num_tokens: tokens consumed so far.
        block_size: chunk length C the state was built with.
        window: None (every finished block kept; dense mixing matrices), or ``(head, recent)``: the blocks
            kept apart (the compact rows of :class:`MixingRows` with that window).
        far_summary / far_key_sum: ``[B, H, D, Dv]`` / ``[B, H, D]``, the sum of the finished blocks that are
            not kept (:attr:`num_folded_blocks` of them); None when ``window`` is None.
        prefix_summary / prefix_key_sum: cache of the mixed earlier blocks ``sum_{b<i} mixing[i, b] S_b`` (and
            z) for the current block ``i``, filled by :func:`~mhla.ops.mhla.decode.mhla_decode_step` when a
            token opens a block. It assumes the mixing does not change during decoding; the chunked forms
            never read it.

    Variable-length calls (``mhla_attention(..., cu_seqlens=...)``) take and return one state per sequence: a
    list of ``N`` ``MHLAState`` of batch 1, since the sequences may have consumed different numbers of tokens.
    """

    block_summaries: torch.Tensor
    block_key_sums: torch.Tensor
    current_summary: torch.Tensor
    current_key_sum: torch.Tensor
    num_tokens: int
    block_size: int
    window: tuple[int, int] | None = None
    far_summary: torch.Tensor | None = None
    far_key_sum: torch.Tensor | None = None
    prefix_summary: torch.Tensor | None = None
    prefix_key_sum: torch.Tensor | None = None

    @property
    def num_finished_blocks(self) -> int:
        return self.num_tokens // self.block_size

    @property
    def num_folded_blocks(self) -> int:
        """Finished blocks summed into ``far_summary`` (0 when ``window`` is None)."""
        return self.num_finished_blocks - self.block_summaries.shape[2]

    @property
    def current_block(self) -> int:
        """Index of the block the next token falls in."""
        return self.num_tokens // self.block_size

    def kept_block_ids(self) -> list[int]:
        """The indices of the blocks in ``block_summaries``, in order."""
        return kept_block_ids(self.num_finished_blocks, self.window)

    def detach(self) -> "MHLAState":
        """A copy cut from the autograd graph (for truncated backprop through time)."""
        d = {
            f: (getattr(self, f).detach() if isinstance(getattr(self, f), torch.Tensor) else getattr(self, f))
            for f in self.__dataclass_fields__
        }
        return MHLAState(**d)

    def nbytes(self) -> int:
        """Bytes of every tensor the state holds (summaries, the folded sum and the decode cache)."""
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor))


def init_state(
    batch: int,
    heads: int,
    dk: int,
    dv: int,
    block_size: int,
    *,
    device=None,
    dtype: torch.dtype = torch.float32,
    window: tuple[int, int] | None = None,
) -> MHLAState:
    """An empty state (no tokens seen). ``dtype`` is the accumulation dtype (fp32, or fp64 for tests);
    ``window``: None (keep every block; dense mixing) or ``(head, recent)`` (:class:`MHLAState`)."""
    z = dict(device=device, dtype=dtype)
    window = _check_window(window)
    return MHLAState(
        block_summaries=torch.zeros(batch, heads, 0, dk, dv, **z),
        block_key_sums=torch.zeros(batch, heads, 0, dk, **z),
        current_summary=torch.zeros(batch, heads, dk, dv, **z),
        current_key_sum=torch.zeros(batch, heads, dk, **z),
        num_tokens=0,
        block_size=block_size,
        window=window,
        far_summary=None if window is None else torch.zeros(batch, heads, dk, dv, **z),
        far_key_sum=None if window is None else torch.zeros(batch, heads, dk, **z),
    )


def _check_window(window) -> tuple[int, int] | None:
    if window is None:
        return None
    if (not isinstance(window, tuple) or len(window) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in window)):
        raise ValueError(f"window must be None or (head, recent), two ints >= 0; got {window!r}")
    return window


def fold_blocks(state: MHLAState, new_s: torch.Tensor, new_z: torch.Tensor, finished: int):
    """The kept summaries and the folded sum after adding the newly finished blocks to ``state``'s.

    Args:
        state: the state before (its kept blocks, folded sum and window).
        new_s: ``[B, H, n, D, Dv]``, new_z: ``[B, H, n, D]``: the summaries of the ``n`` blocks that finished
            since, ``state.num_finished_blocks .. finished - 1``.
        finished: the finished blocks after.
    Returns:
        ``(block_summaries, block_key_sums, far_summary, far_key_sum)`` for ``finished`` blocks under
        ``state.window`` (the far sums None when ``window`` is None). A block leaves the kept ones at most
        once, into ``far_summary``; the kept ones are the first ``kh`` and the last ``kr`` of the old kept
        blocks followed by the new ones (:func:`kept_blocks`).
    """
    all_s = torch.cat([state.block_summaries, new_s], dim=2) if new_s.shape[2] else state.block_summaries
    all_z = torch.cat([state.block_key_sums, new_z], dim=2) if new_z.shape[2] else state.block_key_sums
    if state.window is None:
        return all_s, all_z, None, None
    kh, kr = kept_blocks(finished, state.window)
    n = all_s.shape[2]
    far_s, far_z = state.far_summary, state.far_key_sum
    if kh + kr < n:  # blocks kh .. n - kr - 1 of the list leave it
        far_s = far_s + all_s[:, :, kh:n - kr].sum(2)
        far_z = far_z + all_z[:, :, kh:n - kr].sum(2)
        all_s = torch.cat([all_s[:, :, :kh], all_s[:, :, n - kr:]], dim=2)
        all_z = torch.cat([all_z[:, :, :kh], all_z[:, :, n - kr:]], dim=2)
    return all_s, all_z, far_s, far_z


def state_after_chunk(state: MHLAState, summaries: torch.Tensor, key_sums: torch.Tensor,
                      end: int) -> MHLAState:
    """The state after a chunk of tokens that ends at token ``end``, from the summaries of its blocks.

    Args:
        state: the state the chunk started from (its kept blocks, folded sum, window and block size).
        summaries: ``[B, H, n, D, Dv]``, key_sums: ``[B, H, n, D]``: the chunk's blocks
            ``state.num_finished_blocks ..`` (``n`` of them), the first including the running sums the chunk
            started with. The last is the new running block, unless ``end`` is a block boundary
            (then every one of them is finished and the running sums start at zero).
        end: the number of tokens seen after the chunk.
    """
    finished = end // state.block_size
    new = finished - state.num_finished_blocks  # the chunk's finished blocks: n, or n - 1
    if new == summaries.shape[2]:
        cur_s, cur_z = torch.zeros_like(summaries[:, :, 0]), torch.zeros_like(key_sums[:, :, 0])
    else:
        cur_s, cur_z = summaries[:, :, -1], key_sums[:, :, -1]
    kept_s, kept_z, far_s, far_z = fold_blocks(state, summaries[:, :, :new], key_sums[:, :, :new], finished)
    return MHLAState(block_summaries=kept_s, block_key_sums=kept_z, current_summary=cur_s,
                     current_key_sum=cur_z, num_tokens=end, block_size=state.block_size, window=state.window,
                     far_summary=far_s, far_key_sum=far_z)


def rewindow(state: MHLAState, window: tuple[int, int]) -> MHLAState:
    """``state`` (after any number of tokens) for a call whose mixing rows have ``window``.

    A state that keeps every block (``window=None``, e.g. after a call with a dense mixing matrix) is folded
    to ``window``; a state with the same window is returned as it is. Raises ValueError for a state folded
    under another window (the blocks it folded cannot be told apart again)."""
    if state.window == window:
        return state
    if state.window is not None:
        raise ValueError(
            f"the state folds its far blocks for window (head, recent) = {state.window}, but the mixing "
            f"rows of this call keep {window}; continue it with rows of the same window (a dense mixing "
            "matrix needs a state that keeps every block: window=None)")
    empty = replace(state, window=window, block_summaries=state.block_summaries[:, :, :0],
                    block_key_sums=state.block_key_sums[:, :, :0], num_tokens=0,
                    far_summary=torch.zeros_like(state.current_summary),
                    far_key_sum=torch.zeros_like(state.current_key_sum), prefix_summary=None,
                    prefix_key_sum=None)
    s, z, far_s, far_z = fold_blocks(empty, state.block_summaries, state.block_key_sums,
                                     state.num_finished_blocks)
    return replace(empty, block_summaries=s, block_key_sums=z, far_summary=far_s, far_key_sum=far_z,
                   num_tokens=state.num_tokens)


# ------------------------------------------------------------------------------------ compact mixing rows
@dataclass(frozen=True)
class MixingRows:
    """Rows ``first .. first + n - 1`` of a causal mixing matrix in the compact form a state with
    ``window = (head, recent)`` reads (built by :meth:`mhla.mixing.MixingMatrix.causal_rows`).

    For row ``i`` (``r = i - first``) and a block ``b`` before it, the coefficient is

        head[.., r, b]            if b < head                     (the first blocks, by their index)
        recent[.., r, i - 1 - b]  elif i - 1 - b < recent         (the latest blocks, by their distance)
        far[.., r]                otherwise                       (every other block: ONE shared coefficient)

    and ``diag[.., r]`` for ``b = i``. Entries of ``head`` / ``recent`` that name no earlier block
    (``b >= i``, ``b < 0``, or a recent block ``b < head``) are never read. Because the far blocks share a
    coefficient, a state keeps their summed summary only (:class:`MHLAState`).

    Attributes (``...`` is nothing for one matrix shared by the heads, ``H`` for one per head):
        first: the index of the first row.
        diag: ``[..., n]``; head: ``[..., n, head]``; recent: ``[..., n, recent]``; far: ``[..., n]``.
    Every coefficient is nonnegative and finite (:func:`mhla.ops.mhla_attention` checks; the decode step
    does not).
    """

    first: int
    diag: torch.Tensor
    head: torch.Tensor
    recent: torch.Tensor
    far: torch.Tensor

    @property
    def window(self) -> tuple[int, int]:
        return self.head.shape[-1], self.recent.shape[-1]

    @property
    def num_rows(self) -> int:
        return self.diag.shape[-1]

    @property
    def stop(self) -> int:
        """One past the last row."""
        return self.first + self.num_rows

    def to(self, dtype: torch.dtype) -> "MixingRows":
        return MixingRows(self.first, *(t.to(dtype) for t in (self.diag, self.head, self.recent, self.far)))

    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """``(diag [G, n], head [G, n, head], recent [G, n, recent], far [G, n])`` of the rows
        ``start .. stop - 1`` (``G``: 1 shared, or ``H``)."""
        a, b = start - self.first, stop - self.first
        out = (self.diag[..., a:b], self.head[..., a:b, :], self.recent[..., a:b, :], self.far[..., a:b])
        if self.diag.dim() == 1:
            out = tuple(t.unsqueeze(0) for t in out)
        return out


def row_coefficients(rows: MixingRows, start: int, n: int, col_ids: torch.Tensor) -> torch.Tensor:
    """The coefficients of rows ``start .. start + n - 1`` on the blocks ``col_ids`` (``[N]`` int64, any
    blocks, a block ``b >= i`` reading 0): ``[G, n, N]``."""
    _, head, recent, far = rows.rows(start, start + n)
    kh, kr = rows.window
    G = far.shape[0]
    i = torch.arange(start, start + n, device=col_ids.device).unsqueeze(1)  # [n, 1]
    b = col_ids.unsqueeze(0)  # [1, N]
    dist = i - 1 - b  # [n, N]
    coeff = far.unsqueeze(-1).expand(G, n, col_ids.numel())
    if kr:
        idx = dist.clamp(0, kr - 1).expand(G, n, -1)
        coeff = torch.where(dist < kr, recent.gather(-1, idx), coeff)
    if kh:
        idx = b.clamp(max=kh - 1).expand(G, n, -1)
        coeff = torch.where(b < kh, head.gather(-1, idx), coeff)
    return torch.where(b < i, coeff, 0.0)


def check_rows(rows: MixingRows, num_heads: int, start: int, stop: int, *, check_values: bool = True) -> None:
    """Check compact mixing rows for ``num_heads`` heads cover the rows ``start .. stop - 1``."""
    if not isinstance(rows, MixingRows):
        raise ValueError(f"mixing must be a tensor or MixingRows, got {type(rows).__name__}")
    ts = (rows.diag, rows.head, rows.recent, rows.far)
    lead = rows.diag.shape[:-1]
    n = rows.num_rows
    want = ((*lead, n), (*lead, n, rows.window[0]), (*lead, n, rows.window[1]), (*lead, n))
    if len(lead) > 1 or any(tuple(t.shape) != w for t, w in zip(ts, want)):
        raise ValueError(f"MixingRows tensors must be diag [.., n], head [.., n, head], recent [.., n, "
                         f"recent], far [.., n] (.. nothing or H); got {[tuple(t.shape) for t in ts]}")
    if lead and lead[0] != num_heads:
        raise ValueError(f"per-head mixing rows have {lead[0]} heads but q has {num_heads}")
    if rows.first > start or rows.stop < stop:
        raise ValueError(f"the mixing rows cover blocks {rows.first} .. {rows.stop - 1} but the call needs "
                         f"{start} .. {stop - 1}")
    if check_values and not torch.compiler.is_compiling():
        flat = torch.cat([t.reshape(-1) for t in ts])
        if not bool((torch.isfinite(flat) & (flat >= 0)).all()):
            raise ValueError("mixing rows must be finite and nonnegative (found NaN, inf or a negative)")


# ------------------------------------------------------------------------------------------------- checks
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
    names = ("block_summaries", "block_key_sums", "current_summary", "current_key_sum")
    if state.window is not None:
        names += ("far_summary", "far_key_sum")
    for name in names:
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
    if state.window is not None and tuple(state.far_summary.shape) != want:
        raise ValueError(f"state.far_summary has shape {tuple(state.far_summary.shape)}, expected {want}")
    finished = state.num_tokens // block_size
    kept = sum(kept_blocks(finished, state.window))
    if state.block_summaries.shape[2] != kept:
        what = "finished blocks" if state.window is None else f"kept blocks (window {state.window})"
        raise ValueError(
            f"state has {state.block_summaries.shape[2]} {what} but {state.num_tokens} tokens "
            f"of {block_size} make {finished} finished blocks, of which it must keep {kept}"
        )


def check_causal(q, k, v, mixing, block_size, *, normalize, eps, state=None,
                 check_values: bool = True) -> str:
    """The checks of every causal entry point (``mhla_attention(causal=True)``, ``mhla_decode_step``).

    Args:
        q, k: ``[B, T, H, D]``; v: ``[B, T, H, Dv]``; mixing: ``[M, M]`` or ``[H, M, M]``, or
            :class:`MixingRows`.
        state: None, or the state the call continues (the mixing must then cover its tokens too).
        check_values: also check the mixing's values (finite, nonnegative: a host sync).
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
    stop = ceil_div(seen + q.shape[1], block_size)
    if isinstance(mixing, MixingRows):
        check_rows(mixing, q.shape[2], seen // block_size, stop, check_values=check_values)
        if state is not None:
            check_window(state, mixing)
    else:
        check_mixing(mixing, q.shape[2], stop, check_values=check_values)
        if state is not None and state.window is not None:
            check_window(state, mixing)
    return mode


def check_window(state: MHLAState, mixing) -> None:
    """A state continues with mixing of its own window: compact rows of the same window (or a state that keeps
    every block, folded then), or a dense matrix for a state that keeps every block."""
    if isinstance(mixing, MixingRows):
        if state.window is not None and state.window != mixing.window:
            rewindow(state, mixing.window)  # raises with the explanation
        return
    if state.window is not None:
        raise ValueError(
            f"the state folds its far blocks (window (head, recent) = {state.window}); continue it with the "
            "compact mixing rows it was built with (MixingRows, MixingMatrix.causal_rows), not a dense "
            "matrix")
