"""Input checks shared by the functional ops.

Every public op validates its inputs here so that a bad call fails with a ``ValueError`` that says what
is wrong and how to fix it, instead of a shape error deep inside an einsum.
"""

from __future__ import annotations

import torch

_NORMALIZE_MODES = {True: "paper", False: "none", "paper": "paper", "none": "none", "official": "official"}


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the ops accumulate in: fp32 for fp16/bf16 inputs, the input dtype otherwise (fp32, fp64)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def normalizer_mode(normalize) -> str:
    """Map the ``normalize`` argument to one of ``"paper"``, ``"none"`` or ``"official"``."""
    try:
        return _NORMALIZE_MODES[normalize]
    except (KeyError, TypeError):
        raise ValueError(
            f"normalize must be True (the paper's normalizer), False (no denominator) or 'official' "
            f"(the authors' release's vision normalizer), got {normalize!r}"
        ) from None


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, same_length: bool = True) -> None:
    """Check ``q, k: [B, T, H, D]`` and ``v: [B, T, H, Dv]`` agree."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have shape [batch, seq, heads, dim] (4 dims), got {tuple(t.shape)}"
            )
    if q.shape[0] != k.shape[0] or q.shape[0] != v.shape[0]:
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if q.shape[2] != k.shape[2] or q.shape[2] != v.shape[2]:
        raise ValueError(
            f"head counts differ: q has {q.shape[2]} heads, k {k.shape[2]}, v {v.shape[2]}; "
            "the layout is [batch, seq, heads, dim]"
        )
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must share the feature dim: q {q.shape[3]}, k {k.shape[3]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same length: k {k.shape[1]}, v {v.shape[1]}")
    if same_length and q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must have the same length: q {q.shape[1]}, k {k.shape[1]}")
    if q.shape[1] == 0:
        raise ValueError("the sequence is empty (T = 0)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.is_floating_point()):
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}")


def check_block_size(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return block_size


def check_mixing(
    mixing: torch.Tensor,
    num_heads: int,
    rows_needed: int,
    *,
    square_size: int | None = None,
    check_values: bool = True,
) -> None:
    """Check a mixing matrix ``[M, M]`` or per-head ``[H, M, M]``.

    Args:
        rows_needed: the matrix must have at least this many rows (and columns).
        square_size: if given, ``M`` must equal it exactly (the non-causal case).
        check_values: reject negative entries (skipped when the tensor requires grad inside a
            compiled graph would be costly; here it is always cheap for M x M).
    """
    if not isinstance(mixing, torch.Tensor):
        raise ValueError(f"mixing must be a torch.Tensor, got {type(mixing).__name__}")
    if mixing.dim() not in (2, 3):
        raise ValueError(
            f"mixing must be [M, M] (shared) or [H, M, M] (per head), got shape {tuple(mixing.shape)}"
        )
    if mixing.shape[-1] != mixing.shape[-2]:
        raise ValueError(f"mixing must be square in its last two dims, got {tuple(mixing.shape)}")
    if mixing.dim() == 3 and mixing.shape[0] != num_heads:
        raise ValueError(
            f"per-head mixing has {mixing.shape[0]} heads but q has {num_heads}; "
            "pass [M, M] to share one matrix across heads"
        )
    m = mixing.shape[-1]
    if square_size is not None and m != square_size:
        raise ValueError(
            f"mixing is {m} x {m} but the sequence has {square_size} blocks "
            f"(T / block_size); non-causal MHLA needs exactly one row per block"
        )
    if m < rows_needed:
        raise ValueError(
            f"mixing has {m} rows but the sequence needs {rows_needed} blocks "
            f"(ceil(T / block_size)); build it for more blocks (MixingMatrix extends causal "
            f"matrices to any length)"
        )
    if check_values and not torch.compiler.is_compiling():
        if torch.isnan(mixing).any():
            raise ValueError("mixing contains NaN")
        if (mixing < 0).any():
            raise ValueError(
                f"mixing must be nonnegative (min entry {mixing.min().item():.3g}); "
                "use MixingMatrix, whose parameterization keeps it nonnegative"
            )
