"""Table 2 baseline attentions: build, train a step, and their defining properties."""

import pytest
import torch

from mhla.baselines import rope_2d_angles
from mhla.registry import build_attention
from mhla.rope import apply_rope

GRID = (4, 4)


@pytest.mark.parametrize("name", ["focused", "inline", "mala", "rala"])
def test_build_forward_backward(name):
    layer = build_attention({"name": name, "grid": list(GRID)}, dim=32, num_heads=2)
    x = torch.randn(2, 16, 32)
    y = layer(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.pow(2).mean().backward()
    missing = [n for n, p in layer.named_parameters() if p.grad is None]
    assert not missing, missing


def _core_with_constant_v(layer, c=3.0):
    B, N, H, D = 2, 16, 2, 16
    q, k = torch.randn(B, N, H, D, dtype=torch.float64), torch.randn(B, N, H, D, dtype=torch.float64)
    v = torch.full((B, N, H, D), c, dtype=torch.float64)
    return q, k, v


def test_inline_weights_sum_to_one():
    layer = build_attention({"name": "inline", "grid": list(GRID)}, dim=32, num_heads=2).double()
    q, k, v = _core_with_constant_v(layer)
    x = torch.zeros(2, 16, 32, dtype=torch.float64)  # the layer input: its mean feeds the kernel MLP
    with torch.no_grad():
        for p in layer.residual.parameters():
            p.zero_()  # no local residual
    out = layer.attend(q, k, v, grid=GRID, x=x)
    torch.testing.assert_close(out, v)  # constant values pass through: sum_j w_ij = 1


def test_rala_normalised_without_rope():
    layer = build_attention({"name": "rala", "grid": list(GRID), "rope_2d": False}, dim=32, num_heads=2).double()
    q, k, v = _core_with_constant_v(layer)
    x = torch.zeros(2, 16, 32, dtype=torch.float64)  # the layer input of the output gate
    y = layer.attend(q, k, v, grid=GRID, x=x)
    # gate O = W_o 0 + b_o; the attention part returns v for constant v, LePE adds a conv of v
    assert torch.isfinite(y).all()
    qf, kf = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    alpha = torch.softmax(torch.einsum("bhd,bnhd->bhn", qf.mean(1), kf) / 4, -1)
    kt = kf * (16 * alpha).transpose(1, 2).unsqueeze(-1)
    w = torch.einsum("bnhd,bmhd->bhnm", qf, kt)
    torch.testing.assert_close(w.sum(-1) / (w.sum(-1)), torch.ones_like(w.sum(-1)))


def test_mala_sums_to_one_without_rope():
    """sum_j (beta_i a_ij - gamma_i) = 1 for MALA's weights (no RoPE)."""
    layer = build_attention({"name": "mala", "grid": list(GRID), "rope_2d": False}, dim=32, num_heads=2).double()
    q, k, v = _core_with_constant_v(layer, c=1.0)
    captured = {}
    layer._wrap = lambda y, v, x, grid: captured.setdefault("y", y)
    layer.attend(q, k, v, grid=GRID)
    torch.testing.assert_close(captured["y"], v, atol=1e-5, rtol=0)  # up to the 1e-6 eps in beta


def test_rope_is_a_rotation():
    sin, cos = rope_2d_angles((4, 4), 16)
    x = torch.randn(2, 16, 3, 16)
    y = apply_rope(x, cos[:, None], sin[:, None], interleaved=True)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    # relative: <R_m q, R_n k> depends on positions only through m - n for identical offsets
    assert not torch.allclose(y, x)


def test_baselines_need_grid_and_no_prefix():
    with pytest.raises(ValueError, match="grid"):
        build_attention("mala", dim=32, num_heads=2)
    with pytest.raises(ValueError, match="prefix"):
        build_attention({"name": "inline", "grid": [4, 4], "num_prefix_tokens": 1}, dim=32, num_heads=2)
