"""DiT: shapes with every attention, adaLN-Zero init, sizes, 2-D MHLA layout, CFG, original-checkpoint loading."""

import pytest
import torch

from models.dit import DIT_SIZES, DiT, DiT_models, load_original_dit, sincos_2d


def tiny(attn, **kw):
    args = dict(input_size=8, patch_size=2, in_channels=2, hidden_size=32, depth=2, num_heads=2, num_classes=5)
    args.update(kw)
    return DiT(attn=attn, **args)


ATTNS = [{"name": "softmax"}, {"name": "linear"}, {"name": "mhla", "num_blocks": 4},
         {"name": "mhla", "num_blocks": 4, "cpe": True, "gate": True}, {"name": "focused"}, {"name": "inline"},
         {"name": "mala"}, {"name": "rala"}]


@pytest.mark.parametrize("attn", ATTNS, ids=lambda a: a["name"] + ("+cpe+gate" if a.get("cpe") else ""))
def test_forward_shape_and_zero_init_output(attn):
    torch.manual_seed(0)
    m = tiny(attn)
    x, t, y = torch.randn(3, 2, 8, 8), torch.tensor([0, 10, 999]), torch.tensor([0, 4, 2])
    out = m(x, t, y)
    assert out.shape == (3, 4, 8, 8)
    assert out.abs().max() == 0  # adaLN-Zero: the final layer starts at zero
    torch.nn.init.normal_(m.final_layer.linear.weight, std=0.02)
    for blk in m.blocks:
        torch.nn.init.normal_(blk.adaLN_modulation[-1].weight, std=0.02)
    out = m(x, t, y)
    out.float().pow(2).mean().backward()
    assert torch.isfinite(out).all() and m.x_embedder.proj.weight.grad.abs().sum() > 0


def test_variants_registered_and_dit_s2_size():
    assert set(DiT_models) == {f"{s}/{p}" for s in DIT_SIZES for p in (2, 4, 8)}
    m = DiT_models["DiT-S/2"](input_size=32, num_classes=1000, attn={"name": "softmax"})
    n = sum(p.numel() for p in m.parameters())
    assert 32.5e6 < n < 33.5e6  # DiT paper: DiT-S/2 has 33M parameters
    assert m.blocks[0].attn.num_heads == 6 and len(m.blocks) == 12


def test_mhla_uses_2d_blocks_of_the_patch_grid():
    m = DiT_models["DiT-S/8"](input_size=32, num_classes=10, attn={"name": "mhla", "num_blocks": 4})
    lay = m.blocks[0].attn.layout
    assert lay.grid == (4, 4) and lay.block == (2, 2) and lay.num_blocks == 4
    with pytest.raises(ValueError):
        DiT_models["DiT-S/8"](input_size=32, num_classes=10, attn={"name": "mhla", "num_blocks": 9})


def test_sincos_position_table():
    pe = sincos_2d(16, 4)
    assert pe.shape == (16, 16)
    assert (pe[0, :4] == 0).all() and (pe[0, 4:8] == 1).all()  # position (0, 0): sin 0, cos 0 for the rows
    assert not (pe[1] == pe[4]).all()  # (0, 1) and (1, 0) differ


def test_label_dropout_and_cfg():
    torch.manual_seed(0)
    m = tiny({"name": "mhla", "num_blocks": 4}, class_dropout_prob=0.5)
    for p in m.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    m.eval()
    x, t, y = torch.randn(2, 2, 8, 8), torch.tensor([3, 500]), torch.tensor([1, 3])
    cond = m(x, t, y)
    torch.testing.assert_close(m.forward_with_cfg(x, t, y, 1.0), cond)
    uncond = m(x, t, torch.full_like(y, 5))
    g = m.forward_with_cfg(x, t, y, 3.0)
    torch.testing.assert_close(g[:, :2], uncond[:, :2] + 3 * (cond[:, :2] - uncond[:, :2]))
    torch.testing.assert_close(g[:, 2:], cond[:, 2:])
    g1 = m.forward_with_cfg(x, t, y, 3.0, guidance_channels=1)
    torch.testing.assert_close(g1[:, 1:], cond[:, 1:])
    m.train()
    emb = m.y_embedder(torch.zeros(4000, dtype=torch.long), train=True)
    dropped = (emb == m.y_embedder.embedding_table.weight[5]).all(-1).float().mean().item()
    assert 0.45 < dropped < 0.55


def test_load_original_checkpoint_into_mhla(tmp_path):
    torch.manual_seed(0)
    src = tiny({"name": "softmax"})
    for p in src.parameters():
        torch.nn.init.normal_(p, std=0.1)
    path = tmp_path / "DiT-tiny.pt"
    torch.save({f"module.{k}" if k.startswith("blocks.0") else k: v for k, v in src.state_dict().items()}, path)
    dst = tiny({"name": "mhla", "num_blocks": 4, "cpe": True, "gate": True})
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    report = load_original_dit(dst, str(path))
    sd = dst.state_dict()
    for k, v in src.state_dict().items():
        torch.testing.assert_close(sd[k], v, msg=k)
    assert report.new and all(any(s in k for s in ("mixing", "cpe", "gate", "out_norm")) for k in report.new)
    for k in report.new:
        torch.testing.assert_close(sd[k], before[k])  # kept at init
    assert not report.unused and not report.mismatched
    assert "new" in report.summary()
    bigger = tiny({"name": "mhla", "num_blocks": 4}, num_classes=7)
    assert load_original_dit(bigger, str(path)).mismatched == ["y_embedder.embedding_table.weight"]
    with pytest.raises(FileNotFoundError, match="dl.fbaipublicfiles.com/DiT"):
        load_original_dit(dst, str(tmp_path / "missing.pt"))
