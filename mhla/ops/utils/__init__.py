"""Helpers shared by every op (MHLA, linear, softmax attention). They import nothing of the ops above them.

Modules:
    :mod:`.validation`  input checks (``check_qkv``, ``check_mixing``, ``check_cu_seqlens``, ...), the
                        accumulation dtype and the ``normalize`` argument's modes.
    :mod:`.varlen`      variable-length (packed) batches in flash-linear-attention's ``cu_seqlens``
                        convention: :func:`run_varlen`, length buckets, per-sequence states, token indices.
    :mod:`.causal`      causal sums that stay causal whatever the values (:func:`causal_product`,
                        :func:`exclusive_cumsum`).
"""

from .causal import causal_product, exclusive_cumsum
from .validation import (
    accumulation_dtype,
    check_block_size,
    check_cu_seqlens,
    check_eps,
    check_mixing,
    check_qkv,
    check_varlen_states,
    normalizer_mode,
)
from .varlen import (
    CALL_COST_TOKENS,
    bucket_sequences,
    default_call_cost_tokens,
    pad_sequences,
    run_varlen,
    sequence_bounds,
    token_index,
    unbind_state,
)

__all__ = [
    "CALL_COST_TOKENS",
    "accumulation_dtype",
    "bucket_sequences",
    "causal_product",
    "check_block_size",
    "check_cu_seqlens",
    "check_eps",
    "check_mixing",
    "check_qkv",
    "check_varlen_states",
    "default_call_cost_tokens",
    "exclusive_cumsum",
    "normalizer_mode",
    "pad_sequences",
    "run_varlen",
    "sequence_bounds",
    "token_index",
    "unbind_state",
]
