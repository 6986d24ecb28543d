"""Attention layers (``nn.Module``): MHLA, plain linear attention and softmax attention.

Every attention shares one constructor and one forward signature, so a model builds any of them from one
``attn`` config (:mod:`mhla.registry`) and timm can use them as ``attn_layer``:

    layer = MultiHeadLinearAttention(dim, num_heads, grid=(16, 16), num_blocks=16, qk_norm=True, cpe=True)
    y = layer(x)                      # x: [B, N, dim] in raster order -> y: [B, N, dim]

A layer has two halves:

* the projections (:meth:`AttentionBase._project`, :meth:`AttentionBase._finish`): ``qkv``, per-head q/k
  RMSNorm, a causal short convolution, CPE (a depthwise conv of V added to the output), the output gate and
  the output projection. ``projections=False`` builds a layer without them, for hosts that own their
  projections (the diffusers processors of :mod:`mhla.adapters.diffusers`).
* the attention itself, :meth:`AttentionBase.attend`: projected ``q, k [B, N, H, D]`` and ``v [B, N, H, Dv]``
  in the model's token order -> ``o [B, N, H, Dv]``. Feature map, rotary embedding (placement ``rope``), MHLA's
  block layout and mixing, the normaliser and the decode state all live here, so the layer's forward and the
  diffusers processor run the same code. :meth:`AttentionBase.finish_heads` applies the per-head output
  RMSNorm.

Token order: layers take and return tokens in the model's natural (raster) order, prefix tokens first. MHLA's
:meth:`attend` permutes the grid tokens to block-major order and back (:class:`mhla.layouts.BlockLayout`); its
:meth:`forward` permutes the layer input instead and runs the projections in block-major order too (the same
values; the order of the token sums in the weight gradients is then the one it has always been).

Prefix tokens (class / register tokens, ``num_prefix_tokens > 0``): grid tokens use MHLA over the grid
tokens only; prefix tokens, as queries, read all tokens (prefix and grid) with plain linear attention.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from .feature_maps import get_feature_map
from .layouts import BlockLayout, auto_blocks, ceil_div, layout_for_grid, resolve_blocks
from .mixing import MixingMatrix
from .ops import MHLAState, linear_attention, mhla_attention, mhla_decode_step, softmax_attention
from .ops.utils import check_cu_seqlens, run_varlen, sequence_bounds, unbind_state
from .registry import Supports, register_attention
from .rope import RotaryTables, rope_and_feature_map, rope_placement


@dataclass
class AttentionCache:
    """Decoding state of one causal attention layer.

    ``attn``: the op's state (:class:`mhla.ops.MHLAState` for MHLA, ``(S, z)`` for linear attention,
    ``(k, v)`` for softmax); ``conv``: the last ``kernel - 1`` values ``[B, kernel - 1, inner]`` for a
    causal CPE; ``short_conv``: the last ``kernel - 1`` inputs of the short convolution,
    ``[B, kernel - 1, q | k | v channels]`` (fla's ``ShortConvolution`` cache).

    After a variable-length call (``cu_seqlens``) each is a *list* of ``N`` per-sequence states, each of
    batch 1 (sequences may have consumed different numbers of tokens); a list is how the layers tell the two
    apart. A later variable-length call splits a batched cache into such a list.
    """

    attn: object = None
    conv: torch.Tensor | None = None
    short_conv: torch.Tensor | None = None

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds (the op's state, the convolutions' past inputs)."""
        return tensor_nbytes(self.attn) + tensor_nbytes(self.conv) + tensor_nbytes(self.short_conv)


def tensor_nbytes(obj) -> int:
    """Bytes of the tensors in a state: a tensor, a tuple / list of states, an object with ``nbytes()``
    (such as :class:`mhla.ops.MHLAState`), or None."""
    if obj is None:
        return 0
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_nbytes(o) for o in obj)
    if callable(getattr(obj, "nbytes", None)):
        return obj.nbytes()
    raise TypeError(f"cannot size a state of type {type(obj).__name__}")


def gate_kind(gate) -> str | None:
    """The output gate named by a layer's ``gate`` option: ``None`` (off), ``"swish"`` or ``"linear"``."""
    if gate in (False, None, "none"):
        return None
    if gate is True or gate == "swish":
        return "swish"
    if gate == "linear":
        return "linear"
    raise ValueError(f"gate must be false, true / 'swish' (RMSNorm(o) * swish(W_g x)) or 'linear' ((o + cpe) * "
                     f"(W_o x + b), RALA's), got {gate!r}")


#: the slope of ``relu_leaky_grad``'s gradient below 0 (its forward is relu's)
LEAKY_GRAD_SLOPE = 0.1


def relu_leaky_grad(z: torch.Tensor, slope: float = LEAKY_GRAD_SLOPE) -> torch.Tensor:
    """``relu(z)`` in the forward (exactly: a closed gate writes exactly 0); in the backward below 0 the gradient
    of ``slope * z``, so a closed gate still hears the loss and can open again (relu's is 0 there: a gate the write
    budget closed on a token the answer needs stays closed)."""
    leak = slope * z.clamp(max=0.0)
    return F.relu(z) + (leak - leak.detach())


def two_sigmoid(z: torch.Tensor) -> torch.Tensor:
    """``2 sigmoid(z)``: 1 at ``z = 0``, in (0, 2), never 0."""
    return 2.0 * torch.sigmoid(z)


#: the hard concrete distribution's stretch ``(gamma, zeta)`` and temperature ``beta`` (Louizos, Welling and Kingma
#: 2018, "Learning sparse neural networks through L0 regularization", their values)
HARD_CONCRETE_GAMMA, HARD_CONCRETE_ZETA, HARD_CONCRETE_BETA = -0.1, 1.1, 2.0 / 3.0


def hard_concrete(z: torch.Tensor) -> torch.Tensor:
    """The hard concrete gate at evaluation: ``clamp(sigmoid(z) (zeta - gamma) + gamma, 0, 1)``, exactly 0 for
    ``z <= -log(11) ~ -2.4`` and exactly 1 for ``z >= log(11)``."""
    return (torch.sigmoid(z) * (HARD_CONCRETE_ZETA - HARD_CONCRETE_GAMMA) + HARD_CONCRETE_GAMMA).clamp(0.0, 1.0)


def hard_concrete_sample(z: torch.Tensor) -> torch.Tensor:
    """The hard concrete gate in training: ``z`` moved by logistic noise (``log u - log(1 - u)``, u uniform, from
    torch's global generator) and sharpened by ``1 / beta`` before the stretch and clamp of :func:`hard_concrete`.
    A gate whose ``z`` is far below 0 is almost always exactly 0, but never for sure: on the draws that open it the
    loss's gradient reaches ``z``, so a gate the write budget closed on a token the answer needs can reopen."""
    u = torch.rand_like(z, dtype=torch.float32).clamp(1e-6, 1.0 - 1e-6)
    s = torch.sigmoid((torch.log(u) - torch.log1p(-u) + z.float()) / HARD_CONCRETE_BETA)
    return (s * (HARD_CONCRETE_ZETA - HARD_CONCRETE_GAMMA) + HARD_CONCRETE_GAMMA).clamp(0.0, 1.0).to(z.dtype)


def hard_concrete_open_probability(z: torch.Tensor) -> torch.Tensor:
    """``P(gate > 0)`` under :func:`hard_concrete_sample`: ``sigmoid(z - beta log(-gamma / zeta))``, the expected
    L0 norm of the writes, smooth in ``z`` everywhere (the budget's gradient reaches a closed gate too)."""
    return torch.sigmoid(z - HARD_CONCRETE_BETA * math.log(-HARD_CONCRETE_GAMMA / HARD_CONCRETE_ZETA))


@dataclass(frozen=True)
class WriteGateKind:
    """One kind of :class:`WriteGate`: ``gate(z)``, the gate of ``z = x W^T + b`` (at evaluation, and in training
    unless ``sample``); ``start``, the bias that gives ``gate = 1`` at ``W = 0``; ``sample(z)``, a stochastic gate
    used in training instead (None: ``gate``); ``budget(z)``, what the write budget averages (None: the gate)."""
    gate: Callable[[torch.Tensor], torch.Tensor]
    start: float
    sample: Callable[[torch.Tensor], torch.Tensor] | None = None
    budget: Callable[[torch.Tensor], torch.Tensor] | None = None


#: the kinds of :class:`WriteGate` (``write_gate`` of the kernel attentions). hard_concrete starts at 3.0: at
#: evaluation every gate is exactly 1 there; in training 80% of the draws are exactly 1 and 99% are open
WRITE_GATE_KINDS = {"relu": WriteGateKind(F.relu, 1.0), "relu_leaky_grad": WriteGateKind(relu_leaky_grad, 1.0),
                    "sigmoid": WriteGateKind(two_sigmoid, 0.0),
                    "hard_concrete": WriteGateKind(hard_concrete, 3.0, sample=hard_concrete_sample,
                                                   budget=hard_concrete_open_probability)}
WRITE_GATES = tuple(WRITE_GATE_KINDS)


#: what a :class:`WriteGate` reads (``write_gate_input`` of the kernel attentions): the layer input ``x`` (default) or
#: the short convolution's output (q | k | v of the token and the ``K - 1`` before it)
WRITE_GATE_INPUTS = ("input", "short_conv")


def write_gate_kind(write_gate) -> str | None:
    """The write gate named by a kernel attention's ``write_gate`` option: ``None`` (off: ``None``, ``False`` or
    ``"none"``), else the option itself (:class:`WriteGate` checks it is one of :data:`WRITE_GATES`)."""
    return None if write_gate in (None, False, "none") else write_gate


class WriteGate(nn.Module):
    """How strongly each token writes into the state, per head: ``x: [B, N, C]`` -> ``g: [B, N, H]``, which scales
    the token's value before the state adds it (``S = sum_t g_t phi(k_t) v_t^T``; a selective state, beyond the
    paper's operator). ``W`` starts at 0, so ``g`` starts at 1 for every token and the layer starts as the ungated
    one. ``"relu"``: ``g = relu(x W^T + 1)``, which can be exactly 0 (a token left out at any context length);
    ``"relu_leaky_grad"``: the same ``g``, whose gradient below 0 is a leaky relu's (:func:`relu_leaky_grad`: a
    gate closed on a token gets the loss's gradient and can reopen; relu's gets none); ``"sigmoid"``:
    ``g = 2 sigmoid(x W^T)``, in (0, 2), never 0 (the control: a token's share still falls with the number of tokens
    written beside it); ``"hard_concrete"``: ``g = clamp(1.2 sigmoid(x W^T + 3) - 0.1, 0, 1)``, exactly 0 or 1 over
    most of its range, drawn with logistic noise in training (:func:`hard_concrete_sample`), so a closed gate still
    opens on some draws and hears the loss there, while at evaluation a closed gate writes exactly 0.

    ``penalty``: a write budget for training, ``penalty * mean(g)`` (hard_concrete: the mean probability that a
    gate is open, its expected L0 norm) over the tokens and heads of every forward run with gradients, which the trainer adds to the loss (the :meth:`regularization_loss` hook, :mod:`mhla.hooks`):
    the gate then closes on every token whose write does not pay for itself in the task's loss. 0 (default): none.
    A training loop other than the trainer's must read :meth:`regularization_loss` every step: until it is read, the
    terms (and their graphs) are kept."""

    def __init__(self, dim: int, num_heads: int, kind: str, penalty: float = 0.0, device=None, dtype=None):
        super().__init__()
        if kind not in WRITE_GATES:
            raise ValueError(f"write_gate must be one of {', '.join(WRITE_GATES)} (or none), got {kind!r}")
        if not float(penalty) >= 0:
            raise ValueError(f"write_gate_penalty must be >= 0, got {penalty!r}")
        self.kind = kind
        self.penalty = float(penalty)
        self._written: list[torch.Tensor] = []  # mean gates of this step's forwards with gradients (penalty only)
        self.weight = nn.Parameter(torch.empty(num_heads, dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(num_heads, device=device, dtype=dtype))
        self.reset_parameters()

    def initial_bias(self) -> float:
        """The bias that makes ``g = 1`` at ``W = 0`` (``2 sigmoid(0) = 1``; the relu kinds at 1; hard_concrete at
        evaluation from about 2.4, so 3)."""
        return WRITE_GATE_KINDS[self.kind].start

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.zero_()
        self.bias.fill_(self.initial_bias())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = F.linear(x, self.weight, self.bias)
        kind = WRITE_GATE_KINDS[self.kind]
        g = kind.sample(z) if self.training and kind.sample is not None else kind.gate(z)
        if self.penalty and self.training and torch.is_grad_enabled():
            self._written.append((g if kind.budget is None else kind.budget(z)).float().mean())
        return g

    def regularization_loss(self) -> torch.Tensor | None:
        """Training hook: ``penalty * mean(g)`` over the forwards since the last call (their mean; None without a
        penalty or a forward with gradients), which it forgets."""
        if not self._written:
            return None
        out = self.penalty * torch.stack(self._written).mean()
        self._written.clear()
        return out


class AttentionBase(nn.Module):
    """Projections and options shared by every attention layer (the three here, :mod:`mhla.baselines`, ...).

    Args:
        dim: model width ``C``. Input and output ``[B, N, C]``.
        num_heads: feature heads ``H``; ``head_dim = dim // num_heads`` unless given.
        head_dim: per-head query/key dim ``D``. value_dim: per-head value dim ``Dv`` (default ``head_dim``).
        qkv_bias, proj_bias: biases of the input and output projections.
        qk_norm: RMSNorm of the queries and keys before the feature map: ``True`` (or ``"per_head"``) over each
            head's ``D`` channels; ``"across_heads"`` over all ``H * D`` channels at once (the authors' release:
            its DeiT's ``nn.RMSNorm(dim)``, its Wan's ``WanRMSNorm(dim)``). Epsilon 1e-6 (the release's DeiT
            uses torch's default, the dtype's machine epsilon: no difference on its fixture, see
            docs/method.md).
        in_norm: a LayerNorm (eps 1e-5) on the layer's input before the projections (the release's DeiT has one in
            every attention, after the block's own pre-norm); the output gate then reads the normed input too.
        causal: causal attention over a 1-D sequence (language models); decode with ``cache``.
        cpe: add a depthwise convolution of V on the token grid (kernel ``cpe_kernel``) to the output.
        gate: output gate. ``True`` / ``"swish"``: ``RMSNorm(o) * swish(W_g x)`` (GLA-style); ``"linear"``:
            ``(o + cpe) * (W_o x + b)`` without a norm (RALA's wrapper, used by VLT). A layer built with
            ``projections=False`` keeps its gate: the host passes its input to :meth:`finish_heads` (the release's
            Wan MHLA, ``is_gated``). gate_bias: a bias in ``W_g`` (default: only the linear gate has one; the
            release's Wan gate has one). out_norm: RMSNorm on each
            head's output without a gate (the paper's LM / video setting with ``normalize=False``); ``None`` (the
            default): only the swish gate's.
        rope: where the model's rotary tables apply (:data:`mhla.rope.ROPE_PLACEMENTS`): ``"none"`` (default),
            ``"before_feature_map"``, ``"after_feature_map"``; only attentions whose ``supports.rope`` is set
            take another value, and they then need ``rope_tables`` with each call.
        short_conv: kernel of a causal depthwise conv + SiLU on the projected q, k and v (fla's
            ``ShortConvolution``; 0: off). Causal layers only; a cache keeps its last ``kernel - 1`` inputs
            (decoding, chunked prefill), and ``cu_seqlens`` convolves every sequence alone.
        attn_drop, proj_drop: dropout on the attention output / after the output projection.
        grid, num_prefix_tokens: the token grid ``(T,)``, ``(H, W)`` or ``(F, H, W)`` and the class / register
            tokens in front of it (used by CPE and by layouts); without ``grid`` the tokens form a 1-D sequence.
        projections: ``False`` builds the attention without its projections (no ``qkv``, q/k norms, short conv,
            CPE, gate or output projection): a host module projects and calls :meth:`attend`.
        scale_norm, norm_layer, device, dtype: accepted for timm compatibility (``scale_norm`` must be False).
    """

    supports: ClassVar[Supports] = Supports()
    exclusive_options: ClassVar[tuple[tuple[str, ...], ...]] = ()  # alternatives: setting one drops the others' defaults
    excluded_options: ClassVar[tuple[str, ...]] = ()  # options of a base class that this class sets itself
    dependent_options: ClassVar[dict[str, str]] = {"cpe_kernel": "cpe"}  # option -> the option it needs

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        head_dim: int | None = None,
        value_dim: int | None = None,
        qkv_bias: bool = False,
        proj_bias: bool = True,
        qk_norm: bool | str = False,
        in_norm: bool = False,
        gate_bias: bool | None = None,
        causal: bool = False,
        cpe: bool = False,
        cpe_kernel: int = 3,
        gate: bool | str = False,
        out_norm: bool | None = None,
        rope: str = "none",
        short_conv: int = 0,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        grid=None,
        num_prefix_tokens: int = 0,
        projections: bool = True,
        scale_norm: bool = False,
        norm_layer=None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        name = type(self).__name__
        if scale_norm:
            raise ValueError(f"{name} does not support timm's scale_norm=True")
        if dim % num_heads and head_dim is None:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads}), or pass head_dim")
        if cpe and cpe_kernel % 2 == 0:
            raise ValueError(f"cpe_kernel must be odd so the conv keeps the grid size, got {cpe_kernel}")
        if not cpe and cpe_kernel != 3:
            raise ValueError(f"{name}: cpe_kernel={cpe_kernel} is set but cpe is off; set cpe=true or drop cpe_kernel")
        self.rope = rope_placement(rope)
        if self.rope != "none" and not self.supports.rope:
            raise ValueError(f"{name} does not apply rotary embeddings; rope must be 'none', got {rope!r}")
        if short_conv < 0 or (short_conv and not causal):
            raise ValueError(f"{name}: short_conv is a causal convolution (kernel >= 1) for causal layers; "
                             f"got short_conv={short_conv} with causal={causal}")
        if causal and not self.supports.causal:
            raise ValueError(f"{name} has no causal form")
        if not causal and not self.supports.bidirectional:
            raise ValueError(f"{name} runs causally only: build it with causal=True")
        if num_prefix_tokens and not self.supports.prefix_tokens:
            raise ValueError(f"{name} does not support prefix (class / register) tokens; use average pooling")
        if qk_norm not in (False, True, None, "per_head", "across_heads"):
            raise ValueError(f"{name}: qk_norm must be false, true / 'per_head' or 'across_heads', got {qk_norm!r}")
        self.qk_norm_kind = {None: False, "per_head": True}.get(qk_norm, qk_norm)
        if not projections and (cpe or short_conv or self.qk_norm_kind or in_norm):
            raise ValueError(f"{name}: qk_norm, in_norm, cpe and short_conv belong to the projections; a layer "
                             "built with projections=False (a host owns them) cannot have them")
        dd = dict(device=device, dtype=dtype)
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = head_dim or dim // num_heads
        self.value_dim = value_dim or self.head_dim
        self.causal = causal
        self.num_prefix_tokens = num_prefix_tokens
        self.grid = tuple(int(g) for g in grid) if grid is not None else None
        self.projections = projections
        qk_inner, v_inner = num_heads * self.head_dim, num_heads * self.value_dim
        self.cpe_kernel = cpe_kernel
        self.gate_kind = gate_kind(gate)
        if self.gate_kind == "swish" and out_norm is False:
            raise ValueError(f"{name}: the swish gate is RMSNorm(o) * swish(W_g x), it has its own output RMSNorm; "
                             "out_norm=false would not remove it (drop out_norm, or set gate=false / linear)")
        # Submodules in a fixed order: weight init (timm's, transformers') draws random numbers module by module.
        self.qkv = nn.Linear(dim, 2 * qk_inner + v_inner, bias=qkv_bias, **dd) if projections else None
        norm_width = qk_inner if self.qk_norm_kind == "across_heads" else self.head_dim
        qk = bool(self.qk_norm_kind) and projections
        self.q_norm = nn.RMSNorm(norm_width, eps=1e-6, **dd) if qk else nn.Identity()
        self.k_norm = nn.RMSNorm(norm_width, eps=1e-6, **dd) if qk else nn.Identity()
        self.cpe = self._make_cpe(v_inner, cpe_kernel, dd) if cpe else None
        if gate_bias is not None and not self.gate_kind:
            raise ValueError(f"{name}: gate_bias={gate_bias} is set but the gate is off")
        bias = self.gate_kind == "linear" if gate_bias is None else bool(gate_bias)
        self.gate = nn.Linear(dim, v_inner, bias=bias, **dd) if self.gate_kind else None
        swish_gate = self.gate_kind == "swish"
        self.out_norm = nn.RMSNorm(self.value_dim, eps=1e-6, **dd) if (swish_gate or out_norm) else None
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(v_inner, dim, bias=proj_bias, **dd) if projections else None
        self.proj_drop = nn.Dropout(proj_drop)
        self.short_conv = None
        self.in_norm = nn.LayerNorm(dim, **dd) if in_norm else None
        if short_conv:  # one depthwise conv over the channels of q | k | v, as fla's three ShortConvolutions
            channels = 2 * qk_inner + v_inner
            self.short_conv = nn.Conv1d(channels, channels, short_conv, groups=channels, bias=False, **dd)

    # ------------------------------------------------------------------------------------- settings
    def settings(self) -> dict:
        """The options this layer runs with, read from the layer itself (what a test compares with the config)."""
        out = {"causal": self.causal, "rope": self.rope, "cpe": self.cpe is not None,
               "cpe_kernel": self.cpe_kernel, "gate": self.gate_kind or False,
               "out_norm": self.out_norm is not None,
               "short_conv": self.short_conv.kernel_size[0] if self.short_conv is not None else 0,
               "num_prefix_tokens": self.num_prefix_tokens, "grid": self.grid, "projections": self.projections,
               "head_dim": self.head_dim, "value_dim": self.value_dim}
        if self.projections:
            out["qk_norm"] = self.qk_norm_kind if isinstance(self.q_norm, nn.RMSNorm) else False
            if self.in_norm is not None:
                out["in_norm"] = True
        if self.gate is not None:
            out["gate_bias"] = self.gate.bias is not None
        return out

    # ------------------------------------------------------------------------------------------ CPE
    def _make_cpe(self, channels: int, kernel: int, dd) -> nn.Module:
        ndim = len(self.grid) if self.grid is not None else 1
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[ndim]
        pad = 0 if (self.causal and ndim == 1) else kernel // 2  # causal 1-D: left padding in forward
        return conv(channels, channels, kernel, padding=pad, groups=channels, **dd)

    def _apply_cpe(self, v: torch.Tensor, grid, cache: AttentionCache | None) -> torch.Tensor:
        """Depthwise conv of ``v: [B, N, inner]`` (grid tokens in raster order) -> same shape."""
        B, N, Cv = v.shape
        if isinstance(self.cpe, nn.Conv1d):
            if self.causal:
                out, past = self._causal_conv(v, cache.conv if cache is not None else None)
                if cache is not None:
                    cache.conv = past
                return out
            return self.cpe(v.transpose(1, 2)).transpose(1, 2)
        x = v.transpose(1, 2).reshape(B, Cv, *grid)
        return self.cpe(x).reshape(B, Cv, N).transpose(1, 2)

    def _causal_conv(self, v: torch.Tensor, past: torch.Tensor | None):
        """Causal 1-D CPE: ``v: [B, N, inner]`` after ``past: [B, kernel - 1, inner]`` (None: zeros) ->
        ``(out [B, N, inner], the new past [B, kernel - 1, inner], detached)``."""
        k = self.cpe_kernel - 1
        if past is None:
            past = v.new_zeros(v.shape[0], k, v.shape[2])
        full = torch.cat([past, v], dim=1)
        out = self.cpe(full.transpose(1, 2)).transpose(1, 2)
        return out, (full[:, -k:].detach() if k else full[:, :0])

    def _apply_cpe_varlen(self, v: torch.Tensor, cache: AttentionCache | None, cu_seqlens) -> torch.Tensor:
        """Causal CPE on a packed batch ``v: [1, total_T, inner]``: each sequence convolved alone, after its
        own past (``cache.conv``: a list of per-sequence pasts)."""
        pasts = self._varlen_states(cache, "conv", cu_seqlens)

        def op(v, past, final):
            out, new_past = self._causal_conv(v, past)
            return (out, new_past) if final else out

        def empty():
            return v.new_zeros(1, self.cpe_kernel - 1, v.shape[2])

        if cache is None:
            return run_varlen(op, (v,), cu_seqlens)
        out, cache.conv = run_varlen(op, (v,), cu_seqlens, initial_state=pasts, output_final_state=True,
                                     empty_state=empty)
        return out

    # ---------------------------------------------------------------------------------- projections
    def _project(self, x: torch.Tensor, cache: AttentionCache | None = None, cu_seqlens=None):
        """``x: [B, N, C]`` -> q, k ``[B, N, H, D]`` (normed, short-convolved; not feature-mapped or rotated),
        v ``[B, N, H, Dv]``. ``cache`` / ``cu_seqlens``: the short convolution continues the cached inputs /
        convolves each packed sequence alone (:meth:`_apply_short_conv`)."""
        B, N, _ = x.shape
        H, D, Dv = self.num_heads, self.head_dim, self.value_dim
        q, k, v = self.qkv(x).split([H * D, H * D, H * Dv], dim=-1)
        if self.qk_norm_kind == "across_heads":  # one RMSNorm over all heads' channels
            q, k = self.q_norm(q).view(B, N, H, D), self.k_norm(k).view(B, N, H, D)
        else:
            q, k = self.q_norm(q.view(B, N, H, D)), self.k_norm(k.view(B, N, H, D))
        v = v.view(B, N, H, Dv)
        if self.short_conv is not None:
            q, k, v = self._apply_short_conv(q, k, v, cache, cu_seqlens)
        return q, k, v

    def _apply_short_conv(self, q, k, v, cache: AttentionCache | None = None, cu_seqlens=None):
        """Causal depthwise conv (kernel ``K``) + SiLU over the tokens of q, k ``[B, T, H, D]`` and
        v ``[B, T, H, Dv]``, channel by channel (token ``t`` sees ``t - K + 1 .. t``; zeros before the first).

        ``cache``: the convolution continues after ``cache.short_conv`` (the last ``K - 1`` inputs, zeros when
        None) and stores the new last ``K - 1``. ``cu_seqlens`` (``q: [1, total_T, H, D]``): every packed
        sequence is convolved alone, after its own cached inputs (a list per sequence, as ``cache.conv``)."""
        B, T, H, D = q.shape
        qkv = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        if cu_seqlens is not None:
            qkv = self._short_conv_varlen(qkv, cache, cu_seqlens)
        else:
            qkv, past = self._short_conv_step(qkv, cache.short_conv if cache is not None else None)
            if cache is not None:
                cache.short_conv = past
        q, k, v = qkv.split([H * D, H * D, v.shape[2] * v.shape[3]], dim=-1)
        return q.reshape(B, T, H, D), k.reshape(B, T, H, D), v.reshape(B, T, H, -1)

    def _short_conv_step(self, x: torch.Tensor, past: torch.Tensor | None):
        """The short convolution of ``x: [B, T, ch]`` after ``past: [B, K - 1, ch]`` (None: zeros) ->
        ``(silu(conv) [B, T, ch], the new past [B, K - 1, ch], detached)``."""
        K = self.short_conv.kernel_size[0]
        xt = x.transpose(1, 2)
        full = F.pad(xt, (K - 1, 0)) if past is None else torch.cat([past.transpose(1, 2), xt], dim=2)
        out = F.silu(self.short_conv(full)).transpose(1, 2)
        return out, full[:, :, full.shape[2] - (K - 1):].transpose(1, 2).detach()

    def _short_conv_varlen(self, x: torch.Tensor, cache: AttentionCache | None, cu_seqlens) -> torch.Tensor:
        """:meth:`_short_conv_step` on a packed ``x: [1, total_T, ch]``, every sequence alone after its own
        past (``cache.short_conv``: a list of per-sequence pasts)."""
        pasts = self._varlen_states(cache, "short_conv", cu_seqlens)

        def op(x, past, final):
            out, new_past = self._short_conv_step(x, past)
            return (out, new_past) if final else out

        def empty():
            return x.new_zeros(1, self.short_conv.kernel_size[0] - 1, x.shape[2])

        if cache is None:
            return run_varlen(op, (x,), cu_seqlens)
        out, cache.short_conv = run_varlen(op, (x,), cu_seqlens, initial_state=pasts, output_final_state=True,
                                           empty_state=empty)
        return out

    def _grid_for(self, n_grid: int, grid_size) -> tuple[int, ...]:
        if grid_size is not None:
            grid = tuple(grid_size)
        elif self.grid is not None:
            grid = self.grid
        else:
            grid = (n_grid,)
        n = 1
        for g in grid:
            n *= g
        if n != n_grid:
            raise ValueError(
                f"{type(self).__name__}: the input has {n_grid} grid tokens but the grid {grid} holds {n}; "
                f"pass grid_size=... to forward or build the layer with the right grid "
                f"(num_prefix_tokens={self.num_prefix_tokens})"
            )
        return grid

    def finish_heads(self, o: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """``o: [B, N, H, Dv]`` -> dropout and the per-head output RMSNorm (with a swish gate, or ``out_norm``).

        A layer built with ``projections=False`` and a gate also applies the gate here, on its host's input
        ``x: [B, N, C]``: ``RMSNorm(o) * swish(W_g x)`` (or ``o * (W_o x + b)``), per head."""
        o = self.attn_drop(o)
        o = self.out_norm(o) if self.out_norm is not None else o
        if self.gate is not None and not self.projections:
            if x is None:
                raise ValueError(f"{type(self).__name__} has an output gate: its host must pass its input x to "
                                 "finish_heads(o, x)")
            g = self.gate(x)
            g = F.silu(g) if self.gate_kind == "swish" else g
            o = o * g.unflatten(-1, (self.num_heads, self.value_dim)).to(o.dtype)
        return o

    def _finish(self, o: torch.Tensor, x: torch.Tensor, cpe_out: torch.Tensor | None) -> torch.Tensor:
        """``o: [B, N, H, Dv]`` -> output norm, CPE, gate, projection -> ``[B, N, C]``."""
        B, N = o.shape[:2]
        o = self.finish_heads(o).reshape(B, N, -1)
        if cpe_out is not None:
            o = o + cpe_out
        if self.gate_kind == "swish":
            o = o * F.silu(self.gate(x))
        elif self.gate_kind == "linear":
            o = o * self.gate(x)
        return self.proj_drop(self.proj(o))

    # ------------------------------------------------------------------------------------ attention
    def attend(self, q, k, v, *, grid, rope_tables: RotaryTables | None = None, cache: AttentionCache | None = None,
               attn_mask=None, x=None) -> torch.Tensor:  # pragma: no cover - abstract
        """The attention: q, k ``[B, N, H, D]`` (projected and normed, before the feature map and the rotation),
        v ``[B, N, H, Dv]`` -> ``o [B, N, H, Dv]``, tokens in the model's order (prefix tokens first).

        ``grid``: the token grid of the grid tokens; ``rope_tables``: the model's rotary tables for these
        tokens (attentions with ``supports.rope``); ``cache``: the decode state, updated in place (causal
        layers; else None); ``attn_mask``: the mask of :meth:`forward` (softmax only); ``x: [B, N, C]``: the
        layer input, for attentions that read it (InLine's kernel MLP, MALA / RALA's output gate)."""
        raise NotImplementedError

    def _rotate(self, rope_tables: RotaryTables | None):
        """The rotation ``t -> rope(t)`` of this call, or None (no tables, or ``rope="none"``)."""
        if rope_tables is None or self.rope == "none":
            return None
        if isinstance(rope_tables, tuple):  # (cos, sin), half-split
            rope_tables = RotaryTables(*rope_tables)
        return rope_tables.apply

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        *,
        grid_size=None,
        cache: AttentionCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        rope_tables: RotaryTables | None = None,
    ) -> torch.Tensor:
        """``x: [B, N, C]`` (prefix tokens first, then grid tokens in raster order) -> ``[B, N, C]``.

        Args:
            attn_mask: not supported by the linear layers (ValueError); passed to SDPA by softmax.
            is_causal: timm's flag; must agree with the layer's ``causal``.
            grid_size: the token grid of this input when it differs from the one the layer was built for.
            cache: causal decoding / chunked prefill; updated in place (create with ``AttentionCache()``).
            cu_seqlens: causal 1-D layers; ``x: [1, total_T, C]`` holds ``N`` sequences packed along the tokens
                (``cu_seqlens: [N + 1]`` offsets, :mod:`mhla.ops.utils.varlen`), each attended as if alone; the
                cache then holds per-sequence states (:class:`AttentionCache`).
            rope_tables: the rotary tables of the tokens of ``x`` (:class:`mhla.rope.RotaryTables`, or a
                half-split ``(cos, sin)``), for layers built with ``rope`` other than ``"none"``.
        """
        if not self.projections:
            raise RuntimeError(f"{type(self).__name__} was built with projections=False: its host projects and "
                               "calls attend()")
        if is_causal and not self.causal:
            raise ValueError(f"{type(self).__name__} was built with causal=False but called with is_causal=True")
        if cache is not None and not self.causal:
            raise ValueError("cache is for causal layers")
        if cu_seqlens is not None:
            return self._forward_varlen(x, attn_mask, cache, cu_seqlens, rope_tables)
        P = self.num_prefix_tokens
        grid = self._grid_for(x.shape[1] - P, grid_size)
        layout = self._token_layout(grid)
        if layout is not None:  # a layer with blocks works in block-major order from its input on: per-token ops
            # do not care, and the token order (the order of the sums of the weight gradients) stays the same
            x = torch.cat([x[:, :P], layout.raster_to_block_major(x[:, P:])], dim=1)
        if self.in_norm is not None:
            x = self.in_norm(x)
        q, k, v = self._project(x, cache)
        cpe_out = None
        if self.cpe is not None:
            vg = v[:, P:].reshape(x.shape[0], -1, self.num_heads * self.value_dim)
            if layout is not None:
                cpe_out = layout.raster_to_block_major(self._apply_cpe(layout.block_major_to_raster(vg), grid, cache))
            else:
                cpe_out = self._apply_cpe(vg, grid, cache)
            if P:
                cpe_out = torch.cat([cpe_out.new_zeros(x.shape[0], P, cpe_out.shape[-1]), cpe_out], dim=1)
        if layout is not None and rope_tables is not None:  # the tables follow their tokens
            rope_tables = RotaryTables(*rope_tables) if isinstance(rope_tables, tuple) else rope_tables
            rope_tables = rope_tables.permute_tokens(
                lambda t: torch.cat([t[:, :P], layout.raster_to_block_major(t[:, P:])], dim=1))
        kw = dict(rope_tables=rope_tables, cache=cache, attn_mask=attn_mask, x=x)
        o = self.attend(q, k, v, grid=grid, **kw) if layout is None else self._attend_blocked(q, k, v, layout, **kw)
        y = self._finish(o, x, cpe_out)
        if layout is not None:
            y = torch.cat([y[:, :P], layout.block_major_to_raster(y[:, P:])], dim=1)
        return y

    def _token_layout(self, grid):
        """The block layout whose block-major order :meth:`forward` works in (None: the model's order)."""
        return None

    def _forward_varlen(self, x, attn_mask, cache: AttentionCache | None, cu_seqlens, rope_tables):
        """:meth:`forward` on a packed batch ``x: [1, total_T, C]`` of ``N`` causal 1-D sequences."""
        if not self.causal or not self.supports.varlen:
            raise ValueError(f"{type(self).__name__}: cu_seqlens is for causal layers over 1-D sequences")
        if attn_mask is not None:
            raise ValueError("pass either attn_mask or cu_seqlens")
        check_cu_seqlens(cu_seqlens, x.unsqueeze(2))
        if self.in_norm is not None:
            x = self.in_norm(x)
        q, k, v = self._project(x, cache, cu_seqlens)
        cpe_out = None
        if self.cpe is not None:
            cpe_out = self._apply_cpe_varlen(v.flatten(2), cache, cu_seqlens)
        return self._finish(self._attend_varlen(q, k, v, cache, cu_seqlens, rope_tables), x, cpe_out)

    def _varlen_states(self, cache: AttentionCache | None, field: str, cu_seqlens) -> list | None:
        """The per-sequence states ``cache.<field>`` (``"attn"``, ``"conv"``, ``"short_conv"``) of a packed
        call with ``cu_seqlens``: None when there are none yet, else a list of ``N`` (a batched cache is
        split)."""
        state = getattr(cache, field) if cache is not None else None
        if state is None:
            return None
        n = cu_seqlens.numel() - 1
        states = state if isinstance(state, list) else unbind_state(state, n)
        if len(states) != n:
            raise ValueError(f"the cache holds {len(states)} sequences but cu_seqlens has {n}")
        return states

    def _attend_varlen(self, q, k, v, cache, cu_seqlens, rope_tables):
        """:meth:`attend` on a packed batch: q, k ``[1, total_T, H, D]``, v ``[1, total_T, H, Dv]`` ->
        ``[1, total_T, H, Dv]``, each sequence alone; updates ``cache`` (per-sequence lists) when given."""
        raise ValueError(f"{type(self).__name__} does not support cu_seqlens")


class KernelAttention(AttentionBase):
    """Attentions that score ``phi(q) . phi(k)`` (plain linear attention and MHLA): the feature map, the
    normaliser and the placement of the rotary embedding relative to ``phi``.

    Args:
        feature_map: name in :data:`mhla.feature_maps.FEATURE_MAPS`.
        normalize: ``True`` (divide by the attention mass ``phi(q) . sum phi(k) + eps``), ``False`` (no
            denominator; use ``out_norm``, the paper's LM / video setting) or ``"official"`` (MHLA: the authors'
            release's vision normaliser).
        eps: the denominator's epsilon.
        feature_map_eps: the feature map's own epsilon where it has one (``relu``: ``relu(x) + eps``, default
            1e-6); ``0.0`` gives the plain ``relu`` of the release's language model. None: the map's default.
        q_scale: a factor on the query features (after the feature map and the rotation): a number, or
            ``"head_dim"`` for ``head_dim ** -0.5`` (the release's language model). 1 by default; with a normaliser
            it cancels (up to ``eps``), without one the output RMSNorm removes it (up to its epsilon).
        write_gate: ``None`` (default) or a :class:`WriteGate` kind (:data:`WRITE_GATES`): each token's value
            is scaled by its gate ``g_t`` per head before the state adds it, so ``S = sum_t g_t phi(k_t) v_t^T``
            (MHLA's block summaries and their far sum too; CPE reads the gated values). Needs ``normalize=False``
            (the normaliser's ``sum phi(k)`` would stay ungated) and the layer's own projections.
        write_gate_penalty: the gate's write budget in training (:class:`WriteGate` ``penalty``; default 0).
        write_gate_input: what the gate reads, one of :data:`WRITE_GATE_INPUTS`: ``"input"`` (default) the layer
            input ``x`` of the token alone (in the first layer, its embedding); ``"short_conv"`` the short
            convolution's output, q | k | v ``[B, N, H * (2 D + Dv)]`` of the token and the ``K - 1`` before it (needs
            ``short_conv``), so that the gate can tell a token by its neighbours (a digit after "is:" from one in a
            year). Its cache is the convolution's: decoding and chunked prefill gate alike.

    With ``rope="after_feature_map"`` and a normaliser, the numerator uses the rotated features and the
    normaliser the un-rotated ``phi(q) . phi(k)`` (RoFormer's linear-attention form: the denominator stays
    positive). Causal layers refuse that combination (it would need a second decode state); the paper's LM
    has no normaliser.
    """

    def __init__(self, dim: int, num_heads: int = 8, *, feature_map: str = "relu", normalize=True,
                 eps: float = 1e-6, feature_map_eps: float | None = None, q_scale: float | str = 1.0,
                 write_gate: str | None = None, write_gate_penalty: float = 0.0, write_gate_input: str | None = None,
                 **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        write_gate = write_gate_kind(write_gate)
        if write_gate is not None and normalize is not False:
            raise ValueError(f"write_gate={write_gate!r} scales the values written into the state; with a normaliser "
                             f"(normalize={normalize!r}) its sum of phi(k) would stay ungated: set normalize=false")
        if write_gate is not None and not self.projections:
            raise ValueError(f"write_gate={write_gate!r} reads the layer input in the projections; a layer built with "
                             "projections=False (a host owns them) cannot have it")
        if write_gate is None and write_gate_penalty:
            raise ValueError(f"write_gate_penalty={write_gate_penalty} is set but there is no write gate: set "
                             "write_gate=relu or sigmoid")
        write_gate_input = write_gate_input or "input"
        if write_gate_input not in WRITE_GATE_INPUTS:
            raise ValueError(f"write_gate_input must be one of {', '.join(WRITE_GATE_INPUTS)}, got {write_gate_input!r}")
        if write_gate_input != "input" and write_gate is None:
            raise ValueError(f"write_gate_input={write_gate_input!r} is set but there is no write gate: set "
                             "write_gate=relu or sigmoid")
        if write_gate_input == "short_conv" and self.short_conv is None:
            raise ValueError("write_gate_input='short_conv' reads the short convolution's output; the layer has none: "
                             "set short_conv (e.g. 4)")
        self.write_gate_input = write_gate_input
        dd = dict(device=self.qkv.weight.device, dtype=self.qkv.weight.dtype) if write_gate is not None else {}
        gate_dim = dim if write_gate_input == "input" else self.num_heads * (2 * self.head_dim + self.value_dim)
        self.write_gate = (WriteGate(gate_dim, num_heads, write_gate, write_gate_penalty, **dd)
                           if write_gate is not None else None)
        if normalize not in (True, False, "official"):
            raise ValueError(f"normalize must be true, false or 'official', got {normalize!r}")
        if self.rope == "after_feature_map" and normalize == "official":
            raise ValueError("normalize='official' (the release's normaliser) needs rope != 'after_feature_map'")
        if self.rope == "after_feature_map" and normalize is True and self.causal:
            raise ValueError("causal layers with rope='after_feature_map' have no normaliser: set normalize=false "
                             "(and out_norm=true, the paper's LM setting) or rope='before_feature_map'")
        self.feature_map_name = feature_map
        self.feature_map_eps = feature_map_eps
        fm_kwargs = {} if feature_map_eps is None else {"eps": float(feature_map_eps)}
        self.feature_map = get_feature_map(feature_map, **fm_kwargs)
        if q_scale == "head_dim":
            q_scale = self.head_dim ** -0.5
        elif isinstance(q_scale, str):
            raise ValueError(f"q_scale must be a number or 'head_dim', got {q_scale!r}")
        self.q_scale = float(q_scale)
        self.normalize = normalize
        self.eps = eps

    def settings(self) -> dict:
        out = {**super().settings(), "feature_map": self.feature_map_name, "normalize": self.normalize,
               "eps": self.eps}
        if self.feature_map_eps is not None:
            out["feature_map_eps"] = self.feature_map_eps
        if self.q_scale != 1.0:
            out["q_scale"] = self.q_scale
        if self.write_gate is not None:
            out["write_gate"] = self.write_gate.kind
            if self.write_gate.penalty:
                out["write_gate_penalty"] = self.write_gate.penalty
            if self.write_gate_input != "input":
                out["write_gate_input"] = self.write_gate_input
        return out

    @classmethod
    def tag_words(cls, options: dict) -> list[str]:
        """A write gate in a run's tag (``-wg_relu``; with a penalty ``-wg_relu0.01``; reading the short convolution
        ``-wg_relu_sc0.01``)."""
        if write_gate_kind(options.get("write_gate")) is None:
            return []
        reads = "_sc" if options.get("write_gate_input") == "short_conv" else ""
        return [f"-wg_{options['write_gate']}{reads}" + (f"{options['write_gate_penalty']:g}"
                                                          if options.get("write_gate_penalty") else "")]

    def _project(self, x: torch.Tensor, cache: AttentionCache | None = None, cu_seqlens=None):
        """:meth:`AttentionBase._project`, the values scaled by the write gate (``[B, N, H, 1]``) when there is one;
        the gate reads ``x`` or the short-convolved q | k | v (``write_gate_input``)."""
        q, k, v = super()._project(x, cache, cu_seqlens)
        if self.write_gate is not None:
            B, N = x.shape[:2]
            seen = x if self.write_gate_input == "input" else torch.cat(
                [q.reshape(B, N, -1), k.reshape(B, N, -1), v.reshape(B, N, -1)], dim=-1)
            v = v * self.write_gate(seen).unsqueeze(-1).to(v.dtype)
        return q, k, v

    def check_at_start(self) -> None:
        """The start-of-run check of a built layer (:func:`mhla.registry.probe_layers`): with the rotation after the
        feature map, the model's rotary tables (of the head dimension) rotate the features, so a feature map that
        changes the dimension (a Taylor expansion: ``D -> 1 + D + D^2``) cannot run there. Raises ValueError."""
        if self.rope != "after_feature_map":
            return
        param = next(self.parameters(), None)
        device = param.device if param is not None else torch.device("meta")
        out = self.feature_map(torch.zeros(1, 1, self.num_heads, self.head_dim, device=device)).shape[-1]
        if out != self.head_dim:
            raise ValueError(f"its feature map changes the head dimension ({self.head_dim} -> {out} on the check's "
                             "layer), and rope=after_feature_map would rotate those features with tables of the head "
                             "dimension: set attn.rope=before_feature_map (or none)")

    def _features(self, q, k, rope_tables):
        """``(q, k, q_plain, k_plain)`` after the feature map and the rotation (:func:`rope_and_feature_map`), the
        queries times ``q_scale``."""
        q, k, qp, kp = rope_and_feature_map(q, k, self.feature_map, self._rotate(rope_tables), self.rope)
        if self.q_scale != 1.0:
            same = q is qp
            q = q * self.q_scale
            qp = q if same else qp * self.q_scale
        return q, k, qp, kp

    def _kernel_op(self, op, q, k, v, rope_tables):
        """``op(q, k, v, normalize)`` on the featured (and rotated) q, k; with the rotation after the feature
        map and a normaliser, numerator and normaliser as in the class docstring."""
        q, k, q_plain, k_plain = self._features(q, k, rope_tables)
        if self.normalize is not False and self.rope == "after_feature_map" and q is not q_plain:
            num = op(q, k, v, False)
            den = op(q_plain, k_plain, v.new_ones(*v.shape[:-1], 1), False)
            acc = torch.promote_types(num.dtype, torch.float32)
            return (num.to(acc) / (den.to(acc) + self.eps)).to(num.dtype)
        return op(q, k, v, self.normalize)


@register_attention("mhla")
class MultiHeadLinearAttention(KernelAttention):
    """Multi-Head Linear Attention: linear attention with token-level heads mixed by a learnable matrix.

    Extra args (see :class:`AttentionBase` and :class:`KernelAttention` for the shared ones):
        blocks / block / num_blocks: the block grid, non-causal. ``blocks``: blocks per axis (``(4, 4)``;
            the block shape follows the grid of each call); ``block``: tokens per block (with ``grid``);
            ``num_blocks``: M, factorised over the grid's axes (:func:`mhla.layouts.factorize_blocks`: a perfect
            square / cube splits evenly), or ``"auto"``: M chosen from the layer's ``grid`` by the paper's
            ``M^2 <= N`` rule (:func:`mhla.layouts.auto_blocks`; refused without a grid). Exactly one, or
            ``block_size`` for a 1-D sequence.
        block_size: tokens per block of a 1-D sequence (``"auto"`` on a 1-D grid: as ``num_blocks="auto"``);
            causal layers: the chunk length (default 64; ``"auto"`` is resolved by the model from its context,
            :func:`mhla.layouts.auto_block_size`).
        mixing_init: ``"locality"`` (paper default), ``"uniform"``, ``"ones"``, ``"identity"``, ``"cos"``,
            ``"exp"``, ``"gaussian"``, ``"local"``, ``"locality_visible"``, ``"locality_official"``
            (:func:`mhla.mixing_init`).
        mixing_learnable: learn the mixing matrix (else a frozen buffer). mixing_per_head: one matrix per head.
        mixing_param: nonnegativity parameterization, ``"clamp"`` (paper), ``"softplus"`` or ``"log"``.
        mixing_max: the clamp's upper bound on a coefficient (default 1: the paper clips to ``(0, 1)``); only with
            ``mixing_param="clamp"``.
        max_learned_blocks: causal only; blocks with their own learned coefficients (beyond: the extension
            rule ``mixing_extension``; sequences are not capped).
        mixing_extension: causal only; how rows past ``max_learned_blocks`` are built
            (:data:`mhla.mixing.EXTENSION_RULES` or ``"uniform_far:C"``, default ``"uniform_far"``;
            :func:`mhla.mixing.extend_causal_mixing`).
        backend: op backend (``"auto"``, ``"torch"``, ``"triton"``, ``"reference"``; :func:`mhla.mhla_attention`).
    """

    supports = Supports(bidirectional=True, grid_ranks=(1, 2, 3), causal=True, prefix_tokens=True, decoding=True,
                        varlen=True, rope=True, host_projections=True)
    exclusive_options = (("blocks", "block", "num_blocks"),)
    # what it says about itself (mhla.registry: run tags, plots, benchmarks)
    plot_label, plot_group, benchmark, benchmark_baseline = "MHLA", 3, True, "linear"
    block_options = {"num_blocks": lambda m: "auto" if str(m) == "auto" else int(m)}  # a model's default blocks

    @classmethod
    def tag_words(cls, options: dict) -> list[str]:
        """A mixing initialisation other than the locality init (``-uniform``), a frozen matrix (``-frozen``), then
        :meth:`KernelAttention.tag_words`."""
        words = [f"-{options['mixing_init']}"] if options.get("mixing_init") not in (None, "locality") else []
        return words + (["-frozen"] if options.get("mixing_learnable") is False else []) + super().tag_words(options)

    @classmethod
    def tag_blocks(cls, options: dict) -> str | None:
        """M in a run's tag: ``blocks`` per axis (``7x3x5``), else ``num_blocks``."""
        if options.get("blocks"):
            return "x".join(map(str, options["blocks"]))
        return None if options.get("num_blocks") is None else str(options["num_blocks"])

    @classmethod
    def bench_options(cls, n_tokens: int | None, cpe_gate: bool = False, block_size: int | None = None) -> dict:
        """In a benchmark: M = 16 blocks, divided by 4 until ``M^2 <= n_tokens`` (a grid), or chunks of
        ``block_size`` (a language model); ``cpe_gate``: with CPE and the output gate (Table 3's rows)."""
        if block_size is not None:
            return {"block_size": block_size}
        m = 16
        while m > 1 and n_tokens is not None and m * m > n_tokens:
            m //= 4
        return {"num_blocks": m, "cpe": cpe_gate, "gate": cpe_gate}

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        blocks=None,
        block=None,
        num_blocks: int | str | None = None,
        block_size: int | str | None = None,
        mixing_init: str = "locality",
        mixing_learnable: bool = True,
        mixing_per_head: bool = False,
        mixing_param: str = "clamp",
        mixing_max: float = 1.0,
        max_learned_blocks: int | None = None,
        mixing_extension: str | None = None,
        backend: str = "auto",
        **kwargs,
    ):
        super().__init__(dim, num_heads, **kwargs)
        self.backend = backend
        per_head = num_heads if mixing_per_head else None
        if float(mixing_max) != 1.0 and mixing_param != "clamp":
            raise ValueError(f"mixing_max bounds the clamp parameterization; mixing_param={mixing_param!r} has no "
                             f"upper bound (drop mixing_max={mixing_max} or use mixing_param=clamp)")
        if self.causal:
            given = [n for n, v in (("grid", self.grid if self.grid and len(self.grid) != 1 else None),
                                    ("blocks", blocks), ("block", block), ("num_blocks", num_blocks)) if v is not None]
            if given:
                hint = (" (num_blocks=auto: use block_size=auto, which the language model resolves from its "
                        "context)" if num_blocks == "auto" else "")
                raise ValueError(f"causal MHLA works on 1-D sequences in chunks of block_size tokens; it does not "
                                 f"take {', '.join(given)}{hint}")
            if block_size == "auto":
                raise ValueError("block_size=auto is resolved by the model from its context length "
                                 "(mhla.layouts.auto_block_size, e.g. the language model's "
                                 "max_position_embeddings); a layer built directly needs block_size=<int>")
            self.block_size = int(block_size or 64)
            self.blocks, self.auto_blocks = None, False
            m, distances = int(max_learned_blocks or 32), None
        else:
            if max_learned_blocks is not None or mixing_extension is not None:
                raise ValueError("max_learned_blocks and mixing_extension are for causal MHLA (rows past the learned "
                                 "ones); a non-causal layer has one learned row per block")
            self.blocks = self._block_grid(blocks, block, num_blocks, block_size)
            self.block_size = block_size
            m = 1
            for b in self.blocks:
                m *= b
            with torch.device("cpu"):  # (also under a meta / CUDA default device)
                distances = BlockLayout(self.blocks, (1,) * len(self.blocks)).block_distances()
        self._layouts: dict[tuple[int, ...], BlockLayout] = {}
        self.mixing = MixingMatrix(
            m,
            distances=distances,
            init=mixing_init,
            causal=self.causal,
            learnable=mixing_learnable,
            num_heads=per_head,
            parameterization=mixing_param,
            max_value=float(mixing_max),
            extension=mixing_extension or "uniform_far",
        )
        if kwargs.get("device") is not None:
            self.mixing.to(kwargs["device"])
        if self.short_conv is not None:  # registered after the mixing, as the language model always had it
            self._modules["short_conv"] = self._modules.pop("short_conv")

    def _block_grid(self, blocks, block, num_blocks, block_size) -> tuple[int, ...]:
        """Blocks per axis of a non-causal layer, from exactly one of ``blocks`` / ``block`` / ``num_blocks``
        (or ``block_size`` on a 1-D grid). ``num_blocks="auto"`` (or ``block_size="auto"`` on a 1-D grid): the
        rule of :func:`mhla.layouts.auto_blocks` on the layer's token grid."""
        grid = self.grid
        self.auto_blocks = "auto" in (num_blocks, block_size)
        if self.auto_blocks:
            others = [n for n, v in (("blocks", blocks), ("block", block), ("num_blocks", num_blocks),
                                     ("block_size", block_size)) if v is not None and v != "auto"]
            if others:
                raise ValueError(f"num_blocks=auto chooses the block grid itself; drop {', '.join(others)}")
            if num_blocks == "auto" and block_size is not None:
                raise ValueError("give num_blocks=auto or block_size=auto, not both")
            if grid is None:
                raise ValueError("num_blocks=auto chooses M from the layer's token grid, but this layer is "
                                 "built without one (grid=None): the model must pass its token grid "
                                 "(grid=(H, W), (F, H, W) or (T,)), or give num_blocks=M / blocks=(per axis)")
            if block_size is not None and len(grid) != 1:
                raise ValueError("block_size is for 1-D sequences; on a grid use num_blocks=auto")
            return auto_blocks(grid)
        if grid is not None and len(grid) == 1 and block_size is not None and (blocks, block, num_blocks) == (
                None, None, None):
            block = (block_size,)
        elif block_size is not None:
            raise ValueError("block_size is for 1-D sequences (a causal layer's chunk, or a 1-D grid); give blocks, "
                             "block or num_blocks for a grid")
        if grid is None and blocks is None and block is None:
            if num_blocks is None:
                raise ValueError("non-causal MHLA needs a layout: grid=(H, W) with num_blocks=M, blocks=(per axis) or "
                                 "block=(tokens per block); or num_blocks=M for a 1-D sequence")
            return (int(num_blocks),)
        if isinstance(block, int) and grid is not None:
            block = (block,) * len(grid)
        out = resolve_blocks(grid, blocks=blocks, block=block, num_blocks=num_blocks)
        if grid is not None:
            layout_for_grid(grid, out)  # validates that they tile the grid
        return out

    def settings(self) -> dict:
        m = self.mixing
        out = {**super().settings(), "mixing_init": m.init, "mixing_learnable": m.learnable,
               "mixing_per_head": m.num_heads is not None, "mixing_param": m.parameterization,
               "mixing_max": m.max_value, "backend": self.backend, "num_blocks": m.num_blocks}
        if self.causal:
            out.update(block_size=self.block_size, max_learned_blocks=m.num_blocks, mixing_extension=m.extension)
        else:
            out.update(blocks=self.blocks, auto_blocks=self.auto_blocks)
            if self.grid is not None:
                out["block"] = self.layout_for(self.grid).block
        return out

    @property
    def layout(self) -> BlockLayout | None:
        """The block layout of the grid the layer was built for (None: causal, or no grid given)."""
        return None if self.causal or self.grid is None else self.layout_for(self.grid)

    def layout_for(self, grid: tuple[int, ...]) -> BlockLayout:
        """The block layout of ``grid`` (blocks per axis fixed at build; the block shape follows the grid)."""
        grid = tuple(int(g) for g in grid)
        if grid not in self._layouts:
            if len(grid) != len(self.blocks):
                raise ValueError(f"MHLA was built for a {len(self.blocks)}-D block grid {self.blocks}, got the "
                                 f"{len(grid)}-D token grid {grid}")
            self._layouts[grid] = layout_for_grid(grid, self.blocks)
        return self._layouts[grid]

    def attend(self, q, k, v, *, grid, rope_tables=None, cache=None, attn_mask=None, x=None):
        if attn_mask is not None:
            raise ValueError("MultiHeadLinearAttention does not take attn_mask")
        if self.causal:
            return self._causal(q, k, v, cache, rope_tables)
        P = self.num_prefix_tokens
        layout = self.layout_for(grid)
        to_b, to_r = layout.raster_to_block_major, layout.block_major_to_raster
        # the grid tokens in block-major order (prefix tokens stay first): blocks are contiguous
        q, k, v = (torch.cat([t[:, :P], to_b(t[:, P:])], dim=1) if P else to_b(t) for t in (q, k, v))
        if rope_tables is not None and self.rope != "none":
            rope_tables = rope_tables.permute_tokens(to_b)
        o = self._attend_blocked(q, k, v, layout, rope_tables=rope_tables)
        return torch.cat([o[:, :P], to_r(o[:, P:])], dim=1) if P else to_r(o)

    def _token_layout(self, grid):
        return None if self.causal else self.layout_for(grid)

    def _attend_blocked(self, q, k, v, layout: BlockLayout, *, rope_tables=None, cache=None, attn_mask=None, x=None):
        """:meth:`attend` on tokens already in ``layout``'s block-major order (prefix tokens first); the output in
        the same order."""
        if attn_mask is not None:
            raise ValueError("MultiHeadLinearAttention does not take attn_mask")
        P = self.num_prefix_tokens
        mixing = self.mixing()

        def op(q, k, v, normalize):
            og = mhla_attention(q[:, P:], k[:, P:], v[:, P:], mixing.to(q.dtype), layout.block_size,
                                normalize=normalize, eps=self.eps, backend=self.backend)
            if not P:
                return og
            op_ = linear_attention(q[:, :P], k, v, normalize=normalize is not False, eps=self.eps)
            return torch.cat([op_, og], dim=1)

        return self._kernel_op(op, q, k, v, rope_tables)

    def _causal(self, q, k, v, cache: AttentionCache | None, rope_tables):
        """Causal MHLA of ``q, k [B, T, H, D]``, ``v [B, T, H, Dv]``. Without a cache: one call on the dense
        mixing of the ``ceil(T / C)`` blocks (training). With one: the compact rows of the call's blocks
        (:meth:`mhla.mixing.MixingMatrix.causal_rows`), so the cached state keeps at most ``M - 1`` block
        summaries and one folded sum whatever the length (:class:`mhla.ops.MHLAState`)."""
        q, k, _, _ = self._features(q, k, rope_tables)
        C = self.block_size
        if cache is None:
            mixing = self.mixing(ceil_div(q.shape[1], C)).to(q.dtype)
            return mhla_attention(q, k, v, mixing, C, causal=True, normalize=self.normalize, eps=self.eps,
                                  backend=self.backend)
        state: MHLAState | None = cache.attn
        seen = state.num_tokens if state is not None else 0
        rows = self.mixing.causal_rows(seen // C, ceil_div(seen + q.shape[1], C)).to(q.dtype)
        if q.shape[1] == 1 and state is not None:
            o, cache.attn = mhla_decode_step(q, k, v, rows, state, normalize=self.normalize, eps=self.eps)
            return o
        o, cache.attn = mhla_attention(q, k, v, rows, C, causal=True, normalize=self.normalize,
                                       eps=self.eps, backend="torch", initial_state=state,
                                       output_final_state=True)
        return o

    def _attend_varlen(self, q, k, v, cache, cu_seqlens, rope_tables):
        q, k, _, _ = self._features(q, k, rope_tables)
        C = self.block_size
        states = self._varlen_states(cache, "attn", cu_seqlens)
        bounds = sequence_bounds(cu_seqlens)
        seen = [s.num_tokens if s is not None else 0 for s in states] if states else [0] * len(bounds)
        stop = max(ceil_div(p + e - b, C) for p, (b, e) in zip(seen, bounds))
        kw = dict(normalize=self.normalize, eps=self.eps)
        if cache is None:
            mixing = self.mixing(stop).to(q.dtype)
            return mhla_attention(q, k, v, mixing, C, causal=True, cu_seqlens=cu_seqlens, backend=self.backend,
                                  **kw)
        # compact rows of every sequence's blocks (sequences at different positions: the rows between them)
        rows = self.mixing.causal_rows(min(p // C for p in seen), stop).to(q.dtype)
        if states is not None and all(e - b == 1 and s is not None for (b, e), s in zip(bounds, states)):
            # decoding: one token per sequence, each with its own cached prefix
            o, cache.attn = run_varlen(lambda q, k, v, st, _: mhla_decode_step(q, k, v, rows, st, **kw),
                                       (q, k, v), cu_seqlens, initial_state=states, output_final_state=True)
            return o
        o, cache.attn = mhla_attention(q, k, v, rows, C, causal=True, cu_seqlens=cu_seqlens, backend="torch",
                                       initial_state=states, output_final_state=True, **kw)
        return o


@register_attention("linear")
class LinearAttention(KernelAttention):
    """Plain (normalized) linear attention with the shared constructor: one global summary per head."""

    supports = Supports(bidirectional=True, grid_ranks=(1, 2, 3), causal=True, prefix_tokens=True, decoding=True,
                        varlen=True, rope=True, host_projections=True)
    plot_label, plot_group, benchmark = "Linear", 1, True  # mhla.registry: plots, benchmarks

    def __init__(self, dim: int, num_heads: int = 8, **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        if self.normalize == "official":
            raise ValueError("normalize='official' is MHLA's release normaliser; linear attention takes true or false")

    def attend(self, q, k, v, *, grid, rope_tables=None, cache=None, attn_mask=None, x=None):
        if attn_mask is not None:
            raise ValueError("LinearAttention does not take attn_mask")
        if not self.causal:
            return self._kernel_op(lambda q, k, v, n: linear_attention(q, k, v, normalize=n is not False,
                                                                       eps=self.eps), q, k, v, rope_tables)
        q, k, _, _ = self._features(q, k, rope_tables)
        norm = self.normalize is not False
        if cache is None:
            return linear_attention(q, k, v, causal=True, normalize=norm, eps=self.eps)
        o, cache.attn = linear_attention(q, k, v, causal=True, normalize=norm, eps=self.eps,
                                         initial_state=cache.attn, output_final_state=True)
        return o

    def _attend_varlen(self, q, k, v, cache, cu_seqlens, rope_tables):
        q, k, _, _ = self._features(q, k, rope_tables)
        kw = dict(causal=True, normalize=self.normalize is not False, eps=self.eps, cu_seqlens=cu_seqlens)
        if cache is None:
            return linear_attention(q, k, v, **kw)
        o, cache.attn = linear_attention(q, k, v, initial_state=self._varlen_states(cache, "attn", cu_seqlens),
                                         output_final_state=True, **kw)
        return o


@register_attention("softmax")
class SoftmaxAttention(AttentionBase):
    """Softmax attention (PyTorch SDPA: FlashAttention / memory-efficient kernels on CUDA); the scale is
    ``head_dim ** -0.5``. With rotary tables, q and k are rotated (the placement is irrelevant: there is no
    feature map)."""

    supports = Supports(bidirectional=True, grid_ranks=(1, 2, 3), causal=True, prefix_tokens=True, decoding=True,
                        varlen=True, rope=True, host_projections=True)
    # mhla.registry: plots (FlashAttention and "SA" rows are softmax), benchmarks; it keeps every key
    plot_label, plot_group, plot_aliases = "Softmax", 0, ("flash", "sa", "self-attn")
    benchmark, grows_with_context = True, True

    def _rotated(self, q, k, rope_tables):
        rot = self._rotate(rope_tables)
        return (q, k) if rot is None else (rot(q), rot(k))

    def attend(self, q, k, v, *, grid, rope_tables=None, cache=None, attn_mask=None, x=None):
        q, k = self._rotated(q, k, rope_tables)
        if cache is None:
            return softmax_attention(q, k, v, causal=self.causal, attn_mask=attn_mask)
        o, cache.attn = self._attend_cached(q, k, v, cache.attn, attn_mask)
        return o

    @staticmethod
    def _attend_cached(q, k, v, past, attn_mask=None):
        """Causal attention of a chunk ``q, k, v: [B, T, H, *]`` after the cached ``past = (k, v)`` (or None)
        -> ``(o [B, T, H, Dv], (k, v) with the chunk appended)``."""
        if past is not None:
            k = torch.cat([past[0], k], dim=1)
            v = torch.cat([past[1], v], dim=1)
        Tq, Tk = q.shape[1], k.shape[1]
        if Tq == 1:
            return softmax_attention(q, k, v, attn_mask=attn_mask), (k, v)
        # Chunk after a prefix: query i sits at position Tk - Tq + i.
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
        return softmax_attention(q, k, v, attn_mask=mask), (k, v)

    def _attend_varlen(self, q, k, v, cache, cu_seqlens, rope_tables):
        q, k = self._rotated(q, k, rope_tables)
        if cache is None:
            return softmax_attention(q, k, v, causal=True, cu_seqlens=cu_seqlens)
        o, cache.attn = run_varlen(lambda q, k, v, past, _: self._attend_cached(q, k, v, past), (q, k, v),
                                   cu_seqlens, initial_state=self._varlen_states(cache, "attn", cu_seqlens),
                                   output_final_state=True, empty_state=lambda: (k[:, :0], v[:, :0]))
        return o
