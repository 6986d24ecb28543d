"""Cross-attention layers (``nn.Module``): queries from the layer's tokens, keys and values from a condition
of another length (text tokens), with a key padding mask. Registered as ``softmax_cross``, ``linear_cross``
and ``mhla_cross`` (docs/cross_attention.md); their ``supports.cross`` is set, so a model takes them only for
its cross-attention.

    layer = build_attention({"name": "mhla_cross", "blocks": [2, 2, 2], "key_blocks": 3}, dim=64, num_heads=4,
                            grid=(8, 8, 8), context_dim=32)
    y = layer(x, context, key_padding_mask)
    # x [B, N, dim] (raster order), context [B, L, context_dim], key_padding_mask [B, L] bool (True: a real
    # token) -> y [B, N, dim]

Like the self-attention layers (:class:`mhla.layers.AttentionBase`), a layer has its projections (``to_q``
from the tokens, ``to_kv`` from the condition, the output projection) and the attention itself,
:meth:`attend`: projected ``q [B, N, H, D]``, ``k [B, L, H, D]``, ``v [B, L, H, Dv]`` -> ``o [B, N, H, Dv]``.
``projections=False`` builds the attention alone, for hosts that own their projections (the diffusers
cross-attention processor, :func:`mhla.adapters.diffusers.swap_cross_attention`).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn as nn

from .feature_maps import get_feature_map
from .layouts import factorize_blocks, layout_for_grid
from .mixing import CrossMixingMatrix
from .ops import mhla_cross_attention, softmax_attention
from .registry import Supports, register_attention

CROSS_SUPPORTS = Supports(bidirectional=True, grid_ranks=(1, 2, 3), host_projections=True, cross=True)


class CrossAttentionBase(nn.Module):
    """Projections and options shared by the cross-attention layers.

    Args:
        dim: width of the tokens (queries) and of the output. num_heads: ``H``.
        context_dim: width of the condition (keys / values); default ``dim``.
        head_dim / value_dim: per-head query-key / value dims (default ``dim // num_heads`` / ``head_dim``).
        qkv_bias, proj_bias: biases of the input and output projections.
        out_norm: a per-head RMSNorm on the attention output (before the output projection).
        attn_drop, proj_drop: dropout on the attention output / after the output projection.
        grid: the token grid of the queries (``(T,)``, ``(H, W)`` or ``(F, H, W)``; MHLA's query blocks tile
            it).
        projections: ``False``: no projections, a host projects and calls :meth:`attend`.
    """

    supports: ClassVar[Supports] = CROSS_SUPPORTS
    exclusive_options: ClassVar[tuple[tuple[str, ...], ...]] = ()
    excluded_options: ClassVar[tuple[str, ...]] = ()
    dependent_options: ClassVar[dict[str, str]] = {}

    def __init__(self, dim: int, num_heads: int = 8, *, context_dim: int | None = None,
                 head_dim: int | None = None, value_dim: int | None = None, qkv_bias: bool = False,
                 proj_bias: bool = True, out_norm: bool = False, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, grid=None, projections: bool = True, device=None, dtype=None):
        super().__init__()
        if dim % num_heads and head_dim is None:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads}), or pass head_dim")
        dd = dict(device=device, dtype=dtype)
        self.dim, self.num_heads = dim, num_heads
        self.context_dim = context_dim or dim
        self.head_dim = head_dim or dim // num_heads
        self.value_dim = value_dim or self.head_dim
        self.grid = tuple(int(g) for g in grid) if grid is not None else None
        self.projections = projections
        H = num_heads
        self.to_q = nn.Linear(dim, H * self.head_dim, bias=qkv_bias, **dd) if projections else None
        self.to_kv = nn.Linear(self.context_dim, H * (self.head_dim + self.value_dim), bias=qkv_bias, **dd) \
            if projections else None
        self.out_norm = nn.RMSNorm(self.value_dim, eps=1e-6, **dd) if out_norm else None
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(H * self.value_dim, dim, bias=proj_bias, **dd) if projections else None
        self.proj_drop = nn.Dropout(proj_drop)

    def settings(self) -> dict:
        return {"cross": True, "out_norm": self.out_norm is not None, "grid": self.grid,
                "projections": self.projections, "head_dim": self.head_dim, "value_dim": self.value_dim,
                "context_dim": self.context_dim}

    def attend(self, q, k, v, *, grid=None, key_padding_mask=None) -> torch.Tensor:  # pragma: no cover
        """``q [B, N, H, D]`` (the tokens in the model's raster order), ``k [B, L, H, D]``, ``v [B, L, H,
        Dv]`` (projected), ``key_padding_mask [B, L]`` bool (True: a real key) or None -> ``o [B, N, H, Dv]``.
        ``grid``: the token grid of this call (default: the layer's)."""
        raise NotImplementedError

    def finish_heads(self, o: torch.Tensor) -> torch.Tensor:
        """``o [B, N, H, Dv]`` -> dropout and the per-head output RMSNorm (``out_norm``)."""
        o = self.attn_drop(o)
        return self.out_norm(o) if self.out_norm is not None else o

    def forward(self, x: torch.Tensor, context: torch.Tensor, key_padding_mask: torch.Tensor | None = None, *,
                grid_size=None) -> torch.Tensor:
        """``x [B, N, dim]``, ``context [B, L, context_dim]``, ``key_padding_mask [B, L]`` bool -> ``[B, N,
        dim]``."""
        if not self.projections:
            raise RuntimeError(f"{type(self).__name__} was built with projections=False: its host projects "
                               "and calls attend()")
        B, N, _ = x.shape
        H, D, Dv = self.num_heads, self.head_dim, self.value_dim
        q = self.to_q(x).view(B, N, H, D)
        k, v = self.to_kv(context).split([H * D, H * Dv], dim=-1)
        k, v = k.view(B, context.shape[1], H, D), v.view(B, context.shape[1], H, Dv)
        o = self.finish_heads(self.attend(q, k, v, grid=grid_size, key_padding_mask=key_padding_mask))
        return self.proj_drop(self.proj(o.reshape(B, N, H * Dv)))


@register_attention("softmax_cross")
class SoftmaxCrossAttention(CrossAttentionBase):
    """Softmax cross-attention (SDPA), scale ``head_dim ** -0.5``; masked keys get no weight. A query whose
    keys are all masked gets 0 (SDPA would give NaN), as in the linear forms."""

    def attend(self, q, k, v, *, grid=None, key_padding_mask=None):
        if key_padding_mask is None:
            return softmax_attention(q, k, v)
        o = softmax_attention(q, k, v, attn_mask=key_padding_mask[:, None, None, :])
        return torch.where(key_padding_mask.any(-1)[:, None, None, None], o, 0.0)


@register_attention("linear_cross")
class LinearCrossAttention(CrossAttentionBase):
    """Linear cross-attention: every query reads one summary of the whole condition,
    ``o_t = phi(q_t)^T sum_s phi(k_s) v_s^T / (phi(q_t) . sum_s phi(k_s) + eps)`` over the unmasked keys (the
    ``Mq = Mk = 1`` case of :func:`mhla.ops.mhla_cross_attention`).

    Extra args: ``feature_map`` (:data:`mhla.feature_maps.FEATURE_MAPS`, default ``relu``), ``normalize``
    (true / false), ``eps``, ``backend`` (``auto``, ``torch``, ``triton``, ``reference``).
    """

    def __init__(self, dim: int, num_heads: int = 8, *, feature_map: str = "relu", normalize: bool = True,
                 eps: float = 1e-6, backend: str = "auto", **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        if normalize not in (True, False):
            raise ValueError(f"normalize must be true or false for cross-attention, got {normalize!r}")
        self.feature_map_name, self.feature_map = feature_map, get_feature_map(feature_map)
        self.normalize, self.eps, self.backend = normalize, eps, backend

    def settings(self) -> dict:
        return {**super().settings(), "feature_map": self.feature_map_name, "normalize": self.normalize,
                "eps": self.eps, "backend": self.backend}

    def mixing_matrix(self, q: torch.Tensor) -> torch.Tensor:
        return q.new_ones(1, 1)

    def _query_order(self, grid):
        """``(to block-major, back)`` permutations of the query tokens (identity here)."""
        return None

    def attend(self, q, k, v, *, grid=None, key_padding_mask=None):
        order = self._query_order(grid or self.grid)
        if order is not None:
            q = order.raster_to_block_major(q)
        q, k = self.feature_map(q), self.feature_map(k)
        mixing = self.mixing_matrix(q)
        o = mhla_cross_attention(q, k, v, mixing.to(q.dtype), key_padding_mask=key_padding_mask,
                                 normalize=self.normalize, eps=self.eps, backend=self.backend)
        return o if order is None else order.block_major_to_raster(o)


@register_attention("mhla_cross")
class MHLACrossAttention(LinearCrossAttention):
    """MHLA cross-attention (docs/cross_attention.md): the query tokens in ``Mq`` blocks (tiles of the token
    grid), the condition in ``Mk`` contiguous blocks; query block ``i`` reads ``sum_j mixing[i, j] S_j`` of
    the key blocks' summaries ``S_j`` through a learnable nonnegative ``[Mq, Mk]`` matrix
    (:class:`mhla.mixing.CrossMixingMatrix`).

    Extra args (besides :class:`LinearCrossAttention`'s):
        blocks: query blocks per grid axis (``[2, 2, 2]``); or num_blocks: ``Mq``, factorised over the grid's
            axes (on a 1-D or no grid: ``Mq`` balanced contiguous blocks, any length).
        key_blocks: ``Mk``, contiguous blocks of the condition (any length ``L >= Mk``; padded positions count
            for the blocking, the mask removes their contribution).
        mixing_init: ``uniform`` (``1 / Mk``; the layer starts as linear cross-attention). Locality-type inits
            are refused: query and key blocks have no distance.
        mixing_learnable, mixing_per_head, mixing_param: as MHLA's (``clamp`` | ``softplus`` | ``log``).
    """

    exclusive_options = (("blocks", "num_blocks"),)

    def __init__(self, dim: int, num_heads: int = 8, *, blocks=None, num_blocks: int | None = None,
                 key_blocks: int | None = None, mixing_init: str = "uniform", mixing_learnable: bool = True,
                 mixing_per_head: bool = False, mixing_param: str = "clamp", **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        if (blocks is None) == (num_blocks is None):
            raise ValueError("mhla_cross needs its query blocks: exactly one of blocks=[per grid axis] or "
                             f"num_blocks=Mq (got blocks={blocks}, num_blocks={num_blocks})")
        if key_blocks is None:
            raise ValueError("mhla_cross needs key_blocks=Mk, the number of contiguous blocks of the "
                             "condition")
        if blocks is not None:
            self.blocks = tuple(int(b) for b in blocks)
        elif self.grid is not None and len(self.grid) > 1:
            self.blocks = factorize_blocks(self.grid, int(num_blocks))
        else:
            self.blocks = (int(num_blocks),)
        if self.grid is not None and len(self.grid) > 1:
            layout_for_grid(self.grid, self.blocks)  # the query blocks must tile the grid
        self._layouts = {}
        self.mixing = CrossMixingMatrix(math.prod(self.blocks), int(key_blocks), init=mixing_init,
                                        learnable=mixing_learnable, parameterization=mixing_param,
                                        num_heads=num_heads if mixing_per_head else None)
        if kwargs.get("device") is not None:
            self.mixing.to(kwargs["device"])

    def settings(self) -> dict:
        m = self.mixing
        return {**super().settings(), "blocks": self.blocks, "num_blocks": m.query_blocks,
                "key_blocks": m.key_blocks, "mixing_init": m.init, "mixing_learnable": m.learnable,
                "mixing_per_head": m.num_heads is not None, "mixing_param": m.parameterization}

    def mixing_matrix(self, q: torch.Tensor) -> torch.Tensor:
        return self.mixing()

    def _query_order(self, grid):
        """The block layout of a 2-D / 3-D query grid (its tiles are the query blocks); None on a 1-D or no
        grid (the op's balanced contiguous blocks)."""
        if grid is None or len(grid) == 1:
            return None
        grid = tuple(int(g) for g in grid)
        if grid not in self._layouts:
            if len(grid) != len(self.blocks):
                raise ValueError(f"mhla_cross was built for the {len(self.blocks)}-D block grid "
                                 f"{self.blocks}, got the {len(grid)}-D token grid {grid}")
            self._layouts[grid] = layout_for_grid(grid, self.blocks)
        return self._layouts[grid]
