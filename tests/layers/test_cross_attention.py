"""Cross-attention as a registered attention (mhla/cross.py): the contract (``Supports.cross``), the
rectangular mixing matrix, the layers against the op, and the two models that use it through ``attn_cross``
(the video mini model's text cross-attention, SANA's through the diffusers adapter): every ``attn_cross.*``
option of the YAML files takes effect or is refused, padded caption tokens change nothing, and
``softmax_cross`` reproduces the models' own softmax cross-attention."""

from __future__ import annotations

import os

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from mhla.adapters.diffusers import key_padding_mask_from, swapped_cross_attentions
from mhla.layouts import layout_for_grid
from mhla.mixing import CrossMixingMatrix
from mhla.ops import mhla_cross_reference
from mhla.registry import AttentionContract, Needs, build_attention, choices, resolve_attention
from models.attention import attention_contract, cross_attention_contract
from tasks.common.config import ConfigError, model_cross_attention, register_resolvers

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
register_resolvers()
VIDEO = ["task=video_mini", "model.num_layers=2", "data.num_frames=4", "data.height=8", "data.width=8"]
CROSS = ("linear_cross", "mhla_cross", "softmax_cross")


def _compose(*overrides):
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def _build(cfg):
    from tasks.common.task import task_class

    torch.manual_seed(0)
    return task_class(cfg)(cfg).build_model()


# ------------------------------------------------------------------------------------------- contracts
def test_cross_and_self_attentions_do_not_mix():
    wan_self = attention_contract(_compose(*VIDEO).model)
    wan_cross = cross_attention_contract(_compose(*VIDEO).model)
    assert not set(CROSS) & set(choices(wan_self))
    assert set(choices(wan_cross)) == {*CROSS, "native"}
    with pytest.raises(ValueError, match="self-attention"):
        resolve_attention("mhla_cross", wan_self)
    with pytest.raises(ValueError, match="cross-attention"):
        resolve_attention("mhla", wan_cross, key="attn_cross")
    vit = cross_attention_contract(_compose("task=mnist").model)  # no cross-attention: only native
    assert choices(vit) == ["native"]
    with pytest.raises(ConfigError, match="cannot take attn_cross=mhla_cross; it takes native"):
        model_cross_attention(_compose("task=mnist", "attn_cross=mhla_cross"))
    generic = AttentionContract(model="m", needs=Needs(cross=True, grid_rank=3, host_projections=True))
    resolved = resolve_attention({"name": "mhla_cross", "num_blocks": 8, "key_blocks": 2}, generic)
    assert resolved["key_blocks"] == 2


def test_cross_mixing_matrix():
    m = CrossMixingMatrix(4, 3)
    assert torch.allclose(m(), torch.full((4, 3), 1 / 3)) and m.optim_group == "mixing"
    assert m.logged_matrices()["mixing"].shape == (4, 3)
    for param in ("softplus", "log"):
        assert torch.allclose(CrossMixingMatrix(4, 3, parameterization=param, num_heads=2)(),
                              torch.full((2, 4, 3), 1 / 3), atol=1e-6)
    with torch.no_grad():
        m.raw[0, 0] = -1.0
    m.after_optimizer_step()
    assert m.raw.min() == 0
    with pytest.raises(ValueError, match="no distance between a query block"):
        CrossMixingMatrix(4, 3, init="locality")
    assert not CrossMixingMatrix(2, 2, learnable=False).raw.requires_grad


# --------------------------------------------------------------------------------------------- layers
def _qkv(B=2, N=64, L=5, H=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 3:] = False
    return (torch.randn(B, N, H, D, generator=g), torch.randn(B, L, H, D, generator=g),
            torch.randn(B, L, H, D, generator=g), mask)


def test_mhla_cross_layer_is_the_op_on_grid_tiles():
    """Query blocks are the tiles of the token grid: the layer equals the dense definition with the tokens in
    block-major order; with its uniform init it equals linear cross-attention (a row's scale cancels)."""
    q, k, v, mask = _qkv()
    layer = build_attention({"name": "mhla_cross", "blocks": [2, 2, 2], "key_blocks": 2}, 16, 2,
                            grid=(4, 4, 4), projections=False)
    with torch.no_grad():
        layer.mixing.raw.uniform_(0.1, 1.0)
    o = layer.attend(q, k, v, key_padding_mask=mask)
    lay = layout_for_grid((4, 4, 4), (2, 2, 2))
    fq, fk = layer.feature_map(lay.raster_to_block_major(q)), layer.feature_map(k)
    ref = lay.block_major_to_raster(mhla_cross_reference(fq, fk, v, layer.mixing(), key_padding_mask=mask))
    torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-6)
    # (up to eps: uniform rows of 1/Mk scale the denominator's eps by Mk; fp64 and a tiny eps)
    uniform = build_attention({"name": "mhla_cross", "num_blocks": 8, "key_blocks": 2, "eps": 1e-12}, 16, 2,
                              grid=(4, 4, 4), projections=False)
    linear = build_attention({"name": "linear_cross", "eps": 1e-12}, 16, 2, projections=False)
    q, k, v = q.double(), k.double(), v.double()
    torch.testing.assert_close(uniform.attend(q, k, v, key_padding_mask=mask),
                               linear.attend(q, k, v, key_padding_mask=mask), rtol=1e-9, atol=1e-10)
    assert uniform.settings()["blocks"] == (2, 2, 2)  # num_blocks=8 factorised over the 3-D grid


def test_layers_with_projections_and_errors():
    x, ctx = torch.randn(2, 10, 16), torch.randn(2, 7, 12)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, 4:] = False
    for name, opts in (("mhla_cross", {"num_blocks": 3, "key_blocks": 2}), ("linear_cross", {}),
                       ("softmax_cross", {})):
        layer = build_attention({"name": name, **opts}, 16, 2, context_dim=12)
        y = layer(x, ctx, mask)
        assert y.shape == x.shape
        ctx2 = ctx.clone()
        ctx2[0, 4:] = 1e3  # padded condition tokens change nothing
        torch.testing.assert_close(layer(x, ctx2, mask), y)
    with pytest.raises(ValueError, match="needs its query blocks"):
        build_attention({"name": "mhla_cross", "key_blocks": 2}, 16, 2)
    with pytest.raises(ValueError, match="needs key_blocks"):
        build_attention({"name": "mhla_cross", "num_blocks": 2}, 16, 2)
    with pytest.raises(ValueError, match="do not tile|does not tile|tile"):
        build_attention({"name": "mhla_cross", "blocks": [3, 3], "key_blocks": 2}, 16, 2, grid=(4, 4))


def test_key_padding_mask_from_diffusers_masks():
    bias = torch.zeros(2, 1, 5)
    bias[1, 0, 3:] = -10000.0
    keep = key_padding_mask_from(bias, 2, 5)
    assert keep.dtype == torch.bool and keep[0].all() and keep[1].tolist() == [True] * 3 + [False] * 2
    assert torch.equal(key_padding_mask_from(keep, 2, 5), keep)
    assert key_padding_mask_from(None, 2, 5) is None
    with pytest.raises(ValueError, match="pass it as bool"):
        key_padding_mask_from(torch.ones(2, 5), 2, 5)


# --------------------------------------------------------------------------------------------- models
def _video_out(cfg, text):
    model = _build(cfg).eval()
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(2, 3, 4, 8, 8, generator=g), torch.tensor([0.3, 0.8])
    with torch.no_grad():
        return model, model(x, t, text)


def test_video_mini_cross_attention_by_config():
    text = torch.tensor([[1, 5, 7], [0, 0, 0]])
    base, out = _video_out(_compose(*VIDEO), text)
    assert not swapped_cross_attentions(base)  # the default is unchanged: Wan's own processor
    _, same = _video_out(_compose(*VIDEO, "attn_cross=softmax_cross"), text)
    torch.testing.assert_close(same, out, rtol=1e-5, atol=1e-6)
    model, _ = _video_out(_compose(*VIDEO, "attn_cross=mhla_cross"), text)
    layers = swapped_cross_attentions(model)
    assert len(layers) == 2 and all(l.settings()["key_blocks"] == 3 for l in layers.values())
    # the mixing matrix trains with the model
    model.train()
    x, t = torch.randn(2, 3, 4, 8, 8), torch.tensor([0.3, 0.8])
    model(x, t, text).square().mean().backward()
    assert all(l.mixing.raw.grad is not None and l.mixing.raw.grad.abs().sum() > 0 for l in layers.values())


def _yaml_options(name):
    path = os.path.join(ROOT, "configs", "attn_cross", f"{name}.yaml")
    return [k for k in OmegaConf.load(path) if k != "name"]


OTHER = {"blocks": [1, 1, 1], "num_blocks": 2, "key_blocks": 2, "mixing_init": "locality",
         "mixing_learnable": False, "mixing_per_head": True, "mixing_param": "softplus", "feature_map": "elu",
         "normalize": False, "out_norm": True, "eps": 1e-5, "backend": "torch"}


@pytest.mark.parametrize("name", CROSS)
def test_every_attn_cross_option_takes_effect_or_is_refused(name):
    base = _compose(*VIDEO, f"attn_cross={name}")
    for key in _yaml_options(name):
        cfg = base.copy()
        with open_dict(cfg):
            cfg.attn_cross[key] = OTHER[key]
        try:
            opts = model_cross_attention(cfg)
            model = _build(cfg)
        except (ConfigError, ValueError) as e:
            assert key in str(e) or str(OTHER[key]) in str(e), (key, str(e))
            continue
        assert opts[key] == OTHER[key], (key, opts)
        for layer in swapped_cross_attentions(model).values():
            got = layer.settings()[key]
            want = tuple(OTHER[key]) if isinstance(OTHER[key], list) else OTHER[key]
            assert (tuple(got) if isinstance(got, (list, tuple)) else got) == want, key
    with open_dict(base):
        base.attn_cross["head_dim"] = 4
    with pytest.raises(ConfigError, match="attn_cross.head_dim"):
        model_cross_attention(base)


def test_native_takes_no_options():
    cfg = _compose(*VIDEO)
    with open_dict(cfg):
        cfg.attn_cross["key_blocks"] = 2
    with pytest.raises(ConfigError, match="attn_cross.key_blocks"):
        model_cross_attention(cfg)


def test_sana_cross_attention_with_caption_mask():
    g = torch.Generator().manual_seed(1)
    x, enc = torch.randn(2, 8, 8, 8, generator=g), torch.randn(2, 8, 32, generator=g)
    t = torch.tensor([500.0, 200.0])
    mask = torch.ones(2, 8)
    mask[1, 5:] = 0
    enc2 = enc.clone()
    enc2[1, 5:] = 100.0
    outs = {}
    for name in ("native", "softmax_cross", "mhla_cross"):
        model = _build(_compose("task=sana_mini", f"attn_cross={name}")).eval()
        with torch.no_grad():
            outs[name] = model(x, encoder_hidden_states=enc, timestep=t, encoder_attention_mask=mask).sample
            again = model(x, encoder_hidden_states=enc2, timestep=t, encoder_attention_mask=mask).sample
        torch.testing.assert_close(again, outs[name])  # padded caption tokens change nothing
    assert len(swapped_cross_attentions(model)) == 2
    torch.testing.assert_close(outs["softmax_cross"], outs["native"], rtol=1e-5, atol=1e-6)
