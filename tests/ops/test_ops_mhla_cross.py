"""MHLA cross-attention (mhla/ops/mhla_cross): the dense reference, the torch path and the Triton query kernel
against each other, forward and backward, at lengths that the block counts do not divide, with and without a
key padding mask, in fp64 / fp32 / fp16 / bf16.

Criterion: output and gradients of ``sum(o * w)`` (fixed random ``w``) with respect to q, k, v and the mixing
matrix, each compared with the dense reference in fp64 on the same (rounded) inputs:
``err = max|x - x_ref| / max(max|x_ref|, 1)``. fp64 torch: 1e-12; fp32 (torch and Triton): 1e-5; fp16: 5e-3;
bf16: 2e-2 (the inputs are rounded the same way for both sides, so the error is the path's own rounding).
The Triton kernel runs in Triton's CPU interpreter without a GPU (tests/conftest.py sets TRITON_INTERPRET=1).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mhla.ops import linear_attention, mhla_cross_attention
from mhla.ops.mhla_cross import block_ids, block_starts
from mhla.ops.mhla_cross.api import _triton_query

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# (Tq, Mq, Tk, Mk): divisible, not divisible on one side, on both, one token per block, one block
SHAPES = [(16, 4, 8, 2), (10, 4, 7, 3), (13, 3, 5, 5), (9, 1, 11, 4), (20, 5, 3, 1)]
needs_triton = pytest.mark.skipif(_triton_query() is None, reason="Triton kernel cannot run here")


def make(Tq, Mq, Tk, Mk, *, B=2, H=2, D=8, Dv=6, per_head=True, masked=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(B, Tq, H, D, generator=g, dtype=torch.float64)
    k = torch.rand(B, Tk, H, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Tk, H, Dv, generator=g, dtype=torch.float64)
    mix = torch.rand(*((H, Mq, Mk) if per_head else (Mq, Mk)), generator=g, dtype=torch.float64)
    w = torch.randn(B, Tq, H, Dv, generator=g, dtype=torch.float64)
    mask = None
    if masked:
        mask = torch.rand(B, Tk, generator=g) > 0.4
        mask[:, 0] = True
        mask[-1, Tk // 2:] = False  # a padded tail
    return q, k, v, mix, w, mask


def run(backend, dtype, q, k, v, mix, w, mask, **kw):
    xs = [x.to(DEVICE, dtype).detach().requires_grad_() for x in (q, k, v)]
    m = mix.to(DEVICE, torch.float32 if dtype != torch.float64 else dtype).detach().requires_grad_()
    o = mhla_cross_attention(*xs, m, key_padding_mask=None if mask is None else mask.to(DEVICE),
                             backend=backend, **kw)
    (o.double() * w.to(DEVICE)).sum().backward()
    return [o.detach()] + [x.grad for x in xs] + [m.grad]


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


def check(backend, dtype, inputs, **kw):
    q, k, v, mix, w, mask = inputs
    rounded = [x.to(dtype).double() for x in (q, k, v)]
    rounded.append(mix.float().double() if dtype != torch.float64 else mix)
    exact = run("reference", torch.float64, *rounded, w, mask, **kw)
    got = run(backend, dtype, q, k, v, mix, w, mask, **kw)
    for name, a, r in zip(("o", "dq", "dk", "dv", "dmixing"), got, exact):
        assert a.shape == r.shape, name
        assert rel_err(a, r) <= TOL[dtype], (backend, dtype, name, rel_err(a, r))


def test_blocking_rule():
    assert block_starts(10, 4) == [0, 3, 5, 8, 10]
    assert block_ids(10, 4).tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]
    assert block_ids(12, 4).tolist() == [i // 3 for i in range(12)]  # divisible: plain blocks of T / M tokens
    for T in range(1, 30):
        for M in range(1, T + 1):
            sizes = torch.bincount(block_ids(T, M), minlength=M)
            assert sizes.min() >= 1 and sizes.max() - sizes.min() <= 1


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
def test_torch_matches_reference_fp64(shape, masked):
    check("torch", torch.float64, make(*shape, masked=masked))


@pytest.mark.parametrize("shape", SHAPES[:3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_low_precision(shape, dtype):
    check("torch", dtype, make(*shape, per_head=False))


@needs_triton
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
def test_triton_matches_reference_fp32(shape, masked):
    check("triton", torch.float32, make(*shape, masked=masked))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half(dtype):
    check("triton", dtype, make(10, 4, 7, 3, per_head=False))


@needs_triton
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_normaliser_and_wide_heads(backend):
    """``normalize=False``, head dims that are not powers of two and span several tiles, a long query
    block."""
    q, k, v, mix, w, mask = make(70, 2, 9, 3, D=40, Dv=24)
    check(backend, torch.float32, (q, k, v, mix, w, mask), normalize=False)
    check(backend, torch.float32, (q, k, v, mix, w, mask))


@pytest.mark.parametrize("backend", ["reference", "torch"] + (["triton"] if _triton_query() else []))
def test_masked_keys_contribute_nothing(backend):
    """Whatever a padded key holds (NaN included), the outputs do not change and its gradients are zero."""
    q, k, v, mix, w, mask = make(10, 4, 7, 3)
    dtype = torch.float64 if backend != "triton" else torch.float32
    base = run(backend, dtype, q, k, v, mix, w, mask)
    k2, v2 = k.clone(), v.clone()
    k2[~mask], v2[~mask] = float("nan"), 1e6
    other = run(backend, dtype, q, k2, v2, mix, w, mask)
    for a, b in zip(base, other):
        assert torch.equal(a, b)
    assert (base[2][~mask.to(DEVICE)] == 0).all() and (base[3][~mask.to(DEVICE)] == 0).all()


def test_one_block_is_linear_attention_and_mask_is_truncation():
    """Mq = Mk = 1 (mixing [[1]]) is plain linear attention; with one key block, masking the tail of the keys
    is the call on the keys before it."""
    q, k, v, _, _, _ = make(9, 1, 7, 1, masked=False)
    one = torch.ones(1, 1, dtype=torch.float64)
    o = mhla_cross_attention(q, k, v, one, backend="torch")
    # linear attention of each query over all keys: append the queries' slots as zero-weight keys is not
    # needed, compare with the dense formula directly
    scores = torch.einsum("bthd,bshd->bhts", q, k)
    ref = torch.einsum("bhts,bshe->bthe", scores, v) / (scores.sum(-1).transpose(1, 2).unsqueeze(-1) + 1e-6)
    torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-12)
    same = linear_attention(q[:, :7], k, v)  # q and k of one length: the library's linear attention agrees
    torch.testing.assert_close(mhla_cross_attention(q[:, :7], k, v, one, backend="torch"), same, rtol=1e-10,
                               atol=1e-12)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[:, 4:] = False
    torch.testing.assert_close(mhla_cross_attention(q, k, v, one, key_padding_mask=mask, backend="torch"),
                               mhla_cross_attention(q, k[:, :4], v[:, :4], one, backend="torch"))


def test_all_keys_masked_gives_zero():
    q, k, v, mix, _, _ = make(6, 2, 4, 2, masked=False)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[0] = True
    o = mhla_cross_attention(q, k, v, mix, key_padding_mask=mask, backend="torch")
    assert torch.isfinite(o).all() and (o[1] == 0).all()


def test_errors():
    q, k, v, mix, _, _ = make(6, 2, 4, 2, masked=False)
    with pytest.raises(ValueError, match="4 tokens cannot form 5 blocks"):
        mhla_cross_attention(q, k, v, torch.ones(2, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="nonnegative"):
        mhla_cross_attention(q, k, v, -mix)
    with pytest.raises(ValueError, match="key_padding_mask must be a bool tensor"):
        mhla_cross_attention(q, k, v, mix, key_padding_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="normalize must be true or false"):
        mhla_cross_attention(q, k, v, mix, normalize="official")
    with pytest.raises(ValueError, match="per-head mixing has 3 heads"):
        mhla_cross_attention(q, k, v, torch.ones(3, 2, 2, dtype=torch.float64))
