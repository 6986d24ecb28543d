"""VLT: the RAVLT / MAViT vision linear transformer backbone (docs/baselines.md#vlt) with any attention in its
two linear stages; MHLA-VLT puts MHLA there (M = 49 on the 56 x 56 stage-1 grid, M = 16 on the 28 x 28
stage-2 grid at 224 px) and keeps softmax attention in stages 3-4.

    model = build_vlt("t", linear_attn={"name": "mhla"})        # MHLA-VLT-T
    model = build_vlt("s", linear_attn={"name": "rala"})        # RAVLT-S (the RALA baseline)
    model = timm.create_model("vlt_tiny_mhla", num_classes=5)   # registered with timm (import models)
    feats = timm.create_model("vlt_tiny_mhla", features_only=True)  # 4 stages, strides 4, 8, 16, 32

Structure (4 stages, conv layout ``[B, C, H, W]``): a stride-4 conv stem (4 conv3x3 with BN, GELU), blocks
``x += CPE(x); x += g1 * Attn(LN(x)); x += g2 * FFN(LN(x))`` (CPE: depthwise 3x3; FFN: 1x1 conv, GELU, an
inner residual depthwise 3x3, 1x1 conv, ratio 3.5; LayerScale init 1), conv3x3-s2 + BN downsampling, and a
head 1x1 conv -> BN -> Swish -> global average pool -> linear. The head width is 2048 (MAViT, whose
parameter counts match the paper's MHLA-VLT: 16M / 27M; RAVLT uses 1024). Stage ``i`` (``stages.{i}``) is
the downsampling from the stage before (none in stage 0, after the stem), then its blocks.

Attention wrapper. The paper's MHLA-VLT "strictly follows" RALA, whose attention in every stage (linear
stages 1-2 and softmax stages 3-4) is ``proj((Y + LePE_5x5(V)) * O)`` with an output gate ``O = W_o x``
(docs/baselines.md#vlt). ``rala`` / ``mala`` layers hold that wrapper themselves
(mhla/baselines.py ``_GatedRoPEBaseline``). For the other attentions the wrapper is built from the shared
layer options (:data:`WRAPPER_DEFAULTS`): ``cpe`` with ``cpe_kernel: 5`` is the LePE (a depthwise 5 x 5 conv
on V added to the attention output, as ``_GatedRoPEBaseline.lepe``) and ``gate`` the output gate. These are
defaults: an attention config that sets them wins (from Hydra they are the model's defaults,
:func:`attention_contract`; the softmax stages, built here, always get them).
``gate: linear`` is RALA's linear gate ``(o + LePE(V)) * (W_o x + b)``. One difference is left: the softmax
stages have no 2-D RoPE.

timm model API, as timm's conv nets (EfficientNet: its 1x1 head conv also comes before the pooling):
``forward_features``: ``[B, 3, H, W] -> [B, head_dim, H/32, W/32]`` (stem, stages, head conv, BN, Swish);
``forward_head(x, pre_logits)``: pool, dropout, classifier (``[B, num_classes]``; ``[B, head_dim]`` with
``pre_logits``); ``reset_classifier`` / ``get_classifier`` (``head.fc``); ``num_features =
head_hidden_size = head_dim``; ``feature_info`` for the 4 stages (``stages.{i}``, reductions 4, 8, 16, 32);
``forward_intermediates``; ``features_only=True`` (timm's ``FeatureListNet``; ``feature_cls="getter"``
uses ``forward_intermediates``); ``set_grad_checkpointing``; ``no_weight_decay`` (MHLA's mixing matrices;
timm's optimizer leaves every 1-D parameter, norms, biases, LayerScale, undecayed anyway); ``group_matcher``.

Registered with timm: ``vlt_{tiny,small}_<attention>`` for every attention of the registry (the linear
stages' attention), built with timm's ``build_model_with_cfg`` (no weights: ``pretrained=True`` raises).
Their keyword arguments: :class:`VLT`'s (``img_size``, ``num_classes``, ``in_chans``, ``head_dim``,
``stage_num_blocks``, ``drop_path_rate``, ``drop_rate``, ``global_pool``, ``softmax_attn``) and timm's
builder ones (``features_only``, ``out_indices``, ``feature_cls``, ``pretrained_cfg``, ...) go to the model;
every other keyword is an option of the linear stages' attention (``num_blocks``, ``cpe``, ...), as is
``attn_kwargs={...}`` (for a name that is also a model argument).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from timm.layers import ClassifierHead, DropPath, to_2tuple
from timm.models import build_model_with_cfg, checkpoint_seq, generate_default_cfgs, is_model
from timm.models._features import feature_take_indices

from mhla.registry import (
    AttentionContract,
    Needs,
    accepted_options,
    attentions_for,
    block_defaults,
    build_attention,
    get_attention_class,
    list_attentions,
    takes_blocks,
    with_defaults,
)

from .vit import (
    NoPretrainedWeights,
    grouped_parameter_names,
    image_pretrained_cfg,
    init_params,
    register_family,
    split_model_kwargs,
)

# The RALA wrapper from the shared attention options, for attentions that do not hold it (module docstring).
WRAPPER_DEFAULTS = {"cpe": True, "cpe_kernel": 5, "gate": "linear"}
OWN_WRAPPER = ("rala", "mala")  # LePE 5x5, linear output gate and 2-D RoPE inside the layer

# registered names: vlt_tiny_<attn>, vlt_small_<attn>
VARIANT_NAMES = {"t": "tiny", "s": "small"}
VLT_SPECS = {
    "t": dict(dims=(64, 128, 256, 512), depths=(2, 2, 6, 2), heads=(1, 2, 4, 8), drop_path=0.1),
    "s": dict(dims=(64, 128, 320, 512), depths=(3, 5, 9, 3), heads=(1, 2, 5, 8), drop_path=0.15),
}


def _conv_bn(cin, cout, stride=1, act=True):
    layers = [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)]
    if act:
        layers.append(nn.GELU())
    return layers


class ConvFFN(nn.Module):
    """1x1 conv -> GELU -> (+ depthwise 3x3, inner residual) -> 1x1 conv, on ``[B, C, H, W]``."""

    def __init__(self, dim: int, ratio: float = 3.5):
        super().__init__()
        hidden = int(dim * ratio)
        self.fc1 = nn.Conv2d(dim, hidden, 1)
        self.act = nn.GELU()
        self.dw = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden)
        self.fc2 = nn.Conv2d(hidden, dim, 1)

    def forward(self, x):
        h = self.act(self.fc1(x))
        return self.fc2(h + self.dw(h))


class VLTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, attn_cfg, grid, drop_path: float, mlp_ratio: float = 3.5):
        super().__init__()
        self.cpe = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = build_attention(attn_cfg, dim, heads, grid=tuple(grid))
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.ffn = ConvFFN(dim, mlp_ratio)
        self.gamma1 = nn.Parameter(torch.ones(dim))
        self.gamma2 = nn.Parameter(torch.ones(dim))
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x):  # [B, C, H, W]
        B, C, H, W = x.shape
        x = x + self.cpe(x)
        t = x.flatten(2).transpose(1, 2)  # [B, N, C] raster tokens
        t = t + self.drop_path(self.gamma1 * self.attn(self.norm1(t)))
        x = t.transpose(1, 2).reshape(B, C, H, W)
        y = self.ffn(self.norm2(t).transpose(1, 2).reshape(B, C, H, W))
        return x + self.drop_path(self.gamma2.view(1, C, 1, 1) * y)


class VLTStage(nn.Module):
    """The downsampling from the stage before (conv3x3-s2 + BN; None: identity), then the VLT blocks:
    ``[B, C_in, H, W] -> [B, C, H / 2, W / 2]`` (``[B, C, H, W]`` without downsampling)."""

    def __init__(self, downsample: nn.Module | None, blocks: list[nn.Module]):
        super().__init__()
        self.downsample = downsample if downsample is not None else nn.Identity()
        self.blocks = nn.Sequential(*blocks)
        self.grad_checkpointing = False

    def forward(self, x):
        x = self.downsample(x)
        if self.grad_checkpointing and not torch.jit.is_scripting():
            return checkpoint_seq(self.blocks, x)
        return self.blocks(x)


class VLT(nn.Module):
    """The VLT backbone and classifier: ``[B, in_chans, H, W] -> [B, num_classes]`` (module docstring).

    Args:
        variant: ``"t"`` or ``"s"`` (:data:`VLT_SPECS`).
        linear_attn: attention config of stages 1-2 (default MHLA); ``softmax_attn``: of stages 3-4.
        img_size: ``H`` or ``(H, W)``, multiples of 32; the attention layers are built for its token grids.
        stage_num_blocks: MHLA's M in stages 1 and 2 (when ``linear_attn`` has no ``num_blocks``).
        global_pool: timm's pooling (``avg``; ``""``: none, the head then gives ``[B, C, H/32, W/32]``).
        drop_rate: dropout before the classifier; ``drop_path_rate``: stochastic depth (None: the variant's).
    """

    def __init__(self, variant: str = "t", *, linear_attn=None, softmax_attn=None, img_size=224,
                 num_classes: int = 1000, in_chans: int = 3, head_dim: int = 2048,
                 stage_num_blocks=(49, 16), drop_path_rate: float | None = None, drop_rate: float = 0.0,
                 global_pool: str = "avg"):
        super().__init__()
        if variant not in VLT_SPECS:
            raise ValueError(f"VLT variant must be one of {sorted(VLT_SPECS)}, got {variant!r}")
        spec = VLT_SPECS[variant]
        dims, depths, heads = spec["dims"], spec["depths"], spec["heads"]
        dpr = spec["drop_path"] if drop_path_rate is None else drop_path_rate
        linear_attn = {k: v for k, v in dict(linear_attn or {"name": "mhla"}).items() if v is not None}
        softmax_attn = {k: v for k, v in dict(softmax_attn or {"name": "softmax"}).items() if v is not None}
        for cfg in (linear_attn, softmax_attn):
            if cfg.get("name") not in OWN_WRAPPER:
                cfg.update(with_defaults(cfg, WRAPPER_DEFAULTS, get_attention_class(cfg["name"])))
        size = to_2tuple(img_size)
        if size[0] % 32 or size[1] % 32:
            raise ValueError(f"VLT needs an image size divisible by 32, got {img_size}")
        self.num_classes, self.in_chans, self.global_pool = num_classes, in_chans, global_pool
        self.num_features = self.head_hidden_size = head_dim
        self.grad_checkpointing = False
        c0 = dims[0]
        self.stem = nn.Sequential(*_conv_bn(in_chans, c0 // 2, 2), *_conv_bn(c0 // 2, c0 // 2),
                                  *_conv_bn(c0 // 2, c0 // 2), *_conv_bn(c0 // 2, c0, 2, act=False))
        rates = torch.linspace(0, dpr, sum(depths)).tolist()
        stages, self.feature_info = [], []
        grid, k, downsample = (size[0] // 4, size[1] // 4), 0, None
        for s, (dim, depth, h) in enumerate(zip(dims, depths, heads)):
            if s < 2:  # MHLA's M of this stage unless the config sets the block grid
                cfg = {k: v for k, v in linear_attn.items() if v is not None}
                stage = block_defaults(cfg["name"], stage_num_blocks[s])  # {} for an attention without blocks
                cfg = with_defaults(cfg, stage, get_attention_class(cfg["name"]))
            else:
                cfg = softmax_attn
            blocks = [VLTBlock(dim, h, cfg, grid, rates[k + i]) for i in range(depth)]
            stages.append(VLTStage(downsample, blocks))
            self.feature_info.append(dict(num_chs=dim, reduction=4 * 2 ** s, module=f"stages.{s}"))
            k += depth
            if s < 3:  # built here, after this stage's blocks: the construction (RNG) order of the weights
                downsample = nn.Sequential(*_conv_bn(dim, dims[s + 1], 2, act=False))
                grid = (grid[0] // 2, grid[1] // 2)
        self.stages = nn.Sequential(*stages)
        self.conv_head = nn.Conv2d(dims[-1], head_dim, 1)
        self.norm_head = nn.BatchNorm2d(head_dim)
        self.act_head = nn.SiLU()
        self.head = ClassifierHead(head_dim, num_classes, pool_type=global_pool, drop_rate=drop_rate)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Names kept out of weight decay by timm's optimizer factory: the attention's optimizer groups (MHLA's
        mixing matrices; :func:`models.vit.grouped_parameter_names`)."""
        return grouped_parameter_names(self)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict:
        """Parameter groups (stem, then stage by stage; layer-wise lr decay): timm's convention."""
        return dict(stem=r"^stem", blocks=r"^stages\.(\d+)" if coarse else [
            (r"^stages\.(\d+)\.downsample", (0,)), (r"^stages\.(\d+)\.blocks\.(\d+)", None),
            (r"^conv_head|^norm_head", (99999,))])

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable
        for stage in self.stages:
            stage.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head.fc

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new classifier for ``num_classes`` (0: none, the head gives the pooled ``[B, head_dim]``);
        ``global_pool``: new pooling (``""``: none)."""
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = global_pool
        self.head.reset(num_classes, global_pool)

    def forward_intermediates(self, x, indices=None, norm: bool = False, stop_early: bool = False,
                              output_fmt: str = "NCHW", intermediates_only: bool = False):
        """Stage outputs (``[B, dims[i], H / 2^(i+2), W / 2^(i+2)]``) of the stages ``indices`` picks (None:
        all 4; an int n: the last n; a sequence: those), and unless ``intermediates_only`` the
        :meth:`forward_features` output too: ``(final, intermediates)``. ``norm`` is accepted for timm's
        interface; the stage outputs have no norm of their own (the head's BN follows a 1x1 conv)."""
        if output_fmt != "NCHW":
            raise ValueError(f"VLT gives NCHW feature maps, not {output_fmt}")
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        stages = self.stages if torch.jit.is_scripting() or not stop_early else self.stages[:max_index + 1]
        intermediates = []
        x = self.stem(x)
        for i, stage in enumerate(stages):
            x = stage(x)
            if i in take_indices:
                intermediates.append(x)
        if intermediates_only:
            return intermediates
        if len(stages) == len(self.stages):
            x = self.forward_head_features(x)
        return x, intermediates

    def prune_intermediate_layers(self, indices=1, prune_norm: bool = False, prune_head: bool = True):
        """Drop the stages after the last of ``indices``, the head conv / BN / Swish (``prune_norm``) and the
        classifier and pooling (``prune_head``); returns the kept indices."""
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        self.stages = self.stages[:max_index + 1]
        if prune_norm:
            self.conv_head, self.norm_head, self.act_head = nn.Identity(), nn.Identity(), nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take_indices

    def forward_head_features(self, x):
        """The head's 1x1 conv, BN, Swish: ``[B, 512, h, w] -> [B, head_dim, h, w]``."""
        return self.act_head(self.norm_head(self.conv_head(x)))

    def forward_features(self, x):
        """``[B, in_chans, H, W] -> [B, head_dim, H/32, W/32]``: stem, 4 stages, head conv / BN / Swish."""
        x = self.stem(x)
        x = self.stages(x)
        return self.forward_head_features(x)

    def forward_head(self, x, pre_logits: bool = False):
        """Pool, dropout, classifier: ``[B, head_dim, h, w] -> [B, num_classes]`` (``[B, head_dim]`` with
        ``pre_logits``; ``[B, head_dim, h, w]`` when ``global_pool=""`` and ``num_classes=0``)."""
        return self.head(x, pre_logits=pre_logits)

    def forward(self, x):
        return self.forward_head(self.forward_features(x))


VLT_PARAMS = init_params(VLT) - {"variant", "linear_attn"}


def vlt_pretrained_cfg(img_size=224, **kwargs) -> dict:
    """timm ``pretrained_cfg`` of a VLT (no weights): :func:`models.vit.image_pretrained_cfg` with VLT's first
    conv, classifier and unpooled feature size (``img_size / 32``)."""
    h, w = to_2tuple(img_size)
    return image_pretrained_cfg((h, w), **{"first_conv": "stem.0", "classifier": "head.fc",
                                           "pool_size": (h // 32, w // 32), **kwargs})


def create_vlt(name: str, variant: str, linear_attn=None, pretrained: bool = False, *, img_size=224,
               pretrained_cfg=None, **kwargs) -> VLT:
    """Build a :class:`VLT` with timm's ``build_model_with_cfg`` (``pretrained_cfg``, ``features_only`` over
    the 4 stages, ``out_indices``, ``feature_cls``); ``kwargs``: VLT and builder arguments."""
    if pretrained:
        raise NoPretrainedWeights(name)
    if pretrained_cfg is None and not is_model(name):
        pretrained_cfg = vlt_pretrained_cfg(img_size, num_classes=kwargs.get("num_classes", 1000),
                                            in_chans=kwargs.get("in_chans", 3))
    # VLT's variant goes in positionally: build_model_with_cfg has an argument of that name (the model name)
    return build_model_with_cfg(partial(VLT, variant), name, pretrained=False, pretrained_cfg=pretrained_cfg,
                                feature_cfg=dict(out_indices=(0, 1, 2, 3), flatten_sequential=True),
                                linear_attn=linear_attn, img_size=img_size, **kwargs)


def build_vlt(variant: str, linear_attn=None, **kwargs) -> VLT:
    """VLT-``variant`` (``"t"`` / ``"s"``) with ``linear_attn`` in stages 1-2; ``kwargs``: :class:`VLT`'s
    (``img_size``, ``num_classes``, ...). The model of the registered ``vlt_{tiny,small}_<attn>``."""
    if variant not in VLT_SPECS:
        raise ValueError(f"VLT variant must be one of {sorted(VLT_SPECS)}, got {variant!r}")
    img_size = kwargs.pop("img_size", 224)
    cfg = vlt_pretrained_cfg(img_size, num_classes=kwargs.get("num_classes", 1000),
                             in_chans=kwargs.get("in_chans", 3))
    return create_vlt(f"vlt_{variant}", variant, linear_attn, img_size=img_size, pretrained_cfg=cfg, **kwargs)


def model_name(variant: str, attn: str) -> str:
    return f"vlt_{VARIANT_NAMES[variant]}_{attn}"


def vlt(variant: str, attn: str = "mhla", pretrained: bool = False, **kwargs) -> VLT:
    """VLT-``variant`` (``"t"`` / ``"s"``) with attention ``attn`` in its linear stages, as the registered
    ``vlt_{tiny,small}_<attn>``: ``kwargs`` split into VLT / timm builder arguments and attention options."""
    if variant not in VLT_SPECS:
        raise ValueError(f"VLT variant must be one of {sorted(VLT_SPECS)}, got {variant!r}")
    model_kwargs, attn_options = split_model_kwargs(kwargs, VLT_PARAMS)
    return create_vlt(model_name(variant, attn), variant, {"name": attn, **attn_options}, pretrained,
                      **model_kwargs)


ATTENTIONS = tuple(attentions_for(Needs(grid_rank=2)))  # the registry's 2-D attentions

default_cfgs = generate_default_cfgs(
    {model_name(v, a): vlt_pretrained_cfg(224) for v in VLT_SPECS for a in ATTENTIONS})


register_family(globals(), [(model_name(v, a), partial(vlt, v, a)) for v in VLT_SPECS for a in ATTENTIONS],
                "{name}: VLT with the attention its name ends with in stages 1-2, softmax in stages 3-4 (RALA "
                "wrapper). No pretrained weights.")


def attention_contract(model_cfg) -> AttentionContract:
    """VLT's linear stages take any bidirectional attention over a 2-D grid, with RALA's wrapper as the default of
    those that do not hold it (:data:`WRAPPER_DEFAULTS`); the token blocks of each linear stage are
    ``model.stage_num_blocks`` (MHLA's M; one ``attn.num_blocks`` sets both)."""
    defaults = {}
    for name in list_attentions():
        accepted = accepted_options(get_attention_class(name))
        if name not in OWN_WRAPPER and (accepted is None or set(WRAPPER_DEFAULTS) <= accepted):
            defaults[name] = dict(WRAPPER_DEFAULTS)
    size = int(model_cfg.img_size)
    spec = VLT_SPECS.get(model_cfg.get("variant", "t"), VLT_SPECS["t"])
    probes = tuple(({"grid": (size // s, size // s), "dim": spec["dims"][i], "num_heads": spec["heads"][i]},
                    {name: block_defaults(name, m) for name in list_attentions() if takes_blocks(name)})
                   for i, (s, m) in enumerate(zip((4, 8), model_cfg.get("stage_num_blocks", (49, 16)))))
    return AttentionContract(model=f"model={model_cfg.get('name', 'vlt')}", needs=Needs(grid_rank=2),
                             defaults=defaults, fixed=("grid", "causal", "num_prefix_tokens", "projections",
                                                       "head_dim", "value_dim", "qkv_bias"), probes=probes)
