"""Block layouts: which token belongs to which block, and the permutation to block-major order.

The ops take tokens in *block-major* order (block ``b`` holds tokens ``b*C ... (b+1)*C - 1``); models
produce them in *raster* order (row-major over the grid; frame-major ``(f, h, w)`` for video), optionally
after some prefix tokens (class / register tokens). :class:`BlockLayout` converts between the two.

Order inside block-major: tokens of one block keep the raster order of the block; blocks are ordered in
raster order of the block grid. Example, a 4 x 4 grid in 2 x 2 blocks: block 0 holds raster tokens
0, 1, 4, 5; block 1 holds 2, 3, 6, 7; and so on.

Blocks tile the grid exactly. A grid that the block shape does not divide raises a ``ValueError`` naming
the axis: we chose an ERROR over implicit padding, so that no padded tokens ever enter the block summaries.
A model that needs another size pads its *input* (the paper's DeiT pads 224 px images to 256 px, so
16 x 16 patches form 4 x 4 blocks). A 1-D *causal* sequence may end in a partial block; the ops handle that
from ``block_size`` alone (:func:`num_blocks_for`), and this class is not needed there.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_AXES = {1: ("length",), 2: ("height", "width"), 3: ("frames", "height", "width")}


# ------------------------------------------------------------------------------------------ helpers
def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` in exact integer arithmetic (``b > 0``): blocks of ``b`` covering ``a`` items."""
    return -(-a // b)


def num_blocks_for(seq_len: int, block_size: int) -> int:
    """Blocks covering ``seq_len`` tokens when the last block may be partial (causal 1-D sequences)."""
    seq_len, block_size = _as_int(seq_len, "seq_len"), _as_int(block_size, "block_size")
    if seq_len < 0 or block_size < 1:
        raise ValueError(
            f"need seq_len >= 0 and block_size >= 1, got seq_len={seq_len}, block_size={block_size}"
        )
    return ceil_div(seq_len, block_size)


def _as_int(value, what: str) -> int:
    """``value`` as a python int; floats (even 4.0) and bools are rejected so typos surface early."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {value!r} ({type(value).__name__})") from None


def _as_int_tuple(values, what: str) -> tuple[int, ...]:
    if isinstance(values, (int, bool)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{what} must be a tuple of ints such as (16, 16), got {values!r}")
    return tuple(_as_int(v, f"{what} entry") for v in values)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.cache
def _cached_permutation(grid: tuple[int, ...], block: tuple[int, ...]) -> torch.Tensor:
    """``perm[j]`` = raster index of the token at block-major position ``j`` (do not modify: cached)."""
    nd = len(grid)
    counts = [g // b for g, b in zip(grid, block)]
    raster = torch.arange(math.prod(grid)).reshape(grid)
    # split every axis into (block index, offset in block), then bring the block indices first
    split = raster.reshape([x for c, b in zip(counts, block) for x in (c, b)])
    order = list(range(0, 2 * nd, 2)) + list(range(1, 2 * nd, 2))
    return split.permute(order).reshape(-1).contiguous()


@functools.cache
def _cached_inverse_permutation(grid: tuple[int, ...], block: tuple[int, ...]) -> torch.Tensor:
    """``inv[r]`` = block-major position of raster token ``r`` (do not modify: cached)."""
    return torch.argsort(_cached_permutation(grid, block))


# ------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class BlockLayout:
    """Tiling of a 1-D, 2-D or 3-D token grid into equal blocks (immutable, hashable).

    Attributes:
        grid: ``(T,)``, ``(H, W)`` or ``(F, H, W)``: grid tokens per axis (prefix tokens excluded).
        block: tokens per block along each axis (same rank as ``grid``; must divide it).
        num_prefix_tokens: class / register tokens in front of the grid tokens (not in any block).

    Raises:
        ValueError: on a rank other than 1-3, mismatched ranks, non-positive or non-integer sizes, or a
            grid axis that the block does not divide (the message names the axis and its divisors).
    """

    grid: tuple[int, ...]
    block: tuple[int, ...]
    num_prefix_tokens: int = 0

    def __post_init__(self):
        grid, block = _as_int_tuple(self.grid, "grid"), _as_int_tuple(self.block, "block")
        object.__setattr__(self, "grid", grid)
        object.__setattr__(self, "block", block)
        object.__setattr__(self, "num_prefix_tokens", _as_int(self.num_prefix_tokens, "num_prefix_tokens"))
        if len(grid) not in _AXES:
            raise ValueError(f"grid must have 1, 2 or 3 dims ((T,), (H, W) or (F, H, W)), got {grid}")
        if len(block) != len(grid):
            raise ValueError(f"block {block} must have the same rank as grid {grid} (one size per axis)")
        if self.num_prefix_tokens < 0:
            raise ValueError(f"num_prefix_tokens must be >= 0, got {self.num_prefix_tokens}")
        for axis, g, b in zip(_AXES[len(grid)], grid, block):
            if g < 1:
                raise ValueError(f"grid {axis} must be positive, got {g} (grid {grid})")
            if b < 1:
                raise ValueError(f"block {axis} must be positive, got {b} (block {block})")
            if g % b:
                raise ValueError(
                    f"grid {axis} {g} is not divisible by block {axis} {b}; choose a block that tiles the "
                    f"grid (divisors of {g}: {', '.join(map(str, _divisors(g)))}) or pad the input"
                )

    # ---------------------------------------------------------------------------------------- sizes
    @property
    def ndim(self) -> int:
        """Rank of the grid: 1, 2 or 3."""
        return len(self.grid)

    @property
    def num_tokens(self) -> int:
        """``N``: grid tokens (prefix tokens excluded)."""
        return math.prod(self.grid)

    @property
    def block_size(self) -> int:
        """``C``: tokens per block, ``prod(block)``."""
        return math.prod(self.block)

    @property
    def blocks_per_axis(self) -> tuple[int, ...]:
        """Shape of the block grid: ``grid[i] // block[i]`` per axis."""
        return tuple(g // b for g, b in zip(self.grid, self.block))

    @property
    def num_blocks(self) -> int:
        """``M``: number of blocks (token-level heads)."""
        return math.prod(self.blocks_per_axis)

    # ---------------------------------------------------------------------------------- permutation
    def permutation(self) -> torch.Tensor:
        """LongTensor ``[N]``: ``perm[j]`` = raster index of the token at block-major position ``j``.

        ``x_raster[:, perm]`` is block-major.
        """
        return _cached_permutation(self.grid, self.block).clone()

    def inverse_permutation(self) -> torch.Tensor:
        """LongTensor ``[N]``: block-major position of each raster token (``x_blocked[:, inv]`` is raster)."""
        return _cached_inverse_permutation(self.grid, self.block).clone()

    def raster_to_block_major(self, x: torch.Tensor) -> torch.Tensor:
        """Grid tokens ``[B, N, ...]`` raster -> block-major ``[B, N, ...]``.

        Uses reshape/permute instead of a gather (same result as ``x[:, perm]``, cheaper backward).
        """
        self._check_grid_len(x, "raster")
        B, rest, nd = x.shape[0], x.shape[2:], self.ndim
        x = x.reshape(B, *[v for c, b in zip(self.blocks_per_axis, self.block) for v in (c, b)], *rest)
        order = [0] + [1 + 2 * i for i in range(nd)] + [2 + 2 * i for i in range(nd)]
        order += list(range(1 + 2 * nd, x.dim()))
        return x.permute(order).reshape(B, self.num_tokens, *rest)

    def block_major_to_raster(self, x: torch.Tensor) -> torch.Tensor:
        """Grid tokens ``[B, N, ...]`` block-major -> raster; inverse of :meth:`raster_to_block_major`."""
        self._check_grid_len(x, "block-major")
        B, rest, nd = x.shape[0], x.shape[2:], self.ndim
        x = x.reshape(B, *self.blocks_per_axis, *self.block, *rest)
        order = [0] + [v for i in range(nd) for v in (1 + i, 1 + nd + i)] + list(range(1 + 2 * nd, x.dim()))
        return x.permute(order).reshape(B, self.num_tokens, *rest)

    def to_blocks(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Split off the prefix and reorder the grid tokens to block-major.

        Args:
            x: ``[B, P + N, ...]`` in raster order, prefix tokens first.

        Returns:
            ``(prefix [B, P, ...], x_blocked [B, N, ...])``; with ``P = 0`` the prefix is an empty slice.
        """
        want = self.num_prefix_tokens + self.num_tokens
        if x.dim() < 2 or x.shape[1] != want:
            raise ValueError(
                f"expected x of shape [B, {want}, ...] ({self.num_prefix_tokens} prefix + {self.num_tokens} "
                f"grid tokens of grid {self.grid}), got {tuple(x.shape)}; check the grid size and the "
                f"number of class / register tokens"
            )
        P = self.num_prefix_tokens
        return x[:, :P], self.raster_to_block_major(x[:, P:])

    def from_blocks(self, prefix: torch.Tensor, x_blocked: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_blocks`.

        ``prefix [B, P, ...]``, ``x_blocked [B, N, ...]`` -> ``[B, P + N, ...]``, raster order, prefix first.
        """
        self._check_grid_len(x_blocked, "block-major")
        if prefix.dim() < 2 or prefix.shape[1] != self.num_prefix_tokens:
            raise ValueError(
                f"expected prefix of shape [B, {self.num_prefix_tokens}, ...], got {tuple(prefix.shape)}; "
                f"pass the prefix returned by to_blocks (x[:, :0] when there is none)"
            )
        if prefix.shape[0] != x_blocked.shape[0] or prefix.shape[2:] != x_blocked.shape[2:]:
            raise ValueError(
                f"prefix {tuple(prefix.shape)} and x_blocked {tuple(x_blocked.shape)} must agree on every "
                f"dim except dim 1"
            )
        return torch.cat([prefix, self.block_major_to_raster(x_blocked)], dim=1)

    def _check_grid_len(self, x: torch.Tensor, order: str) -> None:
        if x.dim() < 2 or x.shape[1] != self.num_tokens:
            raise ValueError(
                f"expected {order} grid tokens of shape [B, {self.num_tokens}, ...] (grid {self.grid}, no "
                f"prefix tokens), got {tuple(x.shape)}"
            )

    # ------------------------------------------------------------------------------- block geometry
    def block_centers(self) -> torch.Tensor:
        """float64 ``[M, ndim]``: block centres in block-grid units, blocks in block-major order.

        Block ``(i, j)`` has centre ``(i + 0.5, j + 0.5)``.
        """
        axes = [torch.arange(c, dtype=torch.float64) + 0.5 for c in self.blocks_per_axis]
        mesh = torch.meshgrid(*axes, indexing="ij")
        return torch.stack([m.reshape(-1) for m in mesh], dim=-1)

    def block_distances(self) -> torch.Tensor:
        """float64 ``[M, M]``: Euclidean distances between block centres (exact: zero diagonal, symmetric)."""
        c = self.block_centers()
        return torch.cdist(c, c, compute_mode="donot_use_mm_for_euclid_dist")

    def block_index(self) -> torch.Tensor:
        """LongTensor ``[N]``: block id of each block-major token (``arange(N) // block_size``)."""
        return torch.arange(self.num_tokens) // self.block_size

    def token_block_ids_raster(self) -> torch.Tensor:
        """LongTensor ``[N]``: block id of each raster-order token."""
        return self.block_index()[_cached_inverse_permutation(self.grid, self.block)]


# ------------------------------------------------------------------------------------- constructors
def layout_1d(seq_len: int, block_size: int, num_prefix_tokens: int = 0) -> BlockLayout:
    """``seq_len`` tokens in contiguous blocks of ``block_size`` (must divide; see :func:`num_blocks_for`)."""
    return BlockLayout((seq_len,), (block_size,), num_prefix_tokens)


def layout_2d(height: int, width: int, block_h: int, block_w: int | None = None,
              num_prefix_tokens: int = 0) -> BlockLayout:
    """``height x width`` grid in ``block_h x block_w`` tiles (``block_w`` defaults to ``block_h``)."""
    return BlockLayout((height, width), (block_h, block_h if block_w is None else block_w), num_prefix_tokens)


def layout_3d(frames: int, height: int, width: int, block_f: int, block_h: int, block_w: int,
              num_prefix_tokens: int = 0) -> BlockLayout:
    """Video grid ``(frames, height, width)`` (frame-major) in ``block_f x block_h x block_w`` tiles."""
    return BlockLayout((frames, height, width), (block_f, block_h, block_w), num_prefix_tokens)


def layout_from_num_blocks(grid, num_blocks: int, num_prefix_tokens: int = 0) -> BlockLayout:
    """Split ``grid`` into ``num_blocks`` blocks with the same number of blocks along every axis.

    1-D: ``num_blocks`` chunks. 2-D / 3-D: ``num_blocks`` must be a perfect square / cube whose root
    divides every axis (a 16 x 16 grid with ``num_blocks=16`` -> 4 x 4 blocks of 4 x 4 tokens; 56 x 56 with
    49 -> 7 x 7 blocks of 8 x 8). Other splits (e.g. the paper's video M = 105): :func:`factorize_blocks`
    / :func:`layout_for_grid`, or :class:`BlockLayout` with an explicit ``block``.
    """
    grid = _as_int_tuple(grid, "grid")
    num_blocks = _as_int(num_blocks, "num_blocks")
    nd = len(grid)
    if nd not in _AXES:
        raise ValueError(f"grid must have 1, 2 or 3 dims, got {grid}")
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    per_axis = round(num_blocks ** (1 / nd))
    if per_axis**nd != num_blocks:
        shape = {2: "perfect square (4, 16, 49, 64, ...)", 3: "perfect cube (8, 27, 64, ...)"}[nd]
        raise ValueError(
            f"num_blocks={num_blocks} cannot split the {nd}-D grid {grid} into equal blocks with the same "
            f"count per axis: it must be a {shape}; or build BlockLayout(grid, block) with an explicit block"
        )
    for axis, g in zip(_AXES[nd], grid):
        if g % per_axis:
            raise ValueError(
                f"num_blocks={num_blocks} needs {per_axis} blocks along the grid {axis}, but {g} is not "
                f"divisible by {per_axis}; choose another num_blocks or pad the input"
            )
    return BlockLayout(grid, tuple(g // per_axis for g in grid), num_prefix_tokens)


# ------------------------------------------------------------------------ block grids (blocks per axis)
def factorize_blocks(grid: Sequence[int], num_blocks: int) -> tuple[int, ...]:
    """Blocks per axis ``(b_0, ..., b_{n-1})`` with ``prod(b) == num_blocks`` and ``b_i | grid_i``.

    Among all valid factorisations, the one whose block shape ``grid // b`` is the most isotropic in
    tokens (smallest ``max(block) / min(block)``; ties: more blocks along the leading axes). Example: the
    paper's Wan grid ``(21, 30, 50)`` with ``M = 105`` -> ``(7, 3, 5)``, blocks of ``3 x 10 x 10`` tokens.
    Unlike :func:`layout_from_num_blocks`, the axes may get different block counts.

    Raises:
        ValueError: when no factorisation tiles the grid (the message lists the divisors per axis).
    """
    grid = tuple(int(g) for g in grid)
    num_blocks = int(num_blocks)
    if len(grid) not in _AXES or num_blocks < 1 or any(g < 1 for g in grid):
        raise ValueError(f"need a 1-3 dim grid of positive sizes and num_blocks >= 1, got {grid}, {num_blocks}")
    divisors = [_divisors(g) for g in grid]
    best, best_key = None, None
    for combo in itertools.product(*divisors):
        if math.prod(combo) != num_blocks:
            continue
        shape = [g // b for g, b in zip(grid, combo)]
        key = (max(shape) / min(shape), tuple(-b for b in combo))
        if best_key is None or key < best_key:
            best, best_key = combo, key
    if best is None:
        div = "; ".join(f"{a} {g}: {', '.join(map(str, d))}" for a, g, d in zip(_AXES[len(grid)], grid, divisors))
        raise ValueError(
            f"num_blocks={num_blocks} cannot tile the token grid {grid}: it must be a product of one divisor "
            f"per axis ({div}). Choose another num_blocks or give blocks=(...) per axis"
        )
    return tuple(best)


def resolve_blocks(grid=None, *, blocks=None, block=None, num_blocks=None) -> tuple[int, ...]:
    """Blocks per axis from exactly one of ``blocks`` / ``block`` (+ ``grid``) / ``num_blocks`` (+ ``grid``)."""
    given = [n for n, v in (("blocks", blocks), ("block", block), ("num_blocks", num_blocks)) if v is not None]
    if len(given) != 1:
        raise ValueError(
            f"give exactly one of blocks=(per-axis block counts), block=(tokens per block, with grid) or "
            f"num_blocks=M (with grid); got {given or 'none'}"
        )
    if blocks is not None:
        out = tuple(int(b) for b in blocks)
        if grid is not None:
            layout_for_grid(grid, out)  # validates that they tile the grid
        return out
    if grid is None:
        raise ValueError(f"{given[0]}=... needs grid=(F, H, W) / (H, W) to know the block grid; or give blocks=")
    grid = tuple(int(g) for g in grid)
    if block is not None:
        lay = BlockLayout(grid, tuple(int(b) for b in block))
        return lay.blocks_per_axis
    return factorize_blocks(grid, num_blocks)


def layout_for_grid(grid: Sequence[int], blocks: Sequence[int]) -> BlockLayout:
    """The :class:`BlockLayout` of ``grid`` split into ``blocks`` blocks per axis (``ValueError`` if not)."""
    grid, blocks = tuple(int(g) for g in grid), tuple(int(b) for b in blocks)
    if len(grid) != len(blocks):
        raise ValueError(
            f"the token grid {grid} has {len(grid)} axes but the block grid {blocks} has {len(blocks)}; "
            f"give one block count per axis ({', '.join(_AXES.get(len(grid), ('?',)))})"
        )
    for axis, g, b in zip(_AXES[len(grid)], grid, blocks):
        if b < 1 or g % b:
            divs = ", ".join(str(d) for d in _divisors(g))
            raise ValueError(
                f"MHLA blocks {blocks} do not tile the token grid {grid}: {b} blocks along {axis} do not divide "
                f"{g} (divisors: {divs}). Change the video/image size or the block grid (attn.blocks)"
            )
    return BlockLayout(grid, tuple(g // b for g, b in zip(grid, blocks)))


# ------------------------------------------------------------------------------ choosing M from the grid
AUTO_RULE = ("blocks tile the grid exactly; 2 <= M and M^2 <= N; square blocks on the spatial (last two) "
             "axes where any such tiling has them; the largest such M; ties: the most isotropic block, then "
             "more blocks along the leading axes")


def auto_blocks(grid: Sequence[int]) -> tuple[int, ...]:
    """Blocks per axis for ``num_blocks="auto"``: the paper's ``M^2 <= N`` rule on a token grid.

    Candidates: every block grid ``b`` (blocks per axis) that tiles ``grid`` exactly (``b_i | grid_i``), with
    ``2 <= M = prod(b)`` and ``M^2 <= N = prod(grid)``. When some candidate has square blocks on the spatial
    axes (2-D: ``bh = bw`` tokens; 3-D video ``(F, H, W)``: ``bh = bw``, any ``bf``; 1-D: every candidate),
    only those count. Among them, the largest ``M``; ties: the most isotropic block in tokens (smallest
    ``max(block) / min(block)``), then more blocks along the leading axes (as :func:`factorize_blocks`).

    Examples (grid -> blocks per axis, block in tokens, M): ``(16, 16)`` -> ``(4, 4)``, 4 x 4, 16;
    ``(32, 32)`` -> ``(4, 4)``, 8 x 8, 16 (32 blocks would need 4 x 8 tiles); ``(14, 14)`` -> ``(2, 2)``,
    7 x 7, 4; ``(7, 7)`` (no square tile but the whole grid) -> ``(7, 1)``, 1 x 7, 7; ``(21, 30, 50)`` ->
    ``(7, 3, 5)``, 3 x 10 x 10, 105 (the paper's Wan2.1 setting); ``(64,)`` -> ``(8,)``, 8, 8.

    Raises:
        ValueError: a grid of rank other than 1-3 or with a non-positive size, or one that no block grid with
            ``2 <= M``, ``M^2 <= N`` tiles (a 1-D prime length, a 1 x 1 grid, ...); the message says why.
    """
    grid = _as_int_tuple(grid, "grid")
    if len(grid) not in _AXES or any(g < 1 for g in grid):
        raise ValueError(f"num_blocks=auto needs a token grid of 1-3 positive sizes, got {grid}")
    n = math.prod(grid)
    best, best_key = None, None
    for combo in itertools.product(*(_divisors(g) for g in grid)):
        m = math.prod(combo)
        if m < 2 or m * m > n:
            continue
        shape = [g // b for g, b in zip(grid, combo)]
        square = len(grid) == 1 or shape[-1] == shape[-2]
        key = (not square, -m, max(shape) / min(shape), tuple(-b for b in combo))
        if best_key is None or key < best_key:
            best, best_key = combo, key
    if best is None:
        div = "; ".join(f"{a} {g}: {', '.join(map(str, _divisors(g)))}"
                        for a, g in zip(_AXES[len(grid)], grid))
        raise ValueError(
            f"num_blocks=auto has no solution on the token grid {'x'.join(map(str, grid))} (N = {n}): no "
            f"block grid tiles it with at least 2 blocks and M^2 <= N (divisors per axis: {div}). Give "
            f"num_blocks, blocks or block explicitly, or change the grid (pad the input)")
    return tuple(best)


def auto_num_blocks(grid: Sequence[int]) -> int:
    """``M`` that ``num_blocks="auto"`` picks on ``grid`` (:func:`auto_blocks`)."""
    return math.prod(auto_blocks(grid))


def auto_block_size(seq_len: int) -> int:
    """Chunk length of causal MHLA for ``block_size="auto"``: the smallest power of two ``C`` with
    ``C^2 >= N`` (``C >= sqrt(N)``), so a context of ``N = seq_len`` tokens has ``N / C <= sqrt(N)``
    blocks: ``M^2 <= N`` exactly when ``C`` divides ``N`` (a power-of-two context), else up to the partial
    last chunk (64 -> 8, 128 -> 16, 256 -> 16, 2048 -> 64). A causal sequence may end in a partial chunk
    (:func:`num_blocks_for`), so ``C`` need not divide ``N``; a power of two suits the chunked kernels."""
    seq_len = _as_int(seq_len, "seq_len")
    if seq_len < 1:
        raise ValueError(f"block_size=auto needs a context length >= 1, got {seq_len}")
    c = 1
    while c * c < seq_len:
        c *= 2
    return c
