"""The public entry point ``mhla_attention``: validates inputs and dispatches to a backend.

Backends (the implementations beside this module):
    ``"torch"``      chunked PyTorch (O(T d^2 + M^2 d^2)), :mod:`.chunk`; runs everywhere, the reference fast
                     path.
    ``"reference"``  the dense O(T^2) definition, :mod:`.naive` (tests and analysis only).
    ``"triton"``     fused kernels, :mod:`.triton` (CUDA, or the CPU interpreter with ``TRITON_INTERPRET=1``),
                     when built. Imported lazily: importing this module never imports triton.
    ``"auto"``       ``"triton"`` for CUDA tensors when the kernels are available, else ``"torch"``.

Variable-length calls (``cu_seqlens``) run every sequence through :func:`mhla.ops.utils.run_varlen`.
"""

from __future__ import annotations

import torch

from ...layouts import ceil_div
from ..utils import (
    accumulation_dtype,
    check_block_size,
    check_cu_seqlens,
    check_eps,
    check_mixing,
    check_qkv,
    check_varlen_states,
    normalizer_mode,
    run_varlen,
    unbind_state,
)
from ..utils.validation import checks_mixing_values
from .chunk import mhla_causal_torch, mhla_noncausal_torch
from .naive import mhla_reference
from .state import MHLAState, MixingRows, check_causal, check_rows, check_state, check_window, init_state

BACKENDS = ("auto", "torch", "reference", "triton")


def _triton_backend():
    """The Triton backend module, or None when it is not importable here."""
    try:
        from .triton import backend  # noqa: PLC0415  (optional triton; TRITON_INTERPRET set first)
    except Exception:  # ImportError, or triton failing to initialise without a GPU
        return None
    return backend if backend.available() else None


def resolve_backend(backend: str, q: torch.Tensor, *, causal: bool = False) -> str:
    """Pick the backend that ``backend`` means for these inputs (the kernels serve both forms, with or without
    a state, so ``causal`` does not change the choice today)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if q.is_cuda and _triton_backend() is not None:
            return "triton"
        return "torch"
    if backend == "triton" and _triton_backend() is None:
        raise ValueError(
            "backend='triton' needs the fused kernels (mhla.ops.mhla.triton) and triton with a CUDA device "
            "(or TRITON_INTERPRET=1 set before import, for the CPU interpreter); use backend='torch'"
        )
    return backend


def mhla_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor | MixingRows,
    block_size: int,
    *,
    causal: bool = False,
    normalize=True,
    eps: float = 1e-6,
    backend: str = "auto",
    initial_state: MHLAState | list | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Multi-Head Linear Attention (token-level heads), docs/method.md.

    Args:
        q, k: ``[B, T, H, D]``, already passed through a nonnegative feature map.
        v: ``[B, T, H, Dv]``.
        mixing: ``[M, M]`` shared, or ``[H, M, M]`` per head; nonnegative. Row ``i`` is query block ``i``.
            Its values (finite, nonnegative) are checked on the torch and reference backends, not on the
            Triton one (a host-device sync per call; ``MHLA_CHECK_VALUES=1`` checks there too):
            :func:`mhla.ops.utils.validation.checks_mixing_values`.
            Causal calls also take :class:`MixingRows`, the rows of the call's blocks in the compact form of
            a bounded state (from :meth:`mhla.mixing.MixingMatrix.causal_rows`; ``backend`` torch or triton):
            the state then keeps only the blocks of their window and one folded sum (:class:`MHLAState`).
        block_size: tokens per block ``C``. Tokens are in block-major order: block ``b`` holds tokens
            ``b*C ... (b+1)*C - 1`` (see :mod:`mhla.layouts` for 2-D/3-D grids).
            Non-causal: ``T == M * C``. Causal: any ``T``; the last block may be partial; ``mixing`` is
            read as lower-triangular and needs at least ``ceil(T / C)`` rows (counting the state's tokens).
        causal: chunkwise causal form (language models).
        normalize: ``True`` (paper: divide by ``q . z~ + eps``), ``False`` (no denominator; LM and video
            use an output RMSNorm instead), or ``"official"`` (the authors' release's vision normalizer,
            docs/method.md#vision-normaliser; non-causal only).
        eps: a positive float added to the denominator.
        backend: ``"auto"``, ``"torch"``, ``"reference"`` or ``"triton"`` (module docstring).
        initial_state: causal only; continue after the tokens summarised in this state (chunked prefill).
        output_final_state: causal only; also return the state after these tokens.
        cu_seqlens: causal only; a packed batch of ``N`` variable-length sequences in flash-linear-attention's
            convention (:mod:`mhla.ops.utils.varlen`): ``q, k: [1, total_T, H, D]``,
            ``v: [1, total_T, H, Dv]``, ``cu_seqlens: [N + 1]`` int32/int64 (0 first, ``total_T`` last,
            non-decreasing; sequence ``n`` is tokens ``cu_seqlens[n]:cu_seqlens[n + 1]``, possibly empty).
            Every sequence is computed as if alone: its blocks start at its own first token, and ``mixing``
            needs ``ceil(L_n / C)`` rows for the longest (counting its state's tokens; :class:`MixingRows`
            must cover the blocks of every sequence). States are per sequence: ``initial_state`` is a list
            of ``N`` :class:`MHLAState` of batch 1 (None entries start empty; a single ``MHLAState`` of
            batch ``N``, all sequences after the same tokens, is split), and ``output_final_state`` returns a
            list of ``N`` :class:`MHLAState` of batch 1 (an empty sequence keeps its initial state).
    Returns:
        ``o: [B, T, H, Dv]`` with the dtype of ``v``; ``(o, state)`` when ``output_final_state``
        (``[1, total_T, H, Dv]`` and a list of ``N`` states with ``cu_seqlens``).
    Raises:
        ValueError: on wrong ranks, shapes or dtypes, ``T`` not a multiple of ``block_size`` (non-causal),
            negative or non-finite ``mixing`` (backends torch and reference), too-small ``mixing``, mismatched
            heads, an ``eps`` that is not a positive float, an ``initial_state`` that does not fit the call
            (type, dtype, shapes), or a bad ``cu_seqlens`` (dtype, shape, offsets, batch other than 1,
            non-causal call).
    """
    if cu_seqlens is not None:
        if not causal:
            raise ValueError("cu_seqlens (variable-length sequences) is for causal=True only")
        return _mhla_varlen(q, k, v, mixing, block_size, cu_seqlens, normalize=normalize, eps=eps,
                            backend=backend, initial_state=initial_state, output_final_state=output_final_state)
    stateful = initial_state is not None or output_final_state
    check_qkv(q, k, v)
    which = resolve_backend(backend, q, causal=causal)
    values = checks_mixing_values(which)  # not on the fused kernels' hot path: a host-device sync
    if causal:
        mode = check_causal(q, k, v, mixing, block_size, normalize=normalize, eps=eps, state=initial_state,
                            check_values=values)
    else:
        check_block_size(block_size)
        check_eps(eps)
        mode = normalizer_mode(normalize)
        T, H = q.shape[1], q.shape[2]
        if stateful:
            raise ValueError("initial_state / output_final_state are for causal=True only")
        if T % block_size:
            raise ValueError(
                f"non-causal MHLA needs T ({T}) to be a multiple of block_size ({block_size}); "
                f"{T} tokens form {T / block_size:.2f} blocks. Pad the grid or choose a block that tiles it"
            )
        check_mixing(mixing, H, T // block_size, square_size=T // block_size, check_values=values)

    if which == "reference" and stateful:
        raise ValueError("the reference backend has no state; use backend='torch'")
    if which == "reference" and isinstance(mixing, MixingRows):
        raise ValueError("the reference backend takes a dense mixing matrix, not MixingRows; use "
                         "backend='torch'")
    if causal:
        return _causal_op(which, mixing, block_size, mode, eps)(q, k, v, initial_state, output_final_state)
    if which == "reference":
        return mhla_reference(q, k, v, mixing, block_size, causal=False, normalize=mode, eps=eps)
    if which == "triton":
        return _triton_backend().mhla_triton(q, k, v, mixing, block_size, causal=False, normalize=mode,
                                             eps=eps)
    return mhla_noncausal_torch(q, k, v, mixing, block_size, normalize=mode, eps=eps)


def _causal_op(which: str, mixing: torch.Tensor, block_size: int, mode: str, eps: float):
    """The causal form on backend ``which`` as ``op(q, k, v, initial_state, output_final_state)``."""
    if which == "reference":
        return lambda q, k, v, _state, _final: mhla_reference(q, k, v, mixing, block_size, causal=True,
                                                              normalize=mode, eps=eps)
    if which == "triton":
        fn = _triton_backend().mhla_triton
        return lambda q, k, v, state, final: fn(q, k, v, mixing, block_size, causal=True, normalize=mode, eps=eps,
                                                initial_state=state, output_final_state=final)
    return lambda q, k, v, state, final: mhla_causal_torch(q, k, v, mixing, block_size, normalize=mode, eps=eps,
                                                           initial_state=state, output_final_state=final)


def _mhla_varlen(q, k, v, mixing, block_size, cu_seqlens, *, normalize, eps, backend, initial_state,
                 output_final_state):
    """``mhla_attention(causal=True, cu_seqlens=...)``: validate, then run every sequence as if alone
    (:func:`mhla.ops.utils.run_varlen`). Shapes as :func:`mhla_attention`."""
    check_qkv(q, k, v)
    check_block_size(block_size)
    eps = check_eps(eps)
    mode = normalizer_mode(normalize)
    if mode == "official":
        raise ValueError("normalize='official' is the release's non-causal vision normalizer only")
    lengths = check_cu_seqlens(cu_seqlens, q)
    if isinstance(initial_state, MHLAState):  # one batched state: every sequence after the same tokens
        initial_state = unbind_state(initial_state, len(lengths))
    states = check_varlen_states(initial_state, len(lengths))
    seen = [0] * len(lengths)
    for n, state in enumerate(states or []):
        if state is not None:
            try:
                check_state(state, q[:, :1], v[:, :1], block_size)  # batch 1, heads, dims, dtype, block size
                check_window(state, mixing)
            except ValueError as err:
                raise ValueError(f"initial_state[{n}]: {err}") from None
            seen[n] = state.num_tokens
    stop = max(ceil_div(p + n, block_size) for p, n in zip(seen, lengths))
    compact = isinstance(mixing, MixingRows)
    which = resolve_backend(backend, q, causal=True)
    values = checks_mixing_values(which)
    if compact:
        check_rows(mixing, q.shape[2], min(p // block_size for p in seen), stop, check_values=values)
    else:
        check_mixing(mixing, q.shape[2], stop, check_values=values)
    if which == "reference" and (states is not None or output_final_state):
        raise ValueError("the reference backend has no state; use backend='torch'")
    if which == "reference" and compact:
        raise ValueError("the reference backend takes a dense mixing matrix, not MixingRows; use "
                         "backend='torch'")
    H, D, Dv = q.shape[2], q.shape[3], v.shape[3]

    def empty_state():
        return init_state(1, H, D, Dv, block_size, device=q.device, dtype=accumulation_dtype(q.dtype),
                          window=mixing.window if compact else None)

    return run_varlen(_causal_op(which, mixing, block_size, mode, eps), (q, k, v), cu_seqlens,
                      initial_state=states, output_final_state=output_final_state, empty_state=empty_state)
