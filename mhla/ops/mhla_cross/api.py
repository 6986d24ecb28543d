"""The public entry point ``mhla_cross_attention``: validates the inputs and dispatches to a backend.

Backends: ``"torch"`` (:mod:`.chunk`, everywhere), ``"reference"`` (the dense definition, :mod:`.naive`;
tests), ``"triton"`` (the query side fused, :mod:`.triton.query`; CUDA, or the CPU interpreter with
``TRITON_INTERPRET=1`` set before import; fp64 inputs run the torch path), ``"auto"`` (``"triton"`` for CUDA
tensors when it is available, else ``"torch"``). Importing this module never imports triton.
"""

from __future__ import annotations

import math

import torch

from ..utils import accumulation_dtype, check_eps, check_qkv
from .blocks import check_blocks
from .chunk import key_summaries, mhla_cross_torch, mix_summaries
from .naive import mhla_cross_reference

CROSS_BACKENDS = ("auto", "torch", "reference", "triton")


def _triton_query():
    """The kernel module, or None when it cannot run here."""
    try:
        from .triton import query  # noqa: PLC0415  (optional triton)
    except Exception:  # ImportError, or triton failing to initialise without a GPU
        return None
    return query if query.available() else None


def resolve_cross_backend(backend: str, q: torch.Tensor) -> str:
    if backend not in CROSS_BACKENDS:
        raise ValueError(f"backend must be one of {CROSS_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if q.is_cuda and _triton_query() is not None else "torch"
    if backend == "triton" and _triton_query() is None:
        raise ValueError("backend='triton' needs triton with a CUDA device (or TRITON_INTERPRET=1 set before "
                         "import, for the CPU interpreter); use backend='torch'")
    return backend


def check_cross_mixing(mixing, num_heads: int, query_len: int, key_len: int) -> None:
    """``mixing [Mq, Mk]`` or ``[H, Mq, Mk]``: finite, nonnegative, ``1 <= Mq <= Tq`` and
    ``1 <= Mk <= Tk``."""
    if not isinstance(mixing, torch.Tensor) or mixing.dim() not in (2, 3):
        shape = tuple(mixing.shape) if isinstance(mixing, torch.Tensor) else type(mixing).__name__
        raise ValueError(f"mixing must be [Mq, Mk] (shared) or [H, Mq, Mk] (per head), got {shape}")
    if mixing.dim() == 3 and mixing.shape[0] != num_heads:
        raise ValueError(f"per-head mixing has {mixing.shape[0]} heads but q has {num_heads}")
    check_blocks(query_len, mixing.shape[-2], "queries (mixing rows)")
    check_blocks(key_len, mixing.shape[-1], "keys (mixing columns)")
    if not torch.compiler.is_compiling() and not bool(((mixing >= 0) & (mixing < math.inf)).all()):
        raise ValueError("mixing must be finite and nonnegative (CrossMixingMatrix keeps it so)")


def check_key_padding_mask(mask, k: torch.Tensor) -> None:
    if mask is None:
        return
    shape_ok = isinstance(mask, torch.Tensor) and tuple(mask.shape) == tuple(k.shape[:2])
    if not shape_ok or mask.dtype != torch.bool:
        got = (mask.dtype, tuple(mask.shape)) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"key_padding_mask must be a bool tensor [B, Tk] = {tuple(k.shape[:2])} (True: a "
                         f"real key, False: padding), got {got}")
    if mask.device != k.device:
        raise ValueError(f"key_padding_mask is on {mask.device} but k on {k.device}")


def mhla_cross_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    normalize: bool = True,
    eps: float = 1e-6,
    backend: str = "auto",
) -> torch.Tensor:
    """MHLA cross-attention (docs/cross_attention.md): ``Mq`` query blocks read a nonnegative mix of the
    summaries of ``Mk`` key blocks.

    Args:
        q: ``[B, Tq, H, D]`` queries, already through a nonnegative feature map.
        k: ``[B, Tk, H, D]`` keys (feature-mapped), v: ``[B, Tk, H, Dv]``.
        mixing: ``[Mq, Mk]`` shared or ``[H, Mq, Mk]`` per head, finite and nonnegative; row ``i`` is query
            block ``i``. Blocks (:mod:`mhla.ops.mhla_cross.blocks`): token ``t`` of a length-``T`` axis in
            ``M`` blocks is in block ``(t M) // T`` (contiguous, balanced, none empty: needs ``M <= T``).
            Queries on a 2-D / 3-D grid are put in block-major order first by the layer
            (:class:`mhla.layers.MHLACrossAttention`).
        key_padding_mask: ``[B, Tk]`` bool, True for a real key. Masked keys contribute nothing to the block
            summaries or to the normaliser (whatever they hold); the blocks stay those of the padded axis.
        normalize: ``True``: divide by ``q_t . z~_i + eps``; ``False``: no denominator.
        eps: a positive float. backend: ``"auto"``, ``"torch"``, ``"reference"``, ``"triton"``.
    Returns:
        ``o [B, Tq, H, Dv]`` in the dtype of ``v``. A query whose keys are all masked gets 0.
    Raises:
        ValueError: wrong ranks, shapes, dtypes, a mixing matrix with more blocks than tokens on either axis,
            a negative or non-finite mixing entry, a bad mask, ``normalize`` other than true / false.
    """
    check_qkv(q, k, v, same_length=False)
    eps = check_eps(eps)
    if normalize not in (True, False):
        raise ValueError(f"normalize must be true or false for cross-attention, got {normalize!r}")
    check_cross_mixing(mixing, q.shape[2], q.shape[1], k.shape[1])
    check_key_padding_mask(key_padding_mask, k)
    which = resolve_cross_backend(backend, q)
    kw = dict(key_padding_mask=key_padding_mask, normalize=bool(normalize), eps=eps)
    if which == "reference":
        return mhla_cross_reference(q, k, v, mixing, **kw)
    if which == "torch" or q.dtype == torch.float64:
        return mhla_cross_torch(q, k, v, mixing, **kw)
    S, z = key_summaries(k, v, mixing.shape[-1], key_padding_mask, dtype=accumulation_dtype(q.dtype))
    P, Pz = mix_summaries(mixing, S, z)
    return _triton_query().query_output_triton(q, P, Pz, normalize=bool(normalize), eps=eps,
                                               out_dtype=v.dtype)
