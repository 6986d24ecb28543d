"""Mixing-matrix initialisations and the learnable MixingMatrix."""

import math

import pytest
import torch

from mhla.layouts import layout_2d
from mhla.mixing import INIT_KINDS, MixingMatrix, distances_1d, mixing_init


def test_locality_init_defining_properties():
    d = layout_2d(16, 16, 4).block_distances()  # the paper's 4 x 4 block grid, M = 16
    w = mixing_init("locality", d)
    assert w.shape == (16, 16) and (w >= 0).all()
    torch.testing.assert_close(w.sum(1), torch.ones(16))
    assert torch.equal(w.argmax(1), torch.arange(16))
    far = d.argmax(1)
    assert torch.all(w[torch.arange(16), far] == 0)
    # row 0 (block centre (0.5, 0.5)) by hand: raw = 1 - d / max_d, max_d = sqrt(18)
    raw = 1 - d[0] / math.sqrt(18)
    torch.testing.assert_close(w[0], (raw / raw.sum()).float())


def test_official_init_is_column_normalised_with_global_max():
    d = layout_2d(16, 16, 4).block_distances()
    w = mixing_init("locality_official", d)
    torch.testing.assert_close(w.sum(0), torch.ones(16))
    raw = 1 - d / d.max()
    torch.testing.assert_close(w, (raw / raw.sum(0, keepdim=True)).float())
    assert not torch.allclose(w, mixing_init("locality", d))


def test_causal_inits():
    d = distances_1d(6)
    w = mixing_init("locality", d, causal=True)
    assert torch.equal(w, w.tril())
    assert w[0].tolist() == [1, 0, 0, 0, 0, 0]
    torch.testing.assert_close(w.sum(1), torch.ones(6))
    assert w[3, 0] == 0 and w[3, 3] == w[3].max()
    u = mixing_init("uniform", d, causal=True)
    for i in range(6):
        torch.testing.assert_close(u[i, : i + 1], torch.full((i + 1,), 1 / (i + 1)))


@pytest.mark.parametrize("kind", INIT_KINDS)
def test_every_kind_is_nonnegative_and_normalised(kind):
    w = mixing_init(kind, layout_2d(8, 8, 2).block_distances())
    assert (w >= 0).all()
    sums = w.sum(0) if kind == "locality_official" else w.sum(1)
    torch.testing.assert_close(sums, torch.ones(16))


def test_identity_and_unknown():
    assert torch.equal(mixing_init("identity", distances_1d(3)), torch.eye(3))
    with pytest.raises(ValueError, match="unknown mixing init"):
        mixing_init("bogus", distances_1d(3))


def test_module_per_head_frozen_and_softplus():
    m = MixingMatrix(4, num_heads=3)
    assert m().shape == (3, 4, 4) and len(list(m.parameters())) == 1
    frozen = MixingMatrix(4, learnable=False)
    assert len(list(frozen.parameters())) == 0 and frozen().shape == (4, 4)
    sp = MixingMatrix(4, parameterization="softplus")
    torch.testing.assert_close(sp(), mixing_init("locality", distances_1d(4)), atol=1e-3, rtol=0)
    with pytest.raises(ValueError, match="parameterization"):
        MixingMatrix(4, parameterization="exp")


def test_clamp_stays_nonnegative_and_zero_entries_still_learn():
    m = MixingMatrix(4)  # locality init has zeros at the farthest blocks
    assert m()[0, 3] == 0
    opt = torch.optim.SGD(m.parameters(), lr=10.0)
    (m() * torch.tensor([[1.0, 1, 1, -1]] * 4)).sum().backward()  # pushes column 3 up, others down
    assert m.raw.grad[0, 3] != 0  # the straight-through clamp passes gradient at 0
    opt.step()
    assert (m() >= 0).all() and (m() <= 1).all()
    assert (m.raw < 0).any()
    m.project_()
    assert (m.raw >= 0).all() and (m.raw <= 1).all()
    assert m()[0, 3] > 0  # the zero entry grew


def brute_force_extension(L, n):
    M = L.shape[-1]
    W = torch.zeros(n, n)
    for i in range(n):
        for b in range(i + 1):
            if i < M:
                W[i, b] = L[i, b]
            elif i - b <= M - 1:
                W[i, b] = L[M - 1, M - 1 - (i - b)]
            else:
                W[i, b] = L[M - 1, 0]
    return W


def test_causal_extension_rule_and_gradients():
    m = MixingMatrix(5, init="uniform", causal=True)
    with torch.no_grad():
        m.raw.copy_(torch.rand(5, 5))
    L = m.learned().detach()
    W = m(15)
    assert torch.equal(W, W.tril())
    torch.testing.assert_close(W.detach(), brute_force_extension(L, 15))
    torch.testing.assert_close(m(3), L[:3, :3])
    W.sum().backward()
    assert m.raw.grad.tril().abs().sum() > 0


def test_noncausal_cannot_extend():
    with pytest.raises(ValueError, match="built for M = 4"):
        MixingMatrix(4)(6)
