"""DiT (Peebles & Xie, "Scalable Diffusion Models with Transformers") with any registered attention.

Same structure as DiT's ``models.py`` so the original checkpoints load by name: patch embedding, fixed 2-D
sin-cos position table, sinusoidal timestep embedding + MLP, class embedding with a "null" class for
classifier-free guidance (labels dropped with ``class_dropout_prob`` during training), adaLN-Zero blocks
(shift / scale / gate for attention and MLP, regressed from ``t + y`` and initialised to zero), and a final
adaLN layer predicting ``2 x in_channels`` (noise and the learned-variance interpolation) per pixel.

The attention of every block is built through :func:`mhla.registry.build_attention` with the token grid
``(input_size / patch, input_size / patch)``, so ``attn=mhla`` runs MHLA over 2-D tiles of the patch grid
(M = 16 by default: 4 x 4 blocks), and ``cpe`` / ``gate`` are the attention's options (Table 3 / 12).

    model = DiT_models["DiT-S/2"](input_size=32, num_classes=1000, attn={"name": "mhla", "num_blocks": 16})
    out = model(x, t, y)          # x: [B, C, H, W], t: [B] (0..999), y: [B] -> [B, 2C, H, W]
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from mhla.registry import AttentionContract, build_attention

from .attention import grid_model_contract

# depth, hidden size, heads (DiT paper, Table 1)
DIT_SIZES = {"DiT-S": (12, 384, 6), "DiT-B": (12, 768, 12), "DiT-L": (24, 1024, 16), "DiT-XL": (28, 1152, 16)}


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: ``x [B, N, C] * (1 + scale [B, C]) + shift [B, C]``."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def sincos_2d(embed_dim: int, grid: int) -> np.ndarray:
    """Fixed 2-D sin-cos position table ``[grid * grid, embed_dim]`` (raster order; half the channels encode
    the row, half the column, each as ``[sin(pos * w), cos(pos * w)]`` with ``w = 1 / 10000^(2i / (D/2))``)."""
    if embed_dim % 4:
        raise ValueError(f"sin-cos position embedding needs embed_dim % 4 == 0, got {embed_dim}")

    def one_axis(d: int, pos: np.ndarray) -> np.ndarray:
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1).astype(np.float64), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    coords = np.arange(grid, dtype=np.float32)
    gw, gh = np.meshgrid(coords, coords)  # gw varies along columns
    return np.concatenate([one_axis(embed_dim // 2, gh), one_axis(embed_dim // 2, gw)], axis=1)


class TimestepEmbedder(nn.Module):
    """Scalar timesteps ``[B]`` -> ``[B, hidden]``: sinusoidal features (``freq_dim``) then a 2-layer MLP."""

    def __init__(self, hidden: int, freq_dim: int = 256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.freq_dim = freq_dim

    @staticmethod
    def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
        """``[B]`` (may be fractional) -> ``[B, dim]`` as ``[cos(t w), sin(t w)]``, ``w = max_period^(-i/half)``."""
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
        return emb

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.timestep_embedding(t, self.freq_dim))


class LabelEmbedder(nn.Module):
    """Class labels ``[B]`` -> ``[B, hidden]``. Index ``num_classes`` is the null class (CFG); in training,
    labels are replaced by it with probability ``dropout_prob`` (or where ``force_drop`` is true)."""

    def __init__(self, num_classes: int, hidden: int, dropout_prob: float):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), hidden)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def forward(self, y: torch.Tensor, train: bool, force_drop: torch.Tensor | None = None) -> torch.Tensor:
        if (train and self.dropout_prob > 0) or force_drop is not None:
            drop = (torch.rand(y.shape[0], device=y.device) < self.dropout_prob) if force_drop is None \
                else force_drop.bool()
            y = torch.where(drop, torch.full_like(y, self.num_classes), y)
        return self.embedding_table(y)


class Mlp(nn.Module):
    """``fc1 -> GELU(tanh) -> fc2`` (timm's ``Mlp`` names, so DiT checkpoints load)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class DiTBlock(nn.Module):
    """adaLN-Zero transformer block: ``x + g1 * attn(mod(norm1(x))) ; x + g2 * mlp(mod(norm2(x)))``."""

    def __init__(self, hidden: int, num_heads: int, mlp_ratio: float, attn_cfg, grid: tuple[int, int]):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = build_attention(attn_cfg, hidden, num_heads, grid=grid, qkv_bias=True)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden, int(hidden * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """``x: [B, N, C]`` (raster order), ``c: [B, C]`` (timestep + class embedding)."""
        sh1, sc1, g1, sh2, sc2, g2 = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + g1.unsqueeze(1) * self.attn(modulate(self.norm1(x), sh1, sc1))
        return x + g2.unsqueeze(1) * self.mlp(modulate(self.norm2(x), sh2, sc2))


class FinalLayer(nn.Module):
    def __init__(self, hidden: int, patch: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden, patch * patch * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class PatchEmbed(nn.Module):
    """``[B, C, H, W]`` -> ``[B, (H/p)(W/p), hidden]`` with a stride-``p`` conv (timm's name ``proj``)."""

    def __init__(self, patch: int, in_channels: int, hidden: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, hidden, patch, stride=patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class DiT(nn.Module):
    """Class-conditional diffusion transformer.

    Args:
        input_size: spatial size of the (latent) input (32 for 256 px with the SD-VAE). patch_size: p.
        in_channels: input channels (4 latents; 1 for MNIST pixels). learn_sigma: output ``2 x in_channels``.
        hidden_size, depth, num_heads, mlp_ratio: transformer size. num_classes: classes (+1 null class when
        ``class_dropout_prob > 0``). attn: attention config (name + options) for :func:`build_attention`.
    """

    def __init__(self, input_size: int = 32, patch_size: int = 2, in_channels: int = 4, hidden_size: int = 1152,
                 depth: int = 28, num_heads: int = 16, mlp_ratio: float = 4.0, class_dropout_prob: float = 0.1,
                 num_classes: int = 1000, learn_sigma: bool = True, attn=None):
        super().__init__()
        if input_size % patch_size:
            raise ValueError(f"DiT input_size={input_size} is not a multiple of patch_size={patch_size}")
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.learn_sigma = learn_sigma
        self.patch_size = patch_size
        self.input_size = input_size
        self.num_classes = num_classes
        self.grid = (input_size // patch_size,) * 2
        attn = {"name": "softmax"} if attn is None else attn
        if isinstance(attn, Mapping) or hasattr(attn, "items"):
            attn = {str(k): v for k, v in attn.items()}
        self.x_embedder = PatchEmbed(patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        n = self.grid[0] * self.grid[1]
        # a frozen parameter (as in DiT) so that its name and place in checkpoints match the original
        self.pos_embed = nn.Parameter(torch.zeros(1, n, hidden_size), requires_grad=False)
        self.blocks = nn.ModuleList(DiTBlock(hidden_size, num_heads, mlp_ratio, attn, self.grid) for _ in range(depth))
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """DiT's init: xavier-uniform linears, zero biases, N(0, 0.02) embeddings, zeroed adaLN and output.
        Attention-specific parameters (MHLA mixing, CPE, gate) keep their own initialisation."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        self.pos_embed.data.copy_(torch.from_numpy(sincos_2d(self.pos_embed.shape[-1], self.grid[0])).float()[None])
        w = self.x_embedder.proj.weight.data
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        for block in self.blocks:
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].weight)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, N, p*p*C]`` -> ``[B, C, H, W]``."""
        p, c = self.patch_size, self.out_channels
        h, w = self.grid
        x = x.reshape(x.shape[0], h, w, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(x.shape[0], c, h * p, w * p)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor,
                force_drop: torch.Tensor | None = None) -> torch.Tensor:
        """``x: [B, C, H, W]``, ``t: [B]`` diffusion steps, ``y: [B]`` labels -> ``[B, out_channels, H, W]``.

        ``force_drop: [B]`` bool: replace these labels by the null class (classifier-free guidance)."""
        if x.shape[-2:] != (self.input_size, self.input_size):
            raise ValueError(f"DiT was built for {self.input_size}x{self.input_size} inputs, got {tuple(x.shape[-2:])}")
        h = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y, self.training, force_drop)
        for block in self.blocks:
            h = block(h, c)
        return self.unpatchify(self.final_layer(h, c))

    def forward_with_cfg(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, cfg_scale: float,
                         guidance_channels: int | None = None) -> torch.Tensor:
        """Classifier-free guidance in one batched call: ``eps = eps_u + s (eps_c - eps_u)``.

        ``guidance_channels``: guide only the first k channels (DiT guides 3 of its 4 latent channels, a quirk
        of its release kept for reproducing its numbers); None guides every channel. The learned-variance
        channels are taken from the conditional half.
        """
        B = x.shape[0]
        both = torch.cat([x, x])
        drop = torch.cat([torch.zeros(B, dtype=torch.bool, device=x.device), torch.ones(B, dtype=torch.bool,
                                                                                   device=x.device)])
        out = self(both, torch.cat([t, t]), torch.cat([y, y]), force_drop=drop)
        cond, uncond = out[:B], out[B:]
        k = self.in_channels if guidance_channels is None else int(guidance_channels)
        guided = uncond[:, :k] + cfg_scale * (cond[:, :k] - uncond[:, :k])
        return torch.cat([guided, cond[:, k:]], dim=1)


def _make(size: str, patch: int):
    depth, hidden, heads = DIT_SIZES[size]

    def build(**kwargs) -> DiT:
        return DiT(depth=depth, hidden_size=hidden, num_heads=heads, patch_size=patch, **kwargs)

    build.__name__ = f"{size}/{patch}"
    return build


DiT_models = {f"{s}/{p}": _make(s, p) for s in DIT_SIZES for p in (2, 4, 8)}


def build_dit(model_cfg, attn_cfg) -> DiT:
    """Build from a model config (``variant`` ``DiT-S`` ... or explicit ``depth`` / ``hidden_size`` /
    ``num_heads``; ``patch_size``, ``input_size``, ``in_channels``, ``num_classes``, ``learn_sigma``,
    ``class_dropout_prob``, ``mlp_ratio``, ``pretrained``) and an attention config."""
    attn = OmegaConf.to_container(attn_cfg, resolve=True) if OmegaConf.is_config(attn_cfg) else dict(attn_cfg)
    variant = model_cfg.get("variant")
    depth, hidden, heads = DIT_SIZES[variant] if variant in DIT_SIZES else (None, None, None)
    depth = int(model_cfg.get("depth") or depth)
    hidden = int(model_cfg.get("hidden_size") or hidden)
    heads = int(model_cfg.get("num_heads") or heads)
    model = DiT(input_size=int(model_cfg.input_size), patch_size=int(model_cfg.patch_size),
                in_channels=int(model_cfg.get("in_channels", 4)), hidden_size=hidden, depth=depth, num_heads=heads,
                mlp_ratio=float(model_cfg.get("mlp_ratio", 4.0)),
                class_dropout_prob=float(model_cfg.get("class_dropout_prob", 0.1)),
                num_classes=int(model_cfg.num_classes), learn_sigma=bool(model_cfg.get("learn_sigma", True)),
                attn=attn)
    if model_cfg.get("pretrained"):
        report = load_original_dit(model, model_cfg.pretrained)
        print(report.summary(), flush=True)
    return model


# ------------------------------------------------------------------------------------- checkpoints
class LoadReport:
    """What :func:`load_original_dit` did: ``loaded``, ``new`` (ours, not in the file: kept at init),
    ``unused`` (in the file, not ours), ``mismatched`` (same name, other shape: kept at init)."""

    def __init__(self, path, loaded, new, unused, mismatched):
        self.path, self.loaded, self.new, self.unused, self.mismatched = path, loaded, new, unused, mismatched

    def summary(self) -> str:
        lines = [f"loaded {len(self.loaded)} tensors from {self.path}"]
        if self.new:
            lines.append(f"  new (kept at init, {len(self.new)}): {_compact(self.new)}")
        if self.mismatched:
            lines.append(f"  shape mismatch (kept at init): {_compact(self.mismatched)}")
        if self.unused:
            lines.append(f"  in the checkpoint but not in this model: {_compact(self.unused)}")
        return "\n".join(lines)


def _compact(keys, limit: int = 8) -> str:
    patterns = sorted({re.sub(r"blocks\.\d+\.", "blocks.*.", k) for k in keys})
    more = f" (+{len(patterns) - limit} more)" if len(patterns) > limit else ""
    return ", ".join(patterns[:limit]) + more


def map_original_key(key: str) -> str:
    """A key of DiT's release -> ours: ``module.`` prefixes drop, everything else stays (our attention layers
    keep timm's ``attn.qkv`` / ``attn.proj`` names, so ``blocks.3.attn.qkv.weight`` is the same key)."""
    return key.removeprefix("module.")


def load_original_dit(model: DiT, path: str, prefer: str = "ema") -> LoadReport:
    """Load a checkpoint of DiT's release (``DiT-XL-2-256x256.pt``: a plain state dict; or a training
    checkpoint ``{"model", "ema", ...}``, from which ``prefer`` is taken) into ``model`` for fast adaptation
    (Table 3b). Parameters the file lacks (MHLA mixing, CPE, gate) stay at their initialisation.

    Raises FileNotFoundError with the download location when ``path`` is missing.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"model.pretrained={path} does not exist. Download DiT-XL-2-256x256.pt (or -512x512) from "
            f"https://dl.fbaipublicfiles.com/DiT/models/ and pass its local path")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if isinstance(state, dict) and prefer in state and isinstance(state[prefer], dict):
        state = state[prefer]
    elif isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    ours = model.state_dict()
    mapped = {map_original_key(k): v for k, v in state.items()}
    loaded, mismatched = [], []
    to_load = {}
    for k, v in mapped.items():
        if k in ours:
            if ours[k].shape == v.shape:
                to_load[k] = v
                loaded.append(k)
            else:
                mismatched.append(k)
    model.load_state_dict(to_load, strict=False)
    new = [k for k in ours if k not in mapped]
    unused = [k for k in mapped if k not in ours]
    return LoadReport(path, loaded, new, unused, mismatched)


def attention_contract(model_cfg) -> AttentionContract:
    """DiT takes any bidirectional attention over its 2-D patch grid (:func:`models.attention.grid_model_contract`)."""
    g = int(model_cfg.input_size) // int(model_cfg.patch_size)
    return grid_model_contract(model_cfg, patch_grid=(g, g), width=model_width(model_cfg, DIT_SIZES))


def model_width(model_cfg, sizes: dict) -> dict:
    """``{"dim", "num_heads"}`` of a DiT-shaped config (explicit, or its ``variant`` in ``sizes``: name -> (depth,
    hidden, heads)), for the start-of-run probe; empty when neither gives them."""
    _, hidden, heads = sizes.get(model_cfg.get("variant"), (None, None, None))
    hidden, heads = model_cfg.get("hidden_size") or hidden, model_cfg.get("num_heads") or heads
    return {"dim": int(hidden), "num_heads": int(heads)} if hidden and heads else {}
