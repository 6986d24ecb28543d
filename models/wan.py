"""Wan2.1 text-to-video transformer (diffusers ``WanTransformer3DModel``) with MHLA / linear self-attention.

    from models.wan import build_wan, apply_attention
    model = build_wan(cfg.model, cfg.attn)          # pretrained from model.pretrained, or random init
    apply_attention(model, {"name": "mhla", "blocks": [7, 3, 5], "layers": "hybrid", ...})

Wan2.1-T2V-1.3B (docs/baselines.md#wan21-t2v-13b): 30 layers, width 1536 = 12 heads x 128, FFN 8960, patch (1, 2, 2),
16 latent channels, UMT5-XXL text (4096-dim, 512 tokens), qk RMSNorm across heads, 1419M params. The VAE
compresses (4, 8, 8): 81 frames at 480 x 800 -> latents 21 x 60 x 100 -> 21 x 30 x 50 = 31,500 tokens.

Attention variants (``attn`` config: the self-attention ``attn1``; the text cross-attention ``attn2`` stays
Wan's softmax unless ``attn_cross`` says otherwise, :func:`cross_attention_contract`,
docs/cross_attention.md):
    ``softmax``  the model's own processor (SDPA / FlashAttention): Table 5's "FlashAttention" row
    ``linear``   plain linear attention (ReLU features): Table 5's "Linear" row
    ``mhla``     MHLA over a 3-D block grid ``blocks`` (default 7 x 3 x 5 = 105 blocks of 3 x 10 x 10),
                 ``layers: all`` ("MHLA" row) or ``layers: hybrid`` (2/3 of the layers, "MHLA Hybrid" row)
Options read from ``attn`` (:func:`attention_contract`; defaults = the paper's video setting): ``normalize: false``
with ``out_norm: true`` (output RMSNorm), ``rope: after_feature_map`` (``before_feature_map`` | ``none``), MHLA's
locality init; host options ``layers: all | hybrid | [indices]``, with ``hybrid`` ``softmax_every`` (3) and
``softmax_offset`` (2): the layers ``i % softmax_every == softmax_offset`` keep softmax (Table 5's hybrid cell sets
offset 0, the authors' release: layers 0, 3, ..., 27; the paper does not say which layers).

Local weights only: ``model.pretrained`` is a folder in diffusers format (``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``);
a missing folder raises :class:`MissingWeightsError` that says what to download and where.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch.nn as nn
from omegaconf import OmegaConf

from mhla.adapters.diffusers import hybrid_layers, swap_cross_attention, swap_self_attention
from mhla.registry import AttentionContract, Needs

from .attention import token_blocks
from .weights import MissingWeightsError, require_local_weights  # noqa: F401  (MissingWeightsError: re-exported)

# WanTransformer3DModel config of Wan2.1-T2V-1.3B (diffusers' conversion script; docs/baselines.md#wan21-t2v-13b).
WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
                rope_max_seq_len=1024)
HF_REPO = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
LAYOUT = ("model_index.json", "transformer/ (config.json + *.safetensors)", "vae/ (AutoencoderKLWan)",
          "text_encoder/ (UMT5EncoderModel)", "tokenizer/", "scheduler/")
VAE_STRIDE = (4, 8, 8)
TRANSFORMER_KEYS = tuple(WAN_1_3B)


def check_weights_dir(path, component: str | None = None) -> str:
    """``path`` (and ``path/component``) must exist; else :class:`MissingWeightsError` naming the HF repo."""
    where = os.path.join(path, component) if (path and component) else path
    require_local_weights(where, what="Wan2.1 weights", repo=HF_REPO, option="model.pretrained={dir}",
                          example_dir="/data/Wan2.1-T2V-1.3B-Diffusers", marker=None,
                          contents="expected layout: " + ", ".join(LAYOUT))
    return where


def _plain(cfg) -> dict:
    if cfg is None:
        return {}
    if isinstance(cfg, Mapping):
        return dict(cfg)
    return OmegaConf.to_container(cfg, resolve=True)


def token_grid(num_frames: int, height: int, width: int, patch=(1, 2, 2), vae_stride=VAE_STRIDE) -> tuple[int, ...]:
    """Token grid of a clip: latents ``(1 + (F - 1) / 4, H / 8, W / 8)``, then the patch size.

    ``token_grid(81, 480, 800) == (21, 30, 50)`` (31,500 tokens). ``vae_stride=(1, 1, 1)``: pixel space.
    """
    st, sh, sw = vae_stride
    if (num_frames - 1) % st or height % (sh * patch[1]) or width % (sw * patch[2]):
        raise ValueError(f"{num_frames} frames at {height}x{width} do not fit VAE stride {vae_stride} and patch "
                         f"{tuple(patch)}: need frames = 1 + {st}k and sizes divisible by "
                         f"{sh * patch[1]} / {sw * patch[2]}")
    lat = (1 + (num_frames - 1) // st, height // sh, width // sw)
    return tuple(g // p for g, p in zip(lat, patch))


def build_transformer(model_cfg):
    """``WanTransformer3DModel``: from ``model.pretrained`` (local, diffusers format) or random init."""
    from diffusers import WanTransformer3DModel  # noqa: PLC0415

    m = _plain(model_cfg)
    if m.get("pretrained"):
        where = check_weights_dir(m["pretrained"], "transformer")
        model = WanTransformer3DModel.from_pretrained(where)
    else:
        arch = {k: m[k] for k in TRANSFORMER_KEYS if k in m}
        arch = {k: tuple(v) if isinstance(v, list) else v for k, v in arch.items()}
        model = WanTransformer3DModel(**{**WAN_1_3B, **arch})
    if m.get("gradient_checkpointing"):
        model.enable_gradient_checkpointing()
    return model


# The paper's video setting (Table 5: no normaliser, output RMSNorm, RoPE after the feature map), for the attentions
# that take those options; the Wan cells and the mini task set the rest (blocks, the linear row's own setting).
WAN_ATTENTION_DEFAULTS = {"normalize": False, "out_norm": True, "rope": "after_feature_map"}
HOST_OPTIONS = ("layers", "softmax_every", "softmax_offset")
NATIVE = {"softmax": "Wan's own processor (SDPA / FlashAttention)"}  # the model's own attentions, by config name
CROSS_NATIVE = {"native": "Wan's own softmax cross-attention (SDPA)"}


def attention_contract(model_cfg) -> AttentionContract:
    """Wan's self-attention takes any registered attention that runs inside diffusers' projections over the 3-D
    latent grid with Wan's rotary tables, or ``softmax`` (Wan's own processor, the FlashAttention row). Host options
    (``attn.layers`` / ``softmax_every`` / ``softmax_offset``): which layers get it. Its default token blocks
    are ``model.token_blocks`` (MHLA's M; ``attn.blocks`` per axis wins when set)."""
    defaults = {"*": dict(WAN_ATTENTION_DEFAULTS)}
    # (``gate``: the layer owns its gate, applied on the module's input, as the authors' release's is_gated)
    refused = {k: "the diffusers module owns the projections" for k in ("cpe", "cpe_kernel", "qk_norm",
                                                                        "short_conv")}
    return AttentionContract(
        model=f"model={model_cfg.get('name', 'wan')}", needs=Needs(grid_rank=3, rope=True, host_projections=True),
        defaults=defaults, blocks=token_blocks(model_cfg),
        fixed=("grid", "causal", "projections", "head_dim", "value_dim", "num_prefix_tokens"),
        host_options={"*": HOST_OPTIONS}, native=dict(NATIVE),
        refused=refused, prepare=_check_layer_options)


def _check_layer_options(options: dict) -> dict:
    """The host options' start-of-run check (:func:`attention_layers` on a 30-layer model)."""
    attention_layers(options, 30)
    return options


def attention_layers(attn_cfg, num_layers: int) -> list[int]:
    """Indices of the self-attention layers that get the new attention (``attn.layers``)."""
    a = _plain(attn_cfg)
    layers = a.get("layers", "all")
    if layers != "hybrid" and (a.get("softmax_every") is not None or a.get("softmax_offset") is not None):
        raise ValueError(f"attn.softmax_every / attn.softmax_offset choose the softmax layers of attn.layers=hybrid; "
                         f"with attn.layers={layers} they would change nothing")
    if layers in (None, "all"):
        return list(range(num_layers))
    if layers == "hybrid":
        return hybrid_layers(num_layers, int(a.get("softmax_every", 3)), int(a.get("softmax_offset", 2)))
    if isinstance(layers, str):
        raise ValueError(f"attn.layers must be all, hybrid or a list of layer indices, got {layers!r}")
    return [int(i) for i in layers]


def apply_attention(model, attn_cfg, grid=None) -> list[str]:
    """Swap the self-attention of ``model`` as the resolved ``attn_cfg`` says (:func:`attention_contract`); returns
    the swapped module names. ``attn.name == "softmax"`` keeps Wan's own processor.

    ``grid``: the training token grid, used when the block grid is given as ``num_blocks`` (factorised)
    rather than ``blocks`` (per axis).
    """
    a = _plain(attn_cfg)
    if a.get("name", "softmax") in NATIVE:
        return []
    layer_options = {k: v for k, v in a.items() if k not in HOST_OPTIONS}
    return swap_self_attention(model, layer_options, layers=attention_layers(a, len(model.blocks)), grid=grid)


CROSS_FIXED = ("grid", "projections", "head_dim", "value_dim", "context_dim")


def cross_attention_contract(model_cfg) -> AttentionContract:
    """Wan's text cross-attention (``attn2``; ``attn_cross``): ``native`` (Wan's own softmax processor, the
    default) or a registered cross-attention that runs inside diffusers' projections with queries over the 3-D
    latent grid (``mhla_cross``, ``linear_cross``, ``softmax_cross``); defaults from
    ``model.attn_cross_defaults``."""
    return AttentionContract(
        model=f"model={model_cfg.get('name', 'wan')}",
        needs=Needs(cross=True, grid_rank=3, host_projections=True),
        fixed=CROSS_FIXED, native=dict(CROSS_NATIVE))


def apply_cross_attention(model, cross_cfg, grid=None) -> list[str]:
    """Swap the text cross-attention of ``model`` as the resolved ``cross_cfg`` says (``native``: keep Wan's
    own); returns the swapped module names."""
    a = _plain(cross_cfg)
    if a.get("name", "native") in CROSS_NATIVE:
        return []
    return swap_cross_attention(model, a, grid=grid)


def build_wan(model_cfg, attn_cfg, grid=None, cross_cfg=None) -> nn.Module:
    """The Wan transformer with ``attn_cfg`` applied to its self-attention and ``cross_cfg`` (None: Wan's own)
    to its text cross-attention."""
    model = build_transformer(model_cfg)
    apply_attention(model, attn_cfg, grid)
    apply_cross_attention(model, cross_cfg, grid)
    return model


def load_vae(path):
    """``AutoencoderKLWan`` from ``<path>/vae`` (local)."""
    from diffusers import AutoencoderKLWan  # noqa: PLC0415

    return AutoencoderKLWan.from_pretrained(check_weights_dir(path, "vae"))


def load_text_encoder(path):
    """``(tokenizer, UMT5EncoderModel)`` from ``<path>/tokenizer`` and ``<path>/text_encoder`` (local)."""
    from transformers import AutoTokenizer, UMT5EncoderModel  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(check_weights_dir(path, "tokenizer"))
    enc = UMT5EncoderModel.from_pretrained(check_weights_dir(path, "text_encoder"))
    return tok, enc.eval().requires_grad_(False)
