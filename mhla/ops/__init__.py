"""Functional ops, one folder per op as in flash-linear-attention. Layout: ``[batch, seq, heads, dim]``.

    mhla/      Multi-Head Linear Attention: ``mhla_attention`` (the entry point), its state, the dense
               reference (``naive``), the chunked torch forms (``chunk``), decoding (``decode``) and the
               fused Triton kernels (``triton``, optional)
    linear/    plain linear attention: ``naive`` (dense reference) and ``chunk`` (``linear_attention``)
    mhla_cross/  MHLA cross-attention (queries and keys of different lengths, key padding masks):
               ``mhla_cross_attention``; ``naive``, ``chunk`` (torch), ``triton`` (the query side; it reuses
               mhla's Triton helpers)
    softmax    ``softmax_attention`` (SDPA)
    utils/     shared by every op: input checks, variable-length batches, causal sums

Imports go downwards only: ``utils`` imports nothing of the ops; each op imports ``utils`` and its own
modules; this file re-exports the public API (and the helpers the layers and models use).
"""

from .linear import linear_attention, linear_attention_reference
from .mhla import (
    BACKENDS,
    MHLAState,
    MixingRows,
    init_state,
    mhla_attention,
    mhla_attention_matrix,
    mhla_causal_torch,
    mhla_decode_step,
    mhla_effective_weights,
    mhla_noncausal_torch,
    mhla_reference,
    resolve_backend,
)
from .mhla_cross import mhla_cross_attention, mhla_cross_reference
from .softmax import softmax_attention
from .utils import check_cu_seqlens, run_varlen, sequence_bounds, token_index, unbind_state

__all__ = [
    "BACKENDS",
    "MHLAState",
    "MixingRows",
    "check_cu_seqlens",
    "init_state",
    "linear_attention",
    "linear_attention_reference",
    "mhla_attention",
    "mhla_attention_matrix",
    "mhla_cross_attention",
    "mhla_cross_reference",
    "mhla_causal_torch",
    "mhla_decode_step",
    "mhla_effective_weights",
    "mhla_noncausal_torch",
    "mhla_reference",
    "resolve_backend",
    "run_varlen",
    "sequence_bounds",
    "softmax_attention",
    "token_index",
    "unbind_state",
]
