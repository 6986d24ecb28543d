"""GPU checks (skipped without CUDA): the torch paths in bf16 at realistic shapes, and the trainer on CUDA."""

import pytest
import torch

import mhla

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_torch_path_matches_fp32_at_realistic_shapes(causal):
    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, D = 2, 4096, 8, 64
    q = torch.rand(B, T, H, D, device="cuda", generator=g).bfloat16()
    k = torch.rand(B, T, H, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(B, T, H, D, device="cuda", generator=g).bfloat16()
    M = 64
    mix = mhla.mixing_init("locality", mhla.distances_1d(M), causal=causal).cuda()
    got = mhla.mhla_attention(q, k, v, mix.bfloat16(), T // M, causal=causal, backend="torch")
    want = mhla.mhla_attention(q.float(), k.float(), v.float(), mix.bfloat16().float(), T // M, causal=causal,
                               backend="torch")
    err = (got.float() - want).abs().max() / want.abs().max()
    assert err <= 1e-2


def test_decode_on_gpu_matches_full_forward():
    B, T, H, D, C = 1, 300, 4, 32, 64
    q, k = (torch.rand(B, T, H, D, device="cuda") for _ in range(2))
    v = torch.randn(B, T, H, D, device="cuda")
    mix = torch.rand(5, 5, device="cuda")
    full = mhla.mhla_attention(q, k, v, mix, C, causal=True, backend="torch")
    state = mhla.init_state(B, H, D, D, C, device="cuda")
    outs = []
    for t in range(T):
        o, state = mhla.mhla_decode_step(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], mix, state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-4, atol=1e-4)
