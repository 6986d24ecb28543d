"""Block layouts: block-major order, round trips with prefix tokens, centres, bad grids."""

import itertools
import math

import pytest
import torch

import mhla
from mhla.layouts import BlockLayout, layout_1d, layout_2d, layout_3d, layout_from_num_blocks, num_blocks_for
from mhla.ops import mhla_attention


def brute_force_block_ids(grid, block):
    """Block id of every raster token, by loops over coordinates (blocks in raster order of the block grid)."""
    counts = [g // b for g, b in zip(grid, block)]
    ids = []
    for coord in itertools.product(*[range(g) for g in grid]):
        bc = [c // b for c, b in zip(coord, block)]
        bid = 0
        for n, c in zip(counts, bc):
            bid = bid * n + c
        ids.append(bid)
    return torch.tensor(ids)


@pytest.mark.parametrize("grid,block", [((12,), (4,)), ((8, 12), (4, 3)), ((4, 6, 4), (2, 3, 2)), ((5, 5), (5, 1))])
def test_block_ids_match_definition(grid, block):
    lay = BlockLayout(grid, block)
    assert torch.equal(lay.token_block_ids_raster(), brute_force_block_ids(grid, block))
    # block-major order: token j of the permuted sequence belongs to block j // C
    assert torch.equal(lay.token_block_ids_raster()[lay.permutation()], lay.block_index())
    assert lay.num_blocks == math.prod(g // b for g, b in zip(grid, block))


def test_within_block_raster_order():
    lay = layout_2d(4, 4, 2)
    # block 0 holds raster tokens 0, 1, 4, 5; block 1 holds 2, 3, 6, 7
    assert lay.permutation()[:8].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]


@pytest.mark.parametrize("lay", [layout_1d(10, 5, 2), layout_2d(6, 4, 3, 2, num_prefix_tokens=1),
                                 layout_3d(2, 4, 6, 1, 2, 3, num_prefix_tokens=4)])
def test_round_trip_with_prefix(lay):
    x = torch.randn(3, lay.num_prefix_tokens + lay.num_tokens, 5)
    prefix, blocked = lay.to_blocks(x)
    assert prefix.shape[1] == lay.num_prefix_tokens and blocked.shape[1] == lay.num_tokens
    assert torch.equal(lay.from_blocks(prefix, blocked), x)
    assert torch.equal(prefix, x[:, : lay.num_prefix_tokens])
    with pytest.raises(ValueError, match="prefix"):
        lay.to_blocks(x[:, 1:])


def test_centres_and_distances():
    lay = layout_2d(8, 8, 4)  # 2 x 2 blocks
    assert lay.block_centers().tolist() == [[0.5, 0.5], [0.5, 1.5], [1.5, 0.5], [1.5, 1.5]]
    d = lay.block_distances()
    assert d[0, 3].item() == pytest.approx(math.sqrt(2))
    assert layout_3d(2, 2, 2, 1, 1, 1).block_centers().shape == (8, 3)


@pytest.mark.parametrize("grid,block,axis", [((14, 14), (4, 4), "height"), ((16, 14), (4, 4), "width"),
                                             ((3, 8, 8), (2, 4, 4), "frames"), ((10,), (3,), "length")])
def test_untiled_grid_raises_naming_axis(grid, block, axis):
    with pytest.raises(ValueError, match=f"grid {axis}"):
        BlockLayout(grid, block)


def test_layout_from_num_blocks():
    assert layout_from_num_blocks((16, 16), 16).block == (4, 4)
    assert layout_from_num_blocks((56, 56), 49).block == (8, 8)
    assert layout_from_num_blocks((21, 30, 50), 1).block == (21, 30, 50)
    with pytest.raises(ValueError, match="perfect square"):
        layout_from_num_blocks((16, 16), 8)
    with pytest.raises(ValueError, match="not divisible"):
        layout_from_num_blocks((14, 14), 16)
    assert num_blocks_for(65, 64) == 2


@pytest.mark.parametrize("lay", [layout_1d(24, 6), layout_2d(6, 8, 3, 4), layout_3d(4, 4, 4, 2, 2, 2)])
def test_mhla_on_grid_equals_token_level_definition(lay):
    """fp64: MHLA on the permuted grid equals the definition written on raster tokens."""
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
    assert mhla.mhla_attention is mhla_attention


@pytest.mark.parametrize("lay", [layout_1d(12, 4), layout_2d(6, 8, 3, 4), layout_3d(4, 6, 4, 2, 3, 2)])
def test_reshape_permutation_equals_index_permutation(lay):
    x = torch.randn(2, lay.num_tokens, 3, 2)
    assert torch.equal(lay.raster_to_block_major(x), x[:, lay.permutation()])
    assert torch.equal(lay.block_major_to_raster(lay.raster_to_block_major(x)), x)
