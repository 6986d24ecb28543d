"""Gated linear attention's entry point, :func:`gla`: it dispatches to fla's Triton ``chunk_gla`` on CUDA when
flash-linear-attention imports (:func:`gla_fla`), else to the torch chunked form (:func:`gla_chunked`);
:func:`resolve_gla_backend` says which.
"""

from __future__ import annotations

import functools
import os

import torch

from .chunk import gla_chunked

GLA_BACKENDS = ("auto", "torch", "fla")


@functools.cache
def _fla_chunk_gla():
    """``fla.ops.gla.chunk_gla``, or None when flash-linear-attention does not import here (cached: asked once)."""
    try:
        from fla.ops.gla import chunk_gla  # noqa: PLC0415  (optional: flash-linear-attention, GPU + Triton)
    except Exception:  # noqa: BLE001 - fla raises more than ImportError without a GPU / Triton
        return None
    return chunk_gla


def resolve_gla_backend(backend: str, q: torch.Tensor) -> str:
    """The backend ``backend`` means for inputs like ``q``: ``"torch"`` (:func:`gla_chunked`) or ``"fla"``
    (:func:`gla_fla`).

    ``"auto"``: ``"fla"`` for CUDA tensors when fla imports, else ``"torch"`` (CPU inputs never import fla).
    ``"fla"``: raises ImportError when fla does not import, and ValueError for non-CUDA inputs unless
    ``TRITON_INTERPRET=1`` (Triton's CPU interpreter; a debugging path: fla 0.6.0 under triton 3.8 also needs the
    two shims in ``tests/ops/test_dig_fla.py``, and it is slow).
    """
    if backend not in GLA_BACKENDS:
        raise ValueError(f"GLA backend must be one of {GLA_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "fla" if q.is_cuda and _fla_chunk_gla() is not None else "torch"
    if _fla_chunk_gla() is None:
        raise ImportError(
            "GLA backend='fla' needs flash-linear-attention (fla.ops.gla.chunk_gla; Triton, a GPU): pip install "
            "flash-linear-attention, or use backend='torch' / 'auto'")
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"GLA backend='fla' runs fla's Triton kernels on CUDA tensors; got tensors on {q.device}. Move them to "
            "the GPU or use backend='torch' / 'auto' (or TRITON_INTERPRET=1, set before import, for Triton's CPU "
            "interpreter)")
    return "fla"


def gla_fla(q, k, v, log_a, scale: float | None = None):
    """GLA by flash-linear-attention's chunked Triton kernel; same inputs / output as :func:`~.naive.gla_reference`.

    The mapping onto ``fla.ops.gla.chunk_gla(q, k, v, g, scale=None, initial_state=None,
    output_final_state=False, ...) -> (o, final_state)`` (fla 0.6.0) is the identity:

    * layout: fla's default is ours, time-major ``[B, T, H, K]`` for ``q, k, g`` and ``[B, T, H, V]`` for ``v``
      and ``o`` (no head-first transpose; fla makes the inputs contiguous);
    * gate: fla's ``g`` is the per-key log forget gate, ``S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t``, i.e. our
      ``log_a`` (``logsigmoid(.) / 16``, ``<= 0``) as it is;
    * scale: ``o_t = (scale * q_t) S_t`` with the same default ``K^-1/2``;
    * no initial state, no final state (``final_state`` is None); fla picks its own chunk length
      (``min(64, max(16, next_pow2(T)))``), so :func:`gla_chunked`'s ``chunk`` does not apply;
    * any ``T`` (fla masks the last chunk); fp32 / fp16 / bf16 with fp32 accumulation; output cast to
      ``q.dtype`` (fla returns ``v``'s dtype).
    """
    chunk_gla = _fla_chunk_gla()
    if chunk_gla is None:
        raise ImportError("gla_fla needs flash-linear-attention: pip install flash-linear-attention")
    o, _ = chunk_gla(q, k, v, log_a, scale=scale, initial_state=None, output_final_state=False)
    return o.to(q.dtype)


def gla(q, k, v, log_a, chunk: int = 16, scale: float | None = None, backend: str = "auto"):
    """GLA (same inputs / output as :func:`~.naive.gla_reference`) on the backend :func:`resolve_gla_backend` picks:
    fla's ``chunk_gla`` on CUDA when fla imports, else :func:`gla_chunked` (``chunk``: its chunk length)."""
    if resolve_gla_backend(backend, q) == "fla":
        return gla_fla(q, k, v, log_a, scale=scale)
    return gla_chunked(q, k, v, log_a, chunk, scale=scale)


__all__ = ["GLA_BACKENDS", "gla", "gla_fla", "resolve_gla_backend"]
