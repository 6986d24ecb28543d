"""Input checks shared by the functional ops (the checks of MHLA's causal state are with the state, in
:mod:`mhla.ops.mhla.state`).

Every public op validates its inputs here so that a bad call fails with a ``ValueError`` that says what
is wrong and how to fix it, instead of a shape error deep inside an einsum.
"""

from __future__ import annotations

import math
import numbers
import os

import torch

#: Set to ``1`` to check the mixing's values on every backend, the fused kernels included (debugging; a
#: host-device synchronisation per call on a GPU). Read at every call.
CHECK_VALUES_ENV = "MHLA_CHECK_VALUES"

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


def check_eps(eps) -> float:
    """``eps`` (added to the normalizer's denominator) must be a positive finite number; returns a float."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 < eps < math.inf:
        raise ValueError(f"eps must be a positive float (e.g. 1e-6), got {eps!r}")
    return float(eps)


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
        check_values: reject NaN, infinite and negative entries (skipped while compiling, where the
            data-dependent test would break the graph). Cheap for M x M, but a host-device sync on a GPU:
            the entry points pass :func:`checks_mixing_values` of their backend.
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
        if bool(((mixing >= 0) & (mixing < math.inf)).all()):  # one pass and one host sync when it is fine
            return
        if not torch.isfinite(mixing).all():
            raise ValueError("mixing contains NaN or inf entries; it must be finite")
        if (mixing < 0).any():
            raise ValueError(
                f"mixing must be nonnegative (min entry {mixing.min().item():.3g}); "
                "use MixingMatrix, whose parameterization keeps it nonnegative"
            )


def checks_mixing_values(backend: str) -> bool:
    """Whether a call on ``backend`` (a resolved one: ``"torch"``, ``"reference"`` or ``"triton"``) checks
    the mixing's values (finite, nonnegative) on the host.

    The check reads a reduction of the mixing on the host: on a GPU, a host-device synchronisation every call
    (the CPU waits until the GPU has run everything queued before it, so the launches that follow stop
    overlapping the GPU's work). The torch and reference backends check. The fused kernels (``"triton"``,
    what ``backend="auto"`` picks for CUDA tensors) do not, unless ``MHLA_CHECK_VALUES=1`` is set: with a NaN
    or inf in the mixing, the outputs of the rows that read it are NaN / inf; a negative entry is used as
    given (the formula's value, meaningless as attention). :class:`mhla.mixing.MixingMatrix` keeps its output
    nonnegative by construction (clamp, softplus or exp), so a layer's mixing is never negative.
    """
    return backend != "triton" or os.environ.get(CHECK_VALUES_ENV, "0") == "1"


def check_cu_seqlens(cu_seqlens, q: torch.Tensor) -> list[int]:
    """Check ``cu_seqlens`` of a packed (variable-length) call on ``q: [1, total_T, H, D]``.

    ``cu_seqlens``: ``[N + 1]`` int32 / int64 tensor, 0 first, ``total_T`` last, non-decreasing (sequence
    ``n`` is tokens ``cu_seqlens[n]:cu_seqlens[n + 1]``; empty sequences are allowed), as in
    flash-linear-attention. Returns the ``N`` sequence lengths (a host list).
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be a 1-D int32/int64 tensor [N + 1] of sequence offsets (0, ..., total_T), "
            f"got dtype {cu_seqlens.dtype} and shape {tuple(cu_seqlens.shape)}"
        )
    if q.shape[0] != 1:
        raise ValueError(
            f"with cu_seqlens, q, k, v must be [1, total_T, H, D] (the sequences concatenated along the tokens, "
            f"as in flash-linear-attention), got batch {q.shape[0]}; flatten the batch first"
        )
    cu = cu_seqlens.tolist()
    total = q.shape[1]
    if cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"cu_seqlens must start at 0 and end at total_T = {total}, got {cu[0]} ... {cu[-1]}")
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if min(lengths) < 0:
        bad = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu[bad]} then {cu[bad + 1]} at index {bad}")
    return lengths


def check_varlen_states(states, num_seqs: int) -> list | None:
    """Per-sequence initial states of a packed call: None, or a list / tuple of ``num_seqs`` entries (each a
    state of batch 1, or None for a sequence that starts empty). Returns a list, or None."""
    if states is None:
        return None
    if not isinstance(states, (list, tuple)):
        raise ValueError(
            f"with cu_seqlens, initial_state must be a list of N = {num_seqs} per-sequence states (batch 1 each, "
            f"None for an empty start), got {type(states).__name__}"
        )
    if len(states) != num_seqs:
        raise ValueError(f"cu_seqlens has {num_seqs} sequences but initial_state holds {len(states)} states")
    return list(states)
