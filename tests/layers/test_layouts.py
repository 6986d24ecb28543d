"""Block layouts: block-major order, round trips with prefix tokens, centres, bad grids."""

import itertools
import math

import pytest
import torch

from mhla.layouts import BlockLayout, layout_1d, layout_2d, layout_3d, layout_from_num_blocks, num_blocks_for


def brute_force_block_ids(grid, block):
    """Block id of every raster token, by loops over coordinates (blocks in raster order of the block grid)"""
    counts = [g // b for g, b in zip(grid, block)]
    ids = []
    for coord in itertools.product(*[range(g) for g in grid]):  # raster order (last axis fastest)
        bid = 0
        for n, c, b in zip(counts, coord, block):
            bid = bid * n + c // b
        ids.append(bid)
    return torch.tensor(ids)


def brute_force_permutation(grid, block):
    """Block-major order by definition: blocks in raster order, tokens of a block in raster order."""
    counts = [g // b for g, b in zip(grid, block)]
    strides = [math.prod(grid[i + 1:]) for i in range(len(grid))]
    perm = []
    for bc in itertools.product(*[range(c) for c in counts]):
        for off in itertools.product(*[range(b) for b in block]):
            coord = [c * b + o for c, b, o in zip(bc, block, off)]
            perm.append(sum(c * s for c, s in zip(coord, strides)))
    return torch.tensor(perm)


GRIDS = [((12,), (4,)), ((8, 12), (4, 3)), ((4, 6, 4), (2, 3, 2)), ((5, 5), (5, 1)), ((6,), (6,))]


@pytest.mark.parametrize("grid,block", GRIDS)
def test_block_ids_and_permutation_match_definition(grid, block):
    lay = BlockLayout(grid, block)
    assert torch.equal(lay.token_block_ids_raster(), brute_force_block_ids(grid, block))
    assert torch.equal(lay.permutation(), brute_force_permutation(grid, block))
    # block-major order: token j of the permuted sequence belongs to block j // C
    assert torch.equal(lay.token_block_ids_raster()[lay.permutation()], lay.block_index())
    assert torch.equal(lay.block_index(), torch.arange(lay.num_tokens) // lay.block_size)
    assert lay.num_blocks == math.prod(g // b for g, b in zip(grid, block))
    assert lay.blocks_per_axis == tuple(g // b for g, b in zip(grid, block))
    assert lay.ndim == len(grid) and lay.num_tokens == math.prod(grid) and lay.block_size == math.prod(block)


@pytest.mark.parametrize("grid,block", GRIDS)
def test_inverse_permutation(grid, block):
    lay = BlockLayout(grid, block)
    perm, inv = lay.permutation(), lay.inverse_permutation()
    assert perm.dtype == torch.long and torch.equal(torch.sort(perm).values, torch.arange(lay.num_tokens))
    assert torch.equal(perm[inv], torch.arange(lay.num_tokens))
    assert torch.equal(inv[perm], torch.arange(lay.num_tokens))


def test_within_block_raster_order():
    lay = layout_2d(4, 4, 2)
    # block 0 holds raster tokens 0, 1, 4, 5; block 1 holds 2, 3, 6, 7
    assert lay.permutation()[:8].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    # video: frame-major raster, 2 x 2 x 2 grid in 1 x 2 x 2 blocks = one block per frame
    assert layout_3d(2, 2, 2, 1, 2, 2).permutation().tolist() == list(range(8))


def test_cached_permutation_cannot_be_corrupted():
    lay = layout_2d(4, 4, 2)
    lay.permutation().zero_()
    lay.inverse_permutation().zero_()
    assert lay.permutation()[:4].tolist() == [0, 1, 4, 5]
    assert torch.equal(lay.inverse_permutation()[lay.permutation()], torch.arange(16))


@pytest.mark.parametrize("lay", [layout_1d(10, 5, 2), layout_2d(6, 4, 3, 2, num_prefix_tokens=1),
                                 layout_3d(2, 4, 6, 1, 2, 3, num_prefix_tokens=4), layout_2d(4, 4, 2)])
def test_round_trip_with_prefix(lay):
    x = torch.randn(3, lay.num_prefix_tokens + lay.num_tokens, 5, 2)
    prefix, blocked = lay.to_blocks(x)
    assert prefix.shape == (3, lay.num_prefix_tokens, 5, 2) and blocked.shape == (3, lay.num_tokens, 5, 2)
    assert torch.equal(prefix, x[:, : lay.num_prefix_tokens])
    assert torch.equal(blocked, x[:, lay.num_prefix_tokens:][:, lay.permutation()])
    assert torch.equal(lay.from_blocks(prefix, blocked), x)


def test_wrong_lengths_raise():
    lay = layout_2d(4, 4, 2, num_prefix_tokens=1)
    x = torch.randn(2, 17, 3)
    with pytest.raises(ValueError, match="prefix"):
        lay.to_blocks(x[:, 1:])
    prefix, blocked = lay.to_blocks(x)
    with pytest.raises(ValueError, match="16"):
        lay.from_blocks(prefix, blocked[:, 1:])
    with pytest.raises(ValueError, match="prefix"):
        lay.from_blocks(prefix[:, :0], blocked)
    with pytest.raises(ValueError, match="agree"):
        lay.from_blocks(prefix[:1], blocked)


def test_reshape_permutation_equals_index_permutation():
    for lay in [layout_1d(12, 4), layout_2d(6, 8, 3, 4), layout_3d(4, 6, 4, 2, 3, 2)]:
        x = torch.randn(2, lay.num_tokens, 3, 2)
        assert torch.equal(lay.raster_to_block_major(x), x[:, lay.permutation()])
        assert torch.equal(lay.block_major_to_raster(x), x[:, lay.inverse_permutation()])


def test_centres_and_distances():
    lay = layout_2d(8, 12, 4)  # 2 x 3 blocks
    assert lay.block_centers().dtype == torch.float64
    want = [[0.5, 0.5], [0.5, 1.5], [0.5, 2.5], [1.5, 0.5], [1.5, 1.5], [1.5, 2.5]]
    assert lay.block_centers().tolist() == want
    d = lay.block_distances()
    assert d.shape == (6, 6) and d.dtype == torch.float64
    assert torch.all(d.diagonal() == 0) and torch.equal(d, d.T)
    assert d[0, 5].item() == pytest.approx(math.sqrt(1 + 4), abs=1e-15)
    assert d[1, 2].item() == 1.0
    c3 = layout_3d(4, 2, 6, 2, 1, 3).block_centers()  # blocks per axis (2, 2, 2)
    assert c3.shape == (8, 3)
    assert c3[0].tolist() == [0.5, 0.5, 0.5] and c3[1].tolist() == [0.5, 0.5, 1.5]
    assert c3[4].tolist() == [1.5, 0.5, 0.5]
    assert layout_1d(6, 2).block_distances().tolist() == [[0, 1, 2], [1, 0, 1], [2, 1, 0]]


@pytest.mark.parametrize("grid,block,axis", [((14, 14), (4, 4), "height"), ((16, 14), (4, 4), "width"),
                                             ((3, 8, 8), (2, 4, 4), "frames"), ((10,), (3,), "length")])
def test_untiled_grid_raises_naming_axis(grid, block, axis):
    with pytest.raises(ValueError, match=f"grid {axis} .* not divisible by block {axis}"):
        BlockLayout(grid, block)


def test_untiled_grid_message_lists_divisors():
    with pytest.raises(ValueError, match=r"divisors of 14: 1, 2, 7, 14"):
        layout_2d(14, 14, 4)


@pytest.mark.parametrize("grid,block,match", [
    ((4, 4), (2,), "same rank"),
    ((2, 2, 2, 2), (1, 1, 1, 1), "1, 2 or 3 dims"),
    ((0, 4), (1, 2), "grid height must be positive"),
    ((4, 4), (2, -2), "block width must be positive"),
    ((4.0, 4), (2, 2), "integer"),
    ((4, 4), (True, 2), "integer"),
    (16, (4,), "tuple of ints"),
])
def test_bad_arguments_raise(grid, block, match):
    with pytest.raises(ValueError, match=match):
        BlockLayout(grid, block)


def test_layout_is_immutable_and_hashable():
    lay = layout_2d(8, 8, 4)
    with pytest.raises(AttributeError):
        lay.grid = (4, 4)
    assert lay == BlockLayout([8, 8], [4, 4]) and hash(lay) == hash(BlockLayout((8, 8), (4, 4)))
    with pytest.raises(ValueError, match="num_prefix_tokens"):
        layout_2d(8, 8, 4, num_prefix_tokens=-1)


def test_layout_from_num_blocks():
    assert layout_from_num_blocks((16, 16), 16).block == (4, 4)
    assert layout_from_num_blocks((56, 56), 49).block == (8, 8)
    assert layout_from_num_blocks((16, 32), 4).block == (8, 16)
    assert layout_from_num_blocks((64,), 8).block == (8,)
    assert layout_from_num_blocks((4, 8, 8), 8).block == (2, 4, 4)
    assert layout_from_num_blocks((21, 30, 50), 1).block == (21, 30, 50)
    assert layout_from_num_blocks((16, 16), 16, num_prefix_tokens=1).num_prefix_tokens == 1
    with pytest.raises(ValueError, match="perfect square"):
        layout_from_num_blocks((16, 16), 8)
    with pytest.raises(ValueError, match="perfect cube"):
        layout_from_num_blocks((8, 8, 8), 16)
    with pytest.raises(ValueError, match="not divisible"):
        layout_from_num_blocks((14, 14), 16)
    with pytest.raises(ValueError, match=">= 1"):
        layout_from_num_blocks((16, 16), 0)
    with pytest.raises(ValueError, match=">= 1"):
        layout_from_num_blocks((16, 16), -4)


def test_num_blocks_for():
    assert [num_blocks_for(t, 64) for t in (0, 1, 64, 65, 128, 2049)] == [0, 1, 1, 2, 2, 33]
    with pytest.raises(ValueError, match="block_size"):
        num_blocks_for(10, 0)


@pytest.mark.parametrize("lay", [layout_1d(24, 6), layout_2d(6, 8, 3, 4), layout_3d(4, 4, 4, 2, 2, 2)])
def test_mhla_on_grid_equals_token_level_definition(lay):
    """Integration with the ops (fp64): MHLA on the permuted grid equals the definition on raster tokens."""
    from mhla.ops import mhla_attention  # imported here so the layout tests do not depend on the ops

    g = torch.Generator().manual_seed(0)
    B, H, D, N, M = 2, 2, 3, lay.num_tokens, lay.num_blocks
    q, k = (torch.rand(B, N, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, N, H, D, generator=g, dtype=torch.float64)
    mix = torch.rand(H, M, M, generator=g, dtype=torch.float64)
    blk = lay.token_block_ids_raster()
    w = torch.einsum("bthd,bshd->bhts", q, k) * mix[:, blk][:, :, blk]
    want = torch.einsum("bhts,bshe->bthe", w, v) / (w.sum(-1).transpose(1, 2).unsqueeze(-1) + 1e-6)
    _, qb = lay.to_blocks(q)
    _, kb = lay.to_blocks(k)
    _, vb = lay.to_blocks(v)
    got = lay.from_blocks(q[:, :0], mhla_attention(qb, kb, vb, mix, lay.block_size))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
