"""Vision Transformers (timm's ``VisionTransformer``) with any registered attention.

The paper's DeiT setting (docs/paper_tables.md#table-2): average pooling instead of the class token, qk RMSNorm, CPE
(kernel 3) as an option, and 224 px inputs zero-padded to 256 px so that 16 x 16 patches form 4 x 4 blocks
of 4 x 4 tokens (M = 16).
"""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

from mhla.adapters.timm import timm_attn_layer
from mhla.registry import AttentionContract, Needs

# Options a ViT sets on its attention itself (timm passes them, or the model's grid / class token decide them).
VIT_FIXED_OPTIONS = ("grid", "num_prefix_tokens", "causal", "qkv_bias", "qk_norm", "proj_bias", "attn_drop",
                     "proj_drop", "norm_layer", "scale_norm", "device", "dtype", "head_dim", "value_dim",
                     "projections")


def attention_contract(model_cfg) -> AttentionContract:
    """A ViT takes any bidirectional attention over its 2-D patch grid (with the class token, one that supports
    prefix tokens); MHLA's default M is ``model.mhla_num_blocks``."""
    defaults = {}
    if model_cfg.get("mhla_num_blocks") is not None:
        defaults["mhla"] = {"num_blocks": int(model_cfg.mhla_num_blocks)}
    class_token = bool(model_cfg.get("class_token", False))
    needs = Needs(grid_rank=2, prefix_tokens=class_token)
    img, patch = int(model_cfg.get("pad_to") or model_cfg.img_size), int(model_cfg.patch_size)
    probe = ({"grid": (img // patch, img // patch), "num_prefix_tokens": int(class_token)}, {})
    return AttentionContract(model=f"model={model_cfg.get('name', 'vit')}", needs=needs, defaults=defaults,
                             fixed=VIT_FIXED_OPTIONS, probes=(probe,) if img % patch == 0 else ())


class PaddedInput(nn.Module):
    """Zero-pads ``[B, C, H, W]`` images to ``size`` x ``size`` (centred) before ``model``."""

    def __init__(self, model: nn.Module, size: int):
        super().__init__()
        self.model = model
        self.size = size

    def forward(self, x):
        h, w = x.shape[-2:]
        if h > self.size or w > self.size:
            raise ValueError(f"input {h}x{w} is larger than the padded size {self.size}")
        ph, pw = self.size - h, self.size - w
        if ph or pw:
            x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))
        return self.model(x)


def build_vit(model_cfg, attn_cfg) -> nn.Module:
    """Build a ViT from a model config (``img_size``, ``patch_size``, ``embed_dim``, ``depth``, ``num_heads``,
    ``mlp_ratio``, ``num_classes``, ``in_chans``, ``class_token``, ``global_pool``, ``qk_norm``,
    ``drop_path_rate``, ``pad_to``) and an attention config (name + options)."""
    img = int(model_cfg.get("pad_to") or model_cfg.img_size)
    patch = int(model_cfg.patch_size)
    if img % patch:
        raise ValueError(f"model image size {img} is not a multiple of the patch size {patch}")
    grid = (img // patch, img // patch)
    class_token = bool(model_cfg.get("class_token", False))
    attn_layer = timm_attn_layer(attn_cfg, grid=grid, num_prefix_tokens=1 if class_token else 0)
    vit = VisionTransformer(
        img_size=img,
        patch_size=patch,
        in_chans=int(model_cfg.get("in_chans", 3)),
        num_classes=int(model_cfg.num_classes),
        embed_dim=int(model_cfg.embed_dim),
        depth=int(model_cfg.depth),
        num_heads=int(model_cfg.num_heads),
        mlp_ratio=float(model_cfg.get("mlp_ratio", 4.0)),
        qkv_bias=bool(model_cfg.get("qkv_bias", True)),
        qk_norm=bool(model_cfg.get("qk_norm", False)),
        class_token=class_token,
        global_pool=model_cfg.get("global_pool", "avg"),
        drop_path_rate=float(model_cfg.get("drop_path_rate", 0.0)),
        attn_layer=attn_layer,
    )
    pad_to = model_cfg.get("pad_to")
    return PaddedInput(vit, int(pad_to)) if pad_to else vit
