"""DiG (Zhu et al., "DiG: Scalable and Efficient Diffusion Models with Gated Linear Attention", CVPR 2025).

DiT's skeleton (patch embedding, sin-cos positions, timestep / label embedders, adaLN-Zero, final layer; all
imported from :mod:`models.dit`) with a different block (docs/baselines.md#dig):

* token mixer: **gated linear attention** (GLA, Yang et al. 2024): ``d_k = C / 2``, ``d_v = C`` over ``H`` heads;
  q, k, v, g projections without bias; a low-rank data-dependent forget gate
  ``log a_t = logsigmoid(x W1 W2 + b) / 16`` (``W1: C x 16``, ``W2: 16 x d_k``); the causal recurrence
  ``S_t = diag(a_t) S_{t-1} + k_t^T v_t``, ``o_t = (q_t / sqrt(d_k)) S_t``; output ``W_o(RMSNorm_head(o) * swish(x W_g))``.
  :func:`gla_chunked` is the fast form (chunks of ``L`` tokens; pairwise gate ratios inside a chunk, a state
  between chunks), :func:`gla_recurrent` the token-by-token reference it is tested against. On CUDA, when
  flash-linear-attention imports, :func:`gla` runs fla's Triton kernel ``fla.ops.gla.chunk_gla`` instead
  (:func:`gla_fla`; ``backend="auto" | "torch" | "fla"``, see :func:`resolve_gla_backend`).
* MLP: SwiGLU with ``256 * ceil(floor(8C/3) / 256)`` hidden units (1024 at C = 384), no biases.
* SREM: the scan direction cycles row-major forward, row-major backward, column-major forward, column-major
  backward over blocks ``i % 4`` (the release reverses the sequence after every block and transposes after every
  odd one); after each block a depthwise 3x3 conv over the token grid, identity-initialised, *replaces* the
  hidden state (no residual).

Implementation choice: the hidden state stays in raster order between blocks; each block permutes the tokens into
its scan order around the GLA only (everything else is per token), and the conv runs on the raster grid. This is the
release's function up to a fixed flip / transpose of each conv kernel (an equivalent parametrisation).

"DiG with MHLA" (Table 3, 59.49 FID at 256 px): ``token_mixer="attn"`` builds the block's mixer from the ``attn``
config instead (MHLA over 2-D tiles of the raster grid). MHLA is not causal, so the scan directions do not apply;
the identity-initialised conv is kept (``dwconv``), as the paper does not say otherwise.

    model = build_dig(model_cfg, attn_cfg)           # model_cfg.kind == "dig"
    out = model(x, t, y)                              # same signature and outputs as DiT
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf

from mhla.layouts import ceil_div
from mhla.registry import build_attention
from models.dit import DiT, modulate

DIG_SIZES = {"DiG-S": (12, 384, 6), "DiG-B": (12, 768, 12), "DiG-L": (24, 1024, 16), "DiG-XL": (28, 1152, 18)}
SCAN_DIRECTIONS = ("row", "row_rev", "col", "col_rev")
GLA_BACKENDS = ("auto", "torch", "fla")


# ------------------------------------------------------------------------------------------- GLA ops
def gla_recurrent(q, k, v, log_a, scale: float | None = None):
    """Reference GLA, one token at a time. ``q, k, log_a: [B, T, H, Dk]``, ``v: [B, T, H, Dv]`` -> ``[B, T, H, Dv]``.

    ``S_t = diag(exp(log_a_t)) S_{t-1} + k_t^T v_t``;  ``o_t = (scale * q_t) S_t`` (scale default ``Dk^-1/2``).
    """
    B, T, H, Dk = q.shape
    scale = Dk ** -0.5 if scale is None else scale
    S = q.new_zeros(B, H, Dk, v.shape[-1])
    out = []
    for t in range(T):
        S = S * log_a[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        out.append(torch.einsum("bhd,bhde->bhe", q[:, t] * scale, S))
    return torch.stack(out, dim=1)


def gla_chunked(q, k, v, log_a, chunk: int = 16, scale: float | None = None):
    """GLA in chunks of ``chunk`` tokens (same inputs / output as :func:`gla_recurrent`).

    Inside a chunk, with ``b_t = sum_{s <= t} log_a_s`` (cumulative within the chunk):
    ``o_t = (q_t * e^{b_t}) S_prev + sum_{s <= t} (sum_d q_td k_sd e^{b_td - b_sd}) v_s``, where the pairwise
    exponent is ``<= 0`` (no overflow); the state after the chunk is
    ``S = diag(e^{b_L}) S_prev + sum_s (k_s * e^{b_L - b_s})^T v_s``. Cost ``O(T L Dk + T Dk Dv)`` per head.
    Accumulates in fp32 for half-precision inputs.
    """
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    scale = Dk ** -0.5 if scale is None else scale
    dtype = q.dtype
    f = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    pad = (-T) % chunk
    if pad:  # zero keys/values and zero log-gates (a = 1) in the padding: the causal outputs are unchanged
        q, k, v, log_a = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, log_a))
    n = (T + pad) // chunk
    # [B, H, n, L, d]
    q, k, v, log_a = (x.to(f).reshape(B, n, chunk, H, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v, log_a))
    q = q * scale
    b = log_a.cumsum(dim=3)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # intra-chunk scores A[t, s] = sum_d q_td k_sd exp(b_td - b_sd), s <= t
    diff = (b[..., :, None, :] - b[..., None, :, :]).masked_fill(~causal[..., None], float("-inf"))
    scores = torch.einsum("bhntd,bhnsd,bhntsd->bhnts", q, k, diff.exp())
    intra = scores @ v                                             # [B, H, n, L, Dv]
    # chunk-major copies so the per-chunk matmuls below read contiguous memory: [n, B, H, L, d]
    q_in = (q * b.exp()).permute(2, 0, 1, 3, 4).contiguous()                      # weights on the carried state
    k_out = (k * (b[..., -1:, :] - b).exp()).permute(2, 0, 1, 4, 3).contiguous()  # into the next state (T)
    v_c = v.permute(2, 0, 1, 3, 4).contiguous()
    decay = b[..., -1, :].exp().permute(2, 0, 1, 3)[..., None]                    # [n, B, H, Dk, 1]
    S = q.new_zeros(B, H, Dk, Dv)
    inter = []
    for i in range(n):
        inter.append(q_in[i] @ S)
        S = torch.baddbmm(S.mul(decay[i]).view(-1, Dk, Dv), k_out[i].view(-1, Dk, chunk),
                          v_c[i].view(-1, chunk, Dv)).view(B, H, Dk, Dv)
    o = intra + torch.stack(inter, dim=2)
    o = o.permute(0, 2, 3, 1, 4).reshape(B, n * chunk, H, Dv)[:, :T]
    return o.to(dtype)


@functools.cache
def _fla_chunk_gla():
    """``fla.ops.gla.chunk_gla``, or None when flash-linear-attention does not import here (cached: asked once)."""
    from models.lm.baselines import fla_available  # noqa: PLC0415 (imports transformers; only asked on demand)

    if not fla_available():
        return None
    try:
        from fla.ops.gla import chunk_gla  # noqa: PLC0415
    except Exception:  # noqa: BLE001 - fla raises more than ImportError without a GPU / Triton
        return None
    return chunk_gla


def resolve_gla_backend(backend: str, q: torch.Tensor) -> str:
    """The backend ``backend`` means for inputs like ``q``: ``"torch"`` (:func:`gla_chunked`) or ``"fla"``
    (:func:`gla_fla`).

    ``"auto"``: ``"fla"`` for CUDA tensors when fla imports, else ``"torch"`` (CPU inputs never import fla).
    ``"fla"``: raises ImportError when fla does not import, and ValueError for non-CUDA inputs unless
    ``TRITON_INTERPRET=1`` (Triton's CPU interpreter; a debugging path: fla 0.6.0 under triton 3.8 also needs the
    two shims in ``tests/test_dig_fla.py``, and it is slow).
    """
    if backend not in GLA_BACKENDS:
        raise ValueError(f"GLA backend must be one of {GLA_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "fla" if q.is_cuda and _fla_chunk_gla() is not None else "torch"
    if _fla_chunk_gla() is None:
        raise ImportError(
            "GLA backend='fla' needs flash-linear-attention (fla.ops.gla.chunk_gla; Triton, a GPU): pip install "
            "flash-linear-attention, or use backend='torch' / 'auto'")
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"GLA backend='fla' runs fla's Triton kernels on CUDA tensors; got tensors on {q.device}. Move them to "
            "the GPU or use backend='torch' / 'auto' (or TRITON_INTERPRET=1, set before import, for Triton's CPU "
            "interpreter)")
    return "fla"


def gla_fla(q, k, v, log_a, scale: float | None = None):
    """GLA by flash-linear-attention's chunked Triton kernel; same inputs / output as :func:`gla_recurrent`.

    The mapping onto ``fla.ops.gla.chunk_gla(q, k, v, g, scale=None, initial_state=None,
    output_final_state=False, ...) -> (o, final_state)`` (fla 0.6.0) is the identity:

    * layout: fla's default is ours, time-major ``[B, T, H, K]`` for ``q, k, g`` and ``[B, T, H, V]`` for ``v``
      and ``o`` (no head-first transpose; fla makes the inputs contiguous);
    * gate: fla's ``g`` is the per-key log forget gate, ``S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t``, i.e. our
      ``log_a`` (``logsigmoid(.) / 16``, ``<= 0``) as it is;
    * scale: ``o_t = (scale * q_t) S_t`` with the same default ``K^-1/2``;
    * no initial state, no final state (``final_state`` is None); fla picks its own chunk length
      (``min(64, max(16, next_pow2(T)))``), so :func:`gla_chunked`'s ``chunk`` does not apply;
    * any ``T`` (fla masks the last chunk); fp32 / fp16 / bf16 with fp32 accumulation; output cast to
      ``q.dtype`` (fla returns ``v``'s dtype).
    """
    chunk_gla = _fla_chunk_gla()
    if chunk_gla is None:
        raise ImportError("gla_fla needs flash-linear-attention: pip install flash-linear-attention")
    o, _ = chunk_gla(q, k, v, log_a, scale=scale, initial_state=None, output_final_state=False)
    return o.to(q.dtype)


def gla(q, k, v, log_a, chunk: int = 16, scale: float | None = None, backend: str = "auto"):
    """GLA (same inputs / output as :func:`gla_recurrent`) on the backend :func:`resolve_gla_backend` picks:
    fla's ``chunk_gla`` on CUDA when fla imports, else :func:`gla_chunked` (``chunk``: its chunk length)."""
    if resolve_gla_backend(backend, q) == "fla":
        return gla_fla(q, k, v, log_a, scale=scale)
    return gla_chunked(q, k, v, log_a, chunk, scale=scale)


class GatedLinearAttention(nn.Module):
    """GLA as DiG uses it (fla's ``GatedLinearAttention`` with ``expand_k=0.5, expand_v=1``, gate rank 16,
    gate normaliser 16, ``swish`` output gate, per-head RMSNorm).

    ``forward(x: [B, N, C]) -> [B, N, C]``; causal over the given token order. ``chunk``: chunk length of
    :func:`gla_chunked`; ``mode="recurrent"`` uses the token loop (tests). ``backend``: ``"auto"`` (fla's
    ``chunk_gla`` for CUDA inputs when fla imports, else torch), ``"torch"`` or ``"fla"`` (:func:`gla`);
    :meth:`resolved_backend` says which one a given input runs on.
    """

    def __init__(self, dim: int, num_heads: int, expand_k: float = 0.5, expand_v: float = 1.0, gate_rank: int = 16,
                 gate_norm: float = 16.0, chunk: int = 16, mode: str = "chunk", backend: str = "auto"):
        super().__init__()
        if backend not in GLA_BACKENDS:
            raise ValueError(f"GLA backend must be one of {GLA_BACKENDS}, got {backend!r}")
        self.backend = backend
        self.key_dim, self.value_dim = int(dim * expand_k), int(dim * expand_v)
        if self.key_dim % num_heads or self.value_dim % num_heads:
            raise ValueError(f"GLA: key dim {self.key_dim} / value dim {self.value_dim} not divisible by {num_heads}")
        self.num_heads, self.gate_norm, self.chunk, self.mode = num_heads, gate_norm, chunk, mode
        self.q_proj = nn.Linear(dim, self.key_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.key_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.value_dim, bias=False)
        self.g_proj = nn.Linear(dim, self.value_dim, bias=False)
        self.gk_proj = nn.Sequential(nn.Linear(dim, gate_rank, bias=False), nn.Linear(gate_rank, self.key_dim))
        self.g_norm = nn.RMSNorm(self.value_dim // num_heads, eps=1e-5)
        self.o_proj = nn.Linear(self.value_dim, dim, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """fla's init: xavier-uniform with gain ``2^-2.5`` on the linear weights, zero biases."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight, gain=2 ** -2.5)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, chunk={self.chunk}, mode={self.mode!r}, backend={self.backend!r}"

    def resolved_backend(self, x: torch.Tensor) -> str:
        """``"recurrent"``, ``"torch"`` or ``"fla"``: what :meth:`forward` runs for an input like ``x``."""
        return "recurrent" if self.mode == "recurrent" else resolve_gla_backend(self.backend, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        H = self.num_heads
        q = self.q_proj(x).view(B, N, H, -1)
        k = self.k_proj(x).view(B, N, H, -1)
        v = self.v_proj(x).view(B, N, H, -1)
        log_a = (F.logsigmoid(self.gk_proj(x)) / self.gate_norm).view(B, N, H, -1)
        if self.mode == "recurrent":
            o = gla_recurrent(q, k, v, log_a)
        else:
            o = gla(q, k, v, log_a, self.chunk, backend=self.backend)
        o = self.g_norm(o).reshape(B, N, -1) * F.silu(self.g_proj(x))
        return self.o_proj(o)


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

    ``x: [B, N, C]`` in raster order, ``c: [B, C]`` -> ``[B, N, C]`` in raster order.
    """

    def __init__(self, hidden: int, num_heads: int, grid: tuple[int, int], index: int, token_mixer: str = "gla",
                 attn_cfg=None, scan: bool = True, dwconv: bool = True, gla_chunk: int = 16,
                 gla_backend: str = "auto"):
        super().__init__()
        self.grid = grid
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        if token_mixer == "gla":
            self.attn = GatedLinearAttention(hidden, num_heads, chunk=gla_chunk, backend=gla_backend)
        elif token_mixer == "attn":
            self.attn = build_attention(attn_cfg, hidden, num_heads, grid=grid, qkv_bias=True)
        else:
            raise ValueError(f"DiG token_mixer must be 'gla' or 'attn' (the attn config), got {token_mixer!r}")
        self.mlp = SwiGLU(hidden)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))
        self.direction = SCAN_DIRECTIONS[index % 4] if (scan and token_mixer == "gla") else "row"
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

    Args (beyond DiT's): ``token_mixer`` ``"gla"`` (DiG) or ``"attn"`` (the ``attn`` config, e.g. MHLA);
    ``scan`` the SREM direction cycle (GLA only; needs ``depth % 4 == 0`` to end in raster order in the release,
    here the state is always kept in raster order); ``dwconv`` the SREM conv; ``gla_chunk`` GLA chunk length
    (torch backend); ``gla_backend`` ``"auto"`` | ``"torch"`` | ``"fla"`` (:class:`GatedLinearAttention`).
    """

    def __init__(self, *, depth: int = 12, hidden_size: int = 384, num_heads: int = 6, token_mixer: str = "gla",
                 scan: bool = True, dwconv: bool = True, gla_chunk: int = 16, gla_backend: str = "auto", attn=None,
                 **dit_kwargs):
        super().__init__(depth=0, hidden_size=hidden_size, num_heads=num_heads, attn=attn or {"name": "softmax"},
                         **dit_kwargs)
        self.token_mixer = token_mixer
        self.blocks = nn.ModuleList(
            DiGBlock(hidden_size, num_heads, self.grid, i, token_mixer, attn, scan, dwconv, gla_chunk, gla_backend)
            for i in range(depth))
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


def build_dig(model_cfg, attn_cfg) -> DiG:
    """Build from a model config (``kind: dig``; ``variant`` DiG-S ... or explicit ``depth`` / ``hidden_size`` /
    ``num_heads``; ``token_mixer``, ``scan``, ``dwconv``, ``gla_chunk``, ``gla_backend`` and DiT's keys) and an
    attention config (used when ``token_mixer == "attn"``)."""
    attn = OmegaConf.to_container(attn_cfg, resolve=True) if OmegaConf.is_config(attn_cfg) else dict(attn_cfg or {})
    depth, hidden, heads = DIG_SIZES.get(model_cfg.get("variant"), (None, None, None))
    return DiG(depth=int(model_cfg.get("depth") or depth), hidden_size=int(model_cfg.get("hidden_size") or hidden),
               num_heads=int(model_cfg.get("num_heads") or heads), token_mixer=str(model_cfg.get("token_mixer", "gla")),
               scan=bool(model_cfg.get("scan", True)), dwconv=bool(model_cfg.get("dwconv", True)),
               gla_chunk=int(model_cfg.get("gla_chunk", 16)),
               gla_backend=str(model_cfg.get("gla_backend", "auto")), attn=attn,
               input_size=int(model_cfg.input_size), patch_size=int(model_cfg.patch_size),
               in_channels=int(model_cfg.get("in_channels", 4)),
               class_dropout_prob=float(model_cfg.get("class_dropout_prob", 0.1)),
               num_classes=int(model_cfg.num_classes), learn_sigma=bool(model_cfg.get("learn_sigma", True)))
