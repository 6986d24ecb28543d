"""DeiT-T/S/B in the paper's setting, registered with timm for every attention in the registry.

    import models, timm                                                     # the package registers them
    model = timm.create_model("deit_tiny_patch16_224_mhla")                 # M = 16, paper setting
    model = timm.create_model("deit_small_patch16_224_softmax", cpe=True)    # options go to the attention

Paper setting (docs/paper_tables.md#table-2, docs/baselines.md#deit-setting): average pooling instead of the class token
(timm then applies the final norm after pooling), qk RMSNorm, the learned absolute position embedding,
CPE (depthwise 3x3 conv on V inside every attention) as an option, and 224 px inputs zero-padded to 256 px
so that 16 x 16 patches form 4 x 4 blocks of 4 x 4 tokens (M = 16). ``img_size`` sets the input resolution
(Table 13: 384, 512); the padded size is the next multiple of ``patch * sqrt(M)``.
"""

from __future__ import annotations

import math

from omegaconf import OmegaConf
from timm.models import register_model

from mhla.layouts import ceil_div
from mhla.registry import list_attentions

from .vit import build_vit

DEIT = {
    "tiny": dict(embed_dim=192, depth=12, num_heads=3),
    "small": dict(embed_dim=384, depth=12, num_heads=6),
    "base": dict(embed_dim=768, depth=12, num_heads=12),
}


def padded_size(img_size: int, patch: int = 16, num_blocks: int = 16) -> int:
    """Smallest size >= img_size whose patch grid splits into sqrt(M) x sqrt(M) equal blocks."""
    step = patch * int(round(math.sqrt(num_blocks)))
    return int(ceil_div(img_size, step) * step)


def deit(variant: str, attn: str = "mhla", *, img_size: int = 224, num_classes: int = 1000,
         num_blocks: int = 16, drop_path_rate: float = 0.1, pad: bool = True, **attn_options):
    """Build DeiT-{tiny,small,base} with attention ``attn`` in the paper's setting."""
    if variant not in DEIT:
        raise ValueError(f"DeiT variant must be one of {sorted(DEIT)}, got {variant!r}")
    pad_to = padded_size(img_size, 16, num_blocks) if pad else None
    model_cfg = OmegaConf.create(dict(
        name=f"deit_{variant}", kind="vit", img_size=img_size, input_size=img_size, patch_size=16, in_chans=3,
        num_classes=num_classes, mlp_ratio=4.0, qkv_bias=True, qk_norm=True, class_token=False,
        global_pool="avg", drop_path_rate=drop_path_rate, pad_to=pad_to, **DEIT[variant]))
    attn_cfg = {"name": attn, **attn_options}
    if attn == "mhla":
        attn_cfg.setdefault("num_blocks", num_blocks)
    return build_vit(model_cfg, attn_cfg)


def _register(variant: str, attn: str) -> None:
    def entry(pretrained: bool = False, **kwargs):
        if pretrained:
            raise ValueError("no pretrained MHLA DeiT weights ship with this package; train with train.py")
        kwargs.pop("pretrained_cfg", None)
        kwargs.pop("pretrained_cfg_overlay", None)
        kwargs.pop("cache_dir", None)
        return deit(variant, attn, **kwargs)

    entry.__name__ = f"deit_{variant}_patch16_224_{attn}"
    entry.__qualname__ = entry.__name__
    entry.__module__ = __name__
    entry.__doc__ = f"DeiT-{variant} (paper setting) with {attn} attention."
    register_model(entry)


for _variant in DEIT:
    for _attn in ("mhla", "linear", "softmax", "focused", "inline", "mala", "rala"):
        if _attn in list_attentions():
            _register(_variant, _attn)
