"""The mixing matrix ``Mc`` (``[M, M]``, row ``i`` = query block ``i``): initialisations, learnable module.

Initialisations (:func:`mixing_init`): the paper's locality init (docs/method.md#mixing-initialisation, row-normalised, per-row max
distance), the authors' release variant (global max distance, column-normalised) as ``locality_official``,
and the ablation inits (uniform, ones, identity, cos, exp, gaussian, local).

Nonnegativity (:class:`MixingMatrix`). The paper clips the coefficients to (0, 1) during training, so the
default ``parameterization="clamp"`` does the same: the forward returns ``raw.clamp(0, max_value)``, and
the training loop calls :meth:`MixingMatrix.project_` after every optimizer step to clamp the stored values
in place (projected gradient descent). The clamp in the forward is *straight-through* (value clipped,
gradient passed unchanged) because torch's clamp has zero gradient at its bounds, and the locality init puts
exact zeros on every row (the farthest block) and causal inits put exact ones on row 0: with a plain clamp
those entries could never move. ``parameterization="softplus"`` is the smooth alternative: ``softplus(raw)``
is always positive and needs no projection, at the cost of not matching the paper's clipping.

Causal use (language models). Coefficients exist for any number of blocks: ``M`` blocks have their own
learned rows, later blocks follow an extension rule (:func:`extend_causal_mixing`; default ``"uniform_far"``:
the last learned row by relative distance, and one shared coefficient for the blocks farther back), so a
sequence is never capped by a parameter shape (the authors' release stops at 32 x 64 = 2048 tokens).
"""

from __future__ import annotations

import copy
import functools
import math
import operator

import torch
import torch.nn as nn
import torch.nn.functional as F

from .ops import MixingRows

INIT_KINDS = ("locality", "locality_visible", "locality_official", "uniform", "ones", "identity", "cos", "exp",
              "gaussian", "local")
NORMALIZE_MODES = ("row", "col", "none")
PARAMETERIZATIONS = ("clamp", "softplus", "log")


# --------------------------------------------------------------------------------- initialisations
def distances_1d(num_blocks: int) -> torch.Tensor:
    """float64 ``[M, M]``: ``|i - j|`` between contiguous 1-D blocks."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    i = torch.arange(num_blocks, dtype=torch.float64, device="cpu")
    return (i[:, None] - i[None, :]).abs()


def _normalize(w: torch.Tensor, how: str) -> torch.Tensor:
    """Normalise ``w [M, M]`` so rows (``"row"``) or columns (``"col"``) sum to 1; ``"none"`` returns it.

    A row (column) that sums to 0 becomes a 1 on the diagonal.
    """
    if how == "none":
        return w
    dim = 1 if how == "row" else 0
    s = w.sum(dim=dim, keepdim=True)
    w = torch.where(s > 0, w, torch.eye(w.shape[0], dtype=w.dtype))
    return w / w.sum(dim=dim, keepdim=True)


def _check_distances(distances: torch.Tensor) -> torch.Tensor:
    if not torch.is_tensor(distances) or distances.dim() != 2 or distances.shape[0] != distances.shape[1]:
        shape = tuple(distances.shape) if torch.is_tensor(distances) else type(distances).__name__
        raise ValueError(
            f"distances must be a square [M, M] tensor (BlockLayout.block_distances() or distances_1d(M)), "
            f"got {shape}"
        )
    d = distances.detach().to("cpu", torch.float64)
    if d.shape[0] == 0 or not torch.isfinite(d).all() or (d < 0).any():
        raise ValueError("distances must be non-empty, finite and nonnegative")
    return d


def _locality(d: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """``1 - d(i, j) / max_{k visible} d(i, k)``; a row whose max is 0 gets a 1 on its diagonal."""
    row_max = d.masked_fill(~visible, 0).amax(dim=1, keepdim=True)
    eye = torch.eye(d.shape[0], dtype=d.dtype)
    return torch.where(row_max > 0, 1 - d / row_max.clamp_min(1e-300), eye)


def _uniform(M: int, causal: bool) -> torch.Tensor:
    """``1/M`` everywhere, or ``1/(i+1)`` on ``j <= i`` when causal (the release's LM init)."""
    if not causal:
        return torch.full((M, M), 1.0 / M, dtype=torch.float64)
    counts = torch.arange(1, M + 1, dtype=torch.float64).unsqueeze(1)
    return torch.ones(M, M, dtype=torch.float64).tril() / counts


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
    """Initial mixing matrix ``[M, M]`` (nonnegative) from block-centre distances ``d [M, M]``.

    Kinds (docs/method.md#mixing-initialisation and the ablations):
        ``locality`` (paper default): ``1 - d(i, j) / max_k d(i, k)``, max over the WHOLE row (paper section
            4.2), then, when causal, the upper triangle masked (Appendix C), then normalised. Causal row ``i``
            thus keeps a nonzero weight on block 0 while ``i < (M - 1) / 2``. A row whose max is 0
            (``M = 1``) gets 1 on the diagonal.
        ``locality_visible``: as ``locality`` but, when causal, the max is over the VISIBLE blocks ``k <= i``
            only, so every causal row ``i >= 1`` starts with ``w[i, 0] = 0`` (identical to ``locality`` when
            not causal).
        ``locality_official``: the authors' release: ``1 - d / d.max()`` with the GLOBAL max, then each
            COLUMN normalised to sum 1 (``normalize`` is ignored).
        ``uniform``: ``1/M`` (causal: ``1/(i+1)`` on ``j <= i``, the release's LM init).
        ``ones``: 1 on every visible entry, NOT normalised (``normalize`` is ignored): without a normaliser
            (``normalize=False``, the LMs) the layer starts as plain linear attention, every block reading the
            sum of all earlier blocks' states at linear attention's scale, where causal ``uniform`` leaves
            block ``i`` at ``1/(i+1)`` of it. With a normaliser all inits with equal rows are the same.
        ``identity``: ``eye(M)`` (block-local linear attention).
        ``cos``: ``cos(d / max d * pi/4)``; ``exp``: ``exp(-d / sigma)`` (sigma default 3);
        ``gaussian``: ``exp(-d^2 / (2 sigma^2))`` (sigma default ``max d / 3``);
        ``local``: ``1`` where ``d <= local_threshold``, else 0.

    Args:
        kind: one of :data:`INIT_KINDS`.
        distances: ``[M, M]`` from ``BlockLayout.block_distances()`` or ``distances_1d(M)``.
        causal: zero the entries ``j > i`` BEFORE normalising (1-D language models).
        normalize: ``"row"``, ``"col"`` or ``"none"``, applied after the kind's formula. A row (column)
            summing to 0 keeps a 1 on its diagonal.
        sigma: width for ``exp`` / ``gaussian``.
        local_threshold: distance cut-off for ``local``.
        dtype: dtype of the result (computed in float64).

    Returns:
        ``[M, M]`` nonnegative tensor of ``dtype``.
    """
    if kind not in INIT_KINDS:
        raise ValueError(f"unknown mixing init {kind!r}; choose one of {', '.join(INIT_KINDS)}")
    if normalize not in NORMALIZE_MODES:
        raise ValueError(f"normalize must be one of {', '.join(NORMALIZE_MODES)}, got {normalize!r}")
    if sigma is not None and not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    d = _check_distances(distances)
    M = d.shape[0]
    visible = torch.ones(M, M, dtype=torch.bool)
    if causal:
        visible = visible.tril()
    dmax = float(d.max())
    dmax_safe = dmax if dmax > 0 else 1.0  # all blocks at distance 0 (M = 1): avoid 0 / 0

    if kind == "locality_official":
        w = (1 - d / dmax_safe).masked_fill(~visible, 0)
        return _normalize(w, "col").to(dtype)
    if kind == "ones":
        return visible.to(dtype)
    if kind == "locality":
        w = _locality(d, torch.ones_like(visible))
    elif kind == "locality_visible":
        w = _locality(d, visible)
    elif kind == "uniform":
        w = _uniform(M, causal)
    elif kind == "identity":
        w = torch.eye(M, dtype=torch.float64)
    elif kind == "cos":
        w = torch.cos(d / dmax_safe * math.pi / 4)
    elif kind == "exp":
        w = torch.exp(-d / (3.0 if sigma is None else sigma))
    elif kind == "gaussian":
        s = dmax_safe / 3 if sigma is None else sigma
        w = torch.exp(-(d**2) / (2 * s**2))
    else:  # local
        w = (d <= local_threshold).to(torch.float64)
    w = w.clamp_min(0).masked_fill(~visible, 0)
    return _normalize(w, normalize).to(dtype)


# -------------------------------------------------------------------------------------- the module
def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """``x`` with ``softplus(x) = y`` for ``y > 0`` (stable form of ``log(exp(y) - 1)``)."""
    return y + torch.log(-torch.expm1(-y))


def _straight_through_clamp(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """``x.clamp(low, high)`` in value; gradient of the identity."""
    return x + (x.clamp(low, high) - x).detach()


class MixingMatrix(nn.Module):
    """Learnable (or frozen) nonnegative mixing matrix.

    Args:
        num_blocks: ``M``, the learned size. Causal: the number of blocks with their own learned rows
            (``max_learned_blocks``); longer sequences use the relative-distance rule of :meth:`forward`.
        distances: ``[M, M]`` block-centre distances (default: 1-D ``distances_1d(M)``).
        init: one of :data:`INIT_KINDS` (see :func:`mixing_init`); ``init_kwargs`` (``normalize``,
            ``sigma``, ``local_threshold``) are passed to it.
        causal: lower-triangular matrix that extends to any number of blocks.
        learnable: a parameter; ``False`` stores a buffer (frozen, kept in the state dict, same forward).
        num_heads: ``None`` for one shared ``[M, M]``; ``H`` for per-head ``[H, M, M]`` (all heads start
            from the same init).
        parameterization: how nonnegativity is kept.
            ``"clamp"`` (default, the paper's clipping): ``raw`` holds the init values; the forward returns
            ``raw.clamp(0, max_value)`` with a straight-through gradient, and :meth:`project_` (called by
            the training loop after each optimizer step) clamps ``raw`` in place, so an entry pushed below 0
            is reset to 0 and can grow again.
            ``"softplus"``: ``raw = softplus^-1(max(init, 1e-4))``; the forward returns ``softplus(raw)``
            (always positive; reproduces the init up to the 1e-4 floor; ``max_value`` is not used).
            ``"log"``: ``raw = log(max(init, 1e-4))``; the forward returns ``exp(raw)``. Adam's steps of about
            ``lr`` on ``raw`` then change every coefficient by a RELATIVE amount of about ``lr``, whatever its
            size (with ``clamp`` an entry of ``1/(i+1)`` moves by about ``lr`` in absolute terms, so small
            entries random-walk to the 0 bound; see ``results/mqar/``).
        max_value: upper clip of the clamp parameterization (the paper clips to (0, 1)).
        extension: causal only: how rows past the learned ``M`` are built, one of :data:`EXTENSION_RULES` or
            ``"uniform_far:C"`` (:func:`extend_causal_mixing`, :func:`check_extension`; default ``"uniform_far"``,
            chosen on measurements). A plain attribute:
            it can be changed on a trained model (``scripts/length_extrapolation.py`` compares the rules on one
            checkpoint).
        tie: causal only, one of :data:`TIE_MODES`. ``None`` (default): every entry of the ``[M, M]`` matrix is
            its own parameter. ``"distance"``: the rows are one learned function of the block distance,
            ``W[i, b] = c[i - b]`` (a lower-triangular Toeplitz matrix of ``M`` stored values ``c[0 .. M-1]``, per
            head with ``num_heads``), initialised from the init's last row (``c[d] = init[M-1, M-1-d]``), so a row
            means the same at any position and the ``relative`` / ``uniform_far`` extensions continue what was
            trained (issue 50). ``"log_distance"``: the same Toeplitz rows, with ``c`` a smooth function of the
            distance: stored values at the knots :func:`log_distance_knots` (every distance up to 4, then two
            per doubling: 15 knots for ``M = 128``), ``c[d]`` interpolated linearly in ``log(1 + d)`` between
            them, so a far coefficient is trained by every document whose fact lies near its distance, not only
            by those at exactly that distance. :meth:`tie_by_distance_` converts a built module in place.
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
        extension: str = "uniform_far",
        tie: str | None = None,
    ):
        super().__init__()
        if tie not in TIE_MODES:
            raise ValueError(f"tie must be one of {TIE_MODES}, got {tie!r}")
        if tie is not None and not causal:
            raise ValueError(f"tie={tie!r} is for causal mixing (a row per block distance)")
        self.tied = tie
        self.extension = check_extension(extension)
        self._check_args(num_blocks, num_heads, parameterization, max_value, init_kwargs)
        num_blocks = operator.index(num_blocks)
        num_heads = None if num_heads is None else operator.index(num_heads)
        if distances is None:
            distances = distances_1d(num_blocks)
        if tuple(distances.shape) != (num_blocks, num_blocks):
            raise ValueError(
                f"distances have shape {tuple(distances.shape)} but num_blocks={num_blocks}; pass the "
                f"[M, M] distances of the same layout (BlockLayout.block_distances())"
            )
        self.num_blocks = num_blocks
        self.init = init
        self.causal = causal
        self.learnable = learnable
        self.num_heads = num_heads
        self.parameterization = parameterization
        self.max_value = max_value
        self._init_kwargs = dict(init_kwargs or {})
        self._distances = distances.detach().to("cpu", torch.float64)
        # The init is computed on the CPU, then moved to the default device: under a `torch.device("meta")`
        # context (transformers' from_pretrained) or a CUDA one, mixing_init's tensors would land there.
        self._store_raw(self.initial_raw(), learnable)

    def _store_raw(self, raw: torch.Tensor, learnable: bool) -> None:
        """``raw`` (the init's stored values) on the default device, as a parameter or, frozen, a buffer."""
        raw = raw.to(torch.get_default_device())
        if learnable:
            self.raw = nn.Parameter(raw)
        else:
            self.register_buffer("raw", raw)

    def initial_raw(self) -> torch.Tensor:
        """The stored values of the initialisation (float32 on the CPU): ``[M, M]`` or ``[H, M, M]``.

        ``clamp``: the init itself; ``softplus``: ``softplus^-1(max(init, 1e-4))``; ``log``:
        ``log(max(init, 1e-4))`` (zeros of the init start at ``1e-4``, which Adam grows multiplicatively).
        """
        with torch.device("cpu"):
            w = mixing_init(self.init, self._distances, causal=self.causal, **self._init_kwargs)
            if getattr(self, "tied", None):  # c[d] = init[M-1, M-1-d], at the knots when smooth
                w = self._stored_distances(w[-1].flip(-1))
            return self._raw_from_init(w)

    def _stored_distances(self, c: torch.Tensor) -> torch.Tensor:
        """The values kept of a per-distance ``c [..., M]`` under :attr:`tied`: all of them (``"distance"``),
        or those at :func:`log_distance_knots` (``"log_distance"``)."""
        if self.tied == "log_distance":
            return c[..., log_distance_knots(self.num_blocks)]
        return c

    def _raw_from_init(self, w: torch.Tensor) -> torch.Tensor:
        """The stored values of an init matrix ``w`` (``[M, M]`` / ``[Mq, Mk]``): repeated per head when the
        matrix is per-head, then mapped through the inverse of :attr:`parameterization`."""
        if self.num_heads is not None:
            w = w.unsqueeze(0).repeat(self.num_heads, *([1] * w.dim()))
        if self.parameterization == "softplus":
            return _inverse_softplus(w.clamp_min(1e-4))
        if self.parameterization == "log":
            return w.clamp_min(1e-4).log()
        return w

    @staticmethod
    def _check_args(num_blocks, num_heads, parameterization, max_value, init_kwargs) -> None:
        if not _is_int(num_blocks) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if num_heads is not None and (not _is_int(num_heads) or num_heads < 1):
            raise ValueError(f"num_heads must be None (shared matrix) or a positive int, got {num_heads!r}")
        if parameterization not in PARAMETERIZATIONS:
            raise ValueError(
                f"parameterization must be one of {', '.join(PARAMETERIZATIONS)}, got {parameterization!r}"
            )
        if not max_value > 0:
            raise ValueError(f"max_value must be > 0, got {max_value}")
        bad = set(init_kwargs or {}) - {"normalize", "sigma", "local_threshold"}
        if bad:
            raise ValueError(
                f"init_kwargs {sorted(bad)} are not options of mixing_init; use normalize, sigma, "
                f"local_threshold (causal and distances are arguments of MixingMatrix itself)"
            )

    def learned(self) -> torch.Tensor:
        """Effective learned block ``[M, M]`` / ``[H, M, M]`` (nonnegative; lower-triangular if causal)."""
        return self._effective(self.raw)

    @torch.no_grad()
    def initial(self) -> torch.Tensor:
        """What :meth:`learned` returned before training: the init through the parameterization (``[M, M]`` /
        ``[H, M, M]``, float32 on the CPU)."""
        return self._effective(self.initial_raw())

    def _effective(self, raw: torch.Tensor) -> torch.Tensor:
        """Stored values -> the effective matrix (the parameterization; lower triangle if causal)."""
        if self.parameterization == "clamp":
            w = _straight_through_clamp(raw, 0.0, self.max_value)
        elif self.parameterization == "softplus":
            w = F.softplus(raw)
        else:
            w = raw.exp()
        tied = getattr(self, "tied", None)
        if tied == "log_distance":
            w = w @ _cached_interpolation(self.num_blocks, w.device, w.dtype)
        if tied:
            return _toeplitz_lower(w)
        return w.tril() if self.causal else w

    @torch.no_grad()
    def tie_by_distance_(self, mode: str = "distance") -> "MixingMatrix":
        """Make this causal, untied matrix a learned function of the block distance in place (``tie=mode``,
        ``"distance"`` or ``"log_distance"``): the stored values become ``c[d]`` (at the knots when smooth), taken
        from the current last row (``c[d] = W[M-1, M-1-d]``, through the parameterization's stored form). Call
        before the optimizer is built. Returns ``self``."""
        if mode not in TIE_MODES[1:]:
            raise ValueError(f"mode must be one of {TIE_MODES[1:]}, got {mode!r}")
        if not self.causal:
            raise ValueError(f"tie={mode!r} is for causal mixing (a row per block distance)")
        if self.tied == mode:
            return self
        if self.tied:
            raise ValueError(f"this matrix is already tied ({self.tied!r}); build it with tie={mode!r} instead")
        self.tied = mode
        raw = self._stored_distances(self.raw.detach()[..., -1, :].flip(-1)).clone()
        if self.learnable:
            self.raw = nn.Parameter(raw)
        else:
            del self.raw
            self.register_buffer("raw", raw)
        return self

    @torch.no_grad()
    def project_(self) -> None:
        """Clamp the stored values into ``[0, max_value]`` in place (clamp parameterization; else a no-op).

        Call after every optimizer step.
        """
        if self.parameterization == "clamp":
            self.raw.clamp_(0, self.max_value)

    @torch.no_grad()
    def equalize_(self, keep_near: int = 0) -> "MixingMatrix":
        """An analysis edit, in place: the coefficients at block distance ``>= keep_near`` all take one value per
        head, the mean of the last learned row's at those distances (the row that every extended row repeats);
        nearer ones are kept. ``keep_near=0`` turns causal MHLA into linear attention with a constant weight on
        MHLA's trained features. Tied rows (``tie="distance"``): ``c[keep_near:]`` becomes its mean. The ``clamp``
        parameterisation only (its stored values are the coefficients, after clamping); causal only. Returns
        ``self``."""
        if not self.causal or self.parameterization != "clamp" or self.tied == "log_distance":
            raise ValueError(f"equal weights need a causal matrix with the clamp parameterisation, untied or tied "
                             f"by distance, got causal={self.causal}, param={self.parameterization!r}, "
                             f"tie={self.tied!r}")
        self.project_()  # the stored values into [0, max_value]: the coefficients the forward uses
        if self.tied:
            self.raw[..., keep_near:] = self.raw[..., keep_near:].mean(-1, keepdim=True)
            return self
        M = self.num_blocks
        if keep_near >= M:
            return self
        i = torch.arange(M, device=self.raw.device)
        far = (i[:, None] - i[None, :]) >= keep_near  # [M, M]: distance >= keep_near (and b <= i)
        mean = self.raw[..., M - 1, : M - keep_near].mean(-1)  # [] or [H]
        self.raw.copy_(torch.where(far, mean[..., None, None], self.raw))
        return self

    # ------------------------------------------------------------------------- training hooks
    # The training loop (tasks/common/trainer.py) knows no MHLA: it calls these on any module that has them.
    #: the optimizer group of this module's own parameters (the trainer reads optim.mixing_lr_scale,
    #: optim.mixing_weight_decay and optim.mixing_freeze_steps for it)
    optim_group = "mixing"

    def after_optimizer_step(self) -> None:
        """Training hook: keep the matrix in its feasible set (:meth:`project_`)."""
        self.project_()

    @torch.no_grad()
    def logged_matrices(self) -> dict[str, torch.Tensor]:
        """Training hook: ``{"mixing": the effective learned matrix [M, M] / [H, M, M], float32 on the CPU}`` for
        the heatmaps logged at each evaluation; empty when frozen, or when the matrix is not whole here (sharded)."""
        tied = getattr(self, "tied", None)
        stored = len(log_distance_knots(self.num_blocks)) if tied == "log_distance" else self.num_blocks
        whole = (self.raw.shape[-1] == stored if tied else
                 self.raw.dim() in (2, 3) and tuple(self.raw.shape[-2:]) == (self.num_blocks,) * 2)
        if not self.learnable or not whole:
            return {}
        return {"mixing": self().detach().float().cpu()}

    def forward(self, num_blocks: int | None = None) -> torch.Tensor:
        """The effective nonnegative matrix for ``n = num_blocks`` blocks (default ``M``).

        Returns ``[n, n]`` (shared) or ``[H, n, n]`` (per head); lower-triangular when causal.

        ``n <= M``: the top-left ``n x n`` corner of the learned matrix ``L``. ``n > M`` (causal only;
        non-causal layers have exactly one row per block) extends by ``self.extension``
        (:func:`extend_causal_mixing`); the default ``"uniform_far"`` repeats the last learned row by relative
        distance inside the learned window and lets the blocks farther back share ONE coefficient,

            W[i, b] = L[i, b]                        i < M (learned rows)
            W[i, b] = L[M-1, M-1 - (i - b)]          i >= M, 0 <= i - b <= M-1
            W[i, b] = L[M-1, 0] / (i - M + 1)        i >= M, i - b > M-1 (the i - M + 1 blocks farther back
                                                     than the learned window split the farthest coefficient)
            W[i, b] = 0                              b > i

        so each extended row carries a bounded mass (the last learned row's plus ``L[M-1, 0]``) whatever the
        length, the far past stays readable, and sequences are never capped by the parameter shape. Built with
        index gathers, differentiable with respect to the learned coefficients.
        """
        w = self.learned()
        M = self.num_blocks
        n = M if num_blocks is None else int(num_blocks)
        if n < 1:
            raise ValueError(f"num_blocks must be >= 1, got {n}")
        if n <= M:
            return w[..., :n, :n]
        if not self.causal:
            raise ValueError(
                f"this layer was built for M = {M} blocks, asked for {n}; non-causal MHLA needs one learned "
                f"row per block (rebuild the layer for the new block grid)"
            )
        return extend_causal_mixing(w, n, self.extension)

    def causal_rows(self, start: int, stop: int) -> MixingRows:
        """Rows ``start .. stop - 1`` of the causal matrix :meth:`forward` builds, in the compact form that a
        bounded decode state reads (:class:`mhla.ops.MixingRows`, :func:`causal_mixing_rows`): O((stop -
        start) * M) numbers whatever ``stop``, where :meth:`forward` builds ``stop x stop``. Causal only."""
        if not self.causal:
            raise ValueError("causal_rows is for causal mixing matrices (a non-causal layer has one row per "
                             "block)")
        return causal_mixing_rows(self.learned(), start, stop, self.extension)

    def extra_repr(self) -> str:
        heads = "shared" if self.num_heads is None else f"per_head={self.num_heads}"
        return (f"M={self.num_blocks}, init={self.init}, causal={self.causal}, learnable={self.learnable}, "
                f"{heads}, param={self.parameterization}" + (f", tie={self.tied}" if getattr(self, "tied", None) else ""))


TIE_MODES = (None, "distance", "log_distance")


def log_distance_knots(num_blocks: int) -> torch.Tensor:
    """The block distances whose coefficients ``tie="log_distance"`` stores: ``0 .. 4``, then ``round(2^(j/2))``
    (two per doubling) up to ``num_blocks - 1``, which is always a knot. ``[K]`` int64, increasing; for
    ``M = 128``: 0 1 2 3 4 6 8 11 16 23 32 45 64 91 127."""
    knots, j = set(range(min(num_blocks, 5))), 5
    while round(2 ** (j / 2)) < num_blocks - 1:
        knots.add(round(2 ** (j / 2)))
        j += 1
    knots.add(num_blocks - 1)
    return torch.tensor(sorted(knots), dtype=torch.long)


def log_distance_interpolation(num_blocks: int, *, device=None, dtype=torch.float32) -> torch.Tensor:
    """``P [K, M]`` with ``c = c_knots @ P``: each distance ``d`` interpolated linearly in ``log(1 + d)`` between the
    two knots around it (:func:`log_distance_knots`; a knot reads its own value). Columns sum to 1 and entries are
    nonnegative, so nonnegative knot values give nonnegative coefficients."""
    if num_blocks == 1:
        return torch.ones(1, 1, device=device, dtype=dtype)
    knots = log_distance_knots(num_blocks).double()
    u, uk = torch.arange(num_blocks, dtype=torch.float64).log1p(), knots.log1p()
    hi = torch.searchsorted(uk, u).clamp(1, len(uk) - 1)  # the knot at or after d (knot 0 is d = 0)
    t = ((u - uk[hi - 1]) / (uk[hi] - uk[hi - 1])).clamp(0, 1)
    P = torch.zeros(len(uk), num_blocks, dtype=torch.float64)
    cols = torch.arange(num_blocks)
    P[hi - 1, cols] = 1 - t
    P[hi, cols] += t
    return P.to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=32)
def _cached_interpolation(num_blocks: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """:func:`log_distance_interpolation` built once per ``(M, device, dtype)``: the forward of a ``log_distance``
    matrix reads it every call (a constant; never written to), so it is not rebuilt on the CPU and copied to the
    device each time."""
    return log_distance_interpolation(num_blocks, device=device, dtype=dtype)


def _toeplitz_lower(c: torch.Tensor) -> torch.Tensor:
    """``[..., M]`` values per block distance -> ``[..., M, M]`` with ``W[i, b] = c[i - b]`` for ``b <= i``, else 0
    (differentiable; an index gather)."""
    M = c.shape[-1]
    i = torch.arange(M, device=c.device)
    d = i[:, None] - i[None, :]
    return c[..., d.clamp_min(0)] * (d >= 0).to(c.dtype)


def _is_int(x) -> bool:
    """True for python / numpy / 0-d torch integers (not bools or floats)."""
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


EXTENSION_RULES = ("relative", "last_row", "window", "uniform_far", "sqrt_far", "mass_matched")
CAPPED_RULES = ("uniform_far",)  # the rules that take a cap, written "uniform_far:C" (:func:`parse_extension`)
AUTO_CAP = "uniform_far:auto"  # the cap read from training: resolved by the LM (:func:`resolve_far_cap`)
#: the rules as a user writes them (error messages, the scripts' ``--rules`` help)
EXTENSION_RULES_TEXT = f"{', '.join(EXTENSION_RULES)}, or {' / '.join(f'{r}:C' for r in CAPPED_RULES)}"


def parse_extension(rule: str) -> tuple[str, int | None]:
    """``(name, cap)`` of an extension rule: a name of :data:`EXTENSION_RULES` (cap ``None``), or
    ``"uniform_far:C"`` with ``C`` a positive number of blocks (``uniform_far`` whose far coefficient stops falling
    at ``C`` far blocks: :func:`extend_causal_mixing`). Raises ``ValueError`` on anything else."""
    if str(rule) == AUTO_CAP:
        raise ValueError(f"{AUTO_CAP} is resolved when a language model is built, from the longest context it trained "
                         "on (mhla.lm_attention.complete_lm_attention's trained_context); a layer takes the resolved "
                         "rule uniform_far:C or uniform_far")
    name, sep, cap = str(rule).partition(":")
    if name not in EXTENSION_RULES or (sep and (name not in CAPPED_RULES or not cap.isdigit() or int(cap) < 1)):
        raise ValueError(f"unknown extension rule {rule!r}; choose one of {EXTENSION_RULES_TEXT} with C a positive "
                         "number of blocks")
    return name, (int(cap) if sep else None)


def resolve_far_cap(rule: str, far_blocks: int) -> str:
    """``rule`` with :data:`AUTO_CAP` resolved: ``"uniform_far:C"`` with ``C = far_blocks`` (the far blocks of the
    longest row the model trained on) when that is at least one, else ``"uniform_far"`` (a model trained within its
    learned rows: its far coefficient never met a count to keep). Any other rule is returned as it is."""
    if str(rule) != AUTO_CAP:
        return rule
    return f"uniform_far:{int(far_blocks)}" if int(far_blocks) >= 1 else "uniform_far"


def check_extension(rule: str) -> str:
    """``rule`` itself when :func:`parse_extension` accepts it (for argparse ``type=`` and attribute checks)."""
    parse_extension(rule)
    return rule


def extend_causal_mixing(w: torch.Tensor, n: int, rule: str = "relative") -> torch.Tensor:
    """``[..., n, n]`` causal mixing for ``n > M`` blocks from the learned lower-triangular ``w [..., M, M]``.

    Rows ``i < M`` are the learned rows. Rows ``i >= M`` by ``rule`` (``d = i - b``, the distance in blocks):

        relative      W[i, b] = L[M-1, M-1-d] for d <= M-1, and L[M-1, 0] for every farther block
        last_row      W[i, b] = L[M-1, min(b, M-1)] (absolute columns of the last learned row)
        window        as relative for d <= M-1, 0 farther back (a sliding window of M blocks)
        uniform_far   as relative for d <= M-1; the farther blocks SHARE one L[M-1, 0] (each gets 1/count)
                      (the default of :class:`MixingMatrix`)
        uniform_far:C as uniform_far while count <= C; past it each farther block keeps L[M-1, 0] / C (the far
                      coefficient never falls below what rows with C far blocks read, e.g. the longest trained
                      context's: the far part's mass then grows with count, as under relative; uniform_far:1 is
                      relative). ``uniform_far:auto`` (:data:`AUTO_CAP`) is resolved to a C by the LM that
                      trained (:func:`resolve_far_cap`), never passed here
        sqrt_far      as relative for d <= M-1; each farther block gets L[M-1, 0] / sqrt(count): their share
                      grows as sqrt(count), between relative (count) and uniform_far (1)
        mass_matched  relative, each row rescaled to the last learned row's total

    Measured on lm_mini-sized models trained at 256 tokens, five checkpoints (three seeds with the mixing at
    lr x 0.01, two at lr x 1; ``results/language/length_extrapolation*.md``): with ``relative`` the far past's
    share grows with position and perplexity rises past the training length on all five (+5% to +57% at 4k tokens, 1.9x by 8k);
    ``window`` and ``uniform_far`` stay flat (within 0.1% of each other). ``uniform_far`` is the default
    because it bounds the row mass like ``window`` without dropping the far past, though it reads the far past
    only faintly: recalling the start of a long single document (MQAR past its training length,
    ``results/mqar/extrapolation_n256.md``) works best with ``last_row``, the rule that drifts up on joined text.
    """
    name = parse_extension(rule)[0]
    M = w.shape[-1]
    i = torch.arange(n, device=w.device).unsqueeze(1)
    b = torch.arange(n, device=w.device).unsqueeze(0)
    rows, cols, visible = _extension_indices(n, M, w.device)
    if name == "last_row":
        cols = b.clamp(max=M - 1).expand(n, n)
    W = w[..., rows, cols] * visible.to(w.dtype)
    learned = i < M
    if name != "last_row":  # every block farther back than the window: its row's one far coefficient
        far = (~learned) & ((i - b) > M - 1)
        count = (i[:, 0] - M + 1).clamp(min=1).to(w.dtype)  # [n] (as the compact rows count them)
        W = torch.where(far, _far_coefficients(w[..., M - 1, :1], count, rule).unsqueeze(-1), W)
    if name == "mass_matched":
        target = w[..., M - 1, :].sum(-1)[..., None, None]
        W = torch.where(learned, W, W * target / W.sum(-1, keepdim=True).clamp_min(1e-12))
    return W


def extension_window(M: int, rule: str) -> tuple[int, int]:
    """The blocks a decode state keeps apart under ``rule`` for ``M`` learned rows, ``(head, recent)``
    (:class:`mhla.ops.MHLAState`): every other finished block has one shared coefficient in every row.

    ``last_row``: the first ``M - 1`` blocks (their own columns; every later block reads ``L[M-1, M-1]``);
    every other rule: the ``M - 1`` latest finished blocks (farther ones read one coefficient per row).
    The learned rows ``i < M`` read at most ``M - 1`` earlier blocks, all kept under either window."""
    return (M - 1, 0) if parse_extension(rule)[0] == "last_row" else (0, M - 1)


def causal_mixing_rows(w: torch.Tensor, start: int, stop: int, rule: str = "relative") -> MixingRows:
    """Rows ``start .. stop - 1`` of ``extend_causal_mixing(w, n, rule)`` (any ``n >= stop``) in the compact
    form of :class:`mhla.ops.MixingRows` with window :func:`extension_window`.

    With ``L = w`` (``[..., M, M]``, lower-triangular), row ``i`` and ``d = i - b``:

        i < M      diag L[i, i]; the earlier blocks by their learned coefficients (all within the window)
        i >= M     diag L[M-1, M-1], and by rule
                   relative / window / uniform_far / sqrt_far: recent d = 1 .. M-1 -> L[M-1, M-1-d]; far
                       (d >= M): L[M-1, 0], 0, L[M-1, 0] / (i - M + 1), L[M-1, 0] / sqrt(i - M + 1)
                       (uniform_far:C: L[M-1, 0] / min(i - M + 1, C))
                   mass_matched: relative, every coefficient times L[M-1, :].sum() / (the relative row's sum,
                       L[M-1, :].sum() + (i - M + 1) L[M-1, 0])
                   last_row: head b = 0 .. M-2 -> L[M-1, b]; far (b >= M-1) -> L[M-1, M-1]

    Differentiable with respect to ``w`` (index gathers); O((stop - start) * M) whatever ``stop``.
    """
    name = parse_extension(rule)[0]
    if not 0 <= start < stop:
        raise ValueError(f"need 0 <= start < stop, got {start}, {stop}")
    M = w.shape[-1]
    kh, kr = extension_window(M, rule)
    if start >= M:  # every row extended (decoding past the learned rows): slices of the last learned row
        return _extended_rows(w, start, stop, rule)
    dev = w.device
    i = torch.arange(start, stop, device=dev)  # [n]
    learned = i < M
    last = w[..., M - 1, :]  # [..., M]
    ri = i.clamp(max=M - 1)  # the learned row each row reads
    diag = torch.where(learned, w[..., ri, ri], last[..., M - 1:])
    if name == "last_row":  # the first M - 1 blocks by their column
        b = torch.arange(kh, device=dev)
        head = torch.where(b < i.unsqueeze(1), w[..., ri, :kh], 0.0)  # learned rows: row i; later: row M-1
        recent = w.new_zeros(*w.shape[:-2], stop - start, 0)
        far = torch.where(learned, 0.0, last[..., M - 1:])
    else:  # by distance: recent[d - 1] is block i - d
        d = torch.arange(1, kr + 1, device=dev)
        b = i.unsqueeze(1) - d  # [n, kr]
        learned_coeff = w[..., ri.unsqueeze(1), b.clamp(0, M - 1)]  # row i, block i - d (learned rows)
        extended_coeff = last[..., (M - 1 - d)].unsqueeze(-2)  # L[M-1, M-1-d]
        recent = torch.where(learned.unsqueeze(1), torch.where(b >= 0, learned_coeff, 0.0), extended_coeff)
        head = w.new_zeros(*w.shape[:-2], stop - start, 0)
        count = (i - M + 1).clamp(min=1).to(w.dtype)  # blocks farther back than the window, in row i >= M
        far0 = last[..., :1]
        far = torch.where(learned, 0.0, _far_coefficients(far0, count, rule))
        if name == "mass_matched":
            target = last.sum(-1, keepdim=True)  # [..., 1]
            scale = target / (target + (i - M + 1).clamp(min=0).to(w.dtype) * far0).clamp_min(1e-12)
            scale = torch.where(learned, 1.0, scale)  # [..., n]
            diag, far, recent = diag * scale, far * scale, recent * scale.unsqueeze(-1)
    return MixingRows(start, diag, head, recent, far)


def _extended_rows(w: torch.Tensor, start: int, stop: int, rule: str) -> MixingRows:
    """:func:`causal_mixing_rows` for rows ``start .. stop - 1`` all at or past ``M`` (the same values)."""
    M, n, name = w.shape[-1], stop - start, parse_extension(rule)[0]
    last = w[..., M - 1, :]  # [..., M]
    lead = last.shape[:-1]
    diag = last[..., M - 1:].expand(*lead, n)
    empty = w.new_zeros(*lead, n, 0)
    if name == "last_row":
        return MixingRows(start, diag, last[..., None, :M - 1].expand(*lead, n, M - 1), empty,
                          last[..., M - 1:].expand(*lead, n))
    recent = last[..., :M - 1].flip(-1).unsqueeze(-2).expand(*lead, n, M - 1)  # L[M-1, M-1-d], d = 1 .. M-1
    far0 = last[..., :1]
    count = torch.arange(start - M + 1, stop - M + 1, device=w.device).to(w.dtype)  # blocks farther back
    far = _far_coefficients(far0, count, rule)
    if name == "mass_matched":
        target = last.sum(-1, keepdim=True)
        scale = target / (target + count * far0).clamp_min(1e-12)  # [..., n]
        diag, far, recent = diag * scale, far * scale, recent * scale.unsqueeze(-1)
    return MixingRows(start, diag, empty, recent, far)


def _far_coefficients(far0: torch.Tensor, count: torch.Tensor, rule: str) -> torch.Tensor:
    """The coefficient of the folded far sum in extended rows (every rule but ``last_row``): ``far0 [..., 1]``
    is ``L[M-1, 0]``, ``count [n]`` each row's number of blocks farther back than the window (at least 1);
    returns ``[..., n]``. ``mass_matched`` gives the relative value (its caller rescales the whole row)."""
    name, cap = parse_extension(rule)
    if name in ("relative", "mass_matched"):
        return far0.expand(*far0.shape[:-1], count.shape[-1])
    if name == "window":
        return torch.zeros_like(far0).expand(*far0.shape[:-1], count.shape[-1])
    if name == "sqrt_far":
        return far0 / count.sqrt()
    return far0 / (count if cap is None else count.clamp(max=cap))  # uniform_far (uniform_far:C)


def _extension_indices(n: int, M: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index maps of the relative-distance rule: ``W = L[rows, cols] * visible``, each ``[n, n]``."""
    i = torch.arange(n, device=device).unsqueeze(1)
    b = torch.arange(n, device=device).unsqueeze(0)
    learned_row = i < M
    rows = torch.where(learned_row, i, M - 1).expand(n, n)
    cols = torch.where(learned_row, b.clamp(max=M - 1), (M - 1 - (i - b)).clamp(0, M - 1))
    return rows, cols, b <= i


def normalized_rows(w: torch.Tensor) -> torch.Tensor:
    """``w [..., M, M]`` with every row scaled to sum 1, float64 on the CPU: the mixing MHLA's normaliser
    computes with (a row's scale cancels there). An all-zero row stays zero."""
    w = w.detach().double().cpu()
    return w / w.sum(-1, keepdim=True).clamp_min(1e-300)


@torch.no_grad()
def mixing_profile(m: MixingMatrix) -> dict:
    """Where training took one mixing matrix: its learned rows against its init and against uniform mixing.

    Rows are normalised to sum 1 first: with MHLA's normaliser (``normalize=True``) a row's scale cancels, so
    the normalised row is what the layer computes with (without the normaliser the scale matters too:
    ``row_sum``). Every number is a mean over rows (and heads, for a per-head matrix):

        self_share      the weight a block puts on its own summary, ``W[i, i]``
        mean_distance   the mass-weighted block distance ``sum_j W[i, j] d(i, j)``, in the layout's distance
                        units (block centres; None without distances, e.g. cross-attention)
        entropy         the row entropy in nats (``log M``: uniform; 0: one block)
        tv_from_init    the total-variation distance ``0.5 sum_j |W[i, j] - W0[i, j]|`` to the init's row
        tv_from_uniform the same to uniform mixing (plain linear attention over the visible blocks)
        zero_fraction   the fraction of visible entries at exactly 0 (the clamp's lower bound)

    each as learned, and as ``<name>_init`` / ``<name>_uniform`` for the init and for uniform mixing.
    """
    def describe(p: torch.Tensor) -> dict:
        out = {"self_share": p.diagonal(dim1=-2, dim2=-1).mean().item(),
               "entropy": -(p * p.clamp_min(1e-300).log()).sum(-1).mean().item()}
        out["mean_distance"] = None if dist is None else (p * dist).sum(-1).mean().item()
        return out

    learned = m.learned().detach().double().cpu()
    visible = torch.ones(learned.shape[-2:], dtype=torch.bool)
    if m.causal:
        visible = visible.tril()
    dist = getattr(m, "_distances", None)
    dist = None if dist is None or tuple(dist.shape) != tuple(learned.shape[-2:]) else dist.double()
    p, p0, pu = normalized_rows(learned), normalized_rows(m.initial()), normalized_rows(visible)  # pu: uniform
    out = {"init": m.init, "learnable": bool(m.learnable), "num_blocks": int(learned.shape[-1]),
           **describe(p),
           "tv_from_init": 0.5 * (p - p0).abs().sum(-1).mean().item(),
           "tv_from_uniform": 0.5 * (p - pu).abs().sum(-1).mean().item(),
           "zero_fraction": (learned[..., visible] == 0).double().mean().item(),
           "row_sum": learned.sum(-1).mean().item()}
    out.update({f"{k}_init": v for k, v in describe(p0).items()})
    out["tv_from_uniform_init"] = 0.5 * (p0 - pu).abs().sum(-1).mean().item()
    out.update({f"{k}_uniform": v for k, v in describe(pu).items()})
    return out


def mixing_matrices(model: nn.Module) -> dict[str, MixingMatrix]:
    """Every :class:`MixingMatrix` of ``model`` by the name of the layer that holds it (``blocks.0.attn``), in
    model order: the one way to find them."""
    return {name.rpartition(".")[0] or name: m for name, m in model.named_modules() if isinstance(m, MixingMatrix)}


@torch.no_grad()
def with_equal_weights(model: nn.Module, keep_near: int = 0) -> nn.Module:
    """A copy of ``model`` whose every mixing matrix has :meth:`MixingMatrix.equalize_` applied (the coefficients
    at block distance ``>= keep_near`` made equal, nearer ones kept): how much of a trained model's behaviour its
    mixing's learned shape carries, without training (``scripts/mixing_transplant.py``, ``scripts/long_context.py
    --equal-weights``). An error for a model without mixing matrices."""
    out = copy.deepcopy(model)
    mats = mixing_matrices(out)
    if not mats:
        raise ValueError("the model has no mixing matrix")
    for name, m in mats.items():
        try:
            m.equalize_(keep_near)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    return out


# ------------------------------------------------------------------------------------ cross-attention
CROSS_INIT_KINDS = ("uniform",)


class CrossMixingMatrix(MixingMatrix):
    """The ``[Mq, Mk]`` mixing matrix of MHLA cross-attention (docs/cross_attention.md): row ``i`` says how
    much query block ``i`` reads of each key block's summary. Same parameterizations, training hooks
    (optimizer group ``mixing``, the projection after each step, logged heatmaps) and ``forward()`` as
    :class:`MixingMatrix`.

    Args:
        query_blocks, key_blocks: ``Mq`` and ``Mk``.
        init: ``"uniform"`` (``1 / Mk`` everywhere: every query block starts as plain linear cross-attention).
            The distance-based inits (``locality`` and the others of :data:`INIT_KINDS`) are refused: a query
            block (a region of the image or video) and a key block (a span of the condition) have no distance.
        learnable, num_heads, parameterization, max_value: as :class:`MixingMatrix`.
    """

    def __init__(self, query_blocks: int, key_blocks: int, *, init: str = "uniform", learnable: bool = True,
                 num_heads: int | None = None, parameterization: str = "clamp", max_value: float = 1.0):
        nn.Module.__init__(self)
        if init not in CROSS_INIT_KINDS:
            raise ValueError(
                f"cross-attention mixing_init={init!r} is not available: there is no distance between a "
                f"query block (a region of the tokens) and a key block (a span of the condition), so locality-type "
                f"inits do not apply; use mixing_init=uniform ({', '.join(CROSS_INIT_KINDS)}), learned with "
                f"mixing_learnable=true")
        for name, m in (("query_blocks", query_blocks), ("key_blocks", key_blocks)):
            if not _is_int(m) or m < 1:
                raise ValueError(f"{name} must be a positive int, got {m!r}")
        self._check_args(query_blocks, num_heads, parameterization, max_value, None)
        self.query_blocks, self.key_blocks = int(query_blocks), int(key_blocks)
        self.num_blocks = self.query_blocks
        self.init, self.causal, self.learnable = init, False, learnable
        self.num_heads = None if num_heads is None else operator.index(num_heads)
        self.parameterization, self.max_value, self.extension = parameterization, max_value, None
        self._store_raw(self.initial_raw(), learnable)

    def initial_raw(self) -> torch.Tensor:
        with torch.device("cpu"):
            return self._raw_from_init(torch.full((self.query_blocks, self.key_blocks), 1.0 / self.key_blocks))

    @torch.no_grad()
    def logged_matrices(self) -> dict[str, torch.Tensor]:
        if not self.learnable or tuple(self.raw.shape[-2:]) != (self.query_blocks, self.key_blocks):
            return {}
        return {"mixing": self().detach().float().cpu()}

    def forward(self, num_blocks: int | None = None) -> torch.Tensor:
        """The effective nonnegative ``[Mq, Mk]`` (or ``[H, Mq, Mk]``) matrix."""
        if num_blocks not in (None, self.query_blocks):
            raise ValueError(f"this cross-attention was built for {self.query_blocks} query blocks, asked "
                             f"for {num_blocks}")
        return self.learned()

    def causal_rows(self, start: int, stop: int):
        raise ValueError("cross-attention mixing has no causal rows")

    def extra_repr(self) -> str:
        heads = "shared" if self.num_heads is None else f"per_head={self.num_heads}"
        return (f"Mq={self.query_blocks}, Mk={self.key_blocks}, init={self.init}, "
                f"learnable={self.learnable}, {heads}, param={self.parameterization}")
