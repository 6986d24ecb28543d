"""The ``backend="triton"`` entry point: layout, dtypes, mixing shapes and state around the Functions.

:func:`mhla_triton` has the contract of :func:`mhla.ops.mhla_attention` (which validates the inputs and
calls it; ``cu_seqlens`` is handled there) and returns the same values as the torch path up to rounding:

* layout ``[B, T, H, D]`` in and out (the kernels read it in place, strided by heads);
* ``mixing`` ``[M, M]`` (shared) or ``[H, M, M]`` (per head), or compact rows, any float dtype (read in place
  as fp32: no cast);
* fp16 / bf16 / fp32 inputs, fp32 accumulation and summaries, output in ``v``'s dtype (opt-in:
  ``MHLA_SUMMARY_DTYPE=input`` stores the block summaries ``S`` and their mix ``P`` in the input dtype, without
  a state only: :func:`mhla.ops.mhla.triton.utils.summary_dtype`). Under the CPU
  interpreter bf16 tensors are computed in fp32 (numpy has no bf16) and the output cast back;
* causal calls may continue an :class:`~mhla.ops.MHLAState` and return the final one (fp32 summaries), with
  a dense mixing matrix or compact :class:`~mhla.ops.mhla.state.MixingRows` (the state then keeps the blocks
  of their window and folds the others, and the blocks are mixed in time linear in ``T``:
  :class:`~mhla.ops.mhla.triton.mix.BandedMix`).

Routed to the torch path instead (same results, documented): ``normalize="official"`` (the release's
vision normalizer) and float64 inputs.

:func:`available` says whether the kernels can run here: triton imports and either CUDA is available or
the kernels were built by the CPU interpreter (``TRITON_INTERPRET=1`` set *before* this module is
imported: triton reads it when ``@triton.jit`` decorates the kernels).
"""

from __future__ import annotations

import torch

from ....layouts import ceil_div
from ...utils import normalizer_mode
from ..chunk import mhla_causal_torch, mhla_noncausal_torch
from ..state import (
    MHLAState,
    MixingRows,
    check_state,
    check_window,
    init_state,
    kept_blocks,
    rewindow,
    state_after_chunk,
)
from .causal import mhla_causal_triton
from .mix import BandedMix
from .noncausal import mhla_noncausal_triton
from .utils import INTERPRET_AT_IMPORT, INTERPRETER_USABLE, SUPPORTED_DTYPES


def available() -> bool:
    """True when the kernels can launch: CUDA is available, or they were built for the interpreter."""
    return INTERPRETER_USABLE or torch.cuda.is_available()


def _check_device(q: torch.Tensor) -> None:
    if INTERPRET_AT_IMPORT and not INTERPRETER_USABLE and not q.is_cuda:
        raise ValueError(
            "backend='triton' on CPU: triton was imported before TRITON_INTERPRET=1 was set, so its language "
            "helpers were built for the GPU. Set TRITON_INTERPRET=1 before anything imports triton"
        )
    if not INTERPRET_AT_IMPORT and not q.is_cuda:
        raise ValueError(
            "backend='triton' runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1 set before "
            f"import); got tensors on {q.device}. Move them to the GPU or use backend='torch'"
        )


def mhla_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor | MixingRows,
    block_size: int,
    *,
    causal: bool = False,
    normalize="paper",
    eps: float = 1e-6,
    initial_state: MHLAState | None = None,
    output_final_state: bool = False,
):
    """MHLA on the Triton kernels. Arguments and returns as :func:`mhla.ops.mhla_attention`.

    Returns ``o [B, T, H, Dv]`` (dtype of ``v``), or ``(o, state)`` with ``output_final_state``.
    """
    mode = normalizer_mode(normalize)
    stateful = initial_state is not None or output_final_state
    if not causal and stateful:
        raise ValueError("initial_state / output_final_state are for causal=True only")
    if mode == "official" or q.dtype not in SUPPORTED_DTYPES:
        # Not in the kernels: the release's normalizer and float64. Same results from the torch path.
        if causal:
            return mhla_causal_torch(q, k, v, mixing, block_size, normalize=mode, eps=eps,
                                     initial_state=initial_state, output_final_state=output_final_state)
        return mhla_noncausal_torch(q, k, v, mixing, block_size, normalize=mode, eps=eps)
    _check_device(q)
    out_dtype = v.dtype
    if INTERPRET_AT_IMPORT and q.dtype == torch.bfloat16:  # numpy has no bf16: compute in fp32
        q, k, v = q.float(), k.float(), v.float()
    mixing_dtype = mixing.diag.dtype if isinstance(mixing, MixingRows) else mixing.dtype
    if INTERPRET_AT_IMPORT and mixing_dtype == torch.bfloat16:
        # the kernels read the mixing (matrix or compact rows) in its own dtype; the interpreter has no bf16
        mixing = mixing.to(torch.float32)
    normalize_b = mode == "paper"

    if not causal:
        if q.shape[1] % block_size:
            raise ValueError(f"non-causal MHLA needs T ({q.shape[1]}) to be a multiple of block_size "
                             f"({block_size})")
        o = mhla_noncausal_triton(q, k, v, mixing, block_size, normalize=normalize_b, eps=eps)
        return o.to(out_dtype)

    C = block_size
    compact = isinstance(mixing, MixingRows)
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    window = mixing.window if compact else None
    st = None  # no state to continue: nothing allocated (an empty state is built below only if one is returned)
    if initial_state is not None:
        check_state(initial_state, q, v, C)
        check_window(initial_state, mixing)
        st = rewindow(initial_state, mixing.window) if compact else initial_state
        window = st.window
    P = 0 if st is None else st.num_tokens
    first = P // C
    NB = ceil_div(P % C + T, C)
    mix = None
    if compact:  # linear in T: the rows' head, recent and far coefficients, never a dense [NB, first + NB]
        diag, head, recent, far = mixing.rows(first, first + NB)  # read in place in their dtype: no cast
        kh, kr = kept_blocks(first, window)
        folded = st is not None and st.num_folded_blocks > 0
        mix = (BandedMix(window, first, kh, folded, kr, NB), diag, (head, recent, far))
    state = None
    if st is not None:
        cols_s, cols_z = st.block_summaries, st.block_key_sums
        if compact and folded:  # the folded blocks: one state column between the kept head and recent blocks
            cols_s = torch.cat([cols_s[:, :, :kh], st.far_summary.unsqueeze(2), cols_s[:, :, kh:]], dim=2)
            cols_z = torch.cat([cols_z[:, :, :kh], st.far_key_sum.unsqueeze(2), cols_z[:, :, kh:]], dim=2)
        state = (cols_s, cols_z, st.current_summary, st.current_key_sum, P)
    o, S, Z = mhla_causal_triton(q, k, v, None if compact else mixing, C, normalize=normalize_b, eps=eps,
                                 state=state, keep_z=output_final_state, mix=mix)
    o = o.to(out_dtype)
    if not output_final_state:
        return o

    if st is None:  # the empty state of the right dtype (the kernels' summaries are fp32)
        st = init_state(B, H, D, Dv, C, device=q.device, dtype=S.dtype, window=window)
    new_state = state_after_chunk(st, S, Z, P + T)
    return o, new_state
