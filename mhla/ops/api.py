"""Public entry point ``mhla_attention``: validates inputs and dispatches to a backend.

Backends:
    ``"torch"``      chunked PyTorch (O(T d^2 + M^2 d^2)); runs everywhere, the reference fast path.
    ``"reference"``  the dense O(T^2) definition (tests and analysis only).
    ``"triton"``     fused kernels (CUDA, or the CPU interpreter with ``TRITON_INTERPRET=1``), when built.
    ``"auto"``       ``"triton"`` for CUDA tensors when the kernels are available, else ``"torch"``.
"""

from __future__ import annotations

import torch

from .causal import MHLAState, mhla_causal_torch
from .noncausal import mhla_noncausal_torch
from .reference import mhla_reference
from .validation import check_block_size, check_causal, check_eps, check_mixing, check_qkv, normalizer_mode

BACKENDS = ("auto", "torch", "reference", "triton")


def _triton_backend():
    """The Triton backend module, or None when it is not importable here."""
    try:
        from ..kernels import triton_backend  # noqa: PLC0415
    except Exception:  # ImportError, or triton failing to initialise without a GPU
        return None
    return triton_backend if triton_backend.available() else None


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
            "backend='triton' needs the fused kernels (mhla.kernels) and triton with a CUDA device "
            "(or TRITON_INTERPRET=1 set before import, for the CPU interpreter); use backend='torch'"
        )
    return backend


def mhla_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor,
    block_size: int,
    *,
    causal: bool = False,
    normalize=True,
    eps: float = 1e-6,
    backend: str = "auto",
    initial_state: MHLAState | None = None,
    output_final_state: bool = False,
):
    """Multi-Head Linear Attention (token-level heads), SPEC.md section 1.

    Args:
        q, k: ``[B, T, H, D]``, already passed through a nonnegative feature map.
        v: ``[B, T, H, Dv]``.
        mixing: ``[M, M]`` shared, or ``[H, M, M]`` per head; nonnegative. Row ``i`` is query block ``i``.
        block_size: tokens per block ``C``. Tokens are in block-major order: block ``b`` holds tokens
            ``b*C ... (b+1)*C - 1`` (see :mod:`mhla.layouts` for 2-D/3-D grids).
            Non-causal: ``T == M * C``. Causal: any ``T``; the last block may be partial; ``mixing`` is
            read as lower-triangular and needs at least ``ceil(T / C)`` rows (counting the state's tokens).
        causal: chunkwise causal form (language models).
        normalize: ``True`` (paper: divide by ``q . z~ + eps``), ``False`` (no denominator; LM and video
            use an output RMSNorm instead), or ``"official"`` (the authors' release's vision normalizer,
            SPEC.md section 2; non-causal only).
        eps: a positive float added to the denominator.
        backend: ``"auto"``, ``"torch"``, ``"reference"`` or ``"triton"`` (module docstring).
        initial_state: causal only; continue after the tokens summarised in this state (chunked prefill).
        output_final_state: causal only; also return the state after these tokens.
    Returns:
        ``o: [B, T, H, Dv]`` with the dtype of ``v``; ``(o, state)`` when ``output_final_state``.
    Raises:
        ValueError: on wrong ranks, shapes or dtypes, ``T`` not a multiple of ``block_size`` (non-causal),
            negative, non-finite or too-small ``mixing``, mismatched heads, an ``eps`` that is not a
            positive float, or an ``initial_state`` that does not fit the call (type, dtype, shapes).
    """
    stateful = initial_state is not None or output_final_state
    if causal:
        mode = check_causal(q, k, v, mixing, block_size, normalize=normalize, eps=eps, state=initial_state)
    else:
        check_qkv(q, k, v)
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
        check_mixing(mixing, H, T // block_size, square_size=T // block_size)

    which = resolve_backend(backend, q, causal=causal)
    if which == "reference":
        if stateful:
            raise ValueError("the reference backend has no state; use backend='torch'")
        return mhla_reference(q, k, v, mixing, block_size, causal=causal, normalize=mode, eps=eps)
    if which == "triton":
        return _triton_backend().mhla_attention(
            q, k, v, mixing, block_size, causal=causal, normalize=mode, eps=eps,
            initial_state=initial_state, output_final_state=output_final_state,
        )
    if causal:
        return mhla_causal_torch(
            q,
            k,
            v,
            mixing,
            block_size,
            normalize=mode,
            eps=eps,
            initial_state=initial_state,
            output_final_state=output_final_state,
        )
    return mhla_noncausal_torch(q, k, v, mixing, block_size, normalize=mode, eps=eps)
