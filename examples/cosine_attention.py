"""Cosine linear attention: the worked example of docs/adding_an_attention.md.

Linear attention whose features are the ReLU of the unit-normalised query / key, scaled by a learnable
temperature per head: ``phi(x) = relu(tau_h * x / |x|) + 1e-6``. Bounded features keep the attention from being
dominated by a few large keys. Everything else (normaliser, causal form, decoding, packed sequences) is plain
linear attention's, inherited.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mhla.layers import LinearAttention
from mhla.registry import Supports, register_attention


@register_attention("cosine")
class CosineLinearAttention(LinearAttention):
    """``phi(x) = relu(tau_h * x / |x|) + 1e-6`` per head ``h``; ``temperature``: the initial ``tau``."""

    supports = Supports(bidirectional=True, grid_ranks=(1, 2, 3), causal=True, prefix_tokens=True, decoding=True,
                        varlen=True, rope=True, host_projections=True)
    excluded_options = ("feature_map",)  # the class's own: attn.feature_map is refused, not ignored
    plot_label, benchmark = "Cosine", True  # its name in plots; timed by the benchmarks (mhla/registry.py)

    def __init__(self, dim: int, num_heads: int = 8, *, temperature: float = 4.0, **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        self.temperature = nn.Parameter(torch.full((num_heads, 1), float(temperature)))
        self.feature_map = self.cosine_features

    def cosine_features(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, N, H, D]`` -> ``relu(tau_h * x / |x|) + 1e-6``, same shape."""
        return F.relu(self.temperature * F.normalize(x, dim=-1)) + 1e-6

    def settings(self) -> dict:
        return {**super().settings(), "feature_map": "cosine", "temperature": float(self.temperature.detach().mean())}
