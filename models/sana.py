"""SANA (Xie et al., ICLR 2025) through diffusers' ``SanaTransformer2DModel``, with MHLA in its self-attention.

SANA's self-attention (``attn1`` of every block) is already linear attention with a ReLU kernel (diffusers'
``SanaLinearAttnProcessor2_0``: ``relu(q) sum relu(k)^T v / (relu(q) . sum relu(k) + 1e-15)``, fp32);
cross-attention (``attn2``, to the Gemma text tokens) is softmax. MHLA Table 4 fine-tunes SANA-0.6B with MHLA in
place of that linear attention: :func:`build_sana` swaps the ``attn1`` processors through the project's diffusers
adapter (:func:`mhla.adapters.diffusers.swap_self_attention`; cross-attention is never touched) and leaves
everything else (Mix-FFN, adaLN-single, NoPE) as is.

    model = build_sana({"config": "sana_600m", "pretrained": "/data/Sana_600M_1024px_diffusers/transformer"},
                       {"name": "mhla", "num_blocks": 16})
    v = model(latents [B, 32, H, W], encoder_hidden_states [B, L, 2304], timestep [B]).sample

``attn.name``: any registered attention that runs inside diffusers' projections (``mhla``: M blocks over the latent
grid, 16 = 4 x 4 at 1024 px; ``linear``: plain linear attention; ...) or ``native`` (keep SANA's own ReLU
linear attention, the baseline row). ``attn_cross`` (:func:`cross_attention_contract`): the text
cross-attention, ``native`` (SANA's softmax, the default) or a registered cross-attention (``mhla_cross``,
``linear_cross``, ``softmax_cross``; docs/cross_attention.md); the encoder's padding mask reaches it as a key
padding mask.
"""

from __future__ import annotations

import os

import torch.nn as nn
from omegaconf import OmegaConf

from mhla.adapters.diffusers import swap_cross_attention, swap_self_attention
from mhla.registry import AttentionContract, Needs

from .attention import token_blocks

# docs/baselines.md#sana-06b (scripts/convert_sana_to_diffusers.py, SanaMS_600M_P1_D28); sample_size 32 = 1024 px.
SANA_600M = dict(in_channels=32, out_channels=32, num_attention_heads=36, attention_head_dim=32, num_layers=28,
                 num_cross_attention_heads=16, cross_attention_head_dim=72, cross_attention_dim=1152,
                 caption_channels=2304, mlp_ratio=2.5, attention_bias=False, sample_size=32, patch_size=1,
                 norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=None, qk_norm=None,
                 guidance_embeds=False)
# A tiny SANA with the same structure (tests, CPU runs): width 64, 2 blocks, 8 x 8 latents with 8 channels.
SANA_TINY = dict(SANA_600M, in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=16,
                 num_layers=2, num_cross_attention_heads=4, cross_attention_head_dim=16, cross_attention_dim=64,
                 caption_channels=32, sample_size=8)
CONFIGS = {"sana_600m": SANA_600M, "sana_tiny": SANA_TINY}
NATIVE = ("native",)
CROSS_NATIVE = {"native": "SANA's own softmax cross-attention"}  # its own cross-attention, by config name


def sana_config(name_or_dict) -> dict:
    """A named config (``sana_600m``, ``sana_tiny``) or an explicit mapping of ``SanaTransformer2DModel`` args."""
    if isinstance(name_or_dict, str):
        if name_or_dict not in CONFIGS:
            raise ValueError(f"unknown SANA config {name_or_dict!r}; known: {', '.join(CONFIGS)}")
        return dict(CONFIGS[name_or_dict])
    return dict(name_or_dict)


def load_pretrained_sana(path: str):
    """``SanaTransformer2DModel.from_pretrained`` on a LOCAL diffusers folder (never a hub download)."""
    from diffusers import SanaTransformer2DModel  # noqa: PLC0415

    if not path or not os.path.isdir(path):
        raise FileNotFoundError(
            f"SANA checkpoint folder {path!r} not found. Download the diffusers-format SANA-0.6B weights "
            f"(Efficient-Large-Model/Sana_600M_1024px_diffusers, its 'transformer' subfolder) on a machine with "
            f"internet access, copy it here, and pass model.pretrained=/path/to/Sana_600M_1024px_diffusers/transformer")
    sub = os.path.join(path, "transformer")
    if not os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(sub, "config.json")):
        path = sub
    return SanaTransformer2DModel.from_pretrained(path, local_files_only=True)


HOST_REFUSED = {k: "the diffusers module owns the projections" for k in ("cpe", "cpe_kernel", "gate", "qk_norm",
                                                                         "short_conv")}


def attention_contract(model_cfg) -> AttentionContract:
    """SANA's self-attention takes any registered attention that runs inside diffusers' projections over the 2-D
    latent grid, or ``native`` (SANA's own ReLU linear attention); its default token blocks are
    ``model.token_blocks`` (MHLA's M)."""
    probes = ()
    if not model_cfg.get("pretrained"):  # a released checkpoint's grid is known once it is loaded
        arch = sana_config(model_cfg.get("config", "sana_tiny"))
        g = arch["sample_size"] // arch["patch_size"]
        probes = (({"grid": (g, g), "projections": False, "num_heads": arch["num_attention_heads"],
                    "dim": arch["num_attention_heads"] * arch["attention_head_dim"]}, {}),)
    return AttentionContract(
        model=f"model={model_cfg.get('name', 'sana')}", needs=Needs(grid_rank=2, host_projections=True),
        blocks=token_blocks(model_cfg),
        fixed=("grid", "causal", "projections", "head_dim", "value_dim", "num_prefix_tokens"),
        native={name: "SANA's own ReLU linear attention" for name in NATIVE}, refused=dict(HOST_REFUSED),
        probes=probes)


def cross_attention_contract(model_cfg) -> AttentionContract:
    """SANA's text cross-attention (``attn2``): ``native`` (its softmax, the default) or a registered
    cross-attention that runs inside diffusers' projections with queries over the 2-D latent grid; the caption
    padding mask is its key padding mask. Defaults from ``model.attn_cross_defaults``."""
    probes = ()
    if not model_cfg.get("pretrained"):
        arch = sana_config(model_cfg.get("config", "sana_tiny"))
        g = arch["sample_size"] // arch["patch_size"]
        probes = (({"grid": (g, g), "projections": False, "num_heads": arch["num_cross_attention_heads"],
                    "dim": arch["num_cross_attention_heads"] * arch["cross_attention_head_dim"]}, {}),)
    return AttentionContract(
        model=f"model={model_cfg.get('name', 'sana')}",
        needs=Needs(cross=True, grid_rank=2, host_projections=True),
        fixed=("grid", "projections", "head_dim", "value_dim", "context_dim"),
        native=dict(CROSS_NATIVE), probes=probes)


def swap_cross(model: nn.Module, cross_cfg) -> list[str]:
    """Replace SANA's ``attn2`` processors per the resolved ``cross_cfg`` (``native`` or None: keep SANA's
    own)."""
    cfg = {str(k): v for k, v in dict(cross_cfg or {"name": "native"}).items()}
    if cfg["name"] in CROSS_NATIVE:
        return []
    grid = (model.config.sample_size // model.config.patch_size,) * 2
    return swap_cross_attention(model, cfg, grid=grid)


def swap_attention(model: nn.Module, attn_cfg) -> list[str]:
    """Replace SANA's ``attn1`` processors per the resolved ``attn_cfg`` (a registered attention, or ``native``:
    keep SANA's own); returns the names of the swapped modules."""
    cfg = {str(k): v for k, v in dict(attn_cfg).items()}
    if cfg["name"] in NATIVE:
        return []
    grid = (model.config.sample_size // model.config.patch_size,) * 2
    return swap_self_attention(model, cfg, grid=grid)


def build_sana(model_cfg, attn_cfg, cross_cfg=None):
    """Build SANA from ``model_cfg`` (``config``: a name in :data:`CONFIGS` or a mapping; ``pretrained``: a
    local diffusers checkpoint folder, which wins over ``config``) and swap its self-attention per
    ``attn_cfg`` and its cross-attention per ``cross_cfg`` (None: SANA's own)."""
    from diffusers import SanaTransformer2DModel  # noqa: PLC0415

    to_dict = (lambda c: OmegaConf.to_container(c, resolve=True)) if OmegaConf.is_config(model_cfg) else dict
    mcfg = to_dict(model_cfg)
    acfg = OmegaConf.to_container(attn_cfg, resolve=True) if OmegaConf.is_config(attn_cfg) else dict(attn_cfg)
    if mcfg.get("pretrained"):
        model = load_pretrained_sana(mcfg["pretrained"])
    else:
        model = SanaTransformer2DModel(**sana_config(mcfg.get("config", "sana_tiny")))
    if mcfg.get("gradient_checkpointing"):
        model.enable_gradient_checkpointing()
    swap_attention(model, acfg)
    swap_cross(model, OmegaConf.to_container(cross_cfg, resolve=True) if OmegaConf.is_config(cross_cfg)
               else cross_cfg)
    return model
