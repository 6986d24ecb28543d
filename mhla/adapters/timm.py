"""timm adapter: an ``attn_layer`` factory for ``timm.models.VisionTransformer`` and friends.

    from timm.models.vision_transformer import VisionTransformer
    vit = VisionTransformer(img_size=256, patch_size=16, class_token=False, global_pool="avg",
                            attn_layer=timm_attn_layer({"name": "mhla", "block": [4, 4]}, grid=(16, 16)))

timm builds each block's attention as ``attn_layer(dim, num_heads=..., qkv_bias=..., qk_norm=...,
scale_norm=..., proj_bias=..., attn_drop=..., proj_drop=..., norm_layer=..., device=..., dtype=...)``;
the factory forwards those to :func:`mhla.registry.build_attention` together with the attention config
and the token grid the model knows (patch grid, prefix tokens).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.nn as nn

from ..registry import build_attention


def timm_attn_layer(attn_cfg, *, grid=None, num_prefix_tokens: int = 0, **fixed):
    """Return a class usable as timm's ``attn_layer`` (calling it builds the registered layer).

    Args:
        attn_cfg: attention name or mapping with ``name`` and options (see :mod:`mhla.registry`).
        grid: the patch grid ``(H, W)`` the model produces (passed as ``grid=`` to the layer).
        num_prefix_tokens: class/register tokens in front of the patch tokens.
        fixed: further options that override ``attn_cfg``.
    """
    if isinstance(attn_cfg, str):
        attn_cfg = {"name": attn_cfg}
    elif not isinstance(attn_cfg, Mapping):
        attn_cfg = dict(attn_cfg.items())
    extra = dict(fixed)
    if grid is not None:
        extra["grid"] = tuple(grid)
    if num_prefix_tokens:
        extra["num_prefix_tokens"] = num_prefix_tokens

    def make(cls, dim: int, num_heads: int = 8, **timm_kwargs) -> nn.Module:
        timm_kwargs.pop("depth", None)
        options = {k: v for k, v in timm_kwargs.items() if v is not None or k in ("norm_layer",)}
        # timm's qk_norm flag enables our per-head RMSNorm unless the attention config decides itself.
        if "qk_norm" in attn_cfg:
            options.pop("qk_norm", None)
        return build_attention(attn_cfg, dim, num_heads, **options, **extra)

    # timm calls issubclass() on attn_layer, so hand it a class whose constructor builds our layer.
    name = str(attn_cfg.get("name", "attn"))
    return type(f"TimmAttn_{name}", (), {"__new__": make, "attn_cfg": dict(attn_cfg), "extra": extra})
