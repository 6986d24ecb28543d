"""transformers adapter: a registered attention inside a Llama-architecture decoder, between its own
projections.

    from transformers import LlamaConfig, LlamaForCausalLM
    import mhla
    model = LlamaForCausalLM(LlamaConfig(...))       # trained with softmax
    mhla.convert(model, attn="mhla")                  # every layer's self_attn -> the adapter
    model.generate(input_ids, max_new_tokens=32)      # transformers' API, decoded with MHLA's state

:class:`LlamaAttentionAdapter` replaces one ``LlamaAttention`` (``model.model.layers[i].self_attn``). It keeps
the host's ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj`` (the same ``nn.Linear`` objects, so the state
dict keeps Llama's names) and runs the registered layer's :meth:`~mhla.layers.AttentionBase.attend` between
them, built with ``projections=False`` (as the diffusers adapter does):

    q, k, v = q_proj(x), k_proj(x), v_proj(x)      # [B, T, H, D]; grouped k / v heads repeated to H (GQA)
    o = layer.attend(q, k, v, rope_tables=the model's (cos, sin), cache=this layer's state)
    y = o_proj(layer.finish_heads(o).flatten(heads))

RoPE. ``LlamaAttention`` rotates q and k itself with the ``position_embeddings = (cos, sin)`` the model
computes once per forward (half-split, ``rotate_half``). The adapter does not rotate: it hands those tables to
the layer as :class:`mhla.rope.RotaryTables` (``interleaved=False``, the same layout), and the layer applies
them at its ``rope`` placement: softmax rotates q and k (exactly Llama's attention), MHLA / linear attention
rotate ``phi(q), phi(k)`` (``"after_feature_map"``, the LM default here and in the release) or ``q, k`` before
the feature map (``"before_feature_map"``).

Decoding. transformers hands every layer the model's cache (``DynamicCache``). On its first call with a cache
the adapter puts a :class:`AdapterCacheLayer` in that cache's slot for its ``layer_idx``: it holds the layer's
:class:`mhla.layers.AttentionCache` (MHLA's block summaries, linear attention's ``(S, z)``, softmax's ``(k,
v)``) and counts the tokens consumed, which is what transformers reads for positions and masks. Greedy
decoding, sampling and beam search (the state is reordered with the beams) work; padded batches do not (a 4-D
mask other than the plain causal one raises), and neither do caches that are not a ``DynamicCache``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from transformers.cache_utils import CacheLayerMixin

from ..layers import AttentionBase, AttentionCache
from ..rope import RotaryTables


def map_tensors(obj, fn):
    """``fn`` on every tensor of an attention state (tensors, tuples / lists, dataclasses such as MHLAState;
    batch dim 0)."""
    if obj is None:
        return None
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(o, fn) for o in obj)
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj)
                                           if torch.is_tensor(getattr(obj, f.name))})
    return obj


class StateCacheLayer(CacheLayerMixin):
    """A transformers cache layer that holds an attention layer's own decode state: ``state``
    (:class:`mhla.layers.AttentionCache`, written by the attention layer itself) and ``seen``, the tokens
    consumed (what the model reads as the past length). The shared base of the LM's cache layer
    (``models.lm.modeling_mhla_lm.MHLALMCacheLayer``) and of a converted Llama's (:class:`AdapterCacheLayer`)."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self):
        super().__init__()
        self.state = AttentionCache()
        self.seen = 0

    def lazy_initialization(self, key_states, value_states) -> None:  # the attention layer creates the state
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} is updated by its attention layer through .state")

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


class AdapterCacheLayer(StateCacheLayer):
    """One converted layer's slot in a transformers ``Cache`` (:class:`StateCacheLayer`), initialised at once."""

    def __init__(self):
        super().__init__()
        self.is_initialized = True

    def _map(self, fn) -> None:
        self.state = AttentionCache(attn=map_tensors(self.state.attn, fn),
                                    conv=map_tensors(self.state.conv, fn))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("a converted layer's state cannot be cropped (assisted decoding is "
                                      "unsupported)")


def _layer_slot(cache, layer_idx: int) -> AdapterCacheLayer:
    """This layer's :class:`AdapterCacheLayer` in ``cache`` (created on first use, replacing the cache's
    own)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"a converted Llama layer needs a transformers Cache with .layers (DynamicCache), "
                        f"got {type(cache).__name__}")
    while len(layers) <= layer_idx:
        factory = getattr(cache, "layer_class_to_replicate", None)
        layers.append(factory() if factory is not None else AdapterCacheLayer())
    slot = layers[layer_idx]
    if not isinstance(slot, AdapterCacheLayer):
        if slot.get_seq_length() > 0:
            raise ValueError(f"layer {layer_idx}: the cache already holds keys and values from a softmax "
                             "layer; start generation with an empty cache")
        slot = layers[layer_idx] = AdapterCacheLayer()
    return slot


def _check_causal_mask(mask, T: int) -> None:
    """A 4-D mask ``[B, 1, T, S]`` that says more than "causal" (padding) cannot be honoured; raise then."""
    if mask is None or not torch.is_tensor(mask) or mask.dim() != 4:
        return
    S = mask.shape[-1]
    allowed = mask if mask.dtype == torch.bool else mask == 0
    causal = torch.ones(T, S, dtype=torch.bool, device=mask.device).tril(S - T)
    if not bool((allowed == causal).all()):
        raise ValueError("the converted Llama attention takes unpadded batches only (its attention is causal "
                         "over every token); the attention_mask has padding: run the sequences one at a time")


class LlamaAttentionAdapter(nn.Module):
    """A registered attention (built with ``projections=False, causal=True``) in place of ``LlamaAttention``,
    with the host's projections (module docstring). Same call and return as ``LlamaAttention.forward``:
    ``(hidden_states [B, T, C], position_embeddings=(cos, sin), attention_mask, past_key_values) -> (out,
    None)``.

    Attributes: ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj`` (the host's modules), ``attention`` (the
    registered layer), ``layer_idx``, ``num_heads``, ``num_key_value_groups``, ``head_dim``.
    """

    def __init__(self, host: nn.Module, attention: AttentionBase):
        super().__init__()
        config = host.config
        self.config = config
        self.layer_idx = host.layer_idx
        self.head_dim = host.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = host.num_key_value_groups
        self.is_causal = True
        self.q_proj, self.k_proj = host.q_proj, host.k_proj
        self.v_proj, self.o_proj = host.v_proj, host.o_proj
        if attention.projections or not attention.causal:
            raise ValueError("LlamaAttentionAdapter needs a layer built with projections=False and "
                             "causal=True")
        self.attention = attention

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kwargs):
        B, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, T, -1, self.head_dim)
        k = self.k_proj(hidden_states).view(B, T, -1, self.head_dim)
        v = self.v_proj(hidden_states).view(B, T, -1, self.head_dim)
        # transformers' repeat_kv: query head h reads key / value head h // groups
        if self.num_key_value_groups > 1:
            k = k.repeat_interleave(self.num_key_value_groups, dim=2)
            v = v.repeat_interleave(self.num_key_value_groups, dim=2)
        _check_causal_mask(attention_mask, T)
        tables = None
        if position_embeddings is not None:
            cos, sin = position_embeddings  # [B, T, D], half-split
            tables = RotaryTables(cos.unsqueeze(-2), sin.unsqueeze(-2))
        slot = _layer_slot(past_key_values, self.layer_idx) if past_key_values is not None else None
        o = self.attention.attend(q, k, v, grid=(T,), rope_tables=tables, cache=slot.state if slot else None,
                                  x=hidden_states)
        if slot is not None:
            slot.seen += T
        o = self.attention.finish_heads(o).reshape(B, T, -1).to(hidden_states.dtype)
        return self.o_proj(o), None
