"""``MHLALMConfig``: a decoder-only language model with causal MHLA (or linear / softmax attention).

Defaults are the paper's 340M model (docs/paper_tables.md#table-6): hidden 1024, 24 layers, 4 heads, key dim 0.5 x hidden
(128 per head), value dim 1 x hidden (256 per head), SwiGLU MLP (GLA's ``hidden_ratio`` 4 rule: 2816), vocab
32000, tied embeddings, chunks of 64 tokens, context 2048 (M = 32 learned mixing rows).

Paper defaults versus the authors' release (docs/method.md#language-model), every difference a field:

| field | default (ours; the paper where it is explicit) | release |
|---|---|---|
| ``normalize`` | ``False`` + output RMSNorm (the paper's LM setting) | same |
| ``mixing_init`` | ``"uniform"`` (1/(i+1) over past chunks; chosen on MQAR, ``results/mqar/``); the paper's causal ``"locality"`` is an option | ``"uniform"`` |
| ``output_gate`` | ``True``: RMSNorm(o) * swish(W_g x); Table 6's "340M" is reached only with it (341.2M; 316.0M without) | same |
| ``rope`` | ``"after_feature_map"`` (the paper is silent; the release's placement) | same |
| ``max_position_embeddings`` | learned mixing rows = 2048 / 64; longer inputs extend by ``mixing_extension`` | hard cap at 2048 |
| ``mixing_extension`` | ``"uniform_far"``: rows past the learned ones repeat the last one by distance, the far past shares one coefficient (``results/language/length_extrapolation.md``) | none (capped) |
| ``mixing_param`` | ``"clamp"`` (paper); ``"log"`` and ``"softplus"`` are options | clamp |

The mixing matrix's learning rate is not a model field (``optim.mixing_lr_scale``, its own AdamW group in
``train.py``). The LM tasks train it at the full lr, as the paper and the release do: on text it then beats
linear attention on every seed, while at lr x 0.01 it does not move in a short run and MHLA is linear attention
up to scale (``results/language/mixing_lr.md``). ``task=mqar`` keeps lr x 0.01 (``results/mqar/README.md``).

``rope``: ``"after_feature_map"`` rotates phi(q), phi(k) (release), ``"before_feature_map"`` rotates q, k
before phi (keeps phi's outputs nonnegative), ``"none"`` (:data:`mhla.rope.ROPE_PLACEMENTS`; the diffusers
adapter's ``"after"`` / ``"before"`` are accepted and stored under these names). Softmax attention rotates
q, k for either placement. With ``normalize=True`` the normaliser uses the same (rotated) q, k as the
numerator, unlike the diffusers adapter's ``"after_feature_map"``, which normalises with the un-rotated
phi(q), phi(k) (:mod:`mhla.rope`); the default ``normalize=False`` has no normaliser.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from mhla.layouts import ceil_div
from mhla.mixing import EXTENSION_RULES
from mhla.rope import ROPE_PLACEMENTS, rope_placement  # noqa: F401 (ROPE_PLACEMENTS: models.lm exports it)

ATTN_TYPES = ("mhla", "linear", "softmax")


def swiglu_intermediate(hidden_size: int, hidden_ratio: float = 4.0, multiple_of: int = 256) -> int:
    """GLA/fla's SwiGLU width: ``multiple_of * ceil(int(2/3 * hidden_ratio * hidden) / multiple_of)`` (1024 -> 2816)."""
    inner = int(hidden_size * hidden_ratio * 2 / 3)
    return multiple_of * ceil_div(inner, multiple_of)


class MHLALMConfig(PretrainedConfig):
    """Config of :class:`models.lm.MHLALMForCausalLM` (``model_type = "mhla_lm"``).

    Args:
        attn_type: ``"mhla"`` | ``"linear"`` (plain causal linear attention) | ``"softmax"`` (SDPA, same code).
        vocab_size, hidden_size, num_hidden_layers, num_heads: sizes.
        key_dim_ratio / value_dim_ratio: total key (query) / value width as a fraction of ``hidden_size``
            (GLA's ``expand_k`` / ``expand_v``); per-head dims are these widths / ``num_heads``.
        intermediate_size: SwiGLU width (None: :func:`swiglu_intermediate`).
        block_size: MHLA chunk length C. max_position_embeddings: training context; MHLA learns
            ``max_learned_blocks`` (default ``max_position_embeddings // block_size``) mixing rows and extends
            beyond them by ``mixing_extension`` (no length cap anywhere).
        feature_map: phi for MHLA / linear attention (``mhla.feature_maps``). normalize: keep the paper's
            normalizer (``False``: drop it and RMSNorm the output, the paper's LM setting).
        output_gate: GLA-style ``RMSNorm(o) * swish(W_g x)``. rope, rope_theta: rotary embedding placement.
        mixing_init, mixing_per_head, mixing_param, mixing_learnable: see :class:`mhla.mixing.MixingMatrix`.
        mixing_extension: rule for the mixing rows past ``max_learned_blocks`` (:data:`mhla.mixing.EXTENSION_RULES`;
            ``"uniform_far"``; configs saved before this field existed load with it too).
        qk_norm: RMSNorm per head on q and k. cpe / cpe_kernel: causal depthwise conv on V (off).
        short_conv: kernel of a causal depthwise conv + SiLU on the projected q, k and v (fla's
            ``ShortConvolution``, ``conv_size=4`` in GLA / Gated DeltaNet; 0: off, the paper's LM). It lets a
            layer copy the previous tokens into each position, which linear attention cannot do sharply.
            Training and full-sequence evaluation only: cached decoding and packed (``cu_seqlens`` / padded)
            calls raise NotImplementedError.
        rms_norm_eps, initializer_range, tie_word_embeddings: as in Llama.
        attn_backend: op backend (``"auto"`` | ``"torch"`` | ``"triton"`` | ``"reference"``).
    """

    model_type = "mhla_lm"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        attn_type: str = "mhla",
        vocab_size: int = 32000,
        hidden_size: int = 1024,
        num_hidden_layers: int = 24,
        num_heads: int = 4,
        key_dim_ratio: float = 0.5,
        value_dim_ratio: float = 1.0,
        intermediate_size: int | None = None,
        block_size: int = 64,
        max_position_embeddings: int = 2048,
        max_learned_blocks: int | None = None,
        feature_map: str = "relu",
        normalize: bool = False,
        output_gate: bool = True,
        rope: str = "after_feature_map",
        rope_theta: float = 10000.0,
        mixing_init: str = "uniform",
        mixing_per_head: bool = False,
        mixing_param: str = "clamp",
        mixing_learnable: bool = True,
        mixing_extension: str = "uniform_far",
        qk_norm: bool = False,
        cpe: bool = False,
        cpe_kernel: int = 3,
        short_conv: int = 0,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        attn_backend: str = "auto",
        use_cache: bool = True,
        tie_word_embeddings: bool = True,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        pad_token_id: int | None = None,
        **kwargs,
    ):
        if attn_type not in ATTN_TYPES:
            raise ValueError(f"attn_type must be one of {ATTN_TYPES}, got {attn_type!r}")
        rope = rope_placement(rope)
        key_dim, value_dim = int(hidden_size * key_dim_ratio), int(hidden_size * value_dim_ratio)
        if key_dim % num_heads or value_dim % num_heads:
            raise ValueError(f"key dim {key_dim} and value dim {value_dim} must be divisible by num_heads={num_heads}")
        if rope != "none" and (key_dim // num_heads) % 2:
            raise ValueError(f"RoPE needs an even per-head key dim, got {key_dim // num_heads}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.attn_type = attn_type
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_heads = num_heads
        self.num_attention_heads = num_heads  # the name transformers utilities look for
        self.key_dim_ratio = key_dim_ratio
        self.value_dim_ratio = value_dim_ratio
        self.intermediate_size = intermediate_size or swiglu_intermediate(hidden_size)
        self.block_size = block_size
        self.max_position_embeddings = max_position_embeddings
        self.max_learned_blocks = max_learned_blocks or max(1, max_position_embeddings // block_size)
        self.feature_map = feature_map
        self.normalize = normalize
        self.output_gate = output_gate
        self.rope = rope
        self.rope_theta = rope_theta
        self.mixing_init = mixing_init
        self.mixing_per_head = mixing_per_head
        self.mixing_param = mixing_param
        self.mixing_learnable = mixing_learnable
        if mixing_extension not in EXTENSION_RULES:
            raise ValueError(f"mixing_extension must be one of {', '.join(EXTENSION_RULES)}, got {mixing_extension!r}")
        self.mixing_extension = mixing_extension
        self.qk_norm = qk_norm
        self.cpe = cpe
        self.cpe_kernel = cpe_kernel
        if short_conv < 0:
            raise ValueError(f"short_conv must be >= 0 (0: off), got {short_conv}")
        self.short_conv = short_conv
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.attn_backend = attn_backend
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs)

    @property
    def head_dim(self) -> int:
        """Per-head query/key dim."""
        return int(self.hidden_size * self.key_dim_ratio) // self.num_heads

    @property
    def head_value_dim(self) -> int:
        return int(self.hidden_size * self.value_dim_ratio) // self.num_heads
