"""diffusers adapter: run any registered attention (MHLA, linear, ...) in the self-attention of a diffusers model.

    from mhla.adapters.diffusers import swap_self_attention, hybrid_layers
    # Wan2.1 (3-D latent grid), all 30 self-attention layers, M = 7 x 3 x 5 = 105 blocks:
    names = swap_self_attention(wan, {"name": "mhla", "blocks": [7, 3, 5], "normalize": False, "out_norm": True,
                                      "rope": "after_feature_map"})
    # hybrid: the layers of hybrid_layers() get MHLA, the others keep their softmax processor
    names = swap_self_attention(wan, {"name": "mhla", "blocks": [7, 3, 5]}, layers=hybrid_layers(30))
    # SANA (2-D latent grid, NoPE): attn1 only (cross-attention is never touched by swap_self_attention)
    names = swap_self_attention(sana, {"name": "mhla", "num_blocks": 16}, grid=(32, 32))
    # cross-attention (attn2: queries from the latents, keys / values from the text), the same way:
    names = swap_cross_attention(sana, {"name": "mhla_cross", "blocks": [4, 4], "key_blocks": 4})

One code path. :func:`swap_self_attention` builds the registered layer (:func:`mhla.registry.build_attention`)
with ``projections=False`` and registers it ON THE DIFFUSERS ATTENTION MODULE as ``<attn>.attention``, so its
parameters (MHLA's mixing matrix ``<attn>.attention.mixing.raw``, the per-head output RMSNorm
``<attn>.attention.out_norm.weight``) train, save and load with the model's state dict. The processor,
:class:`AttentionProcessor`, keeps the host's projections (``to_q`` / ``to_k`` / ``to_v`` or a fused ``to_qkv``,
``norm_q`` / ``norm_k``, ``to_out``) and runs everything between them through the layer's own
:meth:`mhla.layers.AttentionBase.attend` and :meth:`~mhla.layers.AttentionBase.finish_heads`: the same feature
map, rotary placement, block layout, mixing and normaliser as :class:`mhla.layers.MultiHeadLinearAttention` in
a ViT, a DiT or the language model (``tests/layers/test_diffusers_adapter.py`` checks the two against each other).

What the processor computes for ``hidden_states x: [B, N, C]`` (grid tokens in raster order, frame-major
``(f, h, w)`` for video, ``(h, w)`` for images):

    q, k, v = to_q(x), to_k(x), to_v(x)             # or to_qkv(x).chunk(3)
    q, k    = norm_q(q), norm_k(k)                   # the module's q/k norms (across heads or per head)
    o = layer.attend(q, k, v [B, N, H, D], grid=..., rope_tables=the model's rotary tables (Wan))
    o = layer.finish_heads(o, x)                     # per-head output RMSNorm (out_norm=True); a gate:
                                                     # o * swish(W_g x), W_g the layer's (gate=true)
    y = to_out[1](to_out[0](o.flatten(heads)))

Token grid. The layout needs the token grid ``(F, H, W)`` / ``(H, W)`` of each call; diffusers passes only
``[B, N, C]`` to the processor. Sources, first match wins: a 4-D ``hidden_states [B, C, H, W]`` (generic
``Attention`` accepts that); the ``grid`` fixed at :func:`swap_self_attention` when ``track_grid=False``;
otherwise a forward pre-hook that :func:`swap_self_attention` installs on the top-level model reads the
model input ``[B, C, (F,) H, W]`` and ``model.config.patch_size`` (int or tuple) and records the patch grid
for every processor of that model (so one model runs at any resolution the blocks tile: the block grid is
fixed, the block shape follows the grid).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from . import select_layers
from ..cross import CrossAttentionBase
from ..layers import AttentionBase
from ..registry import build_attention, get_attention_class
from ..rope import RotaryTables


# --------------------------------------------------------------------------------------- layers
def hybrid_layers(num_layers: int, softmax_every: int = 3, softmax_offset: int = 2) -> list[int]:
    """Indices of the layers that get the new attention in a hybrid model: all but ``i % softmax_every ==
    softmax_offset`` (those keep softmax). Default: every third layer keeps softmax (2, 5, 8, ...), so 2/3 of the
    layers use MHLA (the paper's Wan2.1 hybrid replaces "2/3 of the layers" without saying which)."""
    if softmax_every < 1 or not 0 <= softmax_offset < softmax_every:
        raise ValueError(f"need softmax_every >= 1 and 0 <= softmax_offset < softmax_every, got "
                         f"{softmax_every}, {softmax_offset}")
    return [i for i in range(num_layers) if i % softmax_every != softmax_offset]


# ------------------------------------------------------------------------------------ processor
@dataclass
class GridContext:
    """The latent token grid of the current forward pass, shared by the processors of one model."""

    grid: tuple[int, ...] | None = None


def _norm_width(norm: nn.Module) -> int | None:
    """Width a q/k norm normalises over (``None`` when it does not say, e.g. an L2 norm)."""
    for attr in ("normalized_shape", "dim"):
        shape = getattr(norm, attr, None)
        if isinstance(shape, (tuple, list, torch.Size)) and len(shape):
            return int(shape[-1])
    w = getattr(norm, "weight", None)
    return int(w.shape[-1]) if isinstance(w, torch.Tensor) else None


def _apply_qk_norm(norm, x: torch.Tensor, heads: int) -> torch.Tensor:
    """``x: [B, N, H*D]`` -> normed ``[B, N, H, D]``; a norm over ``H*D`` acts across heads, else per head."""
    if norm is None:
        return x.unflatten(-1, (heads, -1))
    if _norm_width(norm) == x.shape[-1]:
        return norm(x).unflatten(-1, (heads, -1))
    return norm(x.unflatten(-1, (heads, -1)))


class AttentionProcessor:
    """diffusers attention processor that runs the registered layer ``attn.attention`` between the host
    module's projections (module docstring).

    Args:
        grid: fixed token grid; else the model's :class:`GridContext` (``context``) or a 4-D input.
        context: the grid tracked from the model input (:func:`swap_self_attention` installs it).

    Call signature (diffusers): ``(attn, hidden_states [B, N, C] or [B, C, H, W], encoder_hidden_states=None,
    attention_mask=None, rotary_emb=None)`` -> ``[B, N, C]`` (or ``[B, C, H, W]``). Cross-attention
    (``encoder_hidden_states``) and attention masks raise ``ValueError``: this processor is for
    self-attention only. ``rotary_emb``: the model's ``(cos, sin)`` tables with interleaved pairs (Wan's
    ``[1, N, 1, D]``), applied where the layer's ``rope`` option says.
    """

    def __init__(self, grid: Sequence[int] | None = None, context: GridContext | None = None):
        self.grid = tuple(int(g) for g in grid) if grid is not None else None
        self.context = context

    def __repr__(self) -> str:
        return f"AttentionProcessor(grid={self.grid})"

    def token_grid(self, num_tokens: int, grid_4d=None, needs_grid: bool = True) -> tuple[int, ...]:
        """The grid of this call: 4-D input, else the fixed grid, else the model's context, else ``(N,)``
        when the layer has no block layout (``needs_grid=False``)."""
        grid = grid_4d or self.grid or (self.context.grid if self.context is not None else None)
        if grid is None and not needs_grid:
            return (num_tokens,)
        if grid is None:
            raise ValueError(
                "AttentionProcessor does not know the token grid: call swap_self_attention(model, ...) on the "
                "top-level model (it tracks the grid from the model input and config.patch_size), or pass "
                "grid=(F, H, W) / (H, W)")
        if math.prod(grid) != num_tokens:
            raise ValueError(f"the token grid {tuple(grid)} holds {math.prod(grid)} tokens but the attention "
                             f"got {num_tokens}; is the model's input size consistent with its patch size?")
        return tuple(grid)

    @staticmethod
    def project(attn, x: torch.Tensor):
        """``x [B, N, C]`` -> q, k, v ``[B, N, H, D]`` (q, k normed by the module's norms)."""
        if getattr(attn, "fused_projections", False) and hasattr(attn, "to_qkv"):
            q, k, v = attn.to_qkv(x).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
        heads = attn.heads
        q = _apply_qk_norm(getattr(attn, "norm_q", None), q, heads)
        k = _apply_qk_norm(getattr(attn, "norm_k", None), k, heads)
        return q, k, v.unflatten(-1, (heads, -1))

    @staticmethod
    def tokens(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Size | None]:
        """``[B, N, C]`` tokens and the ``[B, C, H, W]`` shape they came in (generic Attention accepts it), or
        None."""
        if hidden_states.dim() == 4:
            return hidden_states.flatten(2).transpose(1, 2), hidden_states.shape
        return hidden_states, None

    @staticmethod
    def output(attn, o: torch.Tensor, residual: torch.Tensor, shape_4d: torch.Size | None) -> torch.Tensor:
        """The host module's tail on the heads ``o`` (``[B, N, H, dv]``): ``to_out``, its residual connection
        and output rescale, and the ``[B, C, H, W]`` shape back where the input had it."""
        y = attn.to_out[0](o.flatten(2).to(residual.dtype))
        if len(attn.to_out) > 1:
            y = attn.to_out[1](y)
        if getattr(attn, "residual_connection", False):
            y = y + residual
        y = y / getattr(attn, "rescale_output_factor", 1.0)
        if shape_4d is not None:
            y = y.transpose(1, 2).reshape(shape_4d)
        return y

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb=None, image_rotary_emb=None,
                 **kwargs) -> torch.Tensor:
        if encoder_hidden_states is not None:
            raise ValueError("AttentionProcessor is for self-attention; this module got encoder_hidden_states "
                             "(cross-attention keeps its own processor)")
        if attention_mask is not None:
            raise ValueError("AttentionProcessor does not take an attention_mask")
        layer: AttentionBase = attn.attention
        rotary_emb = rotary_emb if rotary_emb is not None else image_rotary_emb
        x, shape_4d = self.tokens(hidden_states)
        residual = x
        grid = self.token_grid(x.shape[1], tuple(shape_4d[2:]) if shape_4d is not None else None,
                               needs_grid=getattr(layer, "blocks", None) is not None)
        q, k, v = self.project(attn, x)
        tables = RotaryTables(*rotary_emb, interleaved=True, upcast=True) if rotary_emb is not None else None
        o = layer.finish_heads(layer.attend(q, k, v, grid=grid, rope_tables=tables, x=x), x)
        return self.output(attn, o, residual, shape_4d)


# -------------------------------------------------------------------------------------- swapping
def self_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every diffusers self-attention module of ``model``, in definition order.

    A module counts when it has ``set_processor`` and ``to_q`` and is not a cross-attention
    (``is_cross_attention`` false). In Wan / SANA / PixArt these are the ``attn1`` of each block.
    """
    out = []
    for name, m in model.named_modules():
        if hasattr(m, "set_processor") and hasattr(m, "to_q") and not getattr(m, "is_cross_attention", False):
            out.append((name, m))
    return out


def _patch_grid(model: nn.Module, x: torch.Tensor) -> tuple[int, ...] | None:
    """Token grid of a model input ``x [B, C, (F,) H, W]`` from ``model.config.patch_size``."""
    config = getattr(model, "config", None)
    patch = getattr(config, "patch_size", None) if config is not None else None
    if patch is None or not torch.is_tensor(x) or x.dim() < 4:
        return None
    spatial = tuple(x.shape[2:])
    patch = (int(patch),) * len(spatial) if isinstance(patch, int) else tuple(int(p) for p in patch)
    if len(patch) != len(spatial):
        return None
    return tuple(s // p for s, p in zip(spatial, patch))


def _install_grid_hook(model: nn.Module) -> GridContext:
    """One :class:`GridContext` per model, updated from every forward's input by a pre-hook."""
    ctx = getattr(model, "_mhla_grid_context", None)
    if ctx is not None:
        return ctx
    ctx = GridContext()

    def hook(module, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        grid = _patch_grid(module, x)
        if grid is not None:
            # the module's own context, not the closure's: a deep copy of the model (EMA) copies the context
            # with its processors but shares this function, so it must update the copy's context
            module._mhla_grid_context.grid = grid

    model.register_forward_pre_hook(hook, with_kwargs=True)
    object.__setattr__(model, "_mhla_grid_context", ctx)  # plain attribute, not a submodule
    return ctx


def swap_self_attention(
    model: nn.Module,
    attn_cfg,
    *,
    layers: Iterable[int] | Callable[[int, str], bool] | None = None,
    grid: Sequence[int] | None = None,
    track_grid: bool = True,
) -> list[str]:
    """Put the registered attention ``attn_cfg`` into the selected self-attention layers of ``model``; returns
    their names.

    Args:
        model: a diffusers model (``WanTransformer3DModel``, ``SanaTransformer2DModel``, ...) or any module
            holding diffusers attention modules.
        attn_cfg: a registered attention's name or a mapping with ``name`` and its layer options (e.g.
            ``{"name": "mhla", "blocks": [7, 3, 5], "normalize": False, "out_norm": True, "rope":
            "after_feature_map"}``); its ``supports.host_projections`` must be set.
        layers: which self-attention layers (indices into :func:`self_attention_modules`): ``None`` = all,
            an iterable of indices (e.g. :func:`hybrid_layers`), or ``fn(index, name) -> bool``.
        grid: the token grid ``(F, H, W)`` / ``(H, W)`` the layer is built for (resolves ``num_blocks`` /
            ``block``), and, with ``track_grid=False``, the fixed grid of every call.
        track_grid: install the pre-hook that reads the token grid from the model input (module docstring).

    The layer is created on the device and dtype of each module's ``to_q.weight`` (MHLA's mixing matrix stays
    fp32 when the module is half precision).
    """
    name = attn_cfg if isinstance(attn_cfg, str) else attn_cfg["name"]
    if not get_attention_class(name).supports.host_projections:
        raise ValueError(f"attention {name!r} cannot run inside a host module's projections "
                         "(its supports.host_projections is not set)")
    modules = self_attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no diffusers self-attention modules (set_processor + to_q)")
    context = _install_grid_hook(model) if track_grid else None
    names = []
    for i in select_layers([n for n, _ in modules], layers, "self-attention layers"):
        module_name, attn = modules[i]
        weight = attn.to_q.weight
        pdtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
        head_dim = weight.shape[0] // attn.heads
        layer = build_attention(attn_cfg, weight.shape[1], attn.heads, projections=False, head_dim=head_dim,
                                grid=tuple(grid) if grid is not None else None, device=weight.device, dtype=pdtype)
        attn.attention = layer
        attn.set_processor(AttentionProcessor(grid=None if track_grid else grid, context=context))
        names.append(module_name)
    return names


def swapped_attentions(model: nn.Module) -> dict[str, AttentionBase]:
    """``{module name: layer}`` of the attentions :func:`swap_self_attention` put into ``model``."""
    return {n: m.attention for n, m in self_attention_modules(model)
            if isinstance(getattr(m, "attention", None), AttentionBase)}


# ------------------------------------------------------------------------------------ cross-attention
def key_padding_mask_from(attention_mask: torch.Tensor | None, batch: int,
                          length: int) -> torch.Tensor | None:
    """The keep-mask ``[B, L]`` (True: a real key) of a diffusers cross-attention mask, or None.

    Accepted: a bool mask ``[B, L]`` / ``[B, 1, L]`` (True: keep), or an additive bias ``[B, L]`` / ``[B, 1,
        L]``
    (0: keep, a large negative value: drop; what SANA and PixArt pass their cross-attention after converting
    the encoder's 0/1 mask). A float mask with positive entries is a 0/1 mask that was not converted, and is
    refused (read as a bias it would keep everything)."""
    if attention_mask is None:
        return None
    m = attention_mask
    if m.dim() == 3 and m.shape[1] == 1:
        m = m[:, 0]
    if m.dim() != 2 or m.shape[-1] != length or m.shape[0] not in (1, batch):
        raise ValueError(f"cross-attention mask of shape {tuple(attention_mask.shape)}: expected [B, L] or "
                         f"[B, 1, L] with B = {batch}, L = {length} (one mask per condition, not per query)")
    if m.dtype == torch.bool:
        keep = m
    elif (m > 0).any():
        raise ValueError("a float cross-attention mask must be an additive bias (0: keep, large negative: "
                         "drop); got positive entries (a 0/1 mask): pass it as bool")
    else:
        keep = m > -1.0
    return keep.expand(batch, length)


class CrossAttentionProcessor(AttentionProcessor):
    """diffusers processor for a cross-attention module (``attn2``): the host's ``to_q`` on the tokens,
    ``to_k`` / ``to_v`` on ``encoder_hidden_states``, its q / k norms and ``to_out``; between them the
    registered cross-attention ``attn.attention`` (:class:`mhla.cross.CrossAttentionBase`): ``attend(q, k, v,
    grid=..., key_padding_mask=...)`` and ``finish_heads``. ``attention_mask``: :func:`key_padding_mask_from`.
    The token grid (MHLA's query blocks) comes as for :class:`AttentionProcessor`."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb=None, **kwargs) -> torch.Tensor:
        if encoder_hidden_states is None:
            raise ValueError("CrossAttentionProcessor needs encoder_hidden_states (it is for "
                             "cross-attention)")
        if getattr(attn, "add_k_proj", None) is not None:
            raise ValueError("CrossAttentionProcessor does not handle added image keys / values (Wan I2V)")
        layer: CrossAttentionBase = attn.attention
        x, shape_4d = self.tokens(hidden_states)
        residual = x
        grid = self.token_grid(x.shape[1], tuple(shape_4d[2:]) if shape_4d is not None else None,
                               needs_grid=getattr(layer, "blocks", None) is not None)
        enc = encoder_hidden_states
        heads = attn.heads
        q = _apply_qk_norm(getattr(attn, "norm_q", None), attn.to_q(x), heads)
        k = _apply_qk_norm(getattr(attn, "norm_k", None), attn.to_k(enc), heads)
        v = attn.to_v(enc).unflatten(-1, (heads, -1))
        mask = key_padding_mask_from(attention_mask, x.shape[0], enc.shape[1])
        o = layer.finish_heads(layer.attend(q, k, v, grid=grid, key_padding_mask=mask))
        return self.output(attn, o, residual, shape_4d)


def cross_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every diffusers cross-attention module of ``model`` (``set_processor``, ``to_q``
    and ``is_cross_attention``: the ``attn2`` of Wan / SANA / PixArt blocks), in definition order."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "set_processor") and hasattr(m, "to_q") and getattr(m, "is_cross_attention", False)]


def swap_cross_attention(model: nn.Module, attn_cfg, *, grid: Sequence[int] | None = None,
                         track_grid: bool = True) -> list[str]:
    """Put the registered cross-attention ``attn_cfg`` (``supports.cross``: ``mhla_cross``, ``linear_cross``,
    ``softmax_cross``) into every cross-attention module of ``model``; returns their names. As
    :func:`swap_self_attention`: the layer is built with ``projections=False`` (the module keeps ``to_q`` /
    ``to_k`` / ``to_v`` / ``to_out``), registered as ``<attn2>.attention`` (its mixing matrix trains and saves
    with the model), and :class:`CrossAttentionProcessor` runs it; ``grid`` / ``track_grid`` as there."""
    name = attn_cfg if isinstance(attn_cfg, str) else attn_cfg["name"]
    supports = get_attention_class(name).supports
    if not (supports.cross and supports.host_projections):
        raise ValueError(f"attention {name!r} is not a cross-attention that runs inside a host's projections "
                         "(supports.cross and supports.host_projections)")
    modules = cross_attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no diffusers cross-attention modules")
    context = _install_grid_hook(model) if track_grid else None
    names = []
    for module_name, attn in modules:
        weight = attn.to_q.weight
        pdtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
        layer = build_attention(attn_cfg, weight.shape[1], attn.heads, projections=False,
                                head_dim=weight.shape[0] // attn.heads,
                                value_dim=attn.to_v.weight.shape[0] // attn.heads,
                                context_dim=attn.to_k.weight.shape[1],
                                grid=tuple(grid) if grid is not None else None, device=weight.device,
                                dtype=pdtype)
        attn.attention = layer
        attn.set_processor(CrossAttentionProcessor(grid=None if track_grid else grid, context=context))
        names.append(module_name)
    return names


def swapped_cross_attentions(model: nn.Module) -> dict[str, CrossAttentionBase]:
    """``{module name: layer}`` of the cross-attentions :func:`swap_cross_attention` put into ``model``."""
    return {n: m.attention for n, m in cross_attention_modules(model)
            if isinstance(getattr(m, "attention", None), CrossAttentionBase)}
