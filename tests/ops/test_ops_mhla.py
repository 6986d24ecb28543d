"""MHLA ops against the dense definition, and the properties the paper's operator must have."""

import math

import pytest
import torch

import mhla
from mhla.ops import (
    init_state,
    linear_attention,
    linear_reference,
    mhla_attention,
    mhla_decode_step,
    mhla_reference,
)

F64 = torch.float64


def rand_qkv(B, T, H, D, Dv=None, *, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    Dv = Dv or D
    q = torch.rand(B, T, H, D, generator=g, dtype=F64)
    k = torch.rand(B, T, H, D, generator=g, dtype=F64)
    v = torch.randn(B, T, H, Dv, generator=g, dtype=F64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def rand_mixing(M, H=None, *, seed=1, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    shape = (M, M) if H is None else (H, M, M)
    return torch.rand(*shape, generator=g, dtype=F64).to(dtype)


def dense_oracle(q, k, v, mixing, token_blocks, *, causal=False, normalize=True, eps=1e-6):
    """Independent oracle on arbitrary token order: W[t, s] = mixing[blk(t), blk(s)] * q_t . k_s."""
    H = q.shape[2]
    mix = mixing if mixing.dim() == 3 else mixing.expand(H, -1, -1)
    coeff = mix[:, token_blocks][:, :, token_blocks]  # [H, T, T]
    w = torch.einsum("bthd,bshd->bhts", q, k) * coeff
    if causal:
        w = w * torch.ones_like(w[0, 0]).tril()
    out = torch.einsum("bhts,bshe->bthe", w, v)
    if normalize:
        out = out / (w.sum(-1).transpose(1, 2).unsqueeze(-1) + eps)
    return out


# --------------------------------------------------------------------------------------- non-causal


@pytest.mark.parametrize("M,C", [(1, 7), (4, 16), (16, 4), (9, 5)])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("normalize", [True, False])
def test_noncausal_matches_dense_definition(M, C, per_head, normalize):
    B, H, D, Dv = 2, 3, 6, 5
    q, k, v = rand_qkv(B, M * C, H, D, Dv)
    mix = rand_mixing(M, H if per_head else None)
    blocks = torch.arange(M * C) // C
    want = dense_oracle(q, k, v, mix, blocks, normalize=normalize)
    got = mhla_attention(q, k, v, mix, C, normalize=normalize, backend="torch")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    ref = mhla_attention(q, k, v, mix, C, normalize=normalize, backend="reference")
    torch.testing.assert_close(ref, want, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------------------- causal


@pytest.mark.parametrize("T,C", [(1, 4), (63, 8), (100, 16), (64, 64), (65, 64), (37, 1)])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("normalize", [True, False])
def test_causal_matches_dense_definition(T, C, per_head, normalize):
    B, H, D, Dv = 2, 2, 5, 3
    q, k, v = rand_qkv(B, T, H, D, Dv)
    nb = math.ceil(T / C)
    mix = rand_mixing(nb + 2, H if per_head else None)  # more rows than needed is allowed
    blocks = torch.arange(T) // C
    want = dense_oracle(q, k, v, mix, blocks, causal=True, normalize=normalize)
    got = mhla_attention(q, k, v, mix, C, causal=True, normalize=normalize, backend="torch")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_causal_ignores_upper_triangle_of_mixing():
    q, k, v = rand_qkv(1, 50, 2, 4)
    mix = rand_mixing(5)
    lower = mix.tril()
    a = mhla_attention(q, k, v, mix, 10, causal=True, backend="torch")
    b = mhla_attention(q, k, v, lower, 10, causal=True, backend="torch")
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_causal_many_blocks_beyond_2048_tokens():
    """T > 2048 (the release's cap) with many blocks, against the dense definition."""
    B, T, H, D, C = 1, 2600, 1, 4, 16  # 163 blocks, the last one partial
    q, k, v = rand_qkv(B, T, H, D)
    nb = math.ceil(T / C)
    mix = rand_mixing(nb)
    want = dense_oracle(q, k, v, mix, torch.arange(T) // C, causal=True)
    got = mhla_attention(q, k, v, mix, C, causal=True, backend="torch")
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_noncausal_many_blocks():
    q, k, v = rand_qkv(1, 2304, 2, 4)  # 256 blocks of 9
    mix = rand_mixing(256, 2)
    want = dense_oracle(q, k, v, mix, torch.arange(2304) // 9)
    got = mhla_attention(q, k, v, mix, 9, backend="torch")
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------------------- properties


@pytest.mark.parametrize("causal", [False, True])
def test_single_block_equals_linear_attention(causal):
    q, k, v = rand_qkv(2, 40, 3, 6, 4)
    mix = torch.ones(1, 1, dtype=F64)
    got = mhla_attention(q, k, v, mix, 40, causal=causal, backend="torch")
    torch.testing.assert_close(got, linear_attention(q, k, v, causal=causal), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(
        got, linear_reference(q, k, v, causal=causal), rtol=1e-10, atol=1e-10
    )


def test_all_ones_causal_mixing_equals_causal_linear_attention():
    q, k, v = rand_qkv(2, 77, 2, 5)
    mix = torch.ones(10, 10, dtype=F64)
    got = mhla_attention(q, k, v, mix, 8, causal=True, backend="torch")
    torch.testing.assert_close(got, linear_attention(q, k, v, causal=True), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_identity_mixing_equals_block_local_linear_attention(causal):
    C, M = 8, 5
    q, k, v = rand_qkv(2, C * M, 2, 4, 3)
    got = mhla_attention(q, k, v, torch.eye(M, dtype=F64), C, causal=causal, backend="torch")
    for b in range(M):
        sl = slice(b * C, (b + 1) * C)
        want = linear_attention(q[:, sl], k[:, sl], v[:, sl], causal=causal)
        torch.testing.assert_close(got[:, sl], want, rtol=1e-10, atol=1e-10)


def test_causal_outputs_ignore_future_tokens():
    T, C, cut = 90, 16, 41
    q, k, v = rand_qkv(2, T, 2, 4)
    mix = rand_mixing(6)
    a = mhla_attention(q, k, v, mix, C, causal=True, backend="torch")
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    q2[:, cut:] = torch.rand_like(q2[:, cut:])
    k2[:, cut:] = torch.rand_like(k2[:, cut:]) * 5
    v2[:, cut:] = torch.randn_like(v2[:, cut:]) * 5
    b = mhla_attention(q2, k2, v2, mix, C, causal=True, backend="torch")
    torch.testing.assert_close(a[:, :cut], b[:, :cut], rtol=0, atol=1e-13)
    assert (a[:, cut:] - b[:, cut:]).abs().max() > 1e-3  # and the future does change the future


def test_noncausal_rows_of_effective_attention_sum_to_one():
    q, k, _ = rand_qkv(1, 32, 2, 4)
    A = mhla.mhla_attention_matrix(q, k, rand_mixing(4), 8, eps=0.0)
    torch.testing.assert_close(A.sum(-1), torch.ones_like(A.sum(-1)), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------- state and decode


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("per_head", [False, True])
def test_decode_token_by_token_equals_full_forward(normalize, per_head):
    B, T, H, D, Dv, C = 2, 75, 2, 4, 3, 8
    q, k, v = rand_qkv(B, T, H, D, Dv)
    mix = rand_mixing(math.ceil(T / C), H if per_head else None)
    full = mhla_attention(q, k, v, mix, C, causal=True, normalize=normalize, backend="torch")
    state = init_state(B, H, D, Dv, C, dtype=F64)
    outs = []
    for t in range(T):
        o, state = mhla_decode_step(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], mix, state,
                                    normalize=normalize)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)
    assert state.num_tokens == T and state.num_finished_blocks == T // C


def test_decode_beyond_2048_tokens_with_prefill():
    """Prefill 2000 tokens in one call, then decode 150 more one by one (crossing 2048)."""
    B, T, H, D, C, P = 1, 2150, 2, 4, 64, 2000
    q, k, v = rand_qkv(B, T, H, D, seed=3)
    mix = rand_mixing(math.ceil(T / C), seed=4)
    full = mhla_attention(q, k, v, mix, C, causal=True, backend="torch")
    o_pre, state = mhla_attention(q[:, :P], k[:, :P], v[:, :P], mix, C, causal=True,
                                  output_final_state=True, backend="torch")
    outs = [o_pre]
    for t in range(P, T):
        o, state = mhla_decode_step(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], mix, state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("splits", [[30], [16, 32], [1, 2, 3, 50], [7, 8, 9, 61, 63]])
@pytest.mark.parametrize("normalize", [True, False])
def test_state_split_and_resume_equals_one_call(splits, normalize):
    B, T, H, D, C = 2, 70, 3, 4, 8
    q, k, v = rand_qkv(B, T, H, D, 5)
    mix = rand_mixing(9, H)
    full, full_state = mhla_attention(q, k, v, mix, C, causal=True, normalize=normalize,
                                      output_final_state=True, backend="torch")
    bounds = [0, *splits, T]
    outs, state = [], None
    for a, b in zip(bounds[:-1], bounds[1:]):
        o, state = mhla_attention(q[:, a:b], k[:, a:b], v[:, a:b], mix, C, causal=True,
                                  normalize=normalize, initial_state=state, output_final_state=True,
                                  backend="torch")
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)
    assert state.num_tokens == full_state.num_tokens == T
    torch.testing.assert_close(state.block_summaries, full_state.block_summaries)
    torch.testing.assert_close(state.current_summary, full_state.current_summary)


def test_decode_after_mid_block_prefill_and_prefill_after_decode():
    B, T, H, D, C = 1, 40, 2, 3, 8
    q, k, v = rand_qkv(B, T, H, D)
    mix = rand_mixing(5)
    full = mhla_attention(q, k, v, mix, C, causal=True, backend="torch")
    o1, st = mhla_attention(q[:, :13], k[:, :13], v[:, :13], mix, C, causal=True, output_final_state=True)
    outs = [o1]
    for t in range(13, 20):
        o, st = mhla_decode_step(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], mix, st)
        outs.append(o)
    o3 = mhla_attention(q[:, 20:], k[:, 20:], v[:, 20:], mix, C, causal=True, initial_state=st)
    outs.append(o3)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)


def test_state_keeps_every_finished_block():
    """The release dropped the previous chunk's summary in its cached path; ours keeps all of them."""
    B, T, H, D, C = 1, 24, 1, 2, 8
    q, k, v = rand_qkv(B, T, H, D)
    _, st = mhla_attention(q, k, v, rand_mixing(3), C, causal=True, output_final_state=True)
    want = torch.einsum("bnchd,bnche->bhnde", k.reshape(1, 3, C, 1, D), v.reshape(1, 3, C, 1, D))
    torch.testing.assert_close(st.block_summaries, want)


# ----------------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("normalize", [True, False])
def test_gradcheck_fp64(causal, normalize):
    T = 11 if causal else 12
    q, k, v = rand_qkv(1, T, 2, 3, 2)
    mix = rand_mixing(3, 2)
    q, k, v, mix = (x.clone().requires_grad_() for x in (q, k, v, mix))

    def f(q, k, v, mix):
        return mhla_attention(q, k, v, mix, 4, causal=causal, normalize=normalize, backend="torch")

    assert torch.autograd.gradcheck(f, (q, k, v, mix), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_dense_definition(causal):
    q, k, v = rand_qkv(2, 48, 2, 5, 3)
    mix = rand_mixing(6, 2)
    grads = []
    for backend in ("torch", "reference"):
        xs = [x.clone().requires_grad_() for x in (q, k, v, mix)]
        out = mhla_attention(*xs[:3], xs[3], 8, causal=causal, backend=backend)
        (out * torch.linspace(-1, 1, out.numel(), dtype=F64).view_as(out)).sum().backward()
        grads.append([x.grad for x in xs])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


# --------------------------------------------------------------------------------------- low precision
# Documented tolerance: with fp32 accumulation the only error left is the final rounding of the output,
# so half-precision outputs agree with fp32 on the same (rounded) inputs to within
#   max|o_half - o_fp32| <= tol * max|o_fp32|,  tol = 1e-2 (bf16, 8 mantissa bits), 2e-3 (fp16).
HALF_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_half_precision_within_documented_tolerance(dtype, causal):
    T = 250 if causal else 256
    q, k, v = rand_qkv(2, T, 4, 32, dtype=dtype)
    mix = rand_mixing(16, dtype=dtype)
    got = mhla_attention(q, k, v, mix, 16, causal=causal, backend="torch")
    assert got.dtype == dtype
    want = mhla_attention(q.float(), k.float(), v.float(), mix.float(), 16, causal=causal, backend="torch")
    err = (got.float() - want).abs().max() / want.abs().max()
    assert err <= HALF_TOL[dtype], f"relative error {err:.2e} above {HALF_TOL[dtype]}"


# --------------------------------------------------------------------------------------- official norm


def test_official_normalizer_is_the_release_form_and_differs_from_the_paper():
    B, H, D, M, C = 1, 2, 4, 4, 6
    q, k, v = rand_qkv(B, M * C, H, D)
    mix = rand_mixing(M)
    got = mhla_attention(q, k, v, mix, C, normalize="official", backend="torch")
    # Release form, spelled out with loops: den(i, w) = sum_j mix[i, j] * q[j*C + w] . z_j.
    z = k.reshape(B, M, C, H, D).sum(2)
    num = mhla_attention(q, k, v, mix, C, normalize=False, backend="torch")
    want = torch.empty_like(num)
    for i in range(M):
        for w in range(C):
            den = sum(mix[i, j] * (q[:, j * C + w] * z[:, j]).sum(-1) for j in range(M)) + 1e-6
            want[:, i * C + w] = num[:, i * C + w] / den.unsqueeze(-1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    paper = mhla_attention(q, k, v, mix, C, normalize=True, backend="torch")
    assert (paper - got).abs().max() > 1e-3
    torch.testing.assert_close(
        mhla_attention(q, k, v, mix, C, normalize="official", backend="reference"), got
    )


# ---------------------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda q, k, v, m: (q[0], k, v, m, 8), "4 dims"),
        (lambda q, k, v, m: (q, k[:, :, :1], v, m, 8), "head counts differ"),
        (lambda q, k, v, m: (q, k, v[:, :10], m, 8), "same length"),
        (lambda q, k, v, m: (q, k[..., :2], v, m, 8), "feature dim"),
        (lambda q, k, v, m: (q, k, v, m, 5), "multiple of block_size"),
        (lambda q, k, v, m: (q, k, v, m[:3, :3], 8), "4 blocks"),
        (lambda q, k, v, m: (q, k, v, -m, 8), "nonnegative"),
        (lambda q, k, v, m: (q, k, v, m.expand(5, 4, 4), 8), "per-head mixing has 5 heads"),
        (lambda q, k, v, m: (q, k, v, m[0], 8), r"\[M, M\]"),
        (lambda q, k, v, m: (q, k, v, m[:, :3], 8), "square"),
        (lambda q, k, v, m: (q, k, v, m, 0), "positive int"),
        (lambda q, k, v, m: (q, k, v.float(), m, 8), "dtype"),
    ],
)
def test_bad_inputs_raise_value_error(make, match):
    q, k, v = rand_qkv(2, 32, 3, 4)
    mix = rand_mixing(4)
    with pytest.raises(ValueError, match=match):
        mhla_attention(*make(q, k, v, mix))


def test_bad_causal_and_option_inputs():
    q, k, v = rand_qkv(1, 33, 2, 4)
    with pytest.raises(ValueError, match="needs 5 blocks"):
        mhla_attention(q, k, v, rand_mixing(4), 8, causal=True)
    with pytest.raises(ValueError, match="normalize"):
        mhla_attention(q, k, v, rand_mixing(5), 8, causal=True, normalize="bogus")
    with pytest.raises(ValueError, match="non-causal"):
        mhla_attention(q, k, v, rand_mixing(5), 8, causal=True, normalize="official")
    with pytest.raises(ValueError, match="causal=True only"):
        mhla_attention(q[:, :32], k[:, :32], v[:, :32], rand_mixing(4), 8, output_final_state=True)
    with pytest.raises(ValueError, match="backend"):
        mhla_attention(q, k, v, rand_mixing(5), 8, causal=True, backend="cuda-magic")
    with pytest.raises(ValueError, match="NaN"):
        mhla_attention(q, k, v, torch.full((5, 5), float("nan"), dtype=F64), 8, causal=True)
    _, st = mhla_attention(q, k, v, rand_mixing(5), 8, causal=True, output_final_state=True)
    with pytest.raises(ValueError, match="block_size"):
        mhla_attention(q, k, v, rand_mixing(10), 4, causal=True, initial_state=st)
    with pytest.raises(ValueError, match="one token"):
        mhla_decode_step(q[:, :2], k[:, :2], v[:, :2], rand_mixing(6), st)
    with pytest.raises(ValueError, match="needs 5 blocks"):
        mhla_decode_step(q[:, :1], k[:, :1], v[:, :1], rand_mixing(4), st)
