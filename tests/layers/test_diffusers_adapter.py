"""The diffusers adapter: the processor vs a dense token-level oracle in raster order, on tiny models, and the
processor against the library's own layer with the same weights (one MHLA layer)."""

from __future__ import annotations

import pytest
import torch

from mhla.adapters.diffusers import (
    AttentionProcessor,
    hybrid_layers,
    self_attention_modules,
    swap_self_attention,
    swapped_attentions,
)
from mhla.layers import LinearAttention, MultiHeadLinearAttention
from mhla.rope import RotaryTables
from mhla.layouts import BlockLayout, factorize_blocks, layout_for_grid, resolve_blocks
from mhla.mixing import mixing_init
from mhla.rope import apply_rope

diffusers = pytest.importorskip("diffusers")
from diffusers import WanTransformer3DModel  # noqa: E402
from diffusers.models.attention_processor import Attention  # noqa: E402


def tiny_wan(num_layers=3, dtype=torch.float64):
    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                  in_channels=4, out_channels=4, text_dim=8, freq_dim=16, ffn_dim=32,
                                  num_layers=num_layers, rope_max_seq_len=32)
    return model.to(dtype)


def dense_oracle(attn, x, grid, blocks, *, normalize, rope, rotary=None, kind="mhla", eps=1e-6):
    """Token view in RASTER order: W[t, s] = Mc[b(t), b(s)] * phi(q_t) . phi(k_s), no permutation involved."""
    B, N, _ = x.shape
    H = attn.heads
    q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
    if attn.norm_q is not None:
        q, k = attn.norm_q(q), attn.norm_k(k)
    q, k, v = (t.reshape(B, N, H, -1) for t in (q, k, v))
    rot = lambda t: apply_rope(t, *rotary, interleaved=True, upcast=True)  # noqa: E731
    if rotary is not None and rope == "before":
        q, k = rot(q), rot(k)
    q, k = torch.relu(q) + 1e-6, torch.relu(k) + 1e-6
    qn, kn = q, k
    if rotary is not None and rope == "after":
        qn, kn = rot(q), rot(k)
    if kind == "mhla":
        ids = layout_for_grid(grid, blocks).token_block_ids_raster()
        mc = attn.attention.mixing()[ids][:, ids]  # [N, N]
    else:
        mc = torch.ones(N, N, dtype=x.dtype)
    w_num = torch.einsum("bthd,bshd->bhts", qn, kn) * mc
    o = torch.einsum("bhts,bshe->bthe", w_num, v)
    if normalize:
        w_den = torch.einsum("bthd,bshd->bhts", q, k) * mc
        o = o / (w_den.sum(-1).transpose(1, 2).unsqueeze(-1) + eps)
    if attn.attention.out_norm is not None:
        o = attn.attention.out_norm(o)
    return attn.to_out[0](o.reshape(B, N, -1))


def capture_attn1(model, layer=0):
    """Record (input, rotary_emb, output) of a block's self-attention during a forward."""
    rec = {}
    attn = model.blocks[layer].attn1

    def hook(mod, args, kwargs, out):
        rec["x"], rec["rotary"], rec["y"] = args[0], args[3], out

    h = attn.register_forward_hook(hook, with_kwargs=True)
    return attn, rec, h


def wan_inputs(frames=4, h=8, w=12, batch=2, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 4, frames, h, w, generator=g, dtype=dtype)
    t = torch.tensor([100.0, 700.0][:batch], dtype=dtype)
    text = torch.randn(batch, 5, 8, generator=g, dtype=dtype)
    return x, t, text


@pytest.mark.parametrize("rope,normalize,out_norm", [
    ("before", True, False), ("after", False, True), ("after", True, False), ("none", False, True),
])
def test_wan_processor_matches_dense_oracle(rope, normalize, out_norm):
    model = tiny_wan()
    names = swap_self_attention(model, {"name": "mhla", "blocks": (2, 2, 3), "normalize": normalize,
                                        "out_norm": out_norm, "rope": rope})
    assert names == ["blocks.0.attn1", "blocks.1.attn1", "blocks.2.attn1"]
    with torch.no_grad():  # make the mixing matrix generic (not symmetric, not the init)
        model.blocks[0].attn1.attention.mixing.raw.uniform_(0.05, 1.0)
    attn, rec, h = capture_attn1(model)
    with torch.no_grad():
        model(*wan_inputs())
    h.remove()
    grid = (4, 4, 6)  # 4 frames, 8x12 latents with 2x2 patches
    assert rec["x"].shape[1] == 96
    ref = dense_oracle(attn, rec["x"], grid, (2, 2, 3), normalize=normalize, rope=rope, rotary=rec["rotary"])
    torch.testing.assert_close(rec["y"], ref, rtol=1e-9, atol=1e-10)


def test_wan_linear_kind_matches_dense():
    model = tiny_wan()
    swap_self_attention(model, {"name": "linear", "normalize": True, "rope": "before"})
    assert not [n for n, _ in model.named_parameters() if ".attention." in n]
    attn, rec, h = capture_attn1(model, layer=1)
    with torch.no_grad():
        model(*wan_inputs())
    h.remove()
    ref = dense_oracle(attn, rec["x"], None, None, normalize=True, rope="before", rotary=rec["rotary"], kind="linear")
    torch.testing.assert_close(rec["y"], ref, rtol=1e-9, atol=1e-10)


def test_generic_attention_2d_and_4d_input():
    """diffusers' generic Attention (what SANA's attn1 is): [B, N, C] with a fixed grid and [B, C, H, W]."""
    torch.manual_seed(0)
    attn = Attention(query_dim=16, heads=2, dim_head=8, bias=True).double()
    holder = torch.nn.ModuleDict({"attn1": attn, "attn2": Attention(query_dim=16, cross_attention_dim=6,
                                                                     heads=2, dim_head=8).double()})
    cross_proc = holder["attn2"].processor
    names = swap_self_attention(holder, {"name": "mhla", "num_blocks": 6}, grid=(4, 6), track_grid=False)
    assert names == ["attn1"] and holder["attn2"].processor is cross_proc  # cross-attention untouched
    assert attn.attention.blocks == (2, 3)
    x = torch.randn(2, 24, 16, dtype=torch.float64)
    y = attn(x)
    ref = dense_oracle(attn, x, (4, 6), (2, 3), normalize=True, rope="none")
    torch.testing.assert_close(y, ref, rtol=1e-9, atol=1e-10)
    x4 = x.transpose(1, 2).reshape(2, 16, 4, 6)
    torch.testing.assert_close(attn(x4), y.transpose(1, 2).reshape(2, 16, 4, 6))
    with pytest.raises(ValueError, match="self-attention"):
        attn(x, encoder_hidden_states=x)


def test_parameters_registered_train_and_save():
    model = tiny_wan(num_layers=3, dtype=torch.float32)
    cfg = {"name": "mhla", "blocks": (2, 2, 3), "normalize": False, "out_norm": True}
    swap_self_attention(model, cfg, layers=hybrid_layers(3))
    keys = [k for k in model.state_dict() if ".attention." in k]
    assert keys == ["blocks.0.attn1.attention.out_norm.weight", "blocks.0.attn1.attention.mixing.raw",
                    "blocks.1.attn1.attention.out_norm.weight", "blocks.1.attn1.attention.mixing.raw"]
    assert isinstance(model.blocks[2].attn1.processor, type(model.blocks[2].attn2.processor))  # softmax kept
    # locality init of the 3-D block grid, rows sum to 1 (not the release's constant init)
    expected = mixing_init("locality", BlockLayout((2, 2, 3), (1, 1, 1)).block_distances())
    torch.testing.assert_close(model.blocks[0].attn1.attention.mixing.raw.detach(), expected)
    assert expected.std() > 0.01
    x, t, text = wan_inputs(dtype=torch.float32)
    model(x, t, text).sample.square().mean().backward()
    for layer in swapped_attentions(model).values():
        for p in layer.parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0
    state = model.state_dict()
    clone = tiny_wan(num_layers=3, dtype=torch.float32)
    swap_self_attention(clone, cfg, layers=hybrid_layers(3))
    clone.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(clone(x, t, text).sample, model(x, t, text).sample)


def test_grid_tracking_and_errors():
    model = tiny_wan(num_layers=1)
    swap_self_attention(model, {"name": "mhla", "blocks": (2, 2, 3)})
    with torch.no_grad():
        for shape in ((4, 8, 12), (2, 4, 6)):  # another resolution with the same block grid
            out = model(*wan_inputs(*shape)).sample
            assert out.shape == (2, 4, *shape)
        with pytest.raises(ValueError, match="do not tile"):
            model(*wan_inputs(3, 8, 12))
    assert self_attention_modules(model)[0][0] == "blocks.0.attn1"
    with pytest.raises(ValueError, match="token grid"):
        AttentionProcessor().token_grid(16)
    assert AttentionProcessor().token_grid(16, needs_grid=False) == (16,)


def test_block_factorisation():
    assert factorize_blocks((21, 30, 50), 105) == (7, 3, 5)
    assert layout_for_grid((21, 30, 50), (7, 3, 5)).block == (3, 10, 10)
    assert factorize_blocks((16, 16), 16) == (4, 4)
    assert resolve_blocks((21, 30, 50), block=(3, 10, 10)) == (7, 3, 5)
    with pytest.raises(ValueError, match="cannot tile"):
        factorize_blocks((21, 30, 50), 11)
    with pytest.raises(ValueError, match="frames"):
        layout_for_grid((21, 30, 50), (4, 3, 5))
    with pytest.raises(ValueError, match="exactly one"):
        resolve_blocks((4, 4), blocks=(2, 2), num_blocks=4)
    assert hybrid_layers(30) == [i for i in range(30) if i % 3 != 2] and len(hybrid_layers(30)) == 20


def test_deep_copy_tracks_its_own_grid():
    """An EMA copy (copy.deepcopy) of a swapped model runs on its own: its pre-hook must update the copy's
    grid context, not the original's (the copy was never called before, so it has no grid otherwise)."""
    import copy

    model = tiny_wan(num_layers=1)
    swap_self_attention(model, {"name": "mhla", "blocks": (2, 2, 3)})
    ema = copy.deepcopy(model)
    with torch.no_grad():
        a = ema(*wan_inputs(4, 8, 12)).sample  # fails with "does not know the token grid" if the hook is shared
        b = ema(*wan_inputs(2, 4, 6)).sample
        torch.testing.assert_close(a, model(*wan_inputs(4, 8, 12)).sample)
    assert ema._mhla_grid_context is not model._mhla_grid_context
    assert ema._mhla_grid_context.grid == (2, 2, 3) and model._mhla_grid_context.grid == (4, 4, 6)
    assert b.shape == (2, 4, 2, 4, 6)


# ------------------------------------------------------------------------- one layer, two hosts
def _layer_like(attn, cls, **options):
    """The library's own layer (projections included) with the weights of the diffusers module ``attn`` and of
    its swapped attention: q / k / v / out projections, mixing, output norm, and the module's own q / k norms."""
    heads, dim = attn.heads, attn.to_q.weight.shape[1]
    layer = cls(dim, heads, qkv_bias=attn.to_q.bias is not None, **options).double()
    with torch.no_grad():
        layer.qkv.weight.copy_(torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]))
        if attn.to_q.bias is not None:
            layer.qkv.bias.copy_(torch.cat([attn.to_q.bias, attn.to_k.bias, attn.to_v.bias]))
        layer.proj.weight.copy_(attn.to_out[0].weight)
        layer.proj.bias.copy_(attn.to_out[0].bias)
        layer.load_state_dict(attn.attention.state_dict(), strict=False)
    layer.q_norm, layer.k_norm = attn.norm_q, attn.norm_k  # diffusers' per-head RMSNorm (eps 1e-5, fp32 math)
    return layer


@pytest.mark.parametrize("kind", ["mhla", "linear"])
@pytest.mark.parametrize("normalize", [True, False])
def test_processor_equals_the_layer_sana_shaped(kind, normalize):
    """SANA-shaped: diffusers' generic Attention (per-head q / k RMSNorm, NoPE) on a 2-D latent grid. The
    processor's output equals MultiHeadLinearAttention's (or LinearAttention's) with the same weights."""
    torch.manual_seed(0)
    attn = Attention(query_dim=32, heads=4, dim_head=8, bias=True, qk_norm="rms_norm", out_bias=True).double()
    cfg = {"name": kind, "normalize": normalize, "out_norm": not normalize}
    if kind == "mhla":
        cfg["num_blocks"] = 4
    holder = torch.nn.ModuleDict({"attn1": attn})
    swap_self_attention(holder, cfg, grid=(4, 6), track_grid=False)
    if kind == "mhla":
        with torch.no_grad():
            attn.attention.mixing.raw.uniform_(0.05, 1.0)
    cls = MultiHeadLinearAttention if kind == "mhla" else LinearAttention
    layer = _layer_like(attn, cls, grid=(4, 6), normalize=normalize, out_norm=not normalize,
                        **({"num_blocks": 4} if kind == "mhla" else {}))
    x = torch.randn(2, 24, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), layer(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rope,normalize", [("after_feature_map", False), ("before_feature_map", True),
                                            ("after_feature_map", True)])
def test_processor_equals_the_layer_wan_shaped_with_rope(rope, normalize):
    """Wan-shaped: a 3-D grid, q / k RMSNorm across heads, Wan's interleaved rotary tables. Run the same weights
    through the processor and through MultiHeadLinearAttention.forward (given the same tables): equal."""
    model = tiny_wan(num_layers=1)
    swap_self_attention(model, {"name": "mhla", "blocks": (2, 2, 3), "normalize": normalize,
                                "out_norm": not normalize, "rope": rope})
    attn = model.blocks[0].attn1
    with torch.no_grad():
        attn.attention.mixing.raw.uniform_(0.05, 1.0)
    rec_attn, rec, h = capture_attn1(model)
    with torch.no_grad():
        model(*wan_inputs())
    h.remove()
    x, (cos, sin) = rec["x"], rec["rotary"]
    heads, dim = attn.heads, x.shape[-1]
    layer = MultiHeadLinearAttention(dim, heads, grid=(4, 4, 6), blocks=(2, 2, 3), qkv_bias=True, normalize=normalize,
                                     out_norm=not normalize, rope=rope).double()
    with torch.no_grad():
        layer.qkv.weight.copy_(torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]))
        layer.qkv.bias.copy_(torch.cat([attn.to_q.bias, attn.to_k.bias, attn.to_v.bias]))
        layer.proj.weight.copy_(attn.to_out[0].weight)
        layer.proj.bias.copy_(attn.to_out[0].bias)
        layer.load_state_dict(attn.attention.state_dict(), strict=False)
        # Wan normalises q and k across heads: apply its norms in the layer's projection
        layer.q_norm = _AcrossHeads(attn.norm_q, heads)
        layer.k_norm = _AcrossHeads(attn.norm_k, heads)
        y = layer(x, rope_tables=RotaryTables(cos, sin, interleaved=True, upcast=True))
    torch.testing.assert_close(rec["y"], y, rtol=1e-12, atol=1e-12)


class _AcrossHeads(torch.nn.Module):
    """A norm over all heads ``[B, N, H * D]`` applied to ``[B, N, H, D]`` (Wan's q / k RMSNorm)."""

    def __init__(self, norm, heads):
        super().__init__()
        self.norm, self.heads = norm, heads

    def forward(self, t):
        return self.norm(t.flatten(-2)).unflatten(-1, (self.heads, -1))
