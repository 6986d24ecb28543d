"""VLT: the RAVLT / MAViT vision linear transformer backbone (docs/baselines.md#vlt) with any attention in its
two linear stages; MHLA-VLT puts MHLA there (M = 49 on the 56 x 56 stage-1 grid, M = 16 on the 28 x 28
stage-2 grid at 224 px) and keeps softmax attention in stages 3-4.

    model = build_vlt("t", linear_attn={"name": "mhla"})       # MHLA-VLT-T
    model = build_vlt("s", linear_attn={"name": "rala"})       # RAVLT-S (the RALA baseline)

Structure (4 stages, conv layout ``[B, C, H, W]``): a stride-4 conv stem (4 conv3x3 with BN, GELU), blocks
``x += CPE(x); x += g1 * Attn(LN(x)); x += g2 * FFN(LN(x))`` (CPE: depthwise 3x3; FFN: 1x1 conv, GELU, an inner
residual depthwise 3x3, 1x1 conv, ratio 3.5; LayerScale init 1), conv3x3-s2 + BN downsampling, and a head
1x1 conv -> BN -> Swish -> global average pool -> linear. The head width is 2048 (MAViT, whose parameter
counts match the paper's MHLA-VLT: 16M / 27M; RAVLT uses 1024).

Attention wrapper. The paper's MHLA-VLT "strictly follows" RALA, whose attention in every stage (linear stages 1-2
and softmax stages 3-4) is ``proj((Y + LePE_5x5(V)) * O)`` with an output gate ``O = W_o x`` (docs/baselines.md
#vlt). ``rala`` / ``mala`` layers hold that wrapper themselves (mhla/baselines.py
``_GatedRoPEBaseline``). For the other attentions the wrapper is built from the shared layer options
(:data:`WRAPPER_DEFAULTS`): ``cpe`` with ``cpe_kernel: 5`` is the LePE (a depthwise 5 x 5 conv on V added to the
attention output, as ``_GatedRoPEBaseline.lepe``) and ``gate`` the output gate. These are defaults: an attention
config that sets them wins (the Hydra ``attn/*.yaml`` files set ``cpe: false``, so the Table 2b cells set the
wrapper explicitly; the softmax stages, built here, always get the defaults). ``gate: linear`` is RALA's linear
gate ``(o + LePE(V)) * (W_o x + b)``. One difference is left: the softmax stages have no 2-D RoPE.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from timm.layers import DropPath

from mhla.registry import (
    AttentionContract,
    Needs,
    accepted_options,
    build_attention,
    get_attention_class,
    list_attentions,
    with_defaults,
)

# The RALA wrapper from the shared attention options, for attentions that do not hold it (see the module docstring).
WRAPPER_DEFAULTS = {"cpe": True, "cpe_kernel": 5, "gate": "linear"}
OWN_WRAPPER = ("rala", "mala")  # LePE 5x5, linear output gate and 2-D RoPE inside the layer

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


class VLT(nn.Module):
    def __init__(self, variant: str = "t", *, linear_attn=None, softmax_attn=None, img_size: int = 224,
                 num_classes: int = 1000, in_chans: int = 3, head_dim: int = 2048,
                 stage_num_blocks=(49, 16), drop_path_rate: float | None = None):
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
                for key, value in WRAPPER_DEFAULTS.items():
                    cfg.setdefault(key, value)
        if img_size % 32:
            raise ValueError(f"VLT needs an image size divisible by 32, got {img_size}")
        c0 = dims[0]
        self.stem = nn.Sequential(*_conv_bn(in_chans, c0 // 2, 2), *_conv_bn(c0 // 2, c0 // 2),
                                  *_conv_bn(c0 // 2, c0 // 2), *_conv_bn(c0 // 2, c0, 2, act=False))
        rates = torch.linspace(0, dpr, sum(depths)).tolist()
        self.stages, self.downsamples = nn.ModuleList(), nn.ModuleList()
        size, k = img_size // 4, 0
        for s, (dim, depth, h) in enumerate(zip(dims, depths, heads)):
            if s < 2:  # MHLA's M of this stage unless the config sets the block grid
                cfg = {k: v for k, v in linear_attn.items() if v is not None}
                stage = {"num_blocks": int(stage_num_blocks[s])} if cfg["name"] == "mhla" else {}
                cfg = with_defaults(cfg, stage, get_attention_class(cfg["name"]))
            else:
                cfg = softmax_attn
            self.stages.append(nn.Sequential(*[VLTBlock(dim, h, cfg, (size, size), rates[k + i]) for i in range(depth)]))
            k += depth
            if s < 3:
                self.downsamples.append(nn.Sequential(*_conv_bn(dim, dims[s + 1], 2, act=False)))
                size //= 2
        self.head = nn.Sequential(nn.Conv2d(dims[-1], head_dim, 1), nn.BatchNorm2d(head_dim), nn.SiLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(head_dim, num_classes))

    def forward(self, x):
        x = self.stem(x)
        for s, stage in enumerate(self.stages):
            x = stage(x)
            if s < 3:
                x = self.downsamples[s](x)
        return self.head(x)


def build_vlt(variant: str, linear_attn=None, **kwargs) -> VLT:
    return VLT(variant, linear_attn=linear_attn, **kwargs)


def attention_contract(model_cfg) -> AttentionContract:
    """VLT's linear stages take any bidirectional attention over a 2-D grid, with RALA's wrapper as the default of
    those that do not hold it (:data:`WRAPPER_DEFAULTS`); MHLA's M defaults to ``model.stage_num_blocks`` per
    stage (one ``attn.num_blocks`` sets both)."""
    defaults = {}
    for name in list_attentions():
        accepted = accepted_options(get_attention_class(name))
        if name not in OWN_WRAPPER and (accepted is None or set(WRAPPER_DEFAULTS) <= accepted):
            defaults[name] = dict(WRAPPER_DEFAULTS)
    size = int(model_cfg.img_size)
    probes = tuple(({"grid": (size // s, size // s)}, {"mhla": {"num_blocks": int(m)}})
                   for s, m in zip((4, 8), model_cfg.get("stage_num_blocks", (49, 16))))
    return AttentionContract(model=f"model={model_cfg.get('name', 'vlt')}", needs=Needs(grid_rank=2),
                             defaults=defaults, fixed=("grid", "causal", "num_prefix_tokens", "projections",
                                                       "head_dim", "value_dim", "qkv_bias"), probes=probes)
