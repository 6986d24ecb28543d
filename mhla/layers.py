"""Attention layers (``nn.Module``): MHLA, plain linear attention and softmax attention.

All three share one constructor and one forward signature, so a model builds any of them from one
``attn`` config (see :mod:`mhla.registry`) and timm can use them as ``attn_layer``:

    layer = MultiHeadLinearAttention(dim, num_heads, grid=(16, 16), block=(4, 4), qk_norm=True, cpe=True)
    y = layer(x)                      # x: [B, N, dim] in raster order -> y: [B, N, dim]

Token order: layers take and return tokens in the model's natural (raster) order, prefix tokens first.
MHLA permutes the grid tokens to block-major order internally (:class:`mhla.layouts.BlockLayout`).

Prefix tokens (class / register tokens, ``num_prefix_tokens > 0``): grid tokens use MHLA over the grid
tokens only; prefix tokens, as queries, read all tokens (prefix and grid) with plain linear attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .feature_maps import get_feature_map
from .layouts import BlockLayout, ceil_div, layout_1d, layout_from_num_blocks
from .mixing import MixingMatrix
from .ops import MHLAState, linear_attention, mhla_attention, mhla_decode_step, softmax_attention
from .ops.utils import check_cu_seqlens, run_varlen, sequence_bounds, unbind_state
from .registry import register_attention


@dataclass
class AttentionCache:
    """Decoding state of one causal attention layer.

    ``attn``: the op's state (:class:`mhla.ops.MHLAState` for MHLA, ``(S, z)`` for linear attention,
    ``(k, v)`` for softmax); ``conv``: the last ``kernel - 1`` values ``[B, kernel - 1, inner]`` for a
    causal CPE.

    After a variable-length call (``cu_seqlens``) both are *lists* of ``N`` per-sequence states, each of
    batch 1 (sequences may have consumed different numbers of tokens); a list is how the layers tell the two
    apart. A later variable-length call splits a batched cache into such a list.
    """

    attn: object = None
    conv: torch.Tensor | None = None


def _as_tuple(x, n: int):
    if x is None:
        return None
    if isinstance(x, int):
        return (x,) * n
    return tuple(int(v) for v in x)


def gate_kind(gate) -> str | None:
    """The output gate named by a layer's ``gate`` option: ``None`` (off), ``"swish"`` or ``"linear"``."""
    if gate in (False, None, "none"):
        return None
    if gate is True or gate == "swish":
        return "swish"
    if gate == "linear":
        return "linear"
    raise ValueError(f"gate must be false, true / 'swish' (RMSNorm(o) * swish(W_g x)) or 'linear' ((o + cpe) * "
                     f"(W_o x + b), RALA's), got {gate!r}")


class AttentionBase(nn.Module):
    """Projections and options shared by the attention layers (the three here and :mod:`mhla.baselines`).

    Args:
        dim: model width ``C``. Input and output ``[B, N, C]``.
        num_heads: feature heads ``H``; ``head_dim = dim // num_heads`` unless given.
        head_dim: per-head query/key dim ``D``. value_dim: per-head value dim ``Dv`` (default ``head_dim``).
        qkv_bias, proj_bias: biases of the input and output projections.
        qk_norm: RMSNorm over each head's query and key (before the feature map).
        causal: causal attention (language models); decode with ``cache``.
        feature_map: name in :data:`mhla.feature_maps.FEATURE_MAPS` (linear attention and MHLA).
        normalize: ``True`` / ``False`` / ``"official"`` (see :func:`mhla.mhla_attention`).
        cpe: add a depthwise convolution of V on the token grid (kernel ``cpe_kernel``) to the output.
        gate: output gate. ``True`` / ``"swish"``: ``RMSNorm(o) * swish(W_g x)`` (GLA-style); ``"linear"``:
            ``(o + cpe) * (W_o x + b)`` without a norm (RALA's wrapper, used by VLT). out_norm: RMSNorm on ``o``
            without a gate (the paper's LM / video setting with ``normalize=False``).
        attn_drop, proj_drop: dropout on the attention output / after the output projection.
        grid, block, num_blocks, block_size, num_prefix_tokens: token layout (used by MHLA; CPE uses
            ``grid``). Without ``grid`` the tokens form a 1-D sequence.
        backend: op backend (``"auto"``, ``"torch"``, ``"triton"``, ``"reference"``).
        scale_norm, norm_layer, device, dtype: accepted for timm compatibility (``scale_norm`` must be False).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        head_dim: int | None = None,
        value_dim: int | None = None,
        qkv_bias: bool = False,
        proj_bias: bool = True,
        qk_norm: bool = False,
        causal: bool = False,
        feature_map: str = "relu",
        normalize=True,
        eps: float = 1e-6,
        cpe: bool = False,
        cpe_kernel: int = 3,
        gate: bool | str = False,
        out_norm: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        grid=None,
        block=None,
        num_blocks: int | None = None,
        block_size: int | None = None,
        num_prefix_tokens: int = 0,
        backend: str = "auto",
        scale_norm: bool = False,
        norm_layer=None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if scale_norm:
            raise ValueError(f"{type(self).__name__} does not support timm's scale_norm=True")
        if dim % num_heads and head_dim is None:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads}), or pass head_dim")
        if cpe and cpe_kernel % 2 == 0:
            raise ValueError(f"cpe_kernel must be odd so the conv keeps the grid size, got {cpe_kernel}")
        dd = dict(device=device, dtype=dtype)
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = head_dim or dim // num_heads
        self.value_dim = value_dim or self.head_dim
        self.causal = causal
        self.normalize = normalize
        self.eps = eps
        self.backend = backend
        self.num_prefix_tokens = num_prefix_tokens
        self.grid = tuple(grid) if grid is not None else None
        self.feature_map_name = feature_map
        self.feature_map = get_feature_map(feature_map)
        qk_inner, v_inner = num_heads * self.head_dim, num_heads * self.value_dim
        self.qkv = nn.Linear(dim, 2 * qk_inner + v_inner, bias=qkv_bias, **dd)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=1e-6, **dd) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(self.head_dim, eps=1e-6, **dd) if qk_norm else nn.Identity()
        self.cpe = self._make_cpe(v_inner, cpe_kernel, dd) if cpe else None
        self.cpe_kernel = cpe_kernel
        self.gate_kind = gate_kind(gate)
        linear_gate = self.gate_kind == "linear"
        self.gate = nn.Linear(dim, v_inner, bias=linear_gate, **dd) if self.gate_kind else None
        swish_gate = self.gate_kind == "swish"
        self.out_norm = nn.RMSNorm(self.value_dim, eps=1e-6, **dd) if (swish_gate or out_norm) else None
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(v_inner, dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    # ------------------------------------------------------------------------------------------ CPE
    def _make_cpe(self, channels: int, kernel: int, dd) -> nn.Module:
        ndim = len(self.grid) if self.grid is not None else 1
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[ndim]
        pad = 0 if (self.causal and ndim == 1) else kernel // 2  # causal 1-D: left padding in forward
        return conv(channels, channels, kernel, padding=pad, groups=channels, **dd)

    def _apply_cpe(self, v: torch.Tensor, grid, cache: AttentionCache | None, layout=None) -> torch.Tensor:
        """Depthwise conv of ``v: [B, N, inner]`` (grid tokens; block-major if ``layout``) -> same order."""
        if layout is not None:
            return layout.raster_to_block_major(self._apply_cpe(layout.block_major_to_raster(v), grid, cache))
        B, N, Cv = v.shape
        if isinstance(self.cpe, nn.Conv1d):
            if self.causal:
                out, past = self._causal_conv(v, cache.conv if cache is not None else None)
                if cache is not None:
                    cache.conv = past
                return out
            return self.cpe(v.transpose(1, 2)).transpose(1, 2)
        x = v.transpose(1, 2).reshape(B, Cv, *grid)
        return self.cpe(x).reshape(B, Cv, N).transpose(1, 2)

    def _causal_conv(self, v: torch.Tensor, past: torch.Tensor | None):
        """Causal 1-D CPE: ``v: [B, N, inner]`` after ``past: [B, kernel - 1, inner]`` (None: zeros) ->
        ``(out [B, N, inner], the new past [B, kernel - 1, inner], detached)``."""
        k = self.cpe_kernel - 1
        if past is None:
            past = v.new_zeros(v.shape[0], k, v.shape[2])
        full = torch.cat([past, v], dim=1)
        out = self.cpe(full.transpose(1, 2)).transpose(1, 2)
        return out, (full[:, -k:].detach() if k else full[:, :0])

    def _apply_cpe_varlen(self, v: torch.Tensor, cache: AttentionCache | None, cu_seqlens) -> torch.Tensor:
        """Causal CPE on a packed batch ``v: [1, total_T, inner]``: each sequence convolved alone, after its
        own past (``cache.conv``: a list of per-sequence pasts)."""
        pasts = self._varlen_states(cache, "conv", cu_seqlens)

        def op(v, past, final):
            out, new_past = self._causal_conv(v, past)
            return (out, new_past) if final else out

        def empty():
            return v.new_zeros(1, self.cpe_kernel - 1, v.shape[2])

        if cache is None:
            return run_varlen(op, (v,), cu_seqlens)
        out, cache.conv = run_varlen(op, (v,), cu_seqlens, initial_state=pasts, output_final_state=True,
                                     empty_state=empty)
        return out

    # ---------------------------------------------------------------------------------- projections
    def _project(self, x: torch.Tensor, rope_tables=None):
        """``x: [B, N, C]`` -> q, k ``[B, N, H, D]`` (normed, not feature-mapped), v ``[B, N, H, Dv]``.

        ``rope_tables``: rotary tables of the N tokens, for subclasses that rotate q and k here (the LM's
        attention, :mod:`models.lm.modeling_mhla_lm`); these layers take none."""
        if rope_tables is not None:
            raise ValueError(f"{type(self).__name__} does not apply rope_tables")
        B, N, _ = x.shape
        H, D, Dv = self.num_heads, self.head_dim, self.value_dim
        q, k, v = self.qkv(x).split([H * D, H * D, H * Dv], dim=-1)
        q = self.q_norm(q.view(B, N, H, D))
        k = self.k_norm(k.view(B, N, H, D))
        return q, k, v.view(B, N, H, Dv)

    def _grid_for(self, n_grid: int, grid_size) -> tuple[int, ...]:
        if grid_size is not None:
            grid = tuple(grid_size)
        elif self.grid is not None:
            grid = self.grid
        else:
            grid = (n_grid,)
        n = 1
        for g in grid:
            n *= g
        if n != n_grid:
            raise ValueError(
                f"{type(self).__name__}: the input has {n_grid} grid tokens but the grid {grid} holds {n}; "
                f"pass grid_size=... to forward or build the layer with the right grid "
                f"(num_prefix_tokens={self.num_prefix_tokens})"
            )
        return grid

    def _finish(self, o: torch.Tensor, x: torch.Tensor, cpe_out: torch.Tensor | None) -> torch.Tensor:
        """``o: [B, N, H, Dv]`` -> CPE, output norm / gate, projection -> ``[B, N, C]``."""
        B, N = o.shape[:2]
        o = self.attn_drop(o)
        if self.out_norm is not None:
            o = self.out_norm(o)
        o = o.reshape(B, N, -1)
        if cpe_out is not None:
            o = o + cpe_out
        if self.gate_kind == "swish":
            o = o * F.silu(self.gate(x))
        elif self.gate_kind == "linear":
            o = o * self.gate(x)
        return self.proj_drop(self.proj(o))

    def _core(self, q, k, v, x, grid, cache, attn_mask):  # pragma: no cover - abstract
        """The attention: q, k ``[B, N, H, D]`` (:meth:`_project`), v ``[B, N, H, Dv]`` -> ``[B, N, H, Dv]``.

        ``x: [B, N, C]``: the layer input, in the token order of q, k, v (block-major when the layer has a
        block layout), for layers whose attention reads it (InLine's kernel MLP, MALA / RALA's output gate);
        ``grid``: the token grid; ``cache``: the decode state, updated in place (causal layers; else None);
        ``attn_mask``: the mask of :meth:`forward` (softmax only; the linear layers refuse one)."""
        raise NotImplementedError

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        *,
        grid_size=None,
        cache: AttentionCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        rope_tables=None,
    ) -> torch.Tensor:
        """``x: [B, N, C]`` (prefix tokens first, then grid tokens in raster order) -> ``[B, N, C]``.

        Args:
            attn_mask: not supported by the linear layers (ValueError); passed to SDPA by softmax.
            is_causal: timm's flag; must agree with the layer's ``causal``.
            grid_size: the token grid of this input when it differs from the one the layer was built for.
            cache: causal decoding / chunked prefill; updated in place (create with ``AttentionCache()``).
            cu_seqlens: causal 1-D layers; ``x: [1, total_T, C]`` holds ``N`` sequences packed along the tokens
                (``cu_seqlens: [N + 1]`` offsets, :mod:`mhla.ops.varlen`), each attended as if alone; the
                cache then holds per-sequence states (:class:`AttentionCache`).
            rope_tables: rotary tables of the tokens of ``x``, passed to :meth:`_project` (only layers that
                rotate q and k take them: the LM's attention, :mod:`models.lm.modeling_mhla_lm`).
        """
        if is_causal and not self.causal:
            raise ValueError(f"{type(self).__name__} was built with causal=False but called with is_causal=True")
        if cache is not None and not self.causal:
            raise ValueError("cache is for causal layers")
        if cu_seqlens is not None:
            return self._forward_varlen(x, attn_mask, cache, cu_seqlens, rope_tables)
        P = self.num_prefix_tokens
        grid = self._grid_for(x.shape[1] - P, grid_size)
        layout = self._block_layout(grid)
        if layout is not None:  # work in block-major order: every op but the attention is per token
            x = torch.cat([x[:, :P], layout.raster_to_block_major(x[:, P:])], dim=1)
        q, k, v = self._project(x, rope_tables)
        cpe_out = None
        if self.cpe is not None:
            vg = v[:, P:].reshape(x.shape[0], -1, self.num_heads * self.value_dim)
            cpe_out = self._apply_cpe(vg, grid, cache, layout)
            if P:
                cpe_out = torch.cat([cpe_out.new_zeros(x.shape[0], P, cpe_out.shape[-1]), cpe_out], dim=1)
        o = self._core(q, k, v, x, grid, cache, attn_mask)
        y = self._finish(o, x, cpe_out)
        if layout is not None:
            y = torch.cat([y[:, :P], layout.block_major_to_raster(y[:, P:])], dim=1)
        return y

    def _forward_varlen(self, x, attn_mask, cache: AttentionCache | None, cu_seqlens, rope_tables):
        """:meth:`forward` on a packed batch ``x: [1, total_T, C]`` of ``N`` causal 1-D sequences."""
        if not self.causal or self.num_prefix_tokens or (self.grid is not None and len(self.grid) != 1):
            raise ValueError(f"{type(self).__name__}: cu_seqlens is for causal layers over 1-D sequences")
        if attn_mask is not None:
            raise ValueError("pass either attn_mask or cu_seqlens")
        q, k, v = self._project(x, rope_tables)
        check_cu_seqlens(cu_seqlens, q)
        cpe_out = None
        if self.cpe is not None:
            cpe_out = self._apply_cpe_varlen(v.flatten(2), cache, cu_seqlens)
        return self._finish(self._core_varlen(q, k, v, cache, cu_seqlens), x, cpe_out)

    def _varlen_states(self, cache: AttentionCache | None, field: str, cu_seqlens) -> list | None:
        """The per-sequence states ``cache.<field>`` (``"attn"`` or ``"conv"``) for a packed call with
        ``cu_seqlens``: None when there are none yet, else a list of ``N`` (a batched cache is split)."""
        state = getattr(cache, field) if cache is not None else None
        if state is None:
            return None
        n = cu_seqlens.numel() - 1
        states = state if isinstance(state, list) else unbind_state(state, n)
        if len(states) != n:
            raise ValueError(f"the cache holds {len(states)} sequences but cu_seqlens has {n}")
        return states

    def _core_varlen(self, q, k, v, cache, cu_seqlens):
        """``_core`` on a packed batch: q, k ``[1, total_T, H, D]``, v ``[1, total_T, H, Dv]`` -> ``[1, total_T,
        H, Dv]``, each sequence alone; updates ``cache`` (per-sequence lists) when given."""
        raise ValueError(f"{type(self).__name__} does not support cu_seqlens")

    def _block_layout(self, grid):
        """The layout whose block-major order the layer works in (None: keep the input order)."""
        return None


@register_attention("mhla")
class MultiHeadLinearAttention(AttentionBase):
    """Multi-Head Linear Attention: linear attention with token-level heads mixed by a learnable matrix.

    Extra args (see :class:`AttentionBase` for the shared ones):
        grid / block: token grid ``(T,)``, ``(H, W)`` or ``(F, H, W)`` and block shape (same rank);
            or ``num_blocks`` (M) to split the grid evenly; or ``block_size`` for a 1-D sequence.
            Causal layers use ``block_size`` (chunk length, default 64).
        mixing_init: ``"locality"`` (paper default), ``"uniform"``, ``"identity"``, ``"cos"``, ``"exp"``,
            ``"gaussian"``, ``"local"``, ``"locality_official"`` (the release's column-normalized form).
        mixing_learnable: learn the mixing matrix (else a frozen buffer). mixing_per_head: one matrix per head.
        mixing_param: nonnegativity parameterization, ``"clamp"`` (paper) or ``"softplus"``.
        max_learned_blocks: causal only; blocks with their own learned coefficients (beyond: the extension
            rule ``mixing_extension``; sequences are not capped).
        mixing_extension: causal only; how rows past ``max_learned_blocks`` are built
            (:data:`mhla.mixing.EXTENSION_RULES`, default ``"uniform_far"``; :func:`mhla.mixing.extend_causal_mixing`).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        mixing_init: str = "locality",
        mixing_learnable: bool = True,
        mixing_per_head: bool = False,
        mixing_param: str = "clamp",
        max_learned_blocks: int = 32,
        mixing_extension: str = "uniform_far",
        **kwargs,
    ):
        super().__init__(dim, num_heads, **kwargs)
        grid, block = kwargs.get("grid"), kwargs.get("block")
        num_blocks, block_size = kwargs.get("num_blocks"), kwargs.get("block_size")
        device = kwargs.get("device")
        per_head = num_heads if mixing_per_head else None
        if self.causal:
            if grid is not None and len(grid) != 1:
                raise ValueError("causal MHLA works on 1-D sequences; drop grid or use causal=False")
            self.block_size = block_size or 64
            self.layout = None
            m, distances = max_learned_blocks, None
        else:
            self.layout = self._build_layout(grid, block, num_blocks, block_size)
            self.block_size = self.layout.block_size if self.layout is not None else block_size
            self._num_blocks = num_blocks
            if self.layout is not None:
                m, distances = self.layout.num_blocks, self.layout.block_distances()
            elif num_blocks is not None:
                m, distances = num_blocks, None
            else:
                raise ValueError(
                    "non-causal MHLA needs a layout: grid=(H, W) with block=(bh, bw) or num_blocks=M, "
                    "or num_blocks=M / block_size=C for a 1-D sequence"
                )
        self.mixing = MixingMatrix(
            m,
            distances=distances,
            init=mixing_init,
            causal=self.causal,
            learnable=mixing_learnable,
            num_heads=per_head,
            parameterization=mixing_param,
            extension=mixing_extension,
        )
        if device is not None:
            self.mixing.to(device)

    def _build_layout(self, grid, block, num_blocks, block_size) -> BlockLayout | None:
        if grid is None:
            return None  # 1-D, decided from the sequence length at the first call
        grid = tuple(grid)
        if block is not None:
            return BlockLayout(grid, _as_tuple(block, len(grid)), self.num_prefix_tokens)
        if num_blocks is not None:
            lay = layout_from_num_blocks(grid, num_blocks)
            return BlockLayout(lay.grid, lay.block, self.num_prefix_tokens)
        if block_size is not None and len(grid) == 1:
            return BlockLayout(grid, (block_size,), self.num_prefix_tokens)
        raise ValueError(f"MHLA with grid={grid} needs block=... or num_blocks=...")

    def _block_layout(self, grid):
        return None if self.causal else self._layout_for(grid)

    def _layout_for(self, grid: tuple[int, ...]) -> BlockLayout:
        if self.layout is not None and self.layout.grid == grid:
            return self.layout
        if self.layout is not None:
            # Same block shape on a new grid (e.g. another resolution): only valid if M is unchanged.
            lay = BlockLayout(grid, self.layout.block, self.num_prefix_tokens)
        elif len(grid) == 1 and self.block_size is not None:
            lay = layout_1d(grid[0], self.block_size)
        else:
            if grid[0] % self._num_blocks:
                raise ValueError(
                    f"MHLA: {grid[0]} tokens do not split into num_blocks={self._num_blocks} equal blocks"
                )
            lay = layout_1d(grid[0], grid[0] // self._num_blocks)
        if lay.num_blocks != self.mixing.num_blocks:
            raise ValueError(
                f"MHLA was built for {self.mixing.num_blocks} blocks but grid {grid} with block "
                f"{lay.block} has {lay.num_blocks}; rebuild the layer (or keep the block count fixed)"
            )
        return lay

    def _core(self, q, k, v, x, grid, cache, attn_mask):
        if attn_mask is not None:
            raise ValueError("MultiHeadLinearAttention does not take attn_mask")
        phi = self.feature_map
        q, k = phi(q), phi(k)
        if self.causal:
            return self._causal(q, k, v, cache)
        P = self.num_prefix_tokens
        layout = self._layout_for(grid)
        mixing = self.mixing()
        qp = q[:, :P]
        og = mhla_attention(q[:, P:], k[:, P:], v[:, P:], mixing.to(q.dtype), layout.block_size,
                            normalize=self.normalize, eps=self.eps, backend=self.backend)
        if not P:
            return og
        op = linear_attention(qp, k, v, normalize=self.normalize is not False, eps=self.eps)
        return torch.cat([op, og], dim=1)

    def _causal(self, q, k, v, cache: AttentionCache | None):
        C = self.block_size
        seen = cache.attn.num_tokens if (cache is not None and cache.attn is not None) else 0
        n_blocks = ceil_div(seen + q.shape[1], C)
        mixing = self.mixing(n_blocks).to(q.dtype)
        if cache is None:
            return mhla_attention(q, k, v, mixing, C, causal=True, normalize=self.normalize, eps=self.eps,
                                  backend=self.backend)
        state: MHLAState | None = cache.attn
        if q.shape[1] == 1 and state is not None:
            o, cache.attn = mhla_decode_step(q, k, v, mixing, state, normalize=self.normalize, eps=self.eps)
            return o
        o, cache.attn = mhla_attention(q, k, v, mixing, C, causal=True, normalize=self.normalize,
                                       eps=self.eps, backend="torch", initial_state=state,
                                       output_final_state=True)
        return o

    def _core_varlen(self, q, k, v, cache, cu_seqlens):
        q, k = self.feature_map(q), self.feature_map(k)
        C = self.block_size
        states = self._varlen_states(cache, "attn", cu_seqlens)
        bounds = sequence_bounds(cu_seqlens)
        seen = [s.num_tokens if s is not None else 0 for s in states] if states else [0] * len(bounds)
        mixing = self.mixing(max(ceil_div(p + e - b, C) for p, (b, e) in zip(seen, bounds))).to(q.dtype)
        kw = dict(normalize=self.normalize, eps=self.eps)
        if cache is None:
            return mhla_attention(q, k, v, mixing, C, causal=True, cu_seqlens=cu_seqlens, backend=self.backend,
                                  **kw)
        if states is not None and all(e - b == 1 and s is not None for (b, e), s in zip(bounds, states)):
            # decoding: one token per sequence, each with its own cached prefix
            o, cache.attn = run_varlen(lambda q, k, v, st, _: mhla_decode_step(q, k, v, mixing, st, **kw),
                                       (q, k, v), cu_seqlens, initial_state=states, output_final_state=True)
            return o
        o, cache.attn = mhla_attention(q, k, v, mixing, C, causal=True, cu_seqlens=cu_seqlens, backend="torch",
                                       initial_state=states, output_final_state=True, **kw)
        return o


@register_attention("linear")
class LinearAttention(AttentionBase):
    """Plain (normalized) linear attention with the shared constructor: one global summary per head."""

    def _core(self, q, k, v, x, grid, cache, attn_mask):
        if attn_mask is not None:
            raise ValueError("LinearAttention does not take attn_mask")
        q, k = self.feature_map(q), self.feature_map(k)
        norm = self.normalize is not False
        if not self.causal:
            return linear_attention(q, k, v, normalize=norm, eps=self.eps)
        if cache is None:
            return linear_attention(q, k, v, causal=True, normalize=norm, eps=self.eps)
        o, cache.attn = linear_attention(q, k, v, causal=True, normalize=norm, eps=self.eps,
                                         initial_state=cache.attn, output_final_state=True)
        return o

    def _core_varlen(self, q, k, v, cache, cu_seqlens):
        q, k = self.feature_map(q), self.feature_map(k)
        kw = dict(causal=True, normalize=self.normalize is not False, eps=self.eps, cu_seqlens=cu_seqlens)
        if cache is None:
            return linear_attention(q, k, v, **kw)
        o, cache.attn = linear_attention(q, k, v, initial_state=self._varlen_states(cache, "attn", cu_seqlens),
                                         output_final_state=True, **kw)
        return o


@register_attention("softmax")
class SoftmaxAttention(AttentionBase):
    """Softmax attention (PyTorch SDPA: FlashAttention / memory-efficient kernels on CUDA).

    ``feature_map`` and ``normalize`` are ignored; the scale is ``head_dim ** -0.5``.
    """

    def __init__(self, dim: int, num_heads: int = 8, **kwargs):
        kwargs.pop("feature_map", None)
        super().__init__(dim, num_heads, feature_map="identity", **kwargs)

    def _core(self, q, k, v, x, grid, cache, attn_mask):
        if cache is None:
            return softmax_attention(q, k, v, causal=self.causal, attn_mask=attn_mask)
        o, cache.attn = self._attend_cached(q, k, v, cache.attn, attn_mask)
        return o

    @staticmethod
    def _attend_cached(q, k, v, past, attn_mask=None):
        """Causal attention of a chunk ``q, k, v: [B, T, H, *]`` after the cached ``past = (k, v)`` (or None)
        -> ``(o [B, T, H, Dv], (k, v) with the chunk appended)``."""
        if past is not None:
            k = torch.cat([past[0], k], dim=1)
            v = torch.cat([past[1], v], dim=1)
        Tq, Tk = q.shape[1], k.shape[1]
        if Tq == 1:
            return softmax_attention(q, k, v, attn_mask=attn_mask), (k, v)
        # Chunk after a prefix: query i sits at position Tk - Tq + i.
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
        return softmax_attention(q, k, v, attn_mask=mask), (k, v)

    def _core_varlen(self, q, k, v, cache, cu_seqlens):
        if cache is None:
            return softmax_attention(q, k, v, causal=True, cu_seqlens=cu_seqlens)
        o, cache.attn = run_varlen(lambda q, k, v, past, _: self._attend_cached(q, k, v, past), (q, k, v),
                                   cu_seqlens, initial_state=self._varlen_states(cache, "attn", cu_seqlens),
                                   output_final_state=True, empty_state=lambda: (k[:, :0], v[:, :0]))
        return o
