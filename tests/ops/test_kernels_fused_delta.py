"""The normalizer's ``delta_t = do_t . o_t`` computed inside ``_bwd_block_grads_kernel``, and the causal mixing
read as views of the dense matrix (no gathers): gradients against the float64 torch path.

``delta`` is a dot over all of ``Dv``; the kernel's V-tile-0 programs form it over every V tile, and the
K-tile-0 ones store it for ``_bwd_dqk_kernel``. The cases below put the feature tiles on both sides of that
split (one K tile and three V tiles, three K tiles and one V tile), a state that starts mid-block (empty
positions before token 0, which must not be stored), and a causal dense mixing whose entries on and above the
diagonal hold values the kernels must not read as "earlier" coefficients.
"""


import pytest
import torch

from helpers.triton_env import DEVICE  # noqa: E402  (first: sets TRITON_INTERPRET)

from mhla.ops import mhla_attention  # noqa: E402



def _inputs(B, T, H, D, Dv, M, *, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.rand(B, T, H, D, generator=g) for _ in range(2))
    v = torch.randn(B, T, H, Dv, generator=g)
    mix = torch.rand(M, M, generator=g)
    w = torch.randn(B, T, H, Dv, generator=g)
    return [x.to(DEVICE, dtype) for x in (q, k, v)] + [mix.to(DEVICE), w.to(DEVICE)]


def _grads(backend, q, k, v, mix, w, C, **kw):
    """Output and gradients (q, k, v, mixing) of ``sum(o * w)``."""
    xs = [x.detach().clone().requires_grad_() for x in (q, k, v, mix)]
    o = mhla_attention(*xs, C, backend=backend, **kw)
    (o.double() * w.double()).sum().backward()
    return [o.detach()] + [x.grad for x in xs]


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("D, Dv", [(32, 96), (96, 32)], ids=["1K-3V", "3K-1V"])
def test_fused_delta_across_feature_tiles(causal, D, Dv):
    """Every gradient matches the fp64 torch path when ``Dv`` spans several V tiles (the delta of the V-tile-0
    programs sums them all) or ``D`` several K tiles (each K tile's V-tile-0 program forms the same delta)."""
    B, T, H, C = 2, 96, 2, 32
    q, k, v, mix, w = _inputs(B, T, H, D, Dv, T // C)
    got = _grads("triton", q, k, v, mix, w, C, causal=causal)
    ref = _grads("torch", *(x.double() for x in (q, k, v, mix)), w, C, causal=causal)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dmixing"), got, ref):
        assert _rel(a, b) <= 1e-5, name


def test_block_grads_returns_delta_and_skips_empty_positions():
    """``bwd_block_grads`` returns ``delta [B*H, T] = do . o`` (fp32), also for a call that starts mid-block:
    the ``OFFSET`` empty positions before token 0 are not tokens and leave the buffer alone."""
    from mhla.ops.mhla.triton.chunk import Geometry, bwd_block_grads

    B, T, H, D, Dv, C, offset = 2, 50, 3, 32, 96, 32, 7
    g = torch.Generator().manual_seed(1)
    q = torch.rand(B, T, H, D, generator=g).to(DEVICE)
    do, o = (torch.randn(B, T, H, Dv, generator=g).to(DEVICE) for _ in range(2))
    geo = Geometry.make(q, o, C, offset)
    assert geo.NV == 3 and geo.OFFSET == offset
    den = torch.rand(B * H, T, generator=g).to(DEVICE) + 0.5
    *_, delta = bwd_block_grads(q, do, o, den, None, None, geo, normalize=True)
    want = (do.double() * o.double()).sum(-1).transpose(1, 2).reshape(B * H, T)
    torch.testing.assert_close(delta.double(), want, rtol=1e-5, atol=1e-5)
    assert bwd_block_grads(q, do, o, den, None, None, geo, normalize=False)[-1] is None


@pytest.mark.parametrize("normalize", [True, False])
def test_causal_mixing_above_the_diagonal_is_not_read(normalize):
    """Causal: the kernels read row ``i`` of a dense mixing at columns ``b < i`` and its diagonal only (the
    rows are views of the matrix, not masked copies). Entries above the diagonal set to NaN change nothing, and
    their gradient is zero; the strictly-lower part and the diagonal get the gradient of the zeroed matrix."""
    B, T, H, D, C = 1, 80, 2, 16, 16
    q, k, v, mix, w = _inputs(B, T, H, D, D, T // C, seed=2)
    upper = torch.ones_like(mix, dtype=torch.bool).triu(1)
    clean = _grads("triton", q, k, v, mix.masked_fill(upper, 0.0), w, C, causal=True, normalize=normalize)
    noisy = _grads("triton", q, k, v, mix.masked_fill(upper, float("nan")), w, C, causal=True,
                   normalize=normalize)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dmixing"), noisy, clean):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert (noisy[4][upper] == 0).all()
    assert (noisy[4].diagonal() != 0).any()  # the diagonal's gradient comes back through the view
