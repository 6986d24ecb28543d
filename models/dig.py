"""DiG (Zhu et al., "DiG: Scalable and Efficient Diffusion Models with Gated Linear Attention", CVPR 2025).

DiT's skeleton (patch embedding, sin-cos positions, timestep / label embedders, adaLN-Zero, final layer; all
imported from :mod:`models.dit`) with a different block (docs/baselines.md#dig):

* token mixer: **gated linear attention** (GLA, Yang et al. 2024; the registered ``attn=gla``,
  :class:`mhla.gla.GatedLinearAttention` and its op :mod:`mhla.ops.gla`): ``d_k = C / 2``, ``d_v = C`` over ``H``
  heads; q, k, v, g projections without bias; a low-rank data-dependent forget gate
  ``log a_t = logsigmoid(x W1 W2 + b) / 16``; the causal recurrence ``S_t = diag(a_t) S_{t-1} + k_t^T v_t``,
  ``o_t = (q_t / sqrt(d_k)) S_t``; output ``W_o(RMSNorm_head(o) * swish(x W_g))``.
* MLP: SwiGLU with ``256 * ceil(floor(8C/3) / 256)`` hidden units (1024 at C = 384), no biases.
* SREM: the scan direction cycles row-major forward, row-major backward, column-major forward, column-major
  backward over blocks ``i % 4`` (the release reverses the sequence after every block and transposes after every
  odd one); after each block a depthwise 3x3 conv over the token grid, identity-initialised, *replaces* the
  hidden state (no residual).

Implementation choice: the hidden state stays in raster order between blocks; each block permutes the tokens into
its scan order around the GLA only (everything else is per token), and the conv runs on the raster grid. This is the
release's function up to a fixed flip / transpose of each conv kernel (an equivalent parametrisation).

The block's token mixer is the ``attn`` config like every model's: ``attn=gla`` (:mod:`mhla.gla`, DiG's own) or
"DiG with MHLA" (Table 3, 59.49 FID at 256 px): ``attn=mhla`` (MHLA over 2-D tiles of the raster grid). MHLA is not
causal, so the scan directions do not apply; the identity-initialised conv is kept (``dwconv``), as the paper does
not say otherwise.

    model = build_dig(model_cfg, attn_cfg)           # model_cfg.kind == "dig"
    out = model(x, t, y)                              # same signature and outputs as DiT
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf

from mhla.gla import GatedLinearAttention
from mhla.layouts import ceil_div
from mhla.registry import AttentionContract, accepted_options, build_attention, get_attention_class
from models.attention import grid_model_contract
from models.dit import DiT, model_width, modulate

DIG_SIZES = {"DiG-S": (12, 384, 6), "DiG-B": (12, 768, 12), "DiG-L": (24, 1024, 16), "DiG-XL": (28, 1152, 18)}
SCAN_DIRECTIONS = ("row", "row_rev", "col", "col_rev")


# ------------------------------------------------------------------------------------------ the block
class SwiGLU(nn.Module):
    """fla's GLAMLP: ``down(silu(gate(x)) * up(x))``, no biases, hidden ``256 * ceil(floor(8C/3) / 256)``."""

    def __init__(self, dim: int, hidden: int | None = None):
        super().__init__()
        hidden = hidden or 256 * ceil_div(int(dim * 8 / 3), 256)
        self.gate_proj = nn.Linear(dim, 2 * hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        gate, up = self.gate_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def scan_permutation(grid: tuple[int, int], direction: str) -> torch.Tensor:
    """Indices ``p`` such that ``x_raster[:, p]`` lists the tokens in the scan order ``direction``."""
    h, w = grid
    idx = torch.arange(h * w).view(h, w)
    if direction.startswith("col"):
        idx = idx.t()
    idx = idx.reshape(-1)
    return idx.flip(0) if direction.endswith("_rev") else idx


class DiGBlock(nn.Module):
    """adaLN-Zero block with a GLA (or any registered attention) and a SwiGLU MLP, then the SREM conv.

    ``x: [B, N, C]`` in raster order, ``c: [B, C]`` -> ``[B, N, C]`` in raster order. ``attn_cfg``: the registered
    attention (``{"name": "gla", ...}`` is DiG's own); the scan directions apply to GLA only.
    """

    def __init__(self, hidden: int, num_heads: int, grid: tuple[int, int], index: int, attn_cfg, scan: bool = True,
                 dwconv: bool = True):
        super().__init__()
        self.grid = grid
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        name = attn_cfg if isinstance(attn_cfg, str) else attn_cfg["name"]
        accepted = accepted_options(get_attention_class(name))
        model_args = {k: v for k, v in (("grid", grid), ("qkv_bias", True)) if accepted is None or k in accepted}
        self.attn = build_attention(attn_cfg, hidden, num_heads, **model_args)
        self.mlp = SwiGLU(hidden)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))
        self.direction = SCAN_DIRECTIONS[index % 4] if (scan and isinstance(self.attn, GatedLinearAttention)) else "row"
        perm = scan_permutation(grid, self.direction)
        self.register_buffer("perm", perm, persistent=False)
        self.register_buffer("inv_perm", perm.argsort(), persistent=False)
        self.dwconv = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden) if dwconv else None

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        if self.direction == "row":
            return self.attn(x)
        return self.attn(x[:, self.perm])[:, self.inv_perm]

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        sh1, sc1, g1, sh2, sc2, g2 = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + g1.unsqueeze(1) * self.mix(modulate(self.norm1(x), sh1, sc1))
        x = x + g2.unsqueeze(1) * self.mlp(modulate(self.norm2(x), sh2, sc2))
        if self.dwconv is not None:  # SREM enhancement: replaces the hidden state (identity at init)
            B, N, C = x.shape
            x = self.dwconv(x.transpose(1, 2).reshape(B, C, *self.grid)).reshape(B, C, N).transpose(1, 2)
        return x


class DiG(DiT):
    """DiG: :class:`models.dit.DiT` with :class:`DiGBlock` blocks (same forward, CFG and output layout).

    Args (beyond DiT's): ``attn`` the registered attention of every block (default ``{"name": "gla"}``, DiG's GLA;
    ``{"name": "mhla", ...}`` for "DiG with MHLA"); ``scan`` the SREM direction cycle (GLA only; needs
    ``depth % 4 == 0`` to end in raster order in the release, here the state is always kept in raster order);
    ``dwconv`` the SREM conv.
    """

    def __init__(self, *, depth: int = 12, hidden_size: int = 384, num_heads: int = 6, scan: bool = True,
                 dwconv: bool = True, attn=None, **dit_kwargs):
        attn = attn or {"name": "gla"}
        super().__init__(depth=0, hidden_size=hidden_size, num_heads=num_heads, attn={"name": "softmax"},
                         **dit_kwargs)
        self.blocks = nn.ModuleList(
            DiGBlock(hidden_size, num_heads, self.grid, i, attn, scan, dwconv) for i in range(depth))
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """DiT's init, then the GLA's own init (fla: xavier gain 2^-2.5) and identity SREM convs."""
        super().initialize_weights()
        for block in self.blocks:
            if isinstance(block.attn, GatedLinearAttention):
                block.attn.reset_parameters()
            if block.dwconv is not None:
                nn.init.zeros_(block.dwconv.weight)
                nn.init.zeros_(block.dwconv.bias)
                with torch.no_grad():
                    block.dwconv.weight[:, 0, 1, 1] = 1.0


def attention_contract(model_cfg) -> AttentionContract:
    """DiG takes any bidirectional attention over its 2-D token grid (GLA is its own: ``attn=gla``;
    :func:`models.attention.grid_model_contract`)."""
    g = int(model_cfg.input_size) // int(model_cfg.patch_size)
    return grid_model_contract(model_cfg, patch_grid=(g, g), width=model_width(model_cfg, DIG_SIZES))


def build_dig(model_cfg, attn_cfg) -> DiG:
    """Build from a model config (``kind: dig``; ``variant`` DiG-S ... or explicit ``depth`` / ``hidden_size`` /
    ``num_heads``; ``scan``, ``dwconv`` and DiT's keys) and a resolved attention config (name + options)."""
    attn = OmegaConf.to_container(attn_cfg, resolve=True) if OmegaConf.is_config(attn_cfg) else dict(attn_cfg or {})
    depth, hidden, heads = DIG_SIZES.get(model_cfg.get("variant"), (None, None, None))
    return DiG(depth=int(model_cfg.get("depth") or depth), hidden_size=int(model_cfg.get("hidden_size") or hidden),
               num_heads=int(model_cfg.get("num_heads") or heads), scan=bool(model_cfg.get("scan", True)),
               dwconv=bool(model_cfg.get("dwconv", True)), attn=attn,
               input_size=int(model_cfg.input_size), patch_size=int(model_cfg.patch_size),
               in_channels=int(model_cfg.get("in_channels", 4)),
               class_dropout_prob=float(model_cfg.get("class_dropout_prob", 0.1)),
               num_classes=int(model_cfg.num_classes), learn_sigma=bool(model_cfg.get("learn_sigma", True)))
