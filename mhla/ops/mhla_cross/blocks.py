"""The blocking rule of MHLA cross-attention: how a query or key axis of any length is cut into ``M`` blocks.

A length-``T`` axis in ``M`` blocks (``1 <= M <= T``): token ``t`` belongs to block ``(t * M) // T``.
Blocks are contiguous and balanced: block ``b`` holds tokens ``ceil(b T / M) .. ceil((b + 1) T / M) - 1``,
so their sizes differ by at most one and none is empty. When ``M`` divides ``T`` this is the plain
``t // (T / M)`` of self-attention MHLA (equal blocks of ``C = T / M`` tokens); nothing is padded.

The key padding mask does not move the blocks: they are cut on the padded key axis (the positions), and a
masked key simply contributes nothing to its block (docs/cross_attention.md#blocks-and-masks).
"""

from __future__ import annotations

import torch


def check_blocks(length: int, num_blocks: int, what: str) -> None:
    """Raise a ValueError naming ``what`` unless ``1 <= num_blocks <= length`` (every block holds a token)."""
    if num_blocks < 1:
        raise ValueError(f"{what}: the mixing matrix must have at least one block, got {num_blocks}")
    if num_blocks > length:
        raise ValueError(f"{what}: {length} tokens cannot form {num_blocks} blocks (each block needs a "
                         f"token); use at most {length} blocks on this axis")


def block_starts(length: int, num_blocks: int) -> list[int]:
    """``[M + 1]`` boundaries ``starts[b] = ceil(b T / M)``: block ``b`` holds tokens
    ``starts[b] .. starts[b + 1] - 1``."""
    return [-(-b * length // num_blocks) for b in range(num_blocks + 1)]


def block_ids(length: int, num_blocks: int, device=None) -> torch.Tensor:
    """``[T]`` long: the block of every token, ``(t * M) // T``."""
    return torch.arange(length, device=device) * num_blocks // length


def block_gather(length: int, num_blocks: int,
                 device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Indices that lay a length-``T`` axis out as ``[M, Cmax]`` blocks (``Cmax = ceil(T / M)``, the largest).

    Returns ``(index [M, Cmax], valid [M, Cmax] bool, position [T])``: ``x[:, index]`` is the block layout
    (the slots past a block's end repeat its last token and are not ``valid``), and
    ``blocked.flatten(M, Cmax)[:, position]`` takes it back to token order.
    """
    starts = torch.tensor(block_starts(length, num_blocks), device=device)
    cmax = -(-length // num_blocks)
    slot = torch.arange(cmax, device=device)
    index = starts[:-1, None] + slot[None, :]
    valid = index < starts[1:, None]
    index = torch.minimum(index, starts[1:, None] - 1)
    ids = block_ids(length, num_blocks, device)
    position = ids * cmax + torch.arange(length, device=device) - starts[ids]
    return index, valid, position
