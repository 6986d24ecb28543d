"""MHLA: Multi-Head Linear Attention (token-level heads), arXiv 2601.07832.

Functional ops use the layout ``[batch, seq, heads, dim]``. Importing this package needs only torch
(and einops); Hydra and W&B are used by the training harness, not here.
"""

from .ops import (
    MHLAState,
    init_state,
    linear_attention,
    mhla_attention,
    mhla_attention_matrix,
    mhla_decode_step,
    mhla_reference,
    softmax_attention,
)

__version__ = "0.1.0"
