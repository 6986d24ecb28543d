"""Plain linear attention and softmax attention ops."""

import pytest
import torch

from mhla.ops import linear_attention, linear_reference, softmax_attention, softmax_reference

F64 = torch.float64


def qkv(T=50, Tq=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(2, Tq or T, 3, 4, generator=g, dtype=F64)
    k = torch.rand(2, T, 3, 4, generator=g, dtype=F64)
    v = torch.randn(2, T, 3, 5, generator=g, dtype=F64)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_linear_attention_matches_dense(causal, normalize, chunk):
    q, k, v = qkv()
    got = linear_attention(q, k, v, causal=causal, normalize=normalize, chunk_size=chunk)
    want = linear_reference(q, k, v, causal=causal, normalize=normalize)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_linear_attention_cross_lengths_noncausal():
    q, k, v = qkv(T=40, Tq=3)
    got = linear_attention(q, k, v)
    torch.testing.assert_close(got, linear_reference(q, k, v), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("split", [1, 17, 32])
def test_linear_attention_state_split_equals_one_call(split):
    q, k, v = qkv()
    full = linear_attention(q, k, v, causal=True)
    o1, st = linear_attention(q[:, :split], k[:, :split], v[:, :split], causal=True, output_final_state=True,
                              chunk_size=8)
    o2 = linear_attention(q[:, split:], k[:, split:], v[:, split:], causal=True, initial_state=st)
    torch.testing.assert_close(torch.cat([o1, o2], 1), full, rtol=1e-10, atol=1e-10)


def test_linear_attention_bad_state():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="state must be"):
        linear_attention(q, k, v, causal=True, initial_state=(torch.zeros(1), torch.zeros(1)))
    with pytest.raises(ValueError, match="causal=True only"):
        linear_attention(q, k, v, output_final_state=True)


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_attention_matches_explicit_softmax(causal):
    q, k, v = qkv(T=20)
    got = softmax_attention(q, k, v, causal=causal)
    torch.testing.assert_close(got, softmax_reference(q, k, v, causal=causal), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(softmax_attention(q, k, v, scale=0.3), softmax_reference(q, k, v, scale=0.3),
                               rtol=1e-10, atol=1e-10)
