"""A decoder-only language model with causal MHLA, as a transformers model (``AutoModelForCausalLM``).

Block (as GLA / Transformer++): ``h += Attn(RMSNorm(h)); h += SwiGLU(RMSNorm(h))``, final RMSNorm, tied LM
head. The attention is the library's layer (:mod:`mhla.layers`: ``MultiHeadLinearAttention`` with
``causal=True``, ``LinearAttention`` or ``SoftmaxAttention``); this file only adds RoPE and the model glue.

Decoding: :class:`MHLALMCache` (a transformers ``Cache``) holds one :class:`mhla.layers.AttentionCache` per
layer: the MHLA decode state (:class:`mhla.MHLAState`: every finished chunk's summary plus the running one),
``(S, z)`` for linear attention, the growing ``(k, v)`` for softmax, and the causal CPE's last inputs. A
prompt is prefilled in one chunked call; each new token is one ``mhla_decode_step``. Greedy outputs with the
cache equal those without it (tests), at any length: there is no position cap (mixing coefficients beyond the
learned ``max_learned_blocks`` rows extend by relative distance, RoPE is computed on the fly).

Shapes: ``input_ids [B, T]`` -> ``logits [B, T, vocab]``; attention works in ``[B, T, H, D]``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as hf_init
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from mhla.feature_maps import get_feature_map
from mhla.layers import AttentionCache, LinearAttention, MultiHeadLinearAttention, SoftmaxAttention
from mhla.mixing import MixingMatrix
from mhla.rope import apply_rope, rope_and_feature_map

from .configuration_mhla_lm import MHLALMConfig


# ------------------------------------------------------------------------------------------- RoPE
def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float, dtype=torch.float32):
    """Rotary tables for ``positions [T]`` or ``[B, T]`` -> cos, sin ``[T or B x T, 1, dim]`` (fp32 math).

    Half-split layout (``cat([a, a])``), for :func:`mhla.rope.apply_rope` with ``interleaved=False``.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)
    ang = positions.float()[..., None] * inv_freq  # [..., T, dim/2]
    ang = torch.cat([ang, ang], dim=-1).unsqueeze(-2)  # [..., T, 1, dim]
    return ang.cos().to(dtype), ang.sin().to(dtype)


class _LMAttentionMixin:
    """Makes a library attention layer apply the LM's feature map and RoPE in ``_project``.

    The layer is built with ``feature_map="identity"`` so its ``_core`` sees the final q, k; this mixin
    applies phi and the rotation in the configured order (:func:`mhla.rope.rope_and_feature_map`; the layer's
    normaliser, when ``normalize=True``, sees the same q, k as the numerator: see :mod:`mhla.rope`).
    ``forward_lm`` passes the rotary tables.
    """

    def setup_lm(self, feature_map: str | None, rope: str) -> None:
        self.lm_feature_map = get_feature_map(feature_map) if feature_map else None
        self.lm_rope = rope
        self._rope_tables = None

    def _project(self, x):
        q, k, v = super()._project(x)
        rot = None
        if self._rope_tables is not None:
            cos, sin = self._rope_tables  # half-split tables from rope_cos_sin
            rot = lambda t: apply_rope(t, cos, sin)  # noqa: E731
        q, k, _, _ = rope_and_feature_map(q, k, self.lm_feature_map, rot, self.lm_rope)
        return q, k, v

    def forward_lm(self, x, rope_tables, cache: AttentionCache | None):
        """``x [B, T, C]``, rotary tables for the T positions, optional decode cache -> ``[B, T, C]``."""
        self._rope_tables = rope_tables
        try:
            return self.forward(x, cache=cache)
        finally:
            self._rope_tables = None


class LMMultiHeadLinearAttention(_LMAttentionMixin, MultiHeadLinearAttention):
    """Causal MHLA with the LM's RoPE placement."""


class LMLinearAttention(_LMAttentionMixin, LinearAttention):
    """Causal linear attention with the LM's RoPE placement (the plain linear-attention baseline)."""


class LMSoftmaxAttention(_LMAttentionMixin, SoftmaxAttention):
    """Causal softmax attention (SDPA + KV cache), the same-code control."""


def build_lm_attention(config: MHLALMConfig) -> nn.Module:
    """The attention layer of one block, built from the config."""
    common = dict(
        head_dim=config.head_dim, value_dim=config.head_value_dim, qkv_bias=False, proj_bias=False,
        qk_norm=config.qk_norm, causal=True, cpe=config.cpe, cpe_kernel=config.cpe_kernel,
        gate=config.output_gate, backend=config.attn_backend,
    )
    if config.attn_type == "softmax":
        layer = LMSoftmaxAttention(config.hidden_size, config.num_heads, **common)
        layer.setup_lm(None, config.rope)
        return layer
    common.update(feature_map="identity", normalize=config.normalize, out_norm=not config.normalize)
    if config.attn_type == "linear":
        layer = LMLinearAttention(config.hidden_size, config.num_heads, **common)
    else:
        layer = LMMultiHeadLinearAttention(
            config.hidden_size, config.num_heads, block_size=config.block_size,
            mixing_init=config.mixing_init, mixing_learnable=config.mixing_learnable,
            mixing_per_head=config.mixing_per_head, mixing_param=config.mixing_param,
            max_learned_blocks=config.max_learned_blocks, **common)
    layer.setup_lm(config.feature_map, config.rope)
    return layer


# ------------------------------------------------------------------------------------------ cache
def _map_tensors(obj, fn):
    """Apply ``fn`` to every tensor in an attention state (MHLAState, tuples, tensors; batch dim 0)."""
    if obj is None:
        return None
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: _map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj)
                                           if torch.is_tensor(getattr(obj, f.name))})
    return obj


class MHLALMCacheLayer(CacheLayerMixin):
    """One layer's decode state: ``state`` (:class:`mhla.layers.AttentionCache`) and the tokens seen."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self):
        super().__init__()
        self.state = AttentionCache()
        self.seen = 0

    def lazy_initialization(self, key_states, value_states) -> None:  # state is created by the layer itself
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("MHLALMCacheLayer is updated by the attention layer through .state")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def offload(self):
        pass

    def prefetch(self):
        pass

    def reset(self) -> None:
        self.state, self.seen = AttentionCache(), 0

    def _map(self, fn) -> None:
        self.state = AttentionCache(attn=_map_tensors(self.state.attn, fn), conv=_map_tensors(self.state.conv, fn))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("a recurrent MHLA state cannot be cropped (assisted decoding is unsupported)")


class MHLALMCache(Cache):
    """Per-layer decode state of :class:`MHLALMForCausalLM` (MHLA state, linear ``(S, z)`` or softmax KV)."""

    def __init__(self, config: MHLALMConfig | None = None, num_layers: int | None = None):
        n = num_layers if num_layers is not None else config.num_hidden_layers
        super().__init__(layers=[MHLALMCacheLayer() for _ in range(n)])

    def layer_state(self, layer_idx: int) -> AttentionCache:
        return self.layers[layer_idx].state

    def advance(self, num_tokens: int) -> None:
        """Record that every layer consumed ``num_tokens`` more tokens (called once per forward)."""
        for layer in self.layers:
            layer.seen += num_tokens


# ------------------------------------------------------------------------------------------ model
class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: ``[B, T, C] -> [B, T, C]``."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MHLALMBlock(nn.Module):
    def __init__(self, config: MHLALMConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = build_lm_attention(config)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, h: torch.Tensor, rope_tables, cache: AttentionCache | None) -> torch.Tensor:
        h = h + self.attn.forward_lm(self.attn_norm(h), rope_tables, cache)
        return h + self.mlp(self.mlp_norm(h))


class MHLALMPreTrainedModel(PreTrainedModel):
    config_class = MHLALMConfig
    config: MHLALMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["MHLALMBlock"]
    _skip_keys_device_placement = ["past_key_values"]

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, MixingMatrix):
            hf_init.copy_(module.raw, module.initial_raw().to(module.raw.dtype))


class MHLALMModel(MHLALMPreTrainedModel):
    """Embeddings + blocks + final norm: ``input_ids [B, T]`` -> ``last_hidden_state [B, T, C]``."""

    def __init__(self, config: MHLALMConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(MHLALMBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: MHLALMCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            raise NotImplementedError(
                "padding masks are not supported: linear-attention states would absorb the pad tokens; "
                "batch prompts of equal length (or generate one prompt at a time)")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = h.shape[:2]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if past_key_values is not None and not isinstance(past_key_values, MHLALMCache):
            if past_key_values.get_seq_length() > 0:
                raise TypeError(f"MHLALM needs an MHLALMCache, got a filled {type(past_key_values).__name__}")
            past_key_values = None  # an empty default cache handed in by generate(): replace it
        if use_cache and past_key_values is None:
            past_key_values = MHLALMCache(self.config)
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        rope_tables = None
        if self.config.rope != "none":
            if position_ids is None:
                position_ids = torch.arange(past, past + T, device=h.device)
            rope_tables = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, h.dtype)
        for i, block in enumerate(self.layers):
            state = past_key_values.layer_state(i) if past_key_values is not None else None
            h = block(h, rope_tables, state)
        if past_key_values is not None:
            past_key_values.advance(T)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h), past_key_values=past_key_values)


class MHLALMForCausalLM(MHLALMPreTrainedModel, GenerationMixin):
    """:class:`MHLALMModel` + tied LM head. ``model(input_ids, labels=input_ids)`` -> loss (next token), logits."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MHLALMConfig):
        super().__init__(config)
        self.model = MHLALMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """generate(): use an :class:`MHLALMCache` unless the caller passed a cache or use_cache=False."""
        if model_kwargs.get("past_key_values") is not None:
            model_kwargs["past_key_values"]._is_user_defined = True
            return
        if generation_config.use_cache is False:
            return
        model_kwargs["past_key_values"] = MHLALMCache(self.config)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: MHLALMCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """``labels [B, T]`` are the inputs themselves (shifted inside; -100 is ignored).

        ``logits_to_keep``: ``n > 0`` keeps the last ``n`` positions, an index tensor those positions, and a
        bool ``[B, T]`` mask gives logits ``[P, V]`` at its ``P`` True positions (MQAR's query positions).
        """
        if labels is not None and use_cache is None:
            use_cache = False
        out = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache)
        h = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            h = h[:, -logits_to_keep:]
        elif torch.is_tensor(logits_to_keep) and logits_to_keep.dtype == torch.bool and logits_to_keep.dim() == 2:
            h = h[logits_to_keep]  # a [B, T] mask: logits [P, V] at its P True positions
        elif torch.is_tensor(logits_to_keep):
            h = h[:, logits_to_keep]
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)
