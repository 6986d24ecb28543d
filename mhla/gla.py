"""Gated linear attention (GLA; Yang et al., ICML 2024) as DiG uses it, registered as ``attn=gla``.

``S_t = diag(a_t) S_{t-1} + k_t^T v_t``, ``o_t = (q_t / sqrt(d_k)) S_t`` with a low-rank data-dependent forget gate
``log a_t = logsigmoid(x W1 W2 + b) / 16`` (``W1: C x 16``, ``W2: 16 x d_k``), ``d_k = C / 2``, ``d_v = C`` over ``H``
heads; q, k, v, g projections without bias; output ``W_o(RMSNorm_head(o) * swish(x W_g))``.

* the op is :mod:`mhla.ops.gla` (:func:`~mhla.ops.gla.gla_chunked`, the torch chunked form; the token-by-token
  reference :func:`~mhla.ops.gla.gla_reference`; fla's Triton ``chunk_gla`` on CUDA when flash-linear-attention
  imports: ``backend="auto" | "torch" | "fla"``, :func:`~mhla.ops.gla.resolve_gla_backend`).
* :class:`GatedLinearAttention` (``attn=gla``) runs the recurrence over the tokens in the order it is given them
  (a scan): DiG (:mod:`models.dig`) permutes the tokens into each block's scan direction around it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .ops.gla import GLA_BACKENDS, gla, gla_reference, resolve_gla_backend
from .registry import Supports, register_attention



# ------------------------------------------------------------------------------------------- GLA ops
@register_attention("gla")
class GatedLinearAttention(nn.Module):
    """GLA as DiG uses it (fla's ``GatedLinearAttention`` with ``expand_k=0.5, expand_v=1``, gate rank 16,
    gate normaliser 16, ``swish`` output gate, per-head RMSNorm).

    ``forward(x: [B, N, C]) -> [B, N, C]``; causal over the given token order (a scan: it runs on any token grid,
    in the order the model gives it; no decode cache). ``chunk``: chunk length of :func:`gla_chunked`;
    ``mode="recurrent"`` uses the token loop (tests). ``backend``: ``"auto"`` (fla's ``chunk_gla`` for CUDA
    inputs when fla imports, else torch), ``"torch"`` or ``"fla"`` (:func:`gla`); :meth:`resolved_backend` says
    which one a given input runs on.
    """

    supports = Supports(bidirectional=True, grid_ranks=(1, 2, 3))

    def __init__(self, dim: int, num_heads: int = 8, *, expand_k: float = 0.5, expand_v: float = 1.0,
                 gate_rank: int = 16, gate_norm: float = 16.0, chunk: int = 16, mode: str = "chunk",
                 backend: str = "auto"):
        super().__init__()
        if backend not in GLA_BACKENDS:
            raise ValueError(f"GLA backend must be one of {GLA_BACKENDS}, got {backend!r}")
        self.backend = backend
        self.key_dim, self.value_dim = int(dim * expand_k), int(dim * expand_v)
        if self.key_dim % num_heads or self.value_dim % num_heads:
            raise ValueError(f"GLA: key dim {self.key_dim} / value dim {self.value_dim} not divisible by {num_heads}")
        self.num_heads, self.gate_norm, self.chunk, self.mode = num_heads, gate_norm, chunk, mode
        self.q_proj = nn.Linear(dim, self.key_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.key_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.value_dim, bias=False)
        self.g_proj = nn.Linear(dim, self.value_dim, bias=False)
        self.gk_proj = nn.Sequential(nn.Linear(dim, gate_rank, bias=False), nn.Linear(gate_rank, self.key_dim))
        self.g_norm = nn.RMSNorm(self.value_dim // num_heads, eps=1e-5)
        self.o_proj = nn.Linear(self.value_dim, dim, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """fla's init: xavier-uniform with gain ``2^-2.5`` on the linear weights, zero biases."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight, gain=2 ** -2.5)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, chunk={self.chunk}, mode={self.mode!r}, backend={self.backend!r}"

    def settings(self) -> dict:
        """The options this layer runs with."""
        return {"expand_k": self.key_dim / self.q_proj.in_features, "expand_v": self.value_dim / self.q_proj.in_features,
                "gate_rank": self.gk_proj[0].out_features, "gate_norm": self.gate_norm, "chunk": self.chunk,
                "mode": self.mode, "backend": self.backend}

    def resolved_backend(self, x: torch.Tensor) -> str:
        """``"recurrent"``, ``"torch"`` or ``"fla"``: what :meth:`forward` runs for an input like ``x``."""
        return "recurrent" if self.mode == "recurrent" else resolve_gla_backend(self.backend, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        H = self.num_heads
        q = self.q_proj(x).view(B, N, H, -1)
        k = self.k_proj(x).view(B, N, H, -1)
        v = self.v_proj(x).view(B, N, H, -1)
        log_a = (F.logsigmoid(self.gk_proj(x)) / self.gate_norm).view(B, N, H, -1)
        if self.mode == "recurrent":
            o = gla_reference(q, k, v, log_a)
        else:
            o = gla(q, k, v, log_a, self.chunk, backend=self.backend)
        o = self.g_norm(o).reshape(B, N, -1) * F.silu(self.g_proj(x))
        return self.o_proj(o)
