"""Vision Transformers (timm's ``VisionTransformer``) with any registered attention.

The paper's DeiT setting (docs/paper_tables.md#table-2): average pooling instead of the class token, qk RMSNorm, CPE
(kernel 3) as an option, and 224 px inputs zero-padded to 256 px so that 16 x 16 patches form 4 x 4 blocks
of 4 x 4 tokens (M = 16).

The padding happens inside the model, in its patch embedding (:class:`PaddedPatchEmbed`, timm's
``embed_layer``), so every model built here is an :class:`AttnVisionTransformer`, a timm ``VisionTransformer``
with timm's whole model API (``forward_features``, ``forward_head``, ``reset_classifier``,
``forward_intermediates`` / ``features_only``, ``set_grad_checkpointing``, ``no_weight_decay``, ...):

    model = create_vit("my_vit", {"name": "mhla", "num_blocks": 16}, img_size=224, pad_to=256,
                       embed_dim=192, depth=12, num_heads=3, class_token=False, global_pool="avg")
    model(torch.randn(2, 3, 224, 224))                   # [2, 1000]; tokens: the padded 16 x 16 grid
"""

from __future__ import annotations

import inspect
from functools import partial

import torch
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import Format, PatchEmbed, nchw_to, to_2tuple
from timm.models import build_model_with_cfg, is_model, register_model
from timm.models.vision_transformer import VisionTransformer

from mhla.adapters.timm import timm_attn_layer
from mhla.registry import AttentionContract, Needs

from .attention import token_blocks

# What timm's blocks pass to their attention (timm's ``attn_layer`` hook, mhla/adapters/timm.py): an attention
# that does not take them (GLA, with its own projections) cannot run in a timm ViT (it runs in DiT / DiG).
TIMM_ATTENTION_ARGUMENTS = ("qkv_bias", "qk_norm", "proj_bias", "attn_drop", "proj_drop", "norm_layer", "scale_norm")
# Options a ViT sets on its attention itself (timm passes them, or the model's grid / class token decide them).
VIT_FIXED_OPTIONS = ("grid", "num_prefix_tokens", "causal", "qkv_bias", "qk_norm", "proj_bias", "attn_drop",
                     "proj_drop", "norm_layer", "scale_norm", "device", "dtype", "head_dim", "value_dim",
                     "projections")


def attention_contract(model_cfg) -> AttentionContract:
    """A ViT takes any bidirectional attention over its 2-D patch grid (with the class token, one that supports
    prefix tokens); its default token blocks are ``model.token_blocks`` (MHLA's M)."""
    class_token = bool(model_cfg.get("class_token", False))
    needs = Needs(grid_rank=2, prefix_tokens=class_token)
    img, patch = int(model_cfg.get("pad_to") or model_cfg.img_size), int(model_cfg.patch_size)
    probe = ({"grid": (img // patch, img // patch), "num_prefix_tokens": int(class_token),
              "dim": int(model_cfg.embed_dim), "num_heads": int(model_cfg.num_heads)}, {})
    return AttentionContract(model=f"model={model_cfg.get('name', 'vit')}", needs=needs,
                             blocks=token_blocks(model_cfg), fixed=VIT_FIXED_OPTIONS, passes=TIMM_ATTENTION_ARGUMENTS,
                             probes=(probe,) if img % patch == 0 else ())




def grouped_parameter_names(model: nn.Module) -> set[str]:
    """Names of the parameters whose module names an optimizer group (the ``optim_group`` hook of
    mhla/hooks.py: MHLA's mixing matrices). timm's optimizer factory (``create_optimizer_v2``) keeps the
    names of ``no_weight_decay()`` out of weight decay, as this repo's trainer does for those groups
    (``optim.mixing_weight_decay`` 0 by default)."""
    return {f"{mn}.{pn}" if mn else pn for mn, m in model.named_modules() if getattr(m, "optim_group", None)
            for pn, _ in m.named_parameters(recurse=False)}

# Keyword arguments that timm's ``build_model_with_cfg`` consumes itself (pretrained config, feature
# extraction) or that ``timm.create_model`` passes to every entrypoint: model arguments, never attention ones.
BUILDER_KWARGS = frozenset({
    "pretrained_cfg", "pretrained_cfg_overlay", "cache_dir", "model_cfg", "feature_cfg", "pretrained_strict",
    "pretrained_filter_fn", "kwargs_filter", "pretrained_model_args", "pruned", "features_only",
    "out_indices", "feature_cls",
})


class NoPretrainedWeights(ValueError):
    """``pretrained=True`` for a model of this package: no weights ship with it."""

    def __init__(self, name: str):
        super().__init__(
            f"{name}: no pretrained weights ship with this package (pretrained=True has nothing to load). "
            f"Build it with pretrained=False and train it with train.py, or load a state dict you trained "
            f"with timm.create_model({name!r}, checkpoint_path=...)")


def split_model_kwargs(kwargs: dict, model_params) -> tuple[dict, dict]:
    """Split a model entrypoint's ``**kwargs`` into ``(model kwargs, attention options)``.

    A key goes to the model when the model class takes it (``model_params``: its ``__init__`` parameter
    names) or timm's builder does (:data:`BUILDER_KWARGS`); every other key is an attention option.
    ``attn_kwargs`` (a mapping) passes attention options explicitly, for a name that is also a model
    argument; it wins over a top-level option of the same name.
    """
    kwargs = dict(kwargs)
    attn = dict(kwargs.pop("attn_kwargs", None) or {})
    model, loose = {}, {}
    for key, value in kwargs.items():
        (model if key in model_params or key in BUILDER_KWARGS else loose)[key] = value
    return model, {**loose, **attn}


def init_params(cls) -> frozenset:
    """The keyword parameters of ``cls.__init__`` (the model arguments of :func:`split_model_kwargs`)."""
    return frozenset(p for p in inspect.signature(cls.__init__).parameters if p != "self")


def image_pretrained_cfg(img_size=224, *, num_classes: int = 1000, in_chans: int = 3, **kwargs) -> dict:
    """A timm ``pretrained_cfg`` without weights (``url`` empty) for an image classifier of this package:
    ImageNet mean / std, bicubic, crop 0.875 (the DeiT recipe of tasks/classification/imagenet_data.py),
    fixed input size (the attention layers are built for one token grid). ``kwargs`` override / add fields."""
    h, w = to_2tuple(img_size)
    return {
        "url": "", "num_classes": num_classes, "input_size": (in_chans, h, w), "pool_size": None,
        "crop_pct": 0.875, "interpolation": "bicubic", "fixed_input_size": True,
        "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj", "classifier": "head", "license": "apache-2.0", **kwargs,
    }


class PaddedPatchEmbed(PatchEmbed):
    """timm's ``PatchEmbed`` that first zero-pads ``[B, C, H, W]`` images, centred, to ``pad_to``.

    Used as ``VisionTransformer(embed_layer=partial(PaddedPatchEmbed, pad_to=256))``. ``img_size`` stays the
    nominal input size (224: what ``pretrained_cfg`` and data pipelines see) while ``grid_size`` and
    ``num_patches`` are those of the padded canvas (16 x 16 = 256 tokens at 16 px patches): the position
    embedding, the attention's token grid and the feature maps of ``forward_intermediates`` cover the
    canvas, the image in its centre (a 224 px image: the centre 14 x 14 patches). Any input up to ``pad_to``
    per side is accepted; an axis short by ``p`` pixels gets ``p // 2`` zeros before (top / left) and
    ``p - p // 2`` after.

    Shapes: ``[B, C, H, W] -> [B, N, D]`` (``N = prod(grid_size)``), or ``[B, gh, gw, D]`` with
    ``output_fmt="NHWC"`` (timm's ``dynamic_img_size``).
    """

    def __init__(self, img_size=224, patch_size=16, in_chans: int = 3, embed_dim: int = 768, *, pad_to,
                 **kwargs):
        size, canvas, patch = to_2tuple(img_size), to_2tuple(pad_to), to_2tuple(patch_size)
        if any(s > c for s, c in zip(size, canvas)):
            raise ValueError(f"img_size {size} is larger than the padded size pad_to={canvas}")
        if any(c % p for c, p in zip(canvas, patch)):
            raise ValueError(f"padded size {canvas} is not a multiple of the patch size {patch}")
        super().__init__(img_size=canvas, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim,
                         **kwargs)
        self.pad_to = canvas
        self.img_size = size  # nominal input size; grid_size / num_patches stay the canvas's

    def set_input_size(self, img_size=None, patch_size=None):
        """A new nominal input size within the canvas (the token grid, so the position embedding, stays)."""
        if patch_size is not None and to_2tuple(patch_size) != self.patch_size:
            raise ValueError("a padded patch embedding keeps its patch size (the attention's token grid)")
        if img_size is not None:
            size = to_2tuple(img_size)
            if any(s > c for s, c in zip(size, self.pad_to)):
                raise ValueError(f"img_size {size} is larger than the padded size {self.pad_to}; the token "
                                 f"grid is fixed by the attention layers, build a model with a larger pad_to")
            self.img_size = size

    def dynamic_feat_size(self, img_size):
        """The token grid for an ``(H, W)`` input: the padded canvas's."""
        return self.grid_size

    def forward(self, x):
        h, w = x.shape[-2:]
        ph, pw = self.pad_to[0] - h, self.pad_to[1] - w
        if ph < 0 or pw < 0:
            raise ValueError(f"input {h}x{w} is larger than the padded size {self.pad_to}")
        if ph or pw:
            x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))
        x = self.proj(x)
        if self.flatten:
            x = x.flatten(2).transpose(1, 2)  # [B, D, gh, gw] -> [B, N, D]
        elif self.output_fmt != Format.NCHW:
            x = nchw_to(x, self.output_fmt)
        return self.norm(x)


class AttnVisionTransformer(VisionTransformer):
    """timm's ``VisionTransformer`` with a registered attention (``attn_layer`` from
    :func:`mhla.adapters.timm.timm_attn_layer`); the only addition: :meth:`no_weight_decay` also names the
    parameters of the attention's optimizer groups (MHLA's mixing matrices). Build it with :func:`create_vit` (or
    the registered ``deit_*`` models)."""

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """timm's names (``pos_embed``, ``cls_token``, ...) and :func:`grouped_parameter_names`."""
        return set(super().no_weight_decay()) | grouped_parameter_names(self)


VIT_PARAMS = init_params(VisionTransformer) - {"attn_layer", "embed_layer"}


def create_vit(variant: str, attn_cfg, *, pretrained: bool = False, img_size=224, patch_size=16, pad_to=None,
               pretrained_cfg=None, **kwargs) -> AttnVisionTransformer:
    """Build an :class:`AttnVisionTransformer` with timm's ``build_model_with_cfg`` (``pretrained_cfg``,
    ``features_only`` / ``out_indices`` / ``feature_cls``: the last 3 blocks by default, as timm's ViTs).

    Args:
        variant: the model name (a registered one resolves its ``pretrained_cfg`` from timm's registry).
        attn_cfg: attention name or mapping (``name`` + options, see :mod:`mhla.registry`).
        img_size: nominal input size ``H`` or ``(H, W)``.
        pad_to: None, or the canvas the input is zero-padded to (:class:`PaddedPatchEmbed`); the token grid
            is ``pad_to // patch_size`` (else ``img_size // patch_size``).
        pretrained_cfg: timm's; None: the registry's for ``variant``, else :func:`image_pretrained_cfg`.
        kwargs: ``VisionTransformer`` arguments (``embed_dim``, ``depth``, ``num_classes``, ``class_token``,
            ...) and timm's builder arguments.
    """
    if pretrained:
        raise NoPretrainedWeights(variant)
    if "attn_layer" in kwargs or "embed_layer" in kwargs:
        raise TypeError(f"{variant}: the attention comes from attn_cfg and the patch embedding from pad_to; "
                        f"attn_layer / embed_layer cannot be set")
    patch = to_2tuple(patch_size)
    canvas = to_2tuple(pad_to if pad_to else img_size)
    if any(c % p for c, p in zip(canvas, patch)):
        raise ValueError(f"model image size {canvas} (pad_to, else img_size) is not a multiple of the patch "
                         f"size {patch}")
    grid = tuple(c // p for c, p in zip(canvas, patch))
    # tokens before the patch tokens (timm's VisionTransformer has a class token by default)
    num_prefix = int(kwargs.get("class_token", True)) + int(kwargs.get("reg_tokens", 0))
    if pretrained_cfg is None and not is_model(variant):
        pretrained_cfg = image_pretrained_cfg(img_size, num_classes=kwargs.get("num_classes", 1000),
                                              in_chans=kwargs.get("in_chans", 3))
    return build_model_with_cfg(
        AttnVisionTransformer, variant, pretrained=False, pretrained_cfg=pretrained_cfg,
        feature_cfg=dict(out_indices=3, feature_cls="getter"),
        img_size=img_size, patch_size=patch_size,
        embed_layer=partial(PaddedPatchEmbed, pad_to=canvas) if pad_to else PatchEmbed,
        attn_layer=timm_attn_layer(attn_cfg, grid=grid, num_prefix_tokens=num_prefix), **kwargs)


def build_vit(model_cfg, attn_cfg) -> AttnVisionTransformer:
    """Build a ViT from a model config (``name``, ``img_size``, ``patch_size``, ``embed_dim``, ``depth``,
    ``num_heads``, ``mlp_ratio``, ``num_classes``, ``in_chans``, ``class_token``, ``global_pool``,
    ``qk_norm``, ``qkv_bias``, ``drop_path_rate``, ``pad_to``) and an attention config (name + options).

    ``pad_to`` set: ``[B, C, H, W]`` inputs (H, W <= pad_to) are zero-padded, centred, to ``pad_to`` inside
    the model (:class:`PaddedPatchEmbed`); the model is the same plain timm model either way."""
    pad_to = model_cfg.get("pad_to")
    img_size, num_classes = int(model_cfg.img_size), int(model_cfg.num_classes)
    in_chans = int(model_cfg.get("in_chans", 3))
    return create_vit(
        str(model_cfg.get("name", "vit")), attn_cfg,
        pretrained_cfg=image_pretrained_cfg(img_size, num_classes=num_classes, in_chans=in_chans),
        img_size=img_size,
        patch_size=int(model_cfg.patch_size),
        pad_to=int(pad_to) if pad_to else None,
        in_chans=in_chans,
        num_classes=num_classes,
        embed_dim=int(model_cfg.embed_dim),
        depth=int(model_cfg.depth),
        num_heads=int(model_cfg.num_heads),
        mlp_ratio=float(model_cfg.get("mlp_ratio", 4.0)),
        qkv_bias=bool(model_cfg.get("qkv_bias", True)),
        qk_norm=bool(model_cfg.get("qk_norm", False)),
        class_token=bool(model_cfg.get("class_token", False)),
        global_pool=model_cfg.get("global_pool", "avg"),
        drop_path_rate=float(model_cfg.get("drop_path_rate", 0.0)),
    )


def register_family(module_globals: dict, names_and_builders, doc: str) -> None:
    """Register one timm entrypoint per ``(name, build)`` in the module whose ``globals()`` are given, as timm's
    ``@register_model`` does at a definition: ``build(pretrained, **kwargs)`` makes the model; ``doc`` is the
    entrypoint's docstring, formatted with ``name``. Used by the DeiT and VLT families (every 2-D attention)."""
    for name, build in names_and_builders:
        def entry(pretrained: bool = False, _build=build, **kwargs):
            return _build(pretrained, **kwargs)

        entry.__name__ = entry.__qualname__ = name
        entry.__module__ = module_globals["__name__"]
        entry.__doc__ = doc.format(name=name)
        module_globals[name] = register_model(entry)
