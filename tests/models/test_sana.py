"""SANA (diffusers SanaTransformer2DModel, tiny config, no download) with MHLA in attn1 only."""

from __future__ import annotations

import pytest
import torch

from models.sana import SANA_600M, build_sana


def _tiny(attn):
    torch.manual_seed(0)
    return build_sana({"config": "sana_tiny"}, attn)


def test_tiny_sana_builds_and_swaps_only_self_attention():
    native = _tiny({"name": "native"})
    assert type(native.transformer_blocks[0].attn1.processor).__name__ == "SanaLinearAttnProcessor2_0"
    cross = type(native.transformer_blocks[0].attn2.processor)
    model = _tiny({"name": "mhla", "num_blocks": 4})
    for blk in model.transformer_blocks:
        assert type(blk.attn1.processor).__name__ == "AttentionProcessor"
        assert type(blk.attn2.processor) is cross              # cross-attention stays softmax
        assert blk.attn1.attention.mixing().shape == (4, 4)
    out = model(torch.randn(2, 8, 8, 8), torch.randn(2, 5, 32), torch.rand(2) * 1000).sample
    assert out.shape == (2, 8, 8, 8)
    assert SANA_600M["num_attention_heads"] * SANA_600M["attention_head_dim"] == 1152


def _token_view_mhla(x, attn, grid, blocks, eps=1e-6):
    """Dense oracle: query t (block i) weights key s (block j) by Mc[i, j] * phi(q_t) . phi(k_s), normalised."""
    B, N, C = x.shape
    H = attn.heads
    q, k, v = (f(x).view(B, N, H, -1).double() for f in (attn.to_q, attn.to_k, attn.to_v))
    q, k = torch.relu(q) + 1e-6, torch.relu(k) + 1e-6
    h, w = grid
    bh, bw = h // blocks[0], w // blocks[1]
    rows, cols = torch.arange(N) // w, torch.arange(N) % w
    blk = (rows // bh) * blocks[1] + cols // bw
    mix = attn.attention.mixing().double()[blk][:, blk]                      # [N, N]
    weights = torch.einsum("bthd,bshd->bhts", q, k) * mix
    o = torch.einsum("bhts,bshd->bthd", weights, v) / (weights.sum(-1).transpose(1, 2)[..., None] + eps)
    return attn.to_out[0](o.reshape(B, N, -1).to(x.dtype))


def test_swapped_processor_equals_reference_mhla():
    model = _tiny({"name": "mhla", "num_blocks": 4}).double()
    with torch.no_grad():  # a non-uniform learned mixing, so the test sees the block structure
        for blk in model.transformer_blocks:
            blk.attn1.attention.mixing.raw.uniform_(0.05, 1.0)
    seen = {}
    attn1 = model.transformer_blocks[1].attn1
    attn1.register_forward_hook(lambda m, args, kwargs, out: seen.update(x=kwargs.get("hidden_states", args[0] if args else None), y=out),
                                with_kwargs=True)
    model(torch.randn(2, 8, 8, 8, dtype=torch.float64), torch.randn(2, 5, 32, dtype=torch.float64), torch.rand(2) * 1000)
    ref = _token_view_mhla(seen["x"], attn1, (8, 8), (2, 2))
    torch.testing.assert_close(seen["y"], ref, rtol=1e-8, atol=1e-8)


def test_tiny_sana_two_flow_matching_steps():
    from tasks.common.flow_matching import flow_matching_loss

    model = _tiny({"name": "mhla", "num_blocks": 4})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x0, text = torch.randn(2, 8, 8, 8), torch.randn(2, 5, 32)
    mix0 = model.transformer_blocks[0].attn1.attention.mixing.raw.detach().clone()
    for _ in range(2):
        loss = flow_matching_loss(lambda xt, t: model(xt, text, t * 1000).sample, x0, shift=3.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
    assert not torch.equal(mix0, model.transformer_blocks[0].attn1.attention.mixing.raw)  # the mixing trains


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="Sana_600M_1024px_diffusers"):
        build_sana({"pretrained": str(tmp_path / "nope")}, {"name": "mhla", "num_blocks": 16})
