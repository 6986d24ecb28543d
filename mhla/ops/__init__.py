"""Functional ops. Layout everywhere: ``[batch, seq, heads, dim]``."""

from .api import BACKENDS, mhla_attention, resolve_backend
from .causal import MHLAState, init_state, mhla_causal_torch, mhla_decode_step
from .linear import linear_attention, softmax_attention
from .noncausal import mhla_noncausal_torch
from .reference import (
    linear_attention_reference,
    mhla_attention_matrix,
    mhla_effective_weights,
    mhla_reference,
)

__all__ = [
    "BACKENDS",
    "MHLAState",
    "init_state",
    "linear_attention",
    "linear_attention_reference",
    "mhla_attention",
    "mhla_attention_matrix",
    "mhla_causal_torch",
    "mhla_decode_step",
    "mhla_effective_weights",
    "mhla_noncausal_torch",
    "mhla_reference",
    "resolve_backend",
    "softmax_attention",
]
