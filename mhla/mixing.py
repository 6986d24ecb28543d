"""The mixing matrix ``Mc`` (``[M, M]``, row ``i`` = query block ``i``): initialisations and the learnable module.

Nonnegativity. The paper clips the coefficients to (0, 1) during training. :class:`MixingMatrix` follows it
by default (``parameterization="clamp"``): the forward returns ``raw.clamp(0, max_value)`` with a
straight-through gradient, and the training loop calls :meth:`MixingMatrix.project_` after every optimizer
step, which clamps the stored values in place, so an entry pushed below 0 is reset to 0 and can grow again
(a plain clamp in the forward would leave entries at 0 or 1 stuck: torch's clamp has zero gradient at its
bounds, and the locality init puts zeros on every row). ``parameterization="softplus"`` is the smooth alternative:
``softplus(raw)``, always positive, no projection needed.

Causal use (language models). Coefficients exist for any number of blocks: ``M`` blocks have their own
learned rows; beyond them the *relative-distance rule* applies (:meth:`MixingMatrix.forward`), so a
sequence is never capped by a parameter shape (the authors' release stops at 32 x 64 = 2048 tokens).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

INIT_KINDS = ("locality", "locality_official", "uniform", "identity", "cos", "exp", "gaussian", "local")


def distances_1d(num_blocks: int) -> torch.Tensor:
    """float64 ``[M, M]``: ``|i - j|`` between contiguous 1-D blocks."""
    i = torch.arange(num_blocks, dtype=torch.float64)
    return (i[:, None] - i[None, :]).abs()


def _normalize(w: torch.Tensor, how: str) -> torch.Tensor:
    if how == "none":
        return w
    dim = {"row": 1, "col": 0}.get(how)
    if dim is None:
        raise ValueError(f"normalize must be 'row', 'col' or 'none', got {how!r}")
    s = w.sum(dim=dim, keepdim=True)
    eye = torch.eye(w.shape[0], dtype=w.dtype)
    w = torch.where(s > 0, w, eye)  # an all-zero row (column) keeps a 1 on its diagonal
    return w / w.sum(dim=dim, keepdim=True)


def mixing_init(
    kind: str,
    distances: torch.Tensor,
    *,
    causal: bool = False,
    normalize: str = "row",
    sigma: float | None = None,
    local_threshold: float = 1.5,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Initial mixing matrix ``[M, M]`` (nonnegative) from block-centre distances ``[M, M]``.

    Kinds (SPEC.md 1.5 and the ablations):
        ``locality`` (paper default): ``1 - d(i, j) / max_k d(i, k)``, max over the row (over the visible
            blocks ``k <= i`` when causal); a row whose max is 0 gets 1 on the diagonal.
        ``locality_official``: the release: ``1 - d / d.max()`` (global max), COLUMNS normalised to 1.
        ``uniform``: ``1/M`` (causal: ``1/(i+1)`` on ``j <= i``, the release's LM init).
        ``identity``: ``eye(M)`` (block-local linear attention).
        ``cos``: ``cos(d / max d * pi/4)``; ``exp``: ``exp(-d / sigma)`` (sigma 3); ``gaussian``:
            ``exp(-d^2 / (2 sigma^2))`` (sigma ``max d / 3``); ``local``: ``d <= local_threshold``.
    ``normalize`` ("row", "col", "none") is applied last, after zeroing ``j > i`` when ``causal``.
    """
    if kind not in INIT_KINDS:
        raise ValueError(f"unknown mixing init {kind!r}; choose one of {', '.join(INIT_KINDS)}")
    d = distances.to(torch.float64)
    M = d.shape[0]
    if d.shape != (M, M):
        raise ValueError(f"distances must be square [M, M], got {tuple(d.shape)}")
    visible = torch.ones(M, M, dtype=torch.bool).tril() if causal else torch.ones(M, M, dtype=torch.bool)
    dmax = d.max() if M > 1 else torch.tensor(1.0, dtype=torch.float64)
    if kind == "locality":
        row_max = d.masked_fill(~visible, 0).amax(dim=1, keepdim=True)
        w = torch.where(row_max > 0, 1 - d / row_max.clamp_min(1e-30), torch.eye(M, dtype=torch.float64))
    elif kind == "locality_official":
        w = 1 - d / dmax if M > 1 else torch.ones(1, 1, dtype=torch.float64)
        w = w.masked_fill(~visible, 0)
        return _normalize(w, "col").to(dtype)
    elif kind == "uniform":
        w = torch.ones(M, M, dtype=torch.float64)
    elif kind == "identity":
        w = torch.eye(M, dtype=torch.float64)
    elif kind == "cos":
        w = torch.cos(d / dmax * math.pi / 4)
    elif kind == "exp":
        w = torch.exp(-d / (sigma if sigma is not None else 3.0))
    elif kind == "gaussian":
        s = sigma if sigma is not None else float(dmax) / 3
        w = torch.exp(-(d**2) / (2 * s**2))
    else:  # local
        w = (d <= local_threshold).to(torch.float64)
    w = w.clamp_min(0).masked_fill(~visible, 0)
    return _normalize(w, normalize).to(dtype)


def _inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))


class MixingMatrix(nn.Module):
    """Learnable (or frozen) nonnegative mixing matrix.

    Args:
        num_blocks: ``M``, the learned size (causal: the blocks with their own learned rows).
        distances: ``[M, M]`` block-centre distances (default: 1-D ``|i - j|``).
        init: one of :data:`INIT_KINDS` (see :func:`mixing_init`); ``init_kwargs`` go to it.
        causal: lower-triangular matrix that extends to any number of blocks.
        learnable: a parameter (else a buffer: frozen, same forward).
        num_heads: ``None`` for one shared ``[M, M]``, or ``H`` for per-head ``[H, M, M]`` (same init).
        parameterization: ``"clamp"`` (paper; with :meth:`project_`) or ``"softplus"``.
        max_value: upper clip of the clamp parameterization (the paper clips to (0, 1)).
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        distances: torch.Tensor | None = None,
        init: str = "locality",
        causal: bool = False,
        learnable: bool = True,
        num_heads: int | None = None,
        parameterization: str = "clamp",
        max_value: float = 1.0,
        init_kwargs: dict | None = None,
    ):
        super().__init__()
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if parameterization not in ("clamp", "softplus"):
            raise ValueError(f"parameterization must be 'clamp' or 'softplus', got {parameterization!r}")
        if distances is None:
            distances = distances_1d(num_blocks)
        if tuple(distances.shape) != (num_blocks, num_blocks):
            raise ValueError(f"distances {tuple(distances.shape)} do not match num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.init = init
        self.causal = causal
        self.learnable = learnable
        self.num_heads = num_heads
        self.parameterization = parameterization
        self.max_value = max_value
        w = mixing_init(init, distances, causal=causal, **(init_kwargs or {}))
        if num_heads is not None:
            w = w.unsqueeze(0).repeat(num_heads, 1, 1)
        raw = w if parameterization == "clamp" else _inverse_softplus(w.clamp_min(1e-4))
        if learnable:
            self.raw = nn.Parameter(raw)
        else:
            self.register_buffer("raw", raw)

    def learned(self) -> torch.Tensor:
        """The effective learned block ``[M, M]`` / ``[H, M, M]`` (nonnegative; lower-triangular if causal)."""
        if self.parameterization == "clamp":
            # Straight-through clamp: the value is clipped, the gradient passes as if it were not, so
            # entries sitting at 0 (the locality init's farthest blocks) still learn; project_() keeps the
            # stored values feasible. (torch's clamp has zero gradient at both bounds.)
            w = self.raw + (self.raw.clamp(0, self.max_value) - self.raw).detach()
        else:
            w = F.softplus(self.raw)
        if self.causal:
            w = w.tril()
        return w

    @torch.no_grad()
    def project_(self) -> None:
        """Clamp the stored values into ``[0, max_value]`` (clamp parameterization; no-op for softplus)."""
        if self.parameterization == "clamp":
            self.raw.clamp_(0, self.max_value)

    def forward(self, num_blocks: int | None = None) -> torch.Tensor:
        """The effective matrix for ``n = num_blocks`` blocks (default ``M``): ``[n, n]`` or ``[H, n, n]``.

        ``n <= M``: the top-left corner. ``n > M`` (causal only): the relative-distance rule,

            W[i, b] = L[i, b]                      i < M (learned rows)
            W[i, b] = L[M-1, M-1 - (i - b)]        i >= M, 0 <= i - b <= M-1
            W[i, b] = L[M-1, 0]                    i >= M, i - b > M-1 (the far past shares the farthest
                                                   learned coefficient)
            W[i, b] = 0                            b > i

        i.e. rows past the learned ones repeat the last learned row by relative distance. Differentiable
        with respect to the learned coefficients.
        """
        w = self.learned()
        M = self.num_blocks
        n = M if num_blocks is None else int(num_blocks)
        if n <= M:
            return w[..., :n, :n]
        if not self.causal:
            raise ValueError(
                f"this mixing matrix was built for M = {M} blocks, asked for {n}; non-causal MHLA needs one "
                f"row per block (rebuild the layer for the new block grid)"
            )
        i = torch.arange(n, device=w.device).unsqueeze(1)
        b = torch.arange(n, device=w.device).unsqueeze(0)
        rows = torch.where(i < M, i, torch.full_like(i, M - 1)).expand(n, n)
        cols = torch.where(i < M, b.clamp(max=M - 1), (M - 1 - (i - b)).clamp(0, M - 1))
        valid = b <= i
        return w[..., rows, cols] * valid.to(w.dtype)

    def extra_repr(self) -> str:
        head = f", per_head={self.num_heads}" if self.num_heads is not None else ""
        return (f"M={self.num_blocks}, init={self.init}, causal={self.causal}, learnable={self.learnable}, "
                f"param={self.parameterization}{head}")
