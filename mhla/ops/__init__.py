"""Functional ops, one folder per op as in flash-linear-attention. Layout: ``[batch, seq, heads, dim]``.

Every op folder has the same shape: ``naive`` (the definition written out, ``<op>_reference``: the test oracle),
``chunk`` (a chunked torch path beside other backends, where the op has several), ``api`` (the entry point: its
backend dispatch, or its one path) and an ``__init__`` that only re-exports.

    mhla/        Multi-Head Linear Attention: ``mhla_attention`` (``api``), its state (``state``), decoding
                 (``decode``) and the fused Triton kernels (``triton``, optional)
    mhla_cross/  MHLA cross-attention (queries and keys of different lengths, key padding masks):
                 ``mhla_cross_attention`` (``api``), the blocking rule (``blocks``), the query side in Triton
                 (``triton``; it reuses mhla's Triton helpers)
    linear/      plain linear attention: ``linear_attention`` (``api``: one torch path, chunkwise when causal)
    gla/         gated linear attention (DiG): ``gla`` (``api``: fla's ``chunk_gla`` on CUDA, else ``chunk``)
    softmax/     softmax attention: ``softmax_attention`` (``api``: SDPA)
    utils/       shared by every op: input checks, variable-length batches, causal sums

Imports go downwards only: ``utils`` imports nothing of the ops; each op imports ``utils`` and its own
modules; this file re-exports the public API (and the helpers the layers and models use).
"""

from .linear import linear_attention, linear_reference
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
from .softmax import softmax_attention, softmax_reference
from .utils import check_cu_seqlens, run_varlen, sequence_bounds, token_index, unbind_state

__all__ = [
    "BACKENDS",
    "MHLAState",
    "MixingRows",
    "check_cu_seqlens",
    "init_state",
    "linear_attention",
    "linear_reference",
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
    "softmax_reference",
    "token_index",
    "unbind_state",
]
