"""The Table 2 baseline attentions, built from ``docs/baselines.md`` (FLatten to RALA, quoted baselines).

All four share the constructor and forward of :mod:`mhla.layers` and register themselves by name:

    ``focused``  Focused Linear Attention (FLatten, ICCV'23)
    ``inline``   InLine attention (injective linear attention, NeurIPS'24)
    ``mala``     Magnitude-Aware Linear Attention (ICCV'25)
    ``rala``     Rank-Augmented Linear Attention (CVPR'25)

They need the token grid (``grid=(H, W)``) for their convolutions and positional terms. Class tokens are not
supported here (``num_prefix_tokens`` must be 0): MHLA's DeiT setting uses average pooling. As docs/baselines.md
notes, the published DeiT numbers of FLatten / InLine / MALA come from class-token models at 224 px; we
build them in the same "avg-pool + pad-to-256" setting as MHLA, so a re-run measures that setting (Table 2's
Focused LA cell runs 224 px unpadded, its positional encoding being per token; its InLine cell runs InLine's
6 heads through ``head_width``: the experiment configs say why).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .feature_maps import focused_feature, get_feature_map
from .layers import AttentionBase
from .ops.utils import accumulation_dtype
from .registry import Supports, register_attention
from .rope import apply_rope


# ----------------------------------------------------------------------------------------- 2-D RoPE
def rope_2d_angles(grid: tuple[int, int], head_dim: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """RALA/MALA's 2-D RoPE: ``(sin, cos)`` of shape ``[N, head_dim]`` for a raster ``grid``.

    Frequencies ``1 / 10000^linspace(0, 1, d/4)``, each repeated twice; the first ``d/2`` channels rotate
    with the row index, the last ``d/2`` with the column index; pairs are (even, odd) channels: apply with
    ``mhla.rope.apply_rope(x, cos[:, None], sin[:, None], interleaved=True)`` (note the ``(sin, cos)`` order
    returned here).
    """
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs head_dim divisible by 4, got {head_dim}")
    h, w = grid
    freqs = 1.0 / (10000 ** torch.linspace(0, 1, head_dim // 4, device=device))
    freqs = freqs.repeat_interleave(2)  # [d/2]
    rows = torch.arange(h, device=device, dtype=torch.float32)[:, None].expand(h, w).reshape(-1)
    cols = torch.arange(w, device=device, dtype=torch.float32)[None, :].expand(h, w).reshape(-1)
    angles = torch.cat([rows[:, None] * freqs, cols[:, None] * freqs], dim=-1)  # [N, d]
    return angles.sin(), angles.cos()


def _acc(x: torch.Tensor) -> torch.Tensor:
    """Compute in fp32 for half inputs, keep fp32/fp64 as they are."""
    return x.to(accumulation_dtype(x.dtype))


class _GridBaseline(AttentionBase):
    """Vision attentions over a 2-D grid: no prefix tokens, no causal form (declared in ``supports``)."""

    supports = Supports(bidirectional=True, grid_ranks=(2,))

    def __init__(self, dim: int, num_heads: int = 8, **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        if self.grid is None or len(self.grid) != 2:
            raise ValueError(f"{type(self).__name__} needs the 2-D token grid: pass grid=(H, W)")

    def settings(self) -> dict:
        out = super().settings()
        if hasattr(self, "feature_map_name"):
            out["feature_map"] = self.feature_map_name
        return out

    def _set_feature_map(self, name: str) -> None:
        self.feature_map_name = name
        self.feature_map = get_feature_map(name)

    @staticmethod
    def _depthwise_on_grid(conv: nn.Module, v: torch.Tensor, grid) -> torch.Tensor:
        """Apply ``conv`` (depthwise, channels ``c``) to ``v: [B', N, c]`` on ``grid`` -> ``[B', N, c]``."""
        b, n, c = v.shape
        y = conv(v.transpose(1, 2).reshape(b, c, *grid))
        return y.reshape(b, c, n).transpose(1, 2)


@register_attention("focused")
class FocusedLinearAttention(_GridBaseline):
    """FLatten's focused linear attention (docs/baselines.md#flatten; their 2024 mean-normalised form).

    phi_p(x) = f_p(relu(x) + 1e-6) / softplus(scale), the power ``p`` and norm restoration over the full
    ``C``-dim vector before the head split; a learnable positional encoding (zero-init) added to K before
    the kernel; one depthwise ``kernel x kernel`` conv on V shared by all heads, added to the output.
    """

    def __init__(self, dim: int, num_heads: int = 8, *, focusing_factor: float = 3.0, dwc_kernel: int = 5,
                 **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        n = math.prod(self.grid)
        inner = num_heads * self.head_dim
        self.focusing_factor = focusing_factor
        self.positional_encoding = nn.Parameter(torch.zeros(1, n, inner))
        self.scale = nn.Parameter(torch.zeros(1, 1, inner))
        self.dwc = nn.Conv2d(self.value_dim, self.value_dim, dwc_kernel, padding=dwc_kernel // 2,
                             groups=self.value_dim)

    def settings(self) -> dict:
        return {**super().settings(), "focusing_factor": self.focusing_factor,
                "dwc_kernel": self.dwc.kernel_size[0]}

    def attend(self, q, k, v, *, grid, rope_tables=None, cache=None, attn_mask=None, x=None):
        B, N, H, D = q.shape
        if N != self.positional_encoding.shape[1]:
            raise ValueError(f"FocusedLinearAttention was built for {self.positional_encoding.shape[1]} tokens")
        k = k.reshape(B, N, H * D) + self.positional_encoding
        q = q.reshape(B, N, H * D)
        scale = F.softplus(self.scale)
        q = focused_feature(q, self.focusing_factor) / scale
        k = focused_feature(k, self.focusing_factor) / scale
        q, k = _acc(q.view(B, N, H, D)), _acc(k.view(B, N, H, D))
        kv = torch.einsum("bnhd,bnhe->bhde", k / N**0.5, _acc(v) / N**0.5)
        z = 1.0 / (torch.einsum("bnhd,bhd->bnh", q, k.mean(1)) + 1e-6)
        out = torch.einsum("bnhd,bhde->bnhe", q, kv) * z.unsqueeze(-1)
        local = self._depthwise_on_grid(self.dwc, v.permute(0, 2, 1, 3).reshape(B * H, N, -1), grid)
        return (out + local.reshape(B, H, N, -1).permute(0, 2, 1, 3)).to(v.dtype)


@register_attention("inline")
class InLineAttention(_GridBaseline):
    """InLine attention (docs/baselines.md#inline): injective (subtractive) normalisation, phi = identity.

    ``x_i = q_i kv + (1 - q_i . kbar * s) vbar`` with ``kv = sum_j k_j^T v_j * s / N``, ``s = d^-1/2``
    (weights sum to 1 for every query, may be negative), plus a dynamic per-sample 3 x 3 depthwise conv
    on V whose kernel an MLP predicts from the mean token.

    ``head_width``: InLine's own channels per head, in place of the model's head count (``num_heads = dim //
    head_width``): InLine-DeiT-T runs 6 heads of 32 where DeiT-T has 3 of 64, and its residual MLP
    (``10 C^2 / heads`` parameters) is what makes the paper's 6.5M. None: the model's ``num_heads``.
    """

    @classmethod
    def tag_words(cls, options: dict) -> list[str]:
        """Its own channels per head in a run's tag (``-hw32``; mhla.registry.attention_tag)."""
        return [f"-hw{options['head_width']}"] if options.get("head_width") else []

    def __init__(self, dim: int, num_heads: int = 8, *, feature_map: str = "identity", head_width: int | None = None,
                 **kwargs):
        if head_width:
            if dim % int(head_width):
                raise ValueError(f"InLine head_width={head_width} does not divide the width {dim}")
            num_heads = dim // int(head_width)
        super().__init__(dim, num_heads, **kwargs)
        self._set_feature_map(feature_map)
        self.head_width = dim // num_heads
        c = num_heads * self.value_dim
        self.residual = nn.Sequential(
            nn.Conv1d(dim, c, 1, groups=num_heads if dim % num_heads == 0 else 1),
            nn.GELU(),
            nn.Conv1d(c, 9 * c, 1, groups=num_heads),
        )

    def settings(self) -> dict:
        return {**super().settings(), "head_width": self.head_width}

    def attend(self, q, k, v, *, grid, rope_tables=None, cache=None, attn_mask=None, x=None):
        B, N, H, D = q.shape
        q, k, vf = _acc(self.feature_map(q)), _acc(self.feature_map(k)), _acc(v)
        s = D**-0.5
        kv = torch.einsum("bnhd,bnhe->bhde", k, vf) * (s / N)
        qk_bar = torch.einsum("bnhd,bhd->bnh", q, k.mean(1)) * s
        out = torch.einsum("bnhd,bhde->bnhe", q, kv) + (1 - qk_bar).unsqueeze(-1) * vf.mean(1, keepdim=True)
        c = H * v.shape[-1]
        kernels = self.residual(x.mean(1).unsqueeze(-1)).reshape(B * c, 1, 3, 3)  # from the mean token [B, C]
        vg = v.reshape(B, N, c).transpose(1, 2).reshape(1, B * c, *grid)
        local = F.conv2d(vg, kernels.to(vg.dtype), padding=1, groups=B * c)
        local = local.reshape(B, c, N).transpose(1, 2).reshape(B, N, H, -1)
        return (out + _acc(local)).to(v.dtype)


class _GatedRoPEBaseline(_GridBaseline):
    """MALA / RALA wrapper: ELU+1 features, 2-D RoPE in the numerator, ``(Y + LePE_5x5(V)) * O`` with a linear
    output gate ``O = W_o x`` (no activation), then the output projection."""

    legacy_options = {"rope": "rope_2d"}  # a config stored before the schema named its 2-D RoPE switch attn.rope

    def __init__(self, dim: int, num_heads: int = 8, *, feature_map: str = "elu", rope_2d: bool = True,
                 lepe_kernel: int = 5, **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        self._set_feature_map(feature_map)
        c = num_heads * self.value_dim
        self.rope_2d = rope_2d
        self.lepe = nn.Conv2d(c, c, lepe_kernel, padding=lepe_kernel // 2, groups=c)
        self.out_gate = nn.Linear(dim, c)

    def settings(self) -> dict:
        return {**super().settings(), "rope_2d": self.rope_2d, "lepe_kernel": self.lepe.kernel_size[0]}

    def _rotate_2d(self, q, k, grid):
        if not self.rope_2d:
            return q, k
        sin, cos = rope_2d_angles(grid, q.shape[-1], device=q.device)
        cos, sin = cos[:, None], sin[:, None]  # [N, 1, d]
        return apply_rope(q, cos, sin, interleaved=True), apply_rope(k, cos, sin, interleaved=True)

    def _wrap(self, y, v, x, grid):
        """``(y + LePE(v)) * W_o x``: y, v ``[B, N, H, Dv]``, input ``x: [B, N, C]`` -> ``[B, N, H, Dv]``."""
        B, N, H, Dv = v.shape
        local = self._depthwise_on_grid(self.lepe, v.reshape(B, N, H * Dv), grid).reshape(B, N, H, Dv)
        gate = self.out_gate(x).reshape(B, N, H, Dv)
        return ((y + _acc(local)) * _acc(gate)).to(v.dtype)


@register_attention("mala")
class MagnitudeAwareLinearAttention(_GatedRoPEBaseline):
    """MALA (docs/baselines.md#mala): ``Y_i = rho(q_i) kv (1 + 1/(z_i + 1e-6)) - z_i vbar`` with
    ``z_i = phi(q_i) . mean_j phi(k_j) d^-1/2`` (un-rotated) and ``kv = sum_j rho(phi(k_j))^T v_j d^-1/2 / N``."""

    def attend(self, q, k, v, *, grid, rope_tables=None, cache=None, attn_mask=None, x=None):
        B, N, H, D = q.shape
        q, k, vf = _acc(self.feature_map(q)), _acc(self.feature_map(k)), _acc(v)
        s = D**-0.5
        z = torch.einsum("bnhd,bhd->bnh", q, k.mean(1)) * s
        qr, kr = self._rotate_2d(q, k, grid)
        kv = torch.einsum("bnhd,bnhe->bhde", kr, vf) * (s / N)
        y = torch.einsum("bnhd,bhde->bnhe", qr, kv) * (1 + 1 / (z + 1e-6)).unsqueeze(-1)
        y = y - z.unsqueeze(-1) * vf.mean(1, keepdim=True)
        return self._wrap(y, v, x, grid)


@register_attention("rala")
class RankAugmentedLinearAttention(_GatedRoPEBaseline):
    """RALA (docs/baselines.md#rala): token weights ``alpha = softmax_j(mean(phi(q)) . phi(k_j) d^-1/2)``,
    ``k~_j = N alpha_j phi(k_j)``, ``Y_i = rho(phi(q_i)) [sum_j rho(k~_j)^T v_j / N] / (phi(q_i) . mean_j k~_j + 1e-6)``."""

    def attend(self, q, k, v, *, grid, rope_tables=None, cache=None, attn_mask=None, x=None):
        B, N, H, D = q.shape
        q, k, vf = _acc(self.feature_map(q)), _acc(self.feature_map(k)), _acc(v)
        alpha = torch.softmax(torch.einsum("bhd,bnhd->bhn", q.mean(1), k) * D**-0.5, dim=-1)
        kt = k * (N * alpha).transpose(1, 2).unsqueeze(-1)
        z = 1.0 / (torch.einsum("bnhd,bhd->bnh", q, kt.mean(1)) + 1e-6)
        qr, ktr = self._rotate_2d(q, kt, grid)
        kv = torch.einsum("bnhd,bnhe->bhde", ktr, vf) / N
        y = torch.einsum("bnhd,bhde->bnhe", qr, kv) * z.unsqueeze(-1)
        return self._wrap(y, v, x, grid)
