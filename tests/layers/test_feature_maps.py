"""Feature maps: nonnegativity, the focused map's norm and stability, name lookup."""

import pytest
import torch
import torch.nn.functional as F

from mhla.feature_maps import (
    FEATURE_MAPS,
    NONNEGATIVE,
    elu_plus_one,
    focused_feature,
    get_feature_map,
    identity_feature,
    relu_feature,
    softplus_feature,
)


@pytest.mark.parametrize("name", sorted(NONNEGATIVE))
def test_nonnegative_maps(name):
    x = torch.randn(4, 7, 16) * 3
    y = get_feature_map(name)(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert (y >= 0).all()


def test_definitions():
    x = torch.linspace(-4, 4, 17)
    torch.testing.assert_close(relu_feature(x), torch.relu(x) + 1e-6)
    torch.testing.assert_close(elu_plus_one(x), F.elu(x) + 1)
    torch.testing.assert_close(softplus_feature(x), F.softplus(x))
    assert identity_feature(x) is x
    assert (identity_feature(x) < 0).any() and "identity" not in NONNEGATIVE


def test_focused_keeps_norm_and_sharpens():
    x = torch.randn(5, 32)
    y = focused_feature(x, p=3.0)
    base = torch.relu(x) + 1e-6
    torch.testing.assert_close(y.norm(dim=-1), base.norm(dim=-1), rtol=1e-5, atol=1e-6)
    # the textbook formula (||y|| / ||y^p||) y^p
    want = base**3 * (base.norm(dim=-1, keepdim=True) / (base**3).norm(dim=-1, keepdim=True))
    torch.testing.assert_close(y, want)
    # the direction moves toward the largest coordinate
    cos_before = (base / base.norm(dim=-1, keepdim=True)).max(-1).values
    cos_after = (y / y.norm(dim=-1, keepdim=True)).max(-1).values
    assert (cos_after >= cos_before - 1e-6).all()
    # p = 1 is relu + eps
    torch.testing.assert_close(focused_feature(x, p=1.0), base)


def test_focused_is_stable_and_keeps_dtype():
    x = torch.randn(3, 64)
    for scale in (1e-8, 1e15):  # y^3 would underflow / overflow fp32 without the rescaling
        y = focused_feature(x * scale)
        assert torch.isfinite(y).all()
        base = torch.relu(x * scale) + 1e-6
        torch.testing.assert_close(y.norm(dim=-1), base.norm(dim=-1), rtol=1e-5, atol=0)
    torch.testing.assert_close(focused_feature(torch.full((2, 8), -1.0)).norm(dim=-1),
                               torch.full((2,), 1e-6 * 8**0.5))  # all-negative input: eps everywhere
    xb = (torch.randn(4, 32) * 100).to(torch.bfloat16)
    yb = focused_feature(xb)
    assert yb.dtype == torch.bfloat16 and torch.isfinite(yb.float()).all()
    xg = torch.randn(2, 16, requires_grad=True)
    focused_feature(xg).sum().backward()
    assert torch.isfinite(xg.grad).all()


def test_names_and_kwargs():
    assert set(NONNEGATIVE) <= set(FEATURE_MAPS)
    assert set(FEATURE_MAPS) == {"relu", "elu", "elu+1", "identity", "softplus", "focused"}
    assert get_feature_map("elu") is get_feature_map("elu+1") is elu_plus_one
    f = get_feature_map("relu", eps=0.5)
    assert f(torch.tensor([-1.0])).item() == 0.5
    x = torch.randn(3, 8)
    torch.testing.assert_close(get_feature_map("focused", p=2.0)(x), focused_feature(x, p=2.0))
    assert torch.equal(get_feature_map("identity")(torch.tensor([-2.0])), torch.tensor([-2.0]))
    with pytest.raises(ValueError, match="unknown feature map 'tanh'; choose one of relu"):
        get_feature_map("tanh")
    with pytest.raises(ValueError, match="takes no option"):
        get_feature_map("elu", eps=1e-3)
