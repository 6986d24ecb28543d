"""Block layouts: which token belongs to which block, and the permutation to block-major order.

The ops take tokens in *block-major* order (block ``b`` holds tokens ``b*C ... (b+1)*C - 1``); models
produce them in *raster* order (row-major over the grid; frame-major ``(f, h, w)`` for video), optionally
after some prefix tokens (class / register tokens). :class:`BlockLayout` converts between the two.

Blocks tile the grid exactly: a grid that the block shape does not divide raises a ``ValueError`` naming
the axis. We chose an error over implicit padding so that no masked tokens ever enter the summaries; a
model that needs another size pads its *input* (the paper's DeiT pads 224 px images to 256 px).

Inside a block, tokens keep the raster order of the block; blocks are ordered in raster order of the
block grid.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

_AXES = {1: ("length",), 2: ("height", "width"), 3: ("frames", "height", "width")}


def num_blocks_for(seq_len: int, block_size: int) -> int:
    """Blocks covering ``seq_len`` tokens when the last block may be partial (causal 1-D sequences)."""
    return math.ceil(seq_len / block_size)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.lru_cache(maxsize=256)
def _permutation(grid: tuple[int, ...], block: tuple[int, ...]) -> torch.Tensor:
    """``perm[j]`` = raster index of the token at block-major position ``j``."""
    nd = len(grid)
    counts = [g // b for g, b in zip(grid, block)]
    raster = torch.arange(math.prod(grid)).reshape(grid)
    # split every axis into (block index, offset in block) and bring block indices first
    shape = [x for c, b in zip(counts, block) for x in (c, b)]
    split = raster.reshape(shape)
    order = list(range(0, 2 * nd, 2)) + list(range(1, 2 * nd, 2))
    return split.permute(order).reshape(-1).contiguous()


@dataclass(frozen=True)
class BlockLayout:
    """Tiling of a 1-D, 2-D or 3-D token grid into equal blocks.

    Attributes:
        grid: ``(T,)``, ``(H, W)`` or ``(F, H, W)`` grid tokens (prefix tokens excluded).
        block: tokens per block along each axis (same rank as ``grid``).
        num_prefix_tokens: class / register tokens in front of the grid tokens.
    """

    grid: tuple[int, ...]
    block: tuple[int, ...]
    num_prefix_tokens: int = 0

    def __post_init__(self):
        grid, block = tuple(int(g) for g in self.grid), tuple(int(b) for b in self.block)
        object.__setattr__(self, "grid", grid)
        object.__setattr__(self, "block", block)
        if len(grid) not in (1, 2, 3):
            raise ValueError(f"grid must have 1, 2 or 3 dims, got {grid}")
        if len(block) != len(grid):
            raise ValueError(f"block {block} must have the same rank as grid {grid}")
        if self.num_prefix_tokens < 0:
            raise ValueError(f"num_prefix_tokens must be >= 0, got {self.num_prefix_tokens}")
        for axis, g, b in zip(_AXES[len(grid)], grid, block):
            if g < 1 or b < 1:
                raise ValueError(f"grid and block sizes must be positive, got grid {grid}, block {block}")
            if g % b:
                raise ValueError(
                    f"grid {axis} {g} is not divisible by block {axis} {b}; choose a block that tiles the "
                    f"grid (divisors of {g}: {', '.join(map(str, _divisors(g)))}) or pad the input"
                )

    # ------------------------------------------------------------------------------------- sizes
    @property
    def ndim(self) -> int:
        return len(self.grid)

    @property
    def num_tokens(self) -> int:
        """Grid tokens (prefix tokens excluded)."""
        return math.prod(self.grid)

    @property
    def block_size(self) -> int:
        """Tokens per block ``C``."""
        return math.prod(self.block)

    @property
    def blocks_per_axis(self) -> tuple[int, ...]:
        return tuple(g // b for g, b in zip(self.grid, self.block))

    @property
    def num_blocks(self) -> int:
        """``M``."""
        return math.prod(self.blocks_per_axis)

    # -------------------------------------------------------------------------------- permutation
    def permutation(self) -> torch.Tensor:
        """LongTensor ``[num_tokens]``: raster index of the token at each block-major position."""
        return _permutation(self.grid, self.block)

    def inverse_permutation(self) -> torch.Tensor:
        """LongTensor ``[num_tokens]``: block-major position of each raster token."""
        return torch.argsort(self.permutation())

    def raster_to_block_major(self, x: torch.Tensor) -> torch.Tensor:
        """Grid tokens ``[B, N, ...]`` raster -> block-major, with reshape/permute (no gather: cheap backward)."""
        B, rest = x.shape[0], x.shape[2:]
        nd = self.ndim
        split = [v for c, b in zip(self.blocks_per_axis, self.block) for v in (c, b)]
        x = x.reshape(B, *split, *rest)
        order = [0] + [1 + 2 * i for i in range(nd)] + [2 + 2 * i for i in range(nd)]
        order += list(range(1 + 2 * nd, x.dim()))
        return x.permute(order).reshape(B, self.num_tokens, *rest)

    def block_major_to_raster(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`raster_to_block_major`."""
        B, rest = x.shape[0], x.shape[2:]
        nd = self.ndim
        x = x.reshape(B, *self.blocks_per_axis, *self.block, *rest)
        order = [0] + [v for i in range(nd) for v in (1 + i, 1 + nd + i)] + list(range(1 + 2 * nd, x.dim()))
        return x.permute(order).reshape(B, self.num_tokens, *rest)

    def to_blocks(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x: [B, P + N, ...]`` (raster, prefix first) -> ``(prefix [B, P, ...], grid [B, N, ...])`` with
        the grid tokens in block-major order."""
        self._check_len(x)
        P = self.num_prefix_tokens
        return x[:, :P], self.raster_to_block_major(x[:, P:])

    def from_blocks(self, prefix: torch.Tensor, x_blocked: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_blocks`: ``[B, P + N, ...]`` in raster order."""
        if x_blocked.shape[1] != self.num_tokens:
            raise ValueError(f"expected {self.num_tokens} block-major tokens, got {x_blocked.shape[1]}")
        return torch.cat([prefix, self.block_major_to_raster(x_blocked)], dim=1)

    def _check_len(self, x: torch.Tensor) -> None:
        want = self.num_prefix_tokens + self.num_tokens
        if x.dim() < 2 or x.shape[1] != want:
            raise ValueError(
                f"expected [B, {want}, ...] ({self.num_prefix_tokens} prefix + {self.num_tokens} grid tokens "
                f"of grid {self.grid}), got shape {tuple(x.shape)}"
            )

    # ----------------------------------------------------------------------------- block geometry
    def block_centers(self) -> torch.Tensor:
        """float64 ``[M, ndim]``: block centres in block-grid units (block ``(i, j)`` -> ``(i + .5, j + .5)``)."""
        axes = [torch.arange(c, dtype=torch.float64) + 0.5 for c in self.blocks_per_axis]
        mesh = torch.meshgrid(*axes, indexing="ij")
        return torch.stack([m.reshape(-1) for m in mesh], dim=-1)

    def block_distances(self) -> torch.Tensor:
        """float64 ``[M, M]`` Euclidean distances between block centres."""
        c = self.block_centers()
        return torch.cdist(c, c)

    def block_index(self) -> torch.Tensor:
        """LongTensor ``[num_tokens]``: block id of each block-major token."""
        return torch.arange(self.num_tokens) // self.block_size

    def token_block_ids_raster(self) -> torch.Tensor:
        """LongTensor ``[num_tokens]``: block id of each raster-order token."""
        return self.block_index()[self.inverse_permutation()]


def layout_1d(seq_len: int, block_size: int, num_prefix_tokens: int = 0) -> BlockLayout:
    return BlockLayout((seq_len,), (block_size,), num_prefix_tokens)


def layout_2d(height: int, width: int, block_h: int, block_w: int | None = None,
              num_prefix_tokens: int = 0) -> BlockLayout:
    return BlockLayout((height, width), (block_h, block_w or block_h), num_prefix_tokens)


def layout_3d(frames: int, height: int, width: int, block_f: int, block_h: int, block_w: int,
              num_prefix_tokens: int = 0) -> BlockLayout:
    return BlockLayout((frames, height, width), (block_f, block_h, block_w), num_prefix_tokens)


def layout_from_num_blocks(grid, num_blocks: int, num_prefix_tokens: int = 0) -> BlockLayout:
    """Split ``grid`` into ``num_blocks`` equal blocks, as evenly over the axes as possible.

    1-D: ``num_blocks`` chunks. 2-D / 3-D: ``num_blocks`` must be a perfect square / cube with each root
    dividing its axis (e.g. a 16 x 16 grid with ``num_blocks=16`` -> 4 x 4 blocks of 4 x 4 tokens).
    """
    grid = tuple(int(g) for g in grid)
    nd = len(grid)
    per_axis = round(num_blocks ** (1 / nd))
    if per_axis**nd != num_blocks:
        raise ValueError(
            f"num_blocks={num_blocks} cannot split the {nd}-D grid {grid} evenly: it must be a "
            f"{['', 'positive int', 'perfect square', 'perfect cube'][nd]} (or give block=... explicitly)"
        )
    for axis, g in zip(_AXES[nd], grid):
        if g % per_axis:
            raise ValueError(
                f"num_blocks={num_blocks} needs {per_axis} blocks along the grid {axis}, but {g} is not "
                f"divisible by {per_axis}; choose another num_blocks or pad the input"
            )
    return BlockLayout(grid, tuple(g // per_axis for g in grid), num_prefix_tokens)
