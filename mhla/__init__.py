"""MHLA: Multi-Head Linear Attention (token-level heads), arXiv 2601.07832.

Functional ops use the layout ``[batch, seq, heads, dim]``. Importing this package needs only torch;
Hydra and W&B are used by the training harness, not here.

    import mhla
    o = mhla.mhla_attention(q, k, v, mixing, block_size)                 # non-causal
    o, state = mhla.mhla_attention(q, k, v, mixing, 64, causal=True, output_final_state=True)
    layer = mhla.build_attention({"name": "mhla", "num_blocks": 16}, dim=192, num_heads=3, grid=(16, 16))
    model = mhla.convert(trained_softmax_model, attn="mhla")   # keep its weights, swap the attention
"""

# (registers focused, inline, mala, rala, gla and the cross-attentions; .layers the other three)
from . import baselines, cross, gla  # noqa: F401
from .conversion import convert
from .feature_maps import FEATURE_MAPS, get_feature_map
from .layers import (
    AttentionBase,
    AttentionCache,
    KernelAttention,
    LinearAttention,
    MultiHeadLinearAttention,
    SoftmaxAttention,
)
from .layouts import BlockLayout, layout_1d, layout_2d, layout_3d, layout_from_num_blocks
from .mixing import CrossMixingMatrix, MixingMatrix, distances_1d, mixing_init
from .ops import (
    MHLAState,
    MixingRows,
    init_state,
    linear_attention,
    mhla_attention,
    mhla_attention_matrix,
    mhla_decode_step,
    mhla_reference,
    softmax_attention,
)
from .registry import (
    AttentionContract,
    Needs,
    Supports,
    build_attention,
    list_attentions,
    register_attention,
    resolve_attention,
)
from .rope import RotaryTables

__version__ = "0.1.0"

__all__ = [
    "AttentionBase", "AttentionCache", "AttentionContract", "BlockLayout", "CrossMixingMatrix",
    "FEATURE_MAPS", "KernelAttention",
    "LinearAttention", "MHLAState", "MixingMatrix", "MixingRows", "MultiHeadLinearAttention", "Needs",
    "RotaryTables", "SoftmaxAttention", "Supports", "build_attention", "convert", "distances_1d",
    "get_feature_map", "init_state", "layout_1d", "layout_2d", "layout_3d", "layout_from_num_blocks",
    "linear_attention", "list_attentions", "mhla_attention", "mhla_attention_matrix", "mhla_decode_step",
    "mhla_reference", "mixing_init", "register_attention", "resolve_attention", "softmax_attention",
]
