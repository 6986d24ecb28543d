"""DeiT-T/S/B in the paper's setting, registered with timm for every attention in the registry.

    import models, timm                                                     # the package registers them
    model = timm.create_model("deit_tiny_patch16_224_mhla")                 # M = 16, paper setting
    model = timm.create_model("deit_small_patch16_224_softmax", cpe=True)    # options go to the attention
    model = timm.create_model("deit_tiny_patch16_224_mhla", num_classes=5)  # fine-tuning head
    feats = timm.create_model("deit_tiny_patch16_224_mhla", features_only=True)  # last 3 blocks, NCHW

Each model is a timm ``VisionTransformer`` (:class:`models.vit.AttnVisionTransformer`) built with timm's
``build_model_with_cfg`` from a registered ``pretrained_cfg`` (no weights ship: ``pretrained=True`` raises),
so it has timm's model API: ``forward_features`` (``[B, 256, D]`` tokens at 224 px), ``forward_head``,
``reset_classifier``, ``get_classifier``, ``forward_intermediates``, ``features_only=True``,
``set_grad_checkpointing``, ``no_weight_decay``.

Paper setting (docs/paper_tables.md#table-2, docs/baselines.md#deit-setting): average pooling instead of the class token
(timm then applies the final norm after pooling), qk RMSNorm, the learned absolute position embedding,
CPE (depthwise 3x3 conv on V inside every attention) as an option, and 224 px inputs zero-padded to 256 px
so that 16 x 16 patches form 4 x 4 blocks of 4 x 4 tokens (M = 16). The padding is the model's patch
embedding (:class:`models.vit.PaddedPatchEmbed`); the token grid and the feature maps are those of the
padded canvas (16 x 16 at 224 px, the image in the centre 14 x 14). ``img_size`` sets the input resolution
(Table 13: 384, 512); the padded size is the next multiple of ``patch * sqrt(M)``.

Keyword arguments of an entrypoint (and of :func:`deit`):

- DeiT's own: ``img_size`` (224), ``num_blocks`` (MHLA's M, 16; also sets the padding), ``pad`` (True).
- model: every ``timm.models.vision_transformer.VisionTransformer`` argument (``num_classes``,
  ``global_pool``, ``drop_rate``, ``drop_path_rate`` (0.1), ``class_token``, ``qk_norm``, ...) and timm's
  builder ones (``features_only``, ``out_indices``, ``feature_cls``, ``pretrained_cfg``, ...);
- attention: every other keyword (``cpe=True``, ``cpe_kernel=5``, ``gate="linear"``, ``block=[4, 4]``, ...),
  and ``attn_kwargs={...}`` for an option whose name is also a model argument (it wins).
"""

from __future__ import annotations

import math
from functools import partial

from timm.models import generate_default_cfgs

from mhla.layouts import ceil_div
from mhla.registry import Needs, attentions_for, block_defaults

from .vit import (
    VIT_PARAMS,
    AttnVisionTransformer,
    create_vit,
    image_pretrained_cfg,
    register_family,
    split_model_kwargs,
)

DEIT = {
    "tiny": dict(embed_dim=192, depth=12, num_heads=3),
    "small": dict(embed_dim=384, depth=12, num_heads=6),
    "base": dict(embed_dim=768, depth=12, num_heads=12),
}

# The paper's DeiT arguments of VisionTransformer (any of them can be overridden by a keyword argument).
PAPER_SETTING = dict(patch_size=16, mlp_ratio=4.0, qkv_bias=True, qk_norm=True, class_token=False,
                     global_pool="avg", drop_path_rate=0.1)


def padded_size(img_size: int, patch: int = 16, num_blocks: int = 16) -> int:
    """Smallest size >= img_size whose patch grid splits into sqrt(M) x sqrt(M) equal blocks."""
    step = patch * int(round(math.sqrt(num_blocks)))
    return int(ceil_div(img_size, step) * step)


def model_name(variant: str, attn: str) -> str:
    return f"deit_{variant}_patch16_224_{attn}"


def deit(variant: str, attn: str = "mhla", pretrained: bool = False, *, img_size: int = 224,
         num_blocks: int = 16, pad: bool = True, **kwargs) -> AttnVisionTransformer:
    """Build DeiT-{tiny,small,base} with attention ``attn`` in the paper's setting (what the registered
    ``deit_{variant}_patch16_224_{attn}`` entrypoints call); ``kwargs``: see the module docstring."""
    if variant not in DEIT:
        raise ValueError(f"DeiT variant must be one of {sorted(DEIT)}, got {variant!r}")
    model_kwargs, attn_options = split_model_kwargs(kwargs, VIT_PARAMS)
    args = {**PAPER_SETTING, **DEIT[variant], **model_kwargs}
    pad_to = padded_size(img_size, int(args["patch_size"]), num_blocks) if pad else None
    attn_cfg = {"name": attn, **block_defaults(attn, num_blocks), **attn_options}  # MHLA: M = num_blocks
    return create_vit(model_name(variant, attn), attn_cfg, pretrained=pretrained, img_size=img_size,
                      pad_to=pad_to, **args)


ATTENTIONS = tuple(attentions_for(Needs(grid_rank=2)))  # every registered attention that runs on a 2-D grid

default_cfgs = generate_default_cfgs(
    {model_name(v, a): image_pretrained_cfg(224) for v in DEIT for a in ATTENTIONS})


register_family(globals(), [(model_name(v, a), partial(deit, v, a)) for v in DEIT for a in ATTENTIONS],
                "{name}: DeiT in the paper's setting (224 px zero-padded to 256 px, average pooling, qk RMSNorm) with "
                "the attention its name ends with. No pretrained weights.")
