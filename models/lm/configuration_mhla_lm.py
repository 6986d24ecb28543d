"""``MHLALMConfig``: a decoder-only language model with causal MHLA (or any causal registered attention).

Defaults are the paper's 340M model (docs/paper_tables.md#table-6): hidden 1024, 24 layers, 4 heads, key dim
0.5 x hidden (128 per head), value dim 1 x hidden (256 per head), SwiGLU MLP (GLA's ``hidden_ratio`` 4 rule: 2816),
vocab 32000, tied embeddings, context 2048.

The attention is stored once, as ``config.attn``: a dict with the registered attention's ``name`` and its layer
options (:mod:`mhla.registry`; the layers of :mod:`mhla.layers`). What is not given takes the paper's language-
model setting for that attention (:data:`LM_ATTENTION_DEFAULTS`), every difference from the authors' release
(docs/method.md#language-model) named:

| option | default (ours; the paper where it is explicit) | release |
|---|---|---|
| ``normalize`` | ``False`` + ``out_norm`` (output RMSNorm; the paper's LM setting) | same |
| ``mixing_init`` | ``"uniform"`` (1/(i+1) over past chunks; chosen on MQAR, ``results/mqar/``); the paper's causal ``"locality"`` is an option | ``"uniform"`` |
| ``gate`` | ``True``: RMSNorm(o) * swish(W_g x); Table 6's "340M" is reached only with it (341.2M; 316.0M without) | same |
| ``rope`` | ``"after_feature_map"`` (the paper is silent; the release's placement) | same |
| ``block_size`` | 64 tokens per chunk (``"auto"``: the smallest power of two >= sqrt(context)) | 64 |
| ``max_learned_blocks`` | learned mixing rows = context / block_size; longer inputs extend by ``mixing_extension`` | hard cap at 2048 tokens |
| ``mixing_extension`` | ``"uniform_far"``: rows past the learned ones repeat the last one by distance, the far past shares one coefficient (``results/language/length_extrapolation.md``) | none (capped) |
| ``mixing_param`` | ``"clamp"`` (paper); ``"log"`` and ``"softplus"`` are options | clamp |
| ``mixing_max`` | 1: the clamp's upper bound (the paper clips to (0, 1)) | 1 |
| ``write_gate`` | none; ``"relu"`` / ``"relu_leaky_grad"`` / ``"sigmoid"`` / ``"hard_concrete"``: a learned gate per head on each token's write into the state (beyond the paper; ``docs/long_context.md``) | none |

``out_norm`` follows ``normalize`` unless it is given (``out_norm = not normalize``; with the swish gate, whose
``RMSNorm(o) * swish(W_g x)`` has its own output norm, it is left unset). The mixing matrix's
learning rate is not a model field (``optim.mixing_lr_scale``): the LM tasks train it at the full lr, as the
paper and the release do (``results/language/mixing_lr.md``); ``task=mqar`` keeps lr x 0.01.

``rope``: ``"after_feature_map"`` rotates phi(q), phi(k) (release), ``"before_feature_map"`` rotates q, k before phi
(keeps phi's outputs nonnegative), ``"none"`` (no rotary embedding; :data:`mhla.rope.ROPE_PLACEMENTS`). Softmax
attention rotates q, k for either placement.

Configs saved before the attention was one dict (``attn_type`` plus flat ``feature_map``, ``mixing_init``, ...
fields) load through :func:`attention_from_legacy_fields`, the one mapping (a committed checkpoint of that format
is loaded in ``tests/models/test_lm_model.py``).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from mhla.layouts import ceil_div
from mhla.lm_attention import LM_ATTENTION_DEFAULTS, complete_lm_attention  # noqa: F401 (models.lm exports them)
from mhla.registry import AttentionContract, Needs, accepted_options, get_attention_class
from mhla.rope import ROPE_PLACEMENTS  # noqa: F401 (models.lm exports it)

# Options the model sets itself when it builds each block's attention.
LM_FIXED_OPTIONS = ("causal", "head_dim", "value_dim", "qkv_bias", "proj_bias", "grid", "num_prefix_tokens",
                    "projections", "device", "dtype")

# configs saved before ``attn`` existed: flat field -> attention option (the one mapping: the transformers config
# here, and tasks.common.config.upgrade_config for the train.py configs of then)
LEGACY_ATTENTION_FIELDS = {
    "feature_map": "feature_map", "normalize": "normalize", "output_gate": "gate", "rope": "rope",
    "mixing_init": "mixing_init", "mixing_per_head": "mixing_per_head", "mixing_param": "mixing_param",
    "mixing_learnable": "mixing_learnable", "mixing_extension": "mixing_extension", "qk_norm": "qk_norm",
    "cpe": "cpe", "cpe_kernel": "cpe_kernel", "short_conv": "short_conv", "attn_backend": "backend",
    "block_size": "block_size", "max_learned_blocks": "max_learned_blocks"}


def swiglu_intermediate(hidden_size: int, hidden_ratio: float = 4.0, multiple_of: int = 256) -> int:
    """GLA/fla's SwiGLU width: ``multiple_of * ceil(int(2/3 * hidden_ratio * hidden) / multiple_of)`` (1024 -> 2816)."""
    inner = int(hidden_size * hidden_ratio * 2 / 3)
    return multiple_of * ceil_div(inner, multiple_of)


def attention_contract(model_cfg) -> AttentionContract:
    """What the language model of ``model_cfg`` asks of its attention (``model.arch``): ``mhla_lm`` (ours) a causal
    registered attention with a decode cache and packed sequences, with the paper's LM defaults
    (:data:`LM_ATTENTION_DEFAULTS`); ``llama`` (Transformer++) its own softmax attention."""
    name = f"model={model_cfg.get('name', 'lm')}"
    arch = model_cfg.get("arch", "mhla_lm")
    needs = Needs(causal=True, decoding=True, varlen=True, rope=True)
    if arch == "llama":
        return AttentionContract(model=name, needs=needs, native_only=True,
                                 native={"softmax": "transformers' LlamaAttention (Transformer++)"})
    if arch != "mhla_lm":
        raise ValueError(f"model.arch={arch} is trained outside train.py (flash-linear-attention / flame; see the "
                         "cell's config); train.py builds model.arch=mhla_lm (any causal attention) or llama")
    context = int(model_cfg.get("max_position_embeddings") or 2048)
    return AttentionContract(model=name, needs=needs, defaults={k: dict(v) for k, v in LM_ATTENTION_DEFAULTS.items()},
                             fixed=LM_FIXED_OPTIONS, probes=(({"causal": True}, {}),),
                             prepare=lambda options: complete_lm_attention(options, context))


def attention_from_legacy_fields(kwargs: dict) -> dict:
    """The ``attn`` dict of a config saved with ``attn_type`` and flat attention fields (pops them from
    ``kwargs``); options the attention does not take are dropped (the old config stored every field for every
    attention type), and ``out_norm`` follows ``normalize`` as it did then."""
    name = kwargs.pop("attn_type")
    accepted = accepted_options(get_attention_class(name))
    attn = {"name": name}
    for old, new in LEGACY_ATTENTION_FIELDS.items():
        if old in kwargs:
            value = kwargs.pop(old)
            if accepted is None or new in accepted:
                attn[new] = value
    return attn


class MHLALMConfig(PretrainedConfig):
    """Config of :class:`models.lm.MHLALMForCausalLM` (``model_type = "mhla_lm"``).

    Args:
        attn: the attention of every block: a name (``"mhla"``, ``"linear"``, ``"softmax"``, ...) or a dict with
            ``name`` and layer options; unset options take :data:`LM_ATTENTION_DEFAULTS` (module docstring).
            Stored complete.
        vocab_size, hidden_size, num_hidden_layers, num_heads: sizes.
        key_dim_ratio / value_dim_ratio: total key (query) / value width as a fraction of ``hidden_size``
            (GLA's ``expand_k`` / ``expand_v``); per-head dims are these widths / ``num_heads``.
        intermediate_size: SwiGLU width (None: :func:`swiglu_intermediate`).
        max_position_embeddings: the training context (MHLA learns context / block_size mixing rows; no cap).
        trained_context: the longest context a training row read (state passed over longer documents; None: the
            training context): resolves ``attn["mixing_extension"] = "uniform_far:auto"``
            (:func:`mhla.lm_attention.complete_lm_attention`). Stored.
        rope_theta: base of the rotary embedding (used when ``attn["rope"]`` is not ``"none"``).
        rms_norm_eps, initializer_range, tie_word_embeddings: as in Llama.
    """

    model_type = "mhla_lm"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        attn: dict | str | None = None,
        vocab_size: int = 32000,
        hidden_size: int = 1024,
        num_hidden_layers: int = 24,
        num_heads: int = 4,
        key_dim_ratio: float = 0.5,
        value_dim_ratio: float = 1.0,
        intermediate_size: int | None = None,
        max_position_embeddings: int = 2048,
        trained_context: int | None = None,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        tie_word_embeddings: bool = True,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        pad_token_id: int | None = None,
        **kwargs,
    ):
        if "attn_type" in kwargs:
            if attn is not None:
                raise ValueError("pass attn (the attention dict) or the legacy attn_type fields, not both")
            attn = attention_from_legacy_fields(kwargs)
        legacy = sorted(set(kwargs) & set(LEGACY_ATTENTION_FIELDS))
        if legacy:
            raise ValueError(f"{legacy} are options of the attention: pass attn={{'name': ..., {legacy[0]!r}: ...}}")
        attn = {"name": attn} if isinstance(attn, str) else dict(attn or {"name": "mhla"})
        self.attn = complete_lm_attention(attn, max_position_embeddings, trained_context)
        self.trained_context = trained_context
        key_dim, value_dim = int(hidden_size * key_dim_ratio), int(hidden_size * value_dim_ratio)
        if key_dim % num_heads or value_dim % num_heads:
            raise ValueError(f"key dim {key_dim} and value dim {value_dim} must be divisible by num_heads={num_heads}")
        if self.attn["rope"] != "none" and (key_dim // num_heads) % 2:
            raise ValueError(f"RoPE needs an even per-head key dim, got {key_dim // num_heads}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_heads = num_heads
        self.num_attention_heads = num_heads  # the name transformers utilities look for
        self.key_dim_ratio = key_dim_ratio
        self.value_dim_ratio = value_dim_ratio
        self.intermediate_size = intermediate_size or swiglu_intermediate(hidden_size)
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs)

    @property
    def attn_name(self) -> str:
        return self.attn["name"]

    @property
    def uses_rope(self) -> bool:
        return self.attn.get("rope", "none") != "none"

    @property
    def head_dim(self) -> int:
        """Per-head query/key dim."""
        return int(self.hidden_size * self.key_dim_ratio) // self.num_heads

    @property
    def head_value_dim(self) -> int:
        return int(self.hidden_size * self.value_dim_ratio) // self.num_heads
