"""Attention layers and the registry."""

import pytest
import torch

from mhla.layers import AttentionCache, LinearAttention, MultiHeadLinearAttention, SoftmaxAttention
from mhla.layouts import layout_2d, layout_3d
from mhla.ops import mhla_reference
from mhla.registry import build_attention, get_attention_class, list_attentions, register_attention

torch.manual_seed(0)


def test_registry_names_and_errors():
    assert {"mhla", "linear", "softmax"} <= set(list_attentions())
    assert get_attention_class("mhla") is MultiHeadLinearAttention
    with pytest.raises(ValueError, match="unknown attention 'nope'"):
        build_attention("nope", 32, 4)
    with pytest.raises(ValueError, match="does not take"):
        build_attention({"name": "linear", "bogus_option": 1}, 32, 4)
    with pytest.raises(ValueError, match="needs a 'name'"):
        build_attention({"grid": [4, 4]}, 32, 4)
    with pytest.raises(ValueError, match="already registered"):
        register_attention("mhla")(LinearAttention)


def test_registry_imports_nothing_from_the_package_and_import_mhla_fills_it():
    """mhla/registry.py is a leaf (layers register themselves where they are defined); ``import mhla`` alone
    registers the three layers, the four Table 2 baselines, GLA and the three cross-attentions."""
    import ast
    import pathlib
    import subprocess
    import sys

    import mhla.registry

    tree = ast.parse(pathlib.Path(mhla.registry.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and not (node.module or "").startswith("mhla"), ast.dump(node)
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("mhla") for a in node.names), ast.dump(node)
    out = subprocess.run([sys.executable, "-c", "import mhla; print(' '.join(mhla.list_attentions()))"],
                         capture_output=True, text=True, check=True,
                         cwd=pathlib.Path(__file__).resolve().parents[2]).stdout.split()
    assert out == ["focused", "gla", "inline", "linear", "linear_cross", "mala", "mhla", "mhla_cross", "rala",
                   "softmax", "softmax_cross"]


@pytest.mark.parametrize("name", ["mhla", "linear", "softmax"])
def test_every_layer_shares_constructor_and_forward(name):
    cfg = {"name": name, "qk_norm": True, "cpe": True, "gate": True, "grid": [8, 8]}
    if name == "mhla":
        cfg["block"] = [4, 4]
    layer = build_attention(cfg, dim=32, num_heads=4)
    x = torch.randn(2, 64, 32)
    y = layer(x)
    assert y.shape == x.shape
    y.sum().backward()
    assert all(p.grad is not None for p in layer.parameters() if p.requires_grad)


def _manual_mhla(layer, x, layout):
    """The layer's computation spelled out with the dense reference, on raster tokens."""
    B, N, _ = x.shape
    H, D = layer.num_heads, layer.head_dim
    q, k, v = layer.qkv(x).split([H * D, H * D, H * D], dim=-1)
    q = torch.relu(q.view(B, N, H, D)) + 1e-6
    k = torch.relu(k.view(B, N, H, D)) + 1e-6
    v = v.view(B, N, H, D)
    perm = layout.permutation()
    o = mhla_reference(q[:, perm], k[:, perm], v[:, perm], layer.mixing().double(), layout.block_size)
    o = o[:, layout.inverse_permutation()]
    return layer.proj(o.reshape(B, N, H * D))


def test_mhla_layer_2d_equals_dense_definition_on_raster_tokens():
    layer = MultiHeadLinearAttention(16, 2, grid=(8, 12), block=(4, 3)).double()
    x = torch.randn(2, 96, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(x), _manual_mhla(layer, x, layout_2d(8, 12, 4, 3)))


def test_mhla_layer_3d_equals_dense_definition_on_raster_tokens():
    layer = MultiHeadLinearAttention(16, 2, grid=(4, 4, 6), block=(2, 2, 3)).double()
    x = torch.randn(1, 96, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(x), _manual_mhla(layer, x, layout_3d(4, 4, 6, 2, 2, 3)))


def test_mhla_layer_prefix_tokens():
    layer = MultiHeadLinearAttention(16, 2, grid=(4, 4), block=(2, 2), num_prefix_tokens=1).double()
    x = torch.randn(2, 17, 16, dtype=torch.float64)
    y = layer(x)
    assert y.shape == x.shape
    # Grid outputs do not depend on the prefix token (grid tokens read grid tokens only) ...
    x2 = x.clone()
    x2[:, 0] = torch.randn(2, 16, dtype=torch.float64)
    y2 = layer(x2)
    torch.testing.assert_close(y[:, 1:], y2[:, 1:])
    # ... and the prefix token reads everything (linear attention over all tokens).
    assert (y[:, 0] - y2[:, 0]).abs().max() > 1e-6


def test_mhla_layer_grid_that_blocks_do_not_tile_raises():
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadLinearAttention(16, 2, grid=(14, 14), block=(4, 4))
    layer = MultiHeadLinearAttention(16, 2, grid=(8, 8), block=(4, 4))
    with pytest.raises(ValueError, match="grid tokens"):
        layer(torch.randn(1, 60, 16))


def test_mhla_layer_new_resolution_keeps_the_block_grid():
    """Another resolution keeps the 2 x 2 block grid (so the mixing matrix keeps its meaning) and the block
    shape follows the grid, as in the diffusers adapter; a grid the blocks do not tile is refused."""
    layer = MultiHeadLinearAttention(16, 2, grid=(8, 8), num_blocks=4)
    assert layer(torch.randn(1, 64, 16)).shape == (1, 64, 16)
    assert layer(torch.randn(1, 144, 16), grid_size=(12, 12)).shape == (1, 144, 16)
    assert layer.layout_for((12, 12)).block == (6, 6)
    with pytest.raises(ValueError, match="do not tile"):
        layer(torch.randn(1, 63, 16), grid_size=(9, 7))


def test_mixing_gets_gradient_and_identity_equals_block_local():
    layer = MultiHeadLinearAttention(16, 2, grid=(4, 4), block=(2, 2), mixing_init="identity")
    x = torch.randn(2, 16, 16)
    layer(x).pow(2).sum().backward()
    grads = [p.grad for n, p in layer.named_parameters() if "mixing" in n]
    assert grads and grads[0].abs().sum() > 0


@pytest.mark.parametrize("cls", [MultiHeadLinearAttention, LinearAttention, SoftmaxAttention])
@pytest.mark.parametrize("cpe", [False, True])
def test_causal_layers_decode_with_cache_equals_full_forward(cls, cpe):
    kw = dict(causal=True, cpe=cpe, gate=True, qk_norm=True)
    if cls is MultiHeadLinearAttention:
        kw.update(block_size=4, max_learned_blocks=3)  # 23 tokens = 6 blocks: beyond the learned 3
    layer = cls(16, 2, **kw).double()
    x = torch.randn(2, 23, 16, dtype=torch.float64)
    full = layer(x)
    cache = AttentionCache()
    parts = [layer(x[:, :9], cache=cache)]
    for t in range(9, 23):
        parts.append(layer(x[:, t : t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-9, atol=1e-9)


def test_causal_layer_ignores_future():
    layer = MultiHeadLinearAttention(16, 2, causal=True, block_size=4, cpe=True).double()
    x = torch.randn(1, 30, 16, dtype=torch.float64)
    x2 = x.clone()
    x2[:, 20:] += 1.0
    torch.testing.assert_close(layer(x)[:, :20], layer(x2)[:, :20])


def test_timm_style_construction_kwargs():
    layer = MultiHeadLinearAttention(
        32, num_heads=4, qkv_bias=True, qk_norm=True, scale_norm=False, proj_bias=True, attn_drop=0.0,
        proj_drop=0.0, norm_layer=torch.nn.LayerNorm, num_blocks=4, grid=(4, 4),
    )
    assert layer(torch.randn(1, 16, 32), attn_mask=None).shape == (1, 16, 32)
    with pytest.raises(ValueError, match="scale_norm"):
        LinearAttention(32, 4, scale_norm=True)
    with pytest.raises(ValueError, match="is_causal"):
        layer(torch.randn(1, 16, 32), is_causal=True)


def test_linear_gate_is_ralas_wrapper():
    """gate="linear": out = proj((o + cpe) * (W_o x + b)), no output norm; gate=True stays GLA-style."""
    import torch.nn.functional as F  # noqa: PLC0415

    from mhla.layers import MultiHeadLinearAttention  # noqa: PLC0415

    torch.manual_seed(0)
    layer = MultiHeadLinearAttention(16, 2, grid=(4, 4), num_blocks=4, cpe=True, cpe_kernel=5, gate="linear").double()
    assert layer.out_norm is None and layer.gate.bias is not None
    x = torch.randn(2, 16, 16, dtype=torch.float64)
    o = torch.randn(2, 16, 2, 8, dtype=torch.float64)
    cpe_out = torch.randn(2, 16, 16, dtype=torch.float64)
    want = layer.proj((o.reshape(2, 16, 16) + cpe_out) * F.linear(x, layer.gate.weight, layer.gate.bias))
    torch.testing.assert_close(layer._finish(o, x, cpe_out), want)
    assert MultiHeadLinearAttention(16, 2, num_blocks=4, gate=True).gate_kind == "swish"
    with pytest.raises(ValueError, match="gate must be"):
        MultiHeadLinearAttention(16, 2, num_blocks=4, gate="sigmoid")
