"""The registered models are timm models: registration, timm's model API checks, unchanged outputs.

The API checks follow timm's own model tests (huggingface/pytorch-image-models tests/test_models.py:
test_model_forward, test_model_backward, test_model_default_cfgs(_non_std), test_model_forward_features,
test_model_forward_intermediates(_features)) on one model per family: DeiT-T with MHLA (CPE, the paper's
cell), DeiT-T with softmax (a baseline), VLT-T with MHLA (at 64 px, M = 16 / 4 in its linear stages, to
stay fast on a CPU).
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]

CHILD = r"""
import json
import os
import models  # only the package: no submodule imported by hand
import mhla
import timm
import torch
from mhla.registry import Needs, attentions_for
from timm.models import model_entrypoint

ours = sorted(n for n in timm.list_models() if model_entrypoint(n).__module__.startswith("models."))
built = {}
for name, kw in (("deit_tiny_patch16_224_mhla", {}), ("deit_tiny_patch16_224_softmax", {}),
                 ("vlt_tiny_mhla", {"img_size": 64, "stage_num_blocks": (16, 4)})):
    model = timm.create_model(name, pretrained=False, num_classes=10, **kw).eval()
    size = kw.get("img_size", 224)
    with torch.no_grad():
        built[name] = list(model(torch.randn(1, 3, size, size)).shape)
self_attentions = [n for n in mhla.list_attentions() if not mhla.registry.get_attention_class(n).supports.cross]
print(json.dumps({"ours": ours, "attentions": attentions_for(Needs(grid_rank=2)), "all": self_attentions,
                  "built": built}))
"""


def test_import_models_registers_every_timm_model():
    """Run in a fresh interpreter: in the test process another test may already have imported the modules."""
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    deit = {f"deit_{v}_patch16_224_{a}" for v in ("tiny", "small", "base") for a in out["attentions"]}
    vlt = {f"vlt_{v}_{a}" for v in ("tiny", "small") for a in out["attentions"]}
    assert set(out["ours"]) == deit | vlt
    # every registered self-attention runs on a 2-D grid: mhla, linear, softmax, the Table 2 baselines, gla (the
    # cross-attentions are not models' self-attentions)
    assert set(out["attentions"]) == set(out["all"]) and len(out["attentions"]) >= 8
    assert out["built"] == {name: [1, 10] for name in
                            ("deit_tiny_patch16_224_mhla", "deit_tiny_patch16_224_softmax", "vlt_tiny_mhla")}


import models  # noqa: E402,F401  (registers the models; imported after the fresh-interpreter test above)
import timm  # noqa: E402
import timm.optim  # noqa: E402
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

from mhla.adapters.timm import timm_attn_layer  # noqa: E402
from models.vit import PaddedPatchEmbed, build_vit  # noqa: E402
from models.vlt import VLT, build_vlt  # noqa: E402

VLT_SMALL = {"img_size": 64, "stage_num_blocks": (16, 4)}  # 16 x 16 and 8 x 8 grids: M = 16 / 4 blocks of 4x4
FAMILIES = [
    pytest.param("deit_tiny_patch16_224_mhla", {"cpe": True}, id="deit_t_mhla"),
    pytest.param("deit_tiny_patch16_224_softmax", {}, id="deit_t_softmax"),
    pytest.param("vlt_tiny_mhla", VLT_SMALL, id="vlt_t_mhla"),
]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _input(model, kwargs, batch=1):
    size = kwargs.get("img_size", model.pretrained_cfg["input_size"][-1])
    return torch.randn(batch, 3, size, size)


def _feature_grid(name, kwargs, reduction):
    """Spatial size of a feature map at ``reduction``: DeiT's cover the padded 256 px canvas (16 x 16 at
    224 px, beyond timm's generic bound of ceil(224 / 16) + 1 = 15), VLT's the input."""
    if name.startswith("deit"):
        return 256 // reduction
    return math.ceil(kwargs["img_size"] / reduction)


@pytest.mark.parametrize("name,kwargs", FAMILIES)
def test_default_cfg_forward_features_head_and_reset_classifier(name, kwargs):
    """test_model_forward + test_model_default_cfgs(_non_std): forward, forward_features (unpooled),
    forward_head(pre_logits), reset_classifier(0) / (0, '') / (5), classifier and first conv names."""
    model = timm.create_model(name, pretrained=False, **kwargs).eval()
    cfg = model.pretrained_cfg
    assert cfg["input_size"] == (3, 224, 224) and cfg["url"] == "" and model.default_cfg is cfg
    assert model.num_classes == 1000 and model.num_features > 0 and model.head_hidden_size > 0
    state = model.state_dict()
    assert cfg["classifier"] + ".weight" in state and cfg["first_conv"] + ".weight" in state
    assert model.get_classifier() is dict(model.named_modules())[cfg["classifier"]]
    x = _input(model, kwargs)
    with torch.no_grad():
        out = model(x)
        feats = model.forward_features(x)
        pre = model.forward_head(feats, pre_logits=True)
        assert torch.equal(model.forward_head(feats), out)
    assert out.shape == (1, 1000) and not torch.isnan(out).any()
    if name.startswith("deit"):
        assert isinstance(model, VisionTransformer) and isinstance(model.patch_embed, PaddedPatchEmbed)
        assert feats.shape == (1, 256, model.num_features)  # 224 px padded to 256: 16 x 16 tokens
    else:
        assert isinstance(model, VLT)
        grid = kwargs["img_size"] // 32
        assert feats.shape == (1, model.num_features, grid, grid)
    assert pre.shape == (1, model.head_hidden_size)

    model.reset_classifier(0)
    assert model.num_classes == 0
    with torch.no_grad():  # the head after reset_classifier, on the features above (forward = head(features))
        pooled = model.forward_head(feats)
    assert pooled.shape == pre.shape and torch.allclose(pooled, pre)

    model.reset_classifier(0, "")  # no pooling either: the unpooled features
    with torch.no_grad():
        assert model.forward_head(feats).shape == feats.shape

    model.reset_classifier(5, "avg")
    assert model.num_classes == 5 and model.get_classifier().out_features == 5
    with torch.no_grad():
        assert model(x).shape == (1, 5)
    if name.startswith("vlt"):  # created without classifier and pooling
        bare = timm.create_model(name, num_classes=0, global_pool="", **kwargs).eval()
        with torch.no_grad():
            assert bare(x).shape == feats.shape


@pytest.mark.parametrize("name,kwargs", FAMILIES)
def test_features_only_and_forward_intermediates(name, kwargs):
    """test_model_forward_features, test_model_forward_intermediates(_features): features_only=True (timm's
    default feature class and feature_cls='getter'), forward_intermediates == forward_features, also with
    gradient checkpointing."""
    getter = ["getter"] if name.startswith("vlt") else []  # DeiT's default feature class is the getter
    for feature_cls in [None, *getter]:
        extra = {"feature_cls": feature_cls} if feature_cls else {}
        feat_model = timm.create_model(name, features_only=True, **extra, **kwargs).eval()
        channels, reductions = feat_model.feature_info.channels(), feat_model.feature_info.reduction()
        assert len(channels) >= 3
        with torch.no_grad():
            outs = feat_model(_input(feat_model, kwargs))
        assert len(outs) == len(channels)
        for c, r, o in zip(channels, reductions, outs):
            g = _feature_grid(name, kwargs, r)
            assert o.shape == (1, c, g, g) and not torch.isnan(o).any()
    if name.startswith("vlt"):
        assert channels == [64, 128, 256, 512] and reductions == [4, 8, 16, 32]

    model = timm.create_model(name, **kwargs).eval()
    info = timm.models.FeatureInfo(model.feature_info, list(range(len(model.feature_info))))
    x = _input(model, kwargs)
    with torch.no_grad():
        final, inter = model.forward_intermediates(x)
        assert torch.allclose(final, model.forward_features(x))
        assert len(inter) == len(info.channels())
        for c, r, o in zip(info.channels(), info.reduction(), inter):
            g = _feature_grid(name, kwargs, r)
            assert o.shape == (1, c, g, g)
        last2 = model.forward_intermediates(x, indices=2, intermediates_only=True)
        assert len(last2) == 2 and all(torch.equal(a, b) for a, b in zip(last2, inter[-2:]))
        model.set_grad_checkpointing()
        final_ckpt, _ = model.forward_intermediates(x)
    assert torch.allclose(final, final_ckpt, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,kwargs", FAMILIES)
def test_grad_checkpointing_forward_backward(name, kwargs):
    """test_model_forward (checkpointing leaves the output) and test_model_backward (num_classes=42, every
    parameter gets a gradient), the backward with gradient checkpointing on. Batch 2 for VLT's BatchNorm,
    else 1 (timm: 2) to keep the CPU time down."""
    model = timm.create_model(name, num_classes=42, **kwargs).eval()
    batch = 2 if name.startswith("vlt") else 1
    x = _input(model, kwargs, batch=batch)
    with torch.no_grad():
        ref = model(x)
    model.set_grad_checkpointing()
    assert model.grad_checkpointing
    with torch.no_grad():
        assert torch.allclose(model(x), ref, rtol=1e-4, atol=1e-5)
    model.train()
    out = model(x)
    assert out.shape == (batch, 42) and not torch.isnan(out).any()
    out.mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"


@pytest.mark.parametrize("name,kwargs", FAMILIES)
def test_timm_optimizer_keeps_decay_off_embeddings_norms_biases_and_mixing(name, kwargs):
    """timm.optim.create_optimizer_v2(model, 'adamw', weight_decay=0.05): no decay on the position embedding
    (model.no_weight_decay()), norms, biases, LayerScale (1-D) and MHLA's mixing matrices; decay on the
    projection / MLP / conv / classifier weights."""
    model = timm.create_model(name, **kwargs)
    opt = timm.optim.create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    decay_of = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    names = dict(model.named_parameters())
    assert set(decay_of) == {id(p) for p in names.values()}
    no_decay = {n for n, p in names.items() if decay_of[id(p)] == 0.0}
    decay = {n for n, p in names.items() if decay_of[id(p)] == 0.05}
    assert no_decay | decay == set(names)
    assert {n for n in names if n.endswith(".bias") or "norm" in n} <= no_decay
    assert {n for n in names if n.endswith("mixing.raw")} <= no_decay
    if name.startswith("deit"):
        assert "pos_embed" in model.no_weight_decay() and "pos_embed" in no_decay
        assert {"blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight", "patch_embed.proj.weight",
                "head.weight"} <= decay
    else:
        assert {n for n in names if "gamma" in n} <= no_decay
        assert {"stem.0.weight", "stages.0.blocks.0.attn.qkv.weight", "stages.1.downsample.0.weight",
                "conv_head.weight", "head.fc.weight"} <= decay
    if "mhla" in name:
        assert any(n.endswith("mixing.raw") for n in names)


@pytest.mark.parametrize("name", ["deit_tiny_patch16_224_mhla", "vlt_tiny_mhla"])
def test_pretrained_raises_clearly(name):
    with pytest.raises(ValueError, match="no pretrained weights ship with this package"):
        timm.create_model(name, pretrained=True)


def test_keyword_split_model_vs_attention():
    """Model (VisionTransformer / builder) keywords go to the model, the others to the attention;
    attn_kwargs passes an attention option whose name is also a model argument."""
    model = timm.create_model("deit_tiny_patch16_224_softmax", num_classes=3, depth=2, cpe=True, cpe_kernel=5,
                              attn_kwargs={"qk_norm": False})
    assert model.num_classes == 3 and len(model.blocks) == 2
    attn = model.blocks[0].attn
    assert attn.cpe.kernel_size == (5, 5)
    assert isinstance(attn.q_norm, torch.nn.Identity)  # the attention's qk_norm, not the model's (True)
    with pytest.raises(ValueError, match="does not take \\['bogus'\\]"):
        timm.create_model("deit_tiny_patch16_224_mhla", bogus=1)
    vlt = timm.create_model("vlt_tiny_linear", num_classes=3, cpe=False, **VLT_SMALL)
    assert vlt.num_classes == 3 and vlt.stages[0].blocks[0].attn.cpe is None  # VLT's default LePE: off


def _old_padded_deit(attn_cfg):
    """Today's model before the padding moved into the patch embedding: timm's VisionTransformer at 256 px
    with the attention, behind a centred zero-padding wrapper (the former ``PaddedInput``)."""

    class PaddedInput(torch.nn.Module):
        def __init__(self, model, size):
            super().__init__()
            self.model, self.size = model, size

        def forward(self, x):
            h, w = x.shape[-2:]
            ph, pw = self.size - h, self.size - w
            if ph or pw:
                x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))
            return self.model(x)

    vit = VisionTransformer(img_size=256, patch_size=16, num_classes=1000, embed_dim=192, depth=12,
                            num_heads=3, mlp_ratio=4.0, qkv_bias=True, qk_norm=True, class_token=False,
                            global_pool="avg", drop_path_rate=0.1,
                            attn_layer=timm_attn_layer(attn_cfg, grid=(16, 16)))
    return PaddedInput(vit, 256)


@pytest.mark.parametrize("attn,options", [("mhla", {"cpe": True}), ("softmax", {})])
def test_deit_outputs_bit_identical_to_the_padding_wrapper(attn, options):
    """Same seed, same weights (state-dict keys without the wrapper's ``model.`` prefix) and bit-identical
    outputs, eval and train (drop path), for 224 px and odd-sized inputs (the centring rule)."""
    attn_cfg = {"name": attn, **options, **({"num_blocks": 16} if attn == "mhla" else {})}
    torch.manual_seed(0)
    old = _old_padded_deit(attn_cfg)
    torch.manual_seed(0)
    new = timm.create_model(f"deit_tiny_patch16_224_{attn}", **options)
    old_state, new_state = old.state_dict(), new.state_dict()
    assert [k.removeprefix("model.") for k in old_state] == list(new_state)
    assert all(torch.equal(v, new_state[k.removeprefix("model.")]) for k, v in old_state.items())
    x = torch.randn(1, 3, 224, 224)
    old.eval(), new.eval()
    with torch.no_grad():
        for inp in (x, torch.randn(1, 3, 221, 229)):  # odd padding (35, 27): one more zero after than before
            assert torch.equal(old(inp), new(inp))
    old.train(), new.train()
    torch.manual_seed(1)
    a = old(x)
    torch.manual_seed(1)
    assert torch.equal(a, new(x))
    with pytest.raises(ValueError, match="larger than the padded size"):
        new(torch.randn(1, 3, 257, 224))


def test_build_vit_is_the_registered_plain_timm_model():
    """The classification task's builder gives the same plain timm model as the registry (no wrapper)."""
    from omegaconf import OmegaConf  # noqa: PLC0415

    model_cfg = OmegaConf.load(ROOT / "configs/model/deit_t.yaml")
    attn_cfg = OmegaConf.create({"name": "mhla", "num_blocks": 16})
    torch.manual_seed(0)
    built = build_vit(model_cfg, attn_cfg)
    torch.manual_seed(0)
    registered = timm.create_model("deit_tiny_patch16_224_mhla")
    assert type(built) is type(registered) and isinstance(built.patch_embed, PaddedPatchEmbed)
    assert built.patch_embed.pad_to == (256, 256) and built.patch_embed.grid_size == (16, 16)
    assert built.pretrained_cfg["input_size"] == (3, 224, 224)
    b, r = built.state_dict(), registered.state_dict()
    assert list(b) == list(r) and all(torch.equal(b[k], r[k]) for k in b)
    unpadded = build_vit(OmegaConf.merge(model_cfg, {"pad_to": None, "img_size": 256}), attn_cfg)
    assert type(unpadded.patch_embed).__name__ == "PatchEmbed" and unpadded.patch_embed.grid_size == (16, 16)


def test_build_vlt_is_the_registered_model():
    torch.manual_seed(0)
    built = build_vlt("t", {"name": "mhla"}, **VLT_SMALL)
    torch.manual_seed(0)
    registered = timm.create_model("vlt_tiny_mhla", **VLT_SMALL)
    assert type(built) is VLT and built.pretrained_cfg["pool_size"] == (2, 2)
    b, r = built.state_dict(), registered.state_dict()
    assert list(b) == list(r) and all(torch.equal(b[k], r[k]) for k in b)
