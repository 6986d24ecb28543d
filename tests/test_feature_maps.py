import pytest
import torch

from mhla.feature_maps import FEATURE_MAPS, NONNEGATIVE, focused_feature, get_feature_map


@pytest.mark.parametrize("name", sorted(NONNEGATIVE))
def test_nonnegative_maps(name):
    x = torch.randn(4, 7, 16) * 3
    assert (get_feature_map(name)(x) >= 0).all()


def test_focused_keeps_norm_and_sharpens():
    x = torch.randn(5, 32)
    y = focused_feature(x, p=3.0)
    base = torch.relu(x) + 1e-6
    torch.testing.assert_close(y.norm(dim=-1), base.norm(dim=-1), rtol=1e-5, atol=1e-6)
    # direction moves toward the largest coordinate
    cos_before = (base / base.norm(dim=-1, keepdim=True)).max(-1).values
    cos_after = (y / y.norm(dim=-1, keepdim=True)).max(-1).values
    assert (cos_after >= cos_before - 1e-6).all()


def test_names_and_kwargs():
    assert set(NONNEGATIVE) <= set(FEATURE_MAPS)
    f = get_feature_map("relu", eps=0.5)
    assert f(torch.tensor([-1.0])).item() == 0.5
    assert torch.equal(get_feature_map("identity")(torch.tensor([-2.0])), torch.tensor([-2.0]))
    with pytest.raises(ValueError, match="unknown feature map"):
        get_feature_map("tanh")
