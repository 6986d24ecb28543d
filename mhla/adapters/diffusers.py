"""diffusers adapter: run MHLA (or plain linear attention) in the self-attention of any diffusers model.

Two entry points:

    from mhla.adapters.diffusers import swap_self_attention, hybrid_layers
    # Wan2.1 (3-D latent grid), all 30 self-attention layers, M = 7 x 3 x 5 = 105 blocks:
    names = swap_self_attention(wan, "mhla", blocks=(7, 3, 5), normalize=False, out_norm=True,
                                rope="after_feature_map")
    # hybrid: every third layer (2, 5, 8, ...) keeps its softmax processor
    names = swap_self_attention(wan, "mhla", layers=hybrid_layers(30), blocks=(7, 3, 5), ...)
    # SANA (2-D latent grid, NoPE): attn1 only (cross-attention is never touched)
    names = swap_self_attention(sana, "mhla", num_blocks=16, grid=(32, 32))

* :class:`MHLAAttnProcessor` is a diffusers attention *processor* (a plain callable, not a module). It
  works on any self-attention module with diffusers' projection names: ``to_q``/``to_k``/``to_v`` (or a
  fused ``to_qkv``), optional ``norm_q``/``norm_k``, ``heads``, ``to_out[0]`` (+ ``to_out[1]`` dropout) -
  i.e. ``diffusers.models.attention_processor.Attention`` (SANA, PixArt, DiT, ...) and ``WanAttention``.
* :func:`swap_self_attention` replaces the processors of the selected self-attention modules and registers
  the new parameters ON THE ATTENTION MODULE, so they train, save and load with the model's state dict:
  ``<attn>.mhla_mixing`` (:class:`mhla.mixing.MixingMatrix`; "mixing" in the name: no weight decay, and
  the shared Trainer projects it to [0, 1] after each optimizer step) and ``<attn>.mhla_out_norm``
  (``nn.RMSNorm(head_dim)`` on each head's output, the paper's LM / video setting with ``normalize=False``).

What the processor computes for ``hidden_states x: [B, N, C]`` (grid tokens in raster order, frame-major
``(f, h, w)`` for video, ``(h, w)`` for images):

    q, k, v = to_q(x), to_k(x), to_v(x)             # or to_qkv(x).chunk(3)
    q, k    = norm_q(q), norm_k(k)                   # the module's q/k norms (across heads or per head)
    q, k, v -> [B, N, H, D]
    rope="before_feature_map": q, k = rope(q), rope(k)   # the model's rotary embedding (Wan: rotary_emb)
    q, k    = phi(q), phi(k)                         # feature map, default relu(x) + 1e-6
    rope="after_feature_map": numerator uses rope(phi(q)), rope(phi(k)); the normalizer (when normalize=True)
                   uses the un-rotated phi(q), phi(k) (RoFormer's linear-attention form, so it stays positive;
                   the LM normalises with the rotated ones instead: see mhla.rope)
    MHLA over block-major tokens (mhla.layouts.BlockLayout permutes raster <-> block-major):
        o = mhla_attention(q, k, v, Mc, block_size, normalize=...)    (kind="linear": linear_attention)
    o = out_norm(o) (per head, optional);  y = to_out[1](to_out[0](o.flatten(heads)))

Token grid. MHLA needs the token grid ``(F, H, W)`` / ``(H, W)`` of each call; diffusers passes only
``[B, N, C]`` to the processor. Sources, first match wins: a 4-D ``hidden_states [B, C, H, W]`` (generic
``Attention`` accepts that); the ``grid`` fixed at :func:`swap_self_attention` when ``track_grid=False``;
otherwise a forward pre-hook that :func:`swap_self_attention` installs on the top-level model reads the
model input ``[B, C, (F,) H, W]`` and ``model.config.patch_size`` (int or tuple) and records the patch grid
for every processor of that model (so one model runs at any resolution the blocks tile).

Blocks. The block *grid* (blocks per axis) is fixed when the layer is built, because the mixing matrix is
``M x M`` with ``M = prod(blocks)``; the block *shape* is ``grid // blocks`` at each call, and a grid the
blocks do not tile raises a ``ValueError`` naming the axis. Give ``blocks=(7, 3, 5)`` (blocks per axis),
or ``block=(3, 10, 10)`` (tokens per block, with ``grid``), or ``num_blocks=105`` (with ``grid``; factorised
by :func:`mhla.layouts.factorize_blocks`). Mixing init: the paper's locality init on the block grid's centre
distances (``mixing_init="locality"``); the constant init of the authors' video release is NOT used (a slip).

Parameters registered by :func:`swap_self_attention` (names are stable; checkpoints rely on them):
    ``<attn>.mhla_mixing.raw``       ``[M, M]`` (or ``[H, M, M]`` with ``mixing_per_head``), kind="mhla"
    ``<attn>.mhla_out_norm.weight``  ``[head_dim]``, when ``out_norm=True``
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..feature_maps import get_feature_map
from ..layouts import BlockLayout, layout_for_grid, resolve_blocks
from ..mixing import MixingMatrix
from ..ops import linear_attention, mhla_attention
from ..rope import apply_rope, rope_and_feature_map, rope_placement

KINDS = ("mhla", "linear")


# --------------------------------------------------------------------------------------- layers
def hybrid_layers(num_layers: int, softmax_every: int = 3, softmax_offset: int = 2) -> list[int]:
    """Indices of the layers that get MHLA in a hybrid model: all but ``i % softmax_every == softmax_offset``.

    Default: every third layer keeps softmax attention (2, 5, 8, ...), so 2/3 of the layers use MHLA (the
    paper's Wan2.1 hybrid replaces "2/3 of the layers" without saying which; this pattern is our choice,
    spreading the softmax layers evenly and keeping the first two layers linear like the rest).
    """
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


class MHLAAttnProcessor:
    """diffusers attention processor running MHLA or plain linear attention on self-attention.

    Args:
        kind: ``"mhla"`` or ``"linear"`` (the Table 5 / Table 3 baseline: one global summary).
        blocks: blocks per axis of the token grid (kind="mhla"); ``M = prod(blocks)`` must equal the
            size of ``attn.mhla_mixing``.
        feature_map: name in :data:`mhla.feature_maps.FEATURE_MAPS` (default ``"relu"``: relu(x) + 1e-6).
        normalize: ``True`` (paper's vision normalizer), ``False`` (no denominator; use ``out_norm``), or
            ``"official"`` (the authors' release's normalizer; kind="mhla", rope != "after_feature_map" only).
        rope: ``"before_feature_map"`` / ``"after_feature_map"`` (:data:`mhla.rope.ROPE_PLACEMENTS`; the old
            ``"before"`` / ``"after"`` are aliases), or ``"none"`` to ignore the model's rotary embedding
            (models without RoPE, such as SANA, never pass one). What ``normalize=True`` divides by for each
            placement: :mod:`mhla.rope`.
        eps: denominator epsilon. backend: op backend of :func:`mhla.mhla_attention`.
        grid: fixed token grid; else the model's :class:`GridContext` (``context``) or a 4-D input.

    Call signature (diffusers): ``(attn, hidden_states [B, N, C] or [B, C, H, W], encoder_hidden_states=None,
    attention_mask=None, rotary_emb=None)`` -> ``[B, N, C]`` (or ``[B, C, H, W]``). Cross-attention
    (``encoder_hidden_states``) and attention masks raise ``ValueError``: this processor is for
    self-attention only.
    """

    def __init__(self, kind: str = "mhla", *, blocks: Sequence[int] | None = None, feature_map: str = "relu",
                 normalize=True, rope: str = "before_feature_map", eps: float = 1e-6, backend: str = "auto",
                 grid: Sequence[int] | None = None, context: GridContext | None = None):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        rope = rope_placement(rope)
        if normalize not in (True, False, "official"):
            raise ValueError(f"normalize must be True, False or 'official', got {normalize!r}")
        if normalize == "official" and (kind != "mhla" or rope == "after_feature_map"):
            raise ValueError("normalize='official' is MHLA's release normalizer; it needs kind='mhla' and "
                             "rope != 'after_feature_map'")
        if kind == "mhla" and blocks is None:
            raise ValueError("kind='mhla' needs blocks=(blocks per axis); see resolve_blocks()")
        self.kind = kind
        self.blocks = tuple(int(b) for b in blocks) if blocks is not None else None
        self.feature_map_name = feature_map
        self.feature_map = get_feature_map(feature_map)
        self.normalize = normalize
        self.rope = rope
        self.eps = eps
        self.backend = backend
        self.grid = tuple(int(g) for g in grid) if grid is not None else None
        self.context = context
        self._layouts: dict[tuple[int, ...], BlockLayout] = {}

    def __repr__(self) -> str:
        return (f"MHLAAttnProcessor(kind={self.kind}, blocks={self.blocks}, feature_map={self.feature_map_name}, "
                f"normalize={self.normalize}, rope={self.rope})")

    # ------------------------------------------------------------------------------------ pieces
    def layout(self, grid: Sequence[int]) -> BlockLayout:
        """Block layout of ``grid`` (cached per grid)."""
        grid = tuple(int(g) for g in grid)
        if grid not in self._layouts:
            self._layouts[grid] = layout_for_grid(grid, self.blocks)
        return self._layouts[grid]

    def token_grid(self, num_tokens: int, grid_4d=None) -> tuple[int, ...] | None:
        """The grid of this call: 4-D input, else the fixed grid, else the model's context."""
        grid = grid_4d or self.grid or (self.context.grid if self.context is not None else None)
        if grid is None:
            if self.kind == "linear":
                return None
            raise ValueError(
                "MHLAAttnProcessor does not know the token grid: call swap_self_attention(model, ...) on the "
                "top-level model (it tracks the grid from the model input and config.patch_size), or pass "
                "grid=(F, H, W) / (H, W)")
        if math.prod(grid) != num_tokens:
            raise ValueError(f"the token grid {tuple(grid)} holds {math.prod(grid)} tokens but the attention "
                             f"got {num_tokens}; is the model's input size consistent with its patch size?")
        return tuple(grid)

    def project(self, attn, x: torch.Tensor):
        """``x [B, N, C]`` -> q, k, v ``[B, N, H, D]`` (q, k normed by the module's norms)."""
        if getattr(attn, "fused_projections", False) and hasattr(attn, "to_qkv"):
            q, k, v = attn.to_qkv(x).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
        heads = attn.heads
        q = _apply_qk_norm(getattr(attn, "norm_q", None), q, heads)
        k = _apply_qk_norm(getattr(attn, "norm_k", None), k, heads)
        return q, k, v.unflatten(-1, (heads, -1))

    def attend(self, attn, q, k, v, grid, rotary_emb=None) -> torch.Tensor:
        """Projected ``q, k, v [B, N, H, D]`` in raster order -> ``o [B, N, H, Dv]`` (before out_norm)."""
        rot = None
        if rotary_emb is not None and self.rope != "none":
            cos, sin = rotary_emb  # interleaved pairs, e.g. Wan's [1, N, 1, D] fp64 tables
            rot = lambda t: apply_rope(t, cos, sin, interleaved=True, upcast=True)  # noqa: E731
        q, k, q_plain, k_plain = rope_and_feature_map(q, k, self.feature_map, rot, self.rope)
        if rot is not None and self.rope == "after_feature_map":  # normalise with the un-rotated features
            num = self._op(attn, q, k, v, grid, False)
            if self.normalize is False:
                return num
            den = self._op(attn, q_plain, k_plain, v.new_ones(*v.shape[:-1], 1), grid, False)
            acc = torch.promote_types(num.dtype, torch.float32)
            return (num.to(acc) / (den.to(acc) + self.eps)).to(num.dtype)
        return self._op(attn, q, k, v, grid, self.normalize)

    def _op(self, attn, q, k, v, grid, normalize) -> torch.Tensor:
        if self.kind == "linear":
            return linear_attention(q, k, v, normalize=bool(normalize), eps=self.eps)
        lay = self.layout(grid)
        mixing = attn.mhla_mixing()
        if mixing.shape[-1] != lay.num_blocks:
            raise ValueError(f"{attn.__class__.__name__}.mhla_mixing has M={mixing.shape[-1]} but blocks "
                             f"{self.blocks} give {lay.num_blocks}")
        to_b = lay.raster_to_block_major
        o = mhla_attention(to_b(q), to_b(k), to_b(v), mixing.to(q.dtype), lay.block_size,
                           normalize=normalize, eps=self.eps, backend=self.backend)
        return lay.block_major_to_raster(o)

    # ------------------------------------------------------------------------------------ call
    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb=None, image_rotary_emb=None,
                 **kwargs) -> torch.Tensor:
        if encoder_hidden_states is not None:
            raise ValueError("MHLAAttnProcessor is for self-attention; this module got encoder_hidden_states "
                             "(cross-attention keeps its own processor)")
        if attention_mask is not None:
            raise ValueError("MHLAAttnProcessor does not take an attention_mask")
        rotary_emb = rotary_emb if rotary_emb is not None else image_rotary_emb
        x, shape_4d = hidden_states, None
        if x.dim() == 4:  # generic Attention accepts [B, C, H, W]
            shape_4d = x.shape
            x = x.flatten(2).transpose(1, 2)
        residual = x
        grid = self.token_grid(x.shape[1], tuple(shape_4d[2:]) if shape_4d is not None else None)
        q, k, v = self.project(attn, x)
        o = self.attend(attn, q, k, v, grid, rotary_emb)
        out_norm = getattr(attn, "mhla_out_norm", None)
        if out_norm is not None:
            o = out_norm(o)
        y = attn.to_out[0](o.flatten(2).to(x.dtype))
        if len(attn.to_out) > 1:
            y = attn.to_out[1](y)
        if getattr(attn, "residual_connection", False):
            y = y + residual
        y = y / getattr(attn, "rescale_output_factor", 1.0)
        if shape_4d is not None:
            y = y.transpose(1, 2).reshape(shape_4d)
        return y


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
    kind: str = "mhla",
    *,
    layers: Iterable[int] | Callable[[int, str], bool] | None = None,
    grid: Sequence[int] | None = None,
    blocks: Sequence[int] | None = None,
    block: Sequence[int] | None = None,
    num_blocks: int | None = None,
    feature_map: str = "relu",
    normalize=True,
    out_norm: bool = False,
    rope: str = "before_feature_map",
    mixing_init: str = "locality",
    mixing_learnable: bool = True,
    mixing_per_head: bool = False,
    mixing_param: str = "clamp",
    eps: float = 1e-6,
    backend: str = "auto",
    track_grid: bool = True,
) -> list[str]:
    """Put :class:`MHLAAttnProcessor` into the selected self-attention layers of ``model``; returns their names.

    Args:
        model: a diffusers model (``WanTransformer3DModel``, ``SanaTransformer2DModel``, ...) or any module
            holding diffusers attention modules.
        kind: ``"mhla"`` or ``"linear"``.
        layers: which self-attention layers (indices into :func:`self_attention_modules`): ``None`` = all,
            an iterable of indices (e.g. :func:`hybrid_layers`), or ``fn(index, name) -> bool``.
        grid: the token grid ``(F, H, W)`` / ``(H, W)`` used to resolve ``block`` / ``num_blocks`` (and, with
            ``track_grid=False``, the fixed grid of every call).
        blocks / block / num_blocks: the MHLA block grid, see :func:`resolve_blocks` (kind="mhla").
        feature_map, normalize, rope, eps, backend: see :class:`MHLAAttnProcessor`.
        out_norm: add ``<attn>.mhla_out_norm = RMSNorm(head_dim)`` on the attention output (per head).
        mixing_init, mixing_learnable, mixing_per_head, mixing_param: the :class:`MixingMatrix` options; the
            distances of the locality init are those between block centres of the block grid.
        track_grid: install the pre-hook that reads the token grid from the model input (module docstring).

    The new parameters are created on the device and dtype of each module's ``to_q.weight``
    (the mixing matrix stays fp32 when the module is half precision).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    modules = self_attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no diffusers self-attention modules (set_processor + to_q)")
    if layers is None:
        chosen = list(range(len(modules)))
    elif callable(layers):
        chosen = [i for i, (n, _) in enumerate(modules) if layers(i, n)]
    else:
        chosen = sorted({int(i) for i in layers})
        bad = [i for i in chosen if not 0 <= i < len(modules)]
        if bad:
            raise ValueError(f"layers {bad} out of range: the model has {len(modules)} self-attention layers")
    block_grid = resolve_blocks(grid, blocks=blocks, block=block, num_blocks=num_blocks) if kind == "mhla" else None
    context = _install_grid_hook(model) if track_grid else None
    distances = BlockLayout(block_grid, (1,) * len(block_grid)).block_distances() if block_grid else None
    names = []
    for i in chosen:
        name, attn = modules[i]
        weight = attn.to_q.weight
        head_dim = weight.shape[0] // attn.heads
        pdtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
        if kind == "mhla":
            attn.mhla_mixing = MixingMatrix(
                math.prod(block_grid), distances=distances, init=mixing_init, learnable=mixing_learnable,
                num_heads=attn.heads if mixing_per_head else None, parameterization=mixing_param,
            ).to(weight.device)
        if out_norm:
            attn.mhla_out_norm = nn.RMSNorm(head_dim, eps=1e-6, device=weight.device, dtype=pdtype)
        attn.set_processor(MHLAAttnProcessor(
            kind, blocks=block_grid, feature_map=feature_map, normalize=normalize, rope=rope, eps=eps,
            backend=backend, grid=None if track_grid else grid, context=context))
        names.append(name)
    return names


def mhla_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters added by :func:`swap_self_attention` (mixing matrices, output norms)."""
    return [p for n, p in model.named_parameters() if ".mhla_mixing." in f".{n}" or ".mhla_out_norm." in f".{n}"]
