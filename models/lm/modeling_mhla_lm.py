"""A decoder-only language model with causal MHLA, as a transformers model (``AutoModelForCausalLM``).

Block (as GLA / Transformer++): ``h += Attn(RMSNorm(h)); h += SwiGLU(RMSNorm(h))``, final RMSNorm, tied LM
head. The attention is the registered layer ``config.attn`` built through :func:`mhla.registry.build_attention`
(``MultiHeadLinearAttention`` with ``causal=True``, ``LinearAttention``, ``SoftmaxAttention``, ...); the layer
applies the feature map and the rotary tables the model passes with each call (:class:`mhla.rope.RotaryTables`);
this file adds the tables and the model glue.

Decoding: :class:`MHLALMCache` (a transformers ``Cache``) holds one :class:`mhla.layers.AttentionCache` per
layer: the MHLA decode state (:class:`mhla.MHLAState`: at most ``max_learned_blocks - 1`` finished chunks'
summaries, one folded sum of the older ones and the running one: constant size at any length), ``(S, z)`` for
linear attention, the growing ``(k, v)`` for softmax, and the last inputs of the causal CPE and of the short
convolution (``attn.short_conv``); :meth:`MHLALMCache.nbytes` reports its size. A prompt is prefilled in one
chunked call; each new token is one ``mhla_decode_step``. Greedy outputs with the cache equal those without it
(tests), at any length: there is no position cap (mixing coefficients beyond the learned
``max_learned_blocks`` rows extend by the config's ``mixing_extension`` rule, RoPE is computed on the fly).

Padding and packed documents (:class:`PackedBatch`): a 2-D ``attention_mask`` with zeros (left or right
padding, as ``generate()`` and tokenizers make them) or ``cu_seqlens`` (documents packed in a row) turns the
call into one variable-length call (:mod:`mhla.ops.utils.varlen`): the real tokens of every row / document are
packed into ``[1, total, C]`` and attended as if alone (MHLA chunks start at each sequence's first token,
RoPE positions count its real tokens only), so pad tokens change nothing, and the outputs at pad positions
are zeros. The cache then holds one state per sequence (:class:`mhla.layers.AttentionCache`).

Shapes: ``input_ids [B, T]`` -> ``logits [B, T, vocab]``; attention works in ``[B, T, H, D]``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as hf_init
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from mhla.adapters.transformers import StateCacheLayer, map_tensors
from mhla.lm_attention import build_lm_attention  # noqa: F401 (models.lm's blocks build through it)
from mhla.layers import AttentionCache, WriteGate
from mhla.mixing import MixingMatrix
from mhla.ops.utils import token_index
from mhla.rope import RotaryTables

from .configuration_mhla_lm import MHLALMConfig


# ------------------------------------------------------------------------------------------- RoPE
def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float, dtype=torch.float32) -> RotaryTables:
    """Rotary tables for ``positions [T]`` or ``[B, T]`` -> cos, sin ``[T or B x T, 1, dim]`` (fp32 math).

    Half-split layout (``cat([a, a])``, :func:`mhla.rope.apply_rope` with ``interleaved=False``). The rotation
    runs in fp32 (or wider) and returns q / k in their own dtype (``upcast``): under bf16 autocast q and k come
    out of the projections in bf16 beside a bf16 v, and fp32 tables would otherwise promote them to fp32 alone.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)
    ang = positions.float()[..., None] * inv_freq  # [..., T, dim/2]
    ang = torch.cat([ang, ang], dim=-1).unsqueeze(-2)  # [..., T, 1, dim]
    return RotaryTables(ang.cos().to(dtype), ang.sin().to(dtype), upcast=True)


# ------------------------------------------------------------------------------------------ cache
class MHLALMCacheLayer(StateCacheLayer):
    """One layer's decode state: ``state`` (:class:`mhla.layers.AttentionCache`) and the tokens seen.

    ``seen``: the columns consumed (padding included; what transformers counts). ``seq_seen``: after a padded or
    packed call, the real tokens consumed by each of the ``N`` sequences (``[N]``), and ``state`` then holds
    per-sequence lists; None before (every row has consumed ``seen`` tokens).
    """

    def __init__(self):
        super().__init__()
        self.seq_seen: torch.Tensor | None = None

    def reset(self) -> None:
        self.state, self.seen, self.seq_seen = AttentionCache(), 0, None

    def _map(self, fn) -> None:
        self.state = AttentionCache(**{f.name: map_tensors(getattr(self.state, f.name), fn)
                                       for f in dataclasses.fields(self.state)})

    def _reindex(self, rows: torch.Tensor) -> None:
        """Per-sequence cache: keep the sequences ``rows`` (int indices, repeats allowed), in that order."""
        rows = rows.tolist()
        pick = lambda states: [states[i] for i in rows] if isinstance(states, list) else states  # noqa: E731
        self.state = AttentionCache(**{f.name: pick(getattr(self.state, f.name))
                                       for f in dataclasses.fields(self.state)})
        self.seq_seen = self.seq_seen[rows]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.seq_seen is not None:
            return self._reindex(beam_idx)
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.seq_seen is not None:
            return self._reindex(torch.arange(len(self.seq_seen)).repeat_interleave(repeats))
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.seq_seen is not None:
            rows = torch.arange(len(self.seq_seen))[torch.as_tensor(indices, device="cpu")]
            return self._reindex(rows)
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

    def advance(self, num_tokens: int, seq_lengths: torch.Tensor | None = None) -> None:
        """Record that every layer consumed ``num_tokens`` more columns (called once per forward), and, for a
        padded / packed call, ``seq_lengths [N]`` more real tokens per sequence."""
        if seq_lengths is not None:
            seq_seen = self.sequence_seen(len(seq_lengths), seq_lengths.device) + seq_lengths
        for layer in self.layers:
            layer.seen += num_tokens
            if seq_lengths is not None:
                layer.seq_seen = seq_seen

    def sequence_seen(self, num_seqs: int, device=None) -> torch.Tensor:
        """Real tokens consumed by each of ``num_seqs`` sequences, ``[N]`` (int64)."""
        seq_seen = self.layers[0].seq_seen
        if seq_seen is None:  # no padded call yet: every row consumed the same tokens
            return torch.full((num_seqs,), self.get_seq_length(), dtype=torch.long, device=device)
        if len(seq_seen) != num_seqs:
            raise ValueError(f"the cache holds {len(seq_seen)} sequences but this call has {num_seqs}")
        return seq_seen.to(device)

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds, all layers (decode states, KV caches, conv inputs)."""
        return sum(layer.state.nbytes() for layer in self.layers)

    @property
    def is_per_sequence(self) -> bool:
        """True after a padded or packed call: the layers hold one state per sequence."""
        return self.layers[0].seq_seen is not None


# ---------------------------------------------------------------------------------- padding, packing
@dataclasses.dataclass
class PackedBatch:
    """How a ``[B, T]`` batch maps onto one variable-length call over ``[1, total, ...]``.

    Attributes:
        keep: ``[B, T]`` bool, the real tokens (packed in row-major order), or None: every token, the rows
            flattened (documents packed with ``cu_seqlens``).
        cu_seqlens: ``[N + 1]`` int32 offsets of the packed sequences (:mod:`mhla.ops.utils.varlen`).
        shape: ``(B, T)``.
    """

    keep: torch.Tensor | None
    cu_seqlens: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> "PackedBatch":
        """One sequence per row: its tokens where ``mask [B, T]`` is nonzero (left, right or any padding)."""
        keep = mask.bool()
        counts = keep.sum(1)
        return cls(keep, torch.cat([counts.new_zeros(1), counts.cumsum(0)]).int(), tuple(keep.shape))

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, batch: int, length: int) -> "PackedBatch":
        """Documents packed in ``[batch, length]`` rows: ``cu_seqlens`` over the ``batch * length`` flattened
        tokens, including every row start ``b * length`` (no document crosses a row)."""
        if not torch.is_tensor(cu_seqlens) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32,
                                                                                                 torch.int64):
            raise ValueError("cu_seqlens must be a 1-D int32/int64 tensor of document offsets")
        cu = cu_seqlens.tolist()
        missing = sorted(set(range(0, batch * length, length)) - set(cu))
        if cu[0] != 0 or cu[-1] != batch * length or any(b < a for a, b in zip(cu[:-1], cu[1:])) or missing:
            raise ValueError(
                f"cu_seqlens must be non-decreasing offsets over the {batch} x {length} flattened tokens: 0 first, "
                f"{batch * length} last, every row start included (missing: {missing[:4]}); got {cu[:8]}...")
        return cls(None, cu_seqlens.int(), (batch, length))

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, ...]`` -> ``[1, total, ...]``."""
        return (x.flatten(0, 1) if self.keep is None else x[self.keep]).unsqueeze(0)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, total, ...]`` -> ``[B, T, ...]``, zeros at the pad positions."""
        if self.keep is None:
            return x.reshape(*self.shape, *x.shape[2:])
        keep = self.keep.view(*self.shape, *([1] * (x.dim() - 2)))
        return x.new_zeros(*self.shape, *x.shape[2:]).masked_scatter(keep, x[0])

    def positions(self, position_ids: torch.Tensor | None, seen: torch.Tensor) -> torch.Tensor:
        """RoPE positions of the packed tokens, ``[1, total]``: ``position_ids`` (``[B, T]`` or ``[1, T]``)
        at the real tokens, or else each token's index in its sequence after ``seen [N]`` earlier tokens."""
        if position_ids is not None:
            return self.pack(position_ids.expand(*self.shape))
        seq, pos = token_index(self.cu_seqlens)
        return (pos + seen[seq]).unsqueeze(0)


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

    def forward(self, h: torch.Tensor, rope_tables, cache: AttentionCache | None,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """``h [B, T, C]`` (or ``[1, total, C]`` packed at ``cu_seqlens``) -> same shape."""
        h = h + self.attn(self.attn_norm(h), cache=cache, cu_seqlens=cu_seqlens, rope_tables=rope_tables)
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
        elif isinstance(module, WriteGate):  # starts at 1 for every token (the ungated layer)
            hf_init.zeros_(module.weight)
            hf_init.constant_(module.bias, module.initial_bias())


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
        cu_seqlens: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """``input_ids [B, T]`` -> ``last_hidden_state [B, T, C]``.

        Args:
            attention_mask: ``[B, T]`` or ``[B, past + T]`` (transformers' convention), 1 for real tokens and 0
                for padding (left, right or anywhere): the pad tokens are dropped and every row is run alone
                (:class:`PackedBatch`); their hidden states are zeros.
            position_ids: RoPE positions ``[B, T]`` / ``[1, T]``; default: the count of earlier real tokens
                of the sequence (within its document with ``cu_seqlens``).
            cu_seqlens: ``[N + 1]`` offsets of documents packed in the rows, over the ``B * T`` flattened
                tokens and including every row start ``b * T`` (e.g. ``tasks.language.data.doc_cu_seqlens``):
                each document is run alone (states reset at its first token).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
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
        packed = self._packed_batch(attention_mask, cu_seqlens, B, T, h.device, past_key_values)
        if packed is not None:
            h = self._forward_packed(h, packed, position_ids, past_key_values)
            return BaseModelOutputWithPast(last_hidden_state=h, past_key_values=past_key_values)
        rope_tables = None
        if self.config.uses_rope:
            if position_ids is None:
                position_ids = torch.arange(past, past + T, device=h.device)
            rope_tables = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, h.dtype)
        for i, block in enumerate(self.layers):
            state = past_key_values.layer_state(i) if past_key_values is not None else None
            h = block(h, rope_tables, state)
        if past_key_values is not None:
            past_key_values.advance(T)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h), past_key_values=past_key_values)

    @staticmethod
    def _packed_batch(attention_mask, cu_seqlens, B: int, T: int, device,
                      cache: MHLALMCache | None) -> PackedBatch | None:
        """The variable-length form of this call, or None for a plain ``[B, T]`` call (no padding, no documents,
        and a cache without per-sequence states)."""
        mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        if mask is not None and (mask.shape[0] != B or mask.shape[1] < T):
            raise ValueError(
                f"attention_mask {tuple(mask.shape)} must be [B, T] or [B, past + T] for inputs [{B}, {T}]")
        per_sequence = cache is not None and cache.is_per_sequence
        if cu_seqlens is not None:
            if mask is not None and not bool(mask.all()):
                raise ValueError("pass either a padding attention_mask or cu_seqlens (packed documents), not both")
            return PackedBatch.from_cu_seqlens(cu_seqlens, B, T)
        if mask is None:
            return PackedBatch.from_mask(torch.ones(B, T, dtype=torch.bool, device=device)) if per_sequence else None
        new = mask[:, -T:]
        if per_sequence or not bool(new.all()):
            return PackedBatch.from_mask(new)
        if not bool(mask.all()):
            raise ValueError("attention_mask has padding in the past tokens, but the cache was filled without it; "
                             "pass the same mask to every call (generate() does)")
        return None

    def _forward_packed(self, h, packed: PackedBatch, position_ids, cache: MHLALMCache | None) -> torch.Tensor:
        """The layers over the packed real tokens ``[1, total, C]`` of ``h [B, T, C]``; returns the final
        hidden states ``[B, T, C]`` (zeros at pad positions) and advances the cache per sequence."""
        lengths = packed.cu_seqlens.diff().long()
        x = packed.pack(h)
        rope_tables = None
        if self.config.uses_rope:
            seen = cache.sequence_seen(packed.num_seqs, h.device) if cache is not None else lengths * 0
            positions = packed.positions(position_ids, seen)
            rope_tables = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, h.dtype)
        for i, block in enumerate(self.layers):
            state = cache.layer_state(i) if cache is not None else None
            x = block(x, rope_tables, state, packed.cu_seqlens)
        if cache is not None:
            cache.advance(packed.shape[1], lengths)
        return packed.unpack(self.norm(x))


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
        cu_seqlens: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """``labels [B, T]`` are the inputs themselves (shifted inside; -100 is ignored). ``attention_mask``
        (padding) and ``cu_seqlens`` (packed documents): see :meth:`MHLALMModel.forward`; set the labels of
        pad tokens to -100 yourself.

        ``logits_to_keep``: ``n > 0`` keeps the last ``n`` positions, an index tensor those positions, and a
        bool ``[B, T]`` mask gives logits ``[P, V]`` at its ``P`` True positions (MQAR's query positions).
        """
        if labels is not None and use_cache is None:
            use_cache = False
        out = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         cu_seqlens=cu_seqlens)
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
