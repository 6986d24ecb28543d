"""Inputs, a forward-and-backward driver and the error measure shared by the Triton kernel tests.

Import it after :mod:`helpers.triton_env` (which sets ``TRITON_INTERPRET`` on a CPU), as ``mhla.ops`` is imported here."""

from __future__ import annotations

import torch

from mhla.ops import mhla_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def make_inputs(B, T, H, D, Dv, M, *, per_head, dtype, seed=0, device=DEVICE):
    """``[q, k, v [B, T, H, D / Dv] in dtype, mixing [M, M] or [H, M, M], w [B, T, H, Dv]]`` (fp32 mixing and
    weights of the loss ``sum(o * w)``), seeded."""
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(B, T, H, D, generator=g)
    k = torch.rand(B, T, H, D, generator=g)
    v = torch.randn(B, T, H, Dv, generator=g)
    mix = torch.rand(*((H, M, M) if per_head else (M, M)), generator=g)
    w = torch.randn(B, T, H, Dv, generator=g)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v)] + [mix.to(device), w.to(device)]


def run(backend, q, k, v, mix, w, block_size, **kw):
    """Output and gradients (q, k, v, mixing) of ``sum(o * w)``."""
    xs = [x.detach().clone().requires_grad_() for x in (q, k, v, mix)]
    o = mhla_attention(*xs[:3], xs[3], block_size, backend=backend, **kw)
    (o.float() * w).sum().backward()
    return [o.detach()] + [x.grad for x in xs]


def rel_err(a, b):
    """max |a - b| / max(max |b|, 1)."""
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()
