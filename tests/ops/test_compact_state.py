"""Constant-memory MHLA decoding: the compact mixing rows (:class:`mhla.ops.MixingRows`), the bounded state.

Every extension rule gives the blocks beyond its window one shared coefficient per row, so a state keeps at
most ``M - 1`` block summaries plus one folded sum. Checked: the rows equal the dense extended matrix,
token-by-token decoding and chunked prefill (torch and Triton backends, variable-length) equal one full
forward at 8x the learned length (fp64 to rounding, fp32 to its rounding, every rule, shared and per-head
mixing), the state's size stops growing, gradients through a compact chunked call equal the dense call's, and
the language model's cache.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mhla.mixing import (
    EXTENSION_RULES,
    MixingMatrix,
    causal_mixing_rows,
    extend_causal_mixing,
    extension_window,
)
from mhla.ops import MHLAState, MixingRows, init_state, mhla_attention, mhla_decode_step
from mhla.ops.mhla.chunk import SEGMENT_BLOCKS
from mhla.ops.mhla.state import kept_block_ids, row_coefficients

RULES = EXTENSION_RULES + ("uniform_far:3",)  # every rule, and one cap that binds at these lengths

F64 = torch.float64
M, C = 4, 4  # learned rows, block size
T8 = 8 * M * C + 3  # 8x the learned length, ending inside a block


def mixing_matrix(rule, per_head=False, H=3, dtype=F64, seed=0):
    mm = MixingMatrix(M, init="uniform", causal=True, num_heads=H if per_head else None, extension=rule)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        mm.raw.copy_(torch.rand(mm.raw.shape, generator=g) * 0.8 + 0.1)
    return mm.to(dtype)


def rand_qkv(B, T, H, D, Dv, dtype=F64, seed=1):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.rand(B, T, H, D, generator=g, dtype=F64) for _ in range(2))
    v = torch.randn(B, T, H, Dv, generator=g, dtype=F64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def full_forward(q, k, v, mm, normalize=True, backend="torch"):
    dense = mm(math.ceil(q.shape[1] / C)).detach()
    return mhla_attention(q, k, v, dense, C, causal=True, normalize=normalize, backend=backend)


def decode(q, k, v, mm, normalize=True, prefill=0):
    """A prefill of ``prefill`` tokens (0: the first token alone), then one token per step; every output and
    the block summaries the state held at each step."""
    P = max(prefill, 1)
    rows = mm.causal_rows(0, math.ceil(P / C))
    o, st = mhla_attention(q[:, :P], k[:, :P], v[:, :P], rows, C, causal=True, normalize=normalize,
                           initial_state=None, output_final_state=True, backend="torch")
    outs, kept = [o], [st.block_summaries.shape[2]]
    for t in range(P, q.shape[1]):
        rows = mm.causal_rows(t // C, t // C + 1)
        o, st = mhla_decode_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], rows, st, normalize=normalize)
        outs.append(o)
        kept.append(st.block_summaries.shape[2])
    return torch.cat(outs, dim=1), st, kept


# ------------------------------------------------------------------------------------------- the rows
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_rows_equal_the_extended_matrix(rule, per_head, m):
    g = torch.Generator().manual_seed(m)
    w = torch.rand(*((3,) if per_head else ()), m, m, generator=g, dtype=F64).tril()
    n = 8 * m + 3
    dense = extend_causal_mixing(w, n, rule)
    for start, stop in ((0, n), (0, 1), (m - 1, m + 2), (m, n), (n - 1, n)):
        rows = causal_mixing_rows(w, start, stop, rule)
        assert rows.window == extension_window(m, rule) and sum(rows.window) == m - 1
        coeff = row_coefficients(rows, start, stop - start, torch.arange(n))
        want = dense[..., start:stop, :].tril(start - 1)  # strictly before each row
        torch.testing.assert_close(coeff if per_head else coeff[0], want, rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(rows.diag, torch.diagonal(dense, dim1=-2, dim2=-1)[..., start:stop],
                                   rtol=1e-14, atol=1e-15)
        kh, kr = rows.window
        for i in range(max(start, kh + kr + 1), stop):  # the folded blocks of row i share one coefficient
            folded = [b for b in range(i) if b not in kept_block_ids(i, rows.window)]
            far = rows.far[..., i - start, None].expand(*rows.far.shape[:-1], len(folded))
            torch.testing.assert_close(dense[..., i, folded], far, rtol=1e-14, atol=1e-15)


def test_rows_are_differentiable_and_causal_only():
    mm = mixing_matrix("uniform_far")
    rows = mm.causal_rows(2, 9)
    (rows.diag.sum() + rows.recent.sum() + rows.far.sum()).backward()
    assert mm.raw.grad is not None and mm.raw.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="causal"):
        MixingMatrix(4, causal=False).causal_rows(0, 2)


# --------------------------------------------------------------------------------- decode == forward
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("normalize", [True, False])
def test_decode_equals_full_forward_at_8x_the_learned_length(rule, per_head, normalize):
    q, k, v = rand_qkv(2, T8, 3, 4, 3)
    mm = mixing_matrix(rule, per_head)
    want = full_forward(q, k, v, mm, normalize)
    got, st, kept = decode(q, k, v, mm, normalize)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert max(kept) == M - 1 and st.num_folded_blocks == T8 // C - (M - 1)
    assert st.window == extension_window(M, rule)


@pytest.mark.parametrize("rule", ["uniform_far", "last_row"])
def test_fp32_decode_equals_the_fp32_forward_to_its_rounding(rule):
    q, k, v = rand_qkv(1, T8, 2, 8, 8, dtype=torch.float32)
    mm = mixing_matrix(rule, dtype=torch.float32)
    want = full_forward(q.double(), k.double(), v.double(), mm.double())
    got, _, _ = decode(q, k, v, mixing_matrix(rule, dtype=torch.float32))
    fp32 = full_forward(q, k, v, mixing_matrix(rule, dtype=torch.float32))
    scale = want.abs().max()
    assert (got.double() - want).abs().max() <= 4 * max((fp32.double() - want).abs().max(), 1e-7 * scale)


def test_state_size_stops_growing():
    """After M - 1 blocks the state holds M - 1 summaries, a folded sum and the open block, at any length."""
    q, k, v = rand_qkv(1, 40 * C, 2, 4, 4)
    mm = mixing_matrix("uniform_far")
    sizes = {}
    st = init_state(1, 2, 4, 4, C, dtype=F64, window=extension_window(M, "uniform_far"))
    for t in range(q.shape[1]):
        rows = mm.causal_rows(t // C, t // C + 1)
        _, st = mhla_decode_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], rows, st)
        sizes[t + 1] = st.nbytes()
    per_summary = 4 * 4 * 8 + 4 * 8  # S [4, 4] and z [4] in fp64, per head
    late = range(M * C, q.shape[1] + 1)
    # at a block end: M - 1 kept + the folded sum + the (empty) open block; inside a block also the prefix
    assert {sizes[t] for t in late if t % C == 0} == {2 * (M - 1 + 2) * per_summary}
    assert {sizes[t] for t in late if t % C} == {2 * (M - 1 + 3) * per_summary}


@pytest.mark.parametrize("rule", ["relative", "last_row"])
@pytest.mark.parametrize("normalize", [True, False])
def test_chunked_prefill_in_any_pieces_equals_one_call(rule, normalize):
    q, k, v = rand_qkv(2, T8, 3, 4, 3)
    mm = mixing_matrix(rule, per_head=True)
    want = full_forward(q, k, v, mm, normalize)
    cuts = [0, 1, 7, 8, 30, 31, 64, 65, 66, T8]  # mid-block, block ends, single tokens
    outs, st = [], None
    for a, b in zip(cuts[:-1], cuts[1:]):
        rows = mm.causal_rows(a // C, math.ceil(b / C))
        o, st = mhla_attention(q[:, a:b], k[:, a:b], v[:, a:b], rows, C, causal=True, normalize=normalize,
                               initial_state=st, output_final_state=True, backend="torch")
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), want, rtol=1e-10, atol=1e-12)
    assert st.block_summaries.shape[2] == M - 1


def test_long_prefill_runs_in_segments():
    """One call over more than SEGMENT_BLOCKS blocks (cut into pieces inside) equals the dense call."""
    c = 2
    T = (SEGMENT_BLOCKS * 2 + 5) * c + 1
    q, k, v = rand_qkv(1, T, 2, 3, 3)
    mm = mixing_matrix("uniform_far")
    want = mhla_attention(q, k, v, mm(math.ceil(T / c)).detach(), c, causal=True, backend="torch")
    got, st = mhla_attention(q, k, v, mm.causal_rows(0, math.ceil(T / c)), c, causal=True,
                             output_final_state=True, backend="torch")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert st.num_tokens == T and st.block_summaries.shape[2] == M - 1


def test_dense_state_is_folded_for_compact_rows_and_not_back():
    q, k, v = rand_qkv(1, T8, 2, 4, 4)
    mm = mixing_matrix("window")
    want = full_forward(q, k, v, mm)
    P = 50
    o1, dense_state = mhla_attention(q[:, :P], k[:, :P], v[:, :P], mm(math.ceil(P / C)).detach(), C,
                                     causal=True, output_final_state=True, backend="torch")
    assert dense_state.window is None and dense_state.block_summaries.shape[2] == P // C
    rows = mm.causal_rows(P // C, math.ceil(T8 / C))
    o2, st = mhla_attention(q[:, P:], k[:, P:], v[:, P:], rows, C, causal=True, initial_state=dense_state,
                            output_final_state=True, backend="torch")
    torch.testing.assert_close(torch.cat([o1, o2], 1), want, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="dense matrix"):
        mhla_attention(q[:, :1], k[:, :1], v[:, :1], mm(T8).detach(), C, causal=True, initial_state=st)
    with pytest.raises(ValueError, match="window"):
        mhla_decode_step(q[:, :1], k[:, :1], v[:, :1], causal_mixing_rows(mm.learned(), T8 // C, T8 // C + 1,
                                                                             "last_row"), st)


def test_bad_rows_are_rejected():
    q, k, v = rand_qkv(1, 9, 2, 4, 4)
    mm = mixing_matrix("relative")
    with pytest.raises(ValueError, match="cover"):
        mhla_attention(q, k, v, mm.causal_rows(0, 2), C, causal=True)  # 9 tokens need 3 blocks
    rows = mm.causal_rows(0, 3)
    neg = MixingRows(rows.first, -rows.diag, rows.head, rows.recent, rows.far)
    with pytest.raises(ValueError, match="nonnegative"):
        mhla_attention(q, k, v, neg, C, causal=True)
    with pytest.raises(ValueError, match="heads"):
        rows3 = mixing_matrix("relative", per_head=True, H=3).causal_rows(0, 3)
        mhla_attention(q, k, v, rows3, C, causal=True)
    with pytest.raises(ValueError, match="reference"):
        mhla_attention(q, k, v, rows, C, causal=True, backend="reference")
    with pytest.raises(ValueError):
        mhla_attention(q[:, :8], k[:, :8], v[:, :8], rows, C)  # non-causal takes a dense matrix


def test_gradients_through_compact_chunks_equal_the_dense_call():
    """Truncated backprop through time with compact rows: two chunked calls, gradients of q, k, v and the
    learned coefficients equal those of one dense call."""
    T = 5 * M * C + 2
    q, k, v = rand_qkv(1, T, 2, 3, 3)
    w = torch.randn(1, T, 2, 3, generator=torch.Generator().manual_seed(3), dtype=F64)
    grads = []
    for compact in (False, True):
        mm = mixing_matrix("mass_matched", per_head=True, H=2)
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        if compact:
            P = 37
            o1, st = mhla_attention(*(x[:, :P] for x in xs), mm.causal_rows(0, math.ceil(P / C)), C,
                                    causal=True, output_final_state=True, backend="torch")
            o2 = mhla_attention(*(x[:, P:] for x in xs), mm.causal_rows(P // C, math.ceil(T / C)), C,
                                causal=True, initial_state=st, backend="torch")
            o = torch.cat([o1, o2], 1)
        else:
            o = mhla_attention(*xs, mm(math.ceil(T / C)), C, causal=True, backend="torch")
        (o * w).sum().backward()
        grads.append([x.grad for x in xs] + [mm.raw.grad])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


# ------------------------------------------------------------------------------------ variable length
def test_varlen_per_sequence_compact_states_equal_each_alone():
    lengths = [3 * M * C + 1, 5, 0, 2 * M * C]
    H = 2
    q, k, v = rand_qkv(1, sum(lengths), H, 4, 3)
    mm = mixing_matrix("uniform_far", per_head=True, H=H)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    P = [n // 2 for n in lengths]  # each sequence: a prefill of half, then the rest in a second packed call
    first = torch.cat([q[:, a:a + p] for a, p in zip(cu[:-1].tolist(), P)], 1), \
        torch.cat([k[:, a:a + p] for a, p in zip(cu[:-1].tolist(), P)], 1), \
        torch.cat([v[:, a:a + p] for a, p in zip(cu[:-1].tolist(), P)], 1)
    second = [torch.cat([x[:, a + p:b] for a, b, p in zip(cu[:-1].tolist(), cu[1:].tolist(), P)], 1)
              for x in (q, k, v)]
    cu1 = torch.tensor([0, *torch.tensor(P).cumsum(0).tolist()], dtype=torch.int32)
    rest = [n - p for n, p in zip(lengths, P)]
    cu2 = torch.tensor([0, *torch.tensor(rest).cumsum(0).tolist()], dtype=torch.int32)
    stop = math.ceil(max(lengths) / C)
    o1, states = mhla_attention(*first, mm.causal_rows(0, stop), C, causal=True, cu_seqlens=cu1,
                                output_final_state=True, backend="torch")
    o2, states = mhla_attention(*second, mm.causal_rows(0, stop), C, causal=True, cu_seqlens=cu2,
                                initial_state=states, output_final_state=True, backend="torch")
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if a == b:
            assert states[n].num_tokens == 0
            continue
        want = full_forward(q[:, a:b], k[:, a:b], v[:, a:b], mm)
        got = torch.cat([o1[:, cu1[n]:cu1[n + 1]], o2[:, cu2[n]:cu2[n + 1]]], 1)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        assert states[n].num_tokens == lengths[n]
        assert states[n].block_summaries.shape[2] == min(M - 1, lengths[n] // C)


# ------------------------------------------------------------------------------------------------ triton
def _triton():
    pytest.importorskip("triton")
    backend = pytest.importorskip("mhla.ops.mhla.triton.backend")
    if not backend.available():
        pytest.skip("Triton kernels cannot run here")


@pytest.mark.parametrize("rule", ["uniform_far", "last_row"])
def test_triton_prefill_returns_and_continues_the_compact_state(rule):
    _triton()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    T = 3 * M * C + 3
    q, k, v = (x.to(dev) for x in rand_qkv(1, T, 2, 16, 16, dtype=torch.float32))
    mm = mixing_matrix(rule, per_head=True, H=2, dtype=torch.float32).to(dev)
    want = full_forward(q, k, v, mm)
    outs, st = [], None
    for a, b in ((0, 9), (9, 30), (30, T)):
        rows = mm.causal_rows(a // C, math.ceil(b / C))
        o, st = mhla_attention(q[:, a:b], k[:, a:b], v[:, a:b], rows, C, causal=True, initial_state=st,
                               output_final_state=True, backend="triton")
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), want, rtol=1e-5, atol=1e-5)
    assert isinstance(st, MHLAState) and st.block_summaries.shape[2] == M - 1 and st.num_folded_blocks > 0
    ref_st = mhla_attention(q, k, v, mm.causal_rows(0, math.ceil(T / C)), C, causal=True,
                            output_final_state=True, backend="torch")[1]
    for name in ("block_summaries", "far_summary", "current_summary", "far_key_sum"):
        torch.testing.assert_close(getattr(st, name), getattr(ref_st, name), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------- language model
@pytest.mark.parametrize("rule", RULES)
def test_lm_decoding_at_8x_the_training_length_and_a_constant_cache(rule):
    from helpers.lm_configs import lm_config  # noqa: PLC0415
    from models.lm import MHLALMCache, MHLALMForCausalLM  # noqa: PLC0415

    torch.manual_seed(0)
    cfg = lm_config("mhla", vocab_size=61, hidden_size=32, num_hidden_layers=2, num_heads=2, block_size=4,
                    max_position_embeddings=16, mixing_extension=rule, mixing_per_head=rule == "mass_matched")
    model = MHLALMForCausalLM(cfg).eval().double()
    g = torch.Generator().manual_seed(1)
    for layer in model.model.layers:
        layer.attn.mixing.raw.data = torch.rand(layer.attn.mixing.raw.shape, generator=g, dtype=F64)
    x = torch.randint(0, 61, (2, 8 * 16 + 3))
    sizes = []
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        cache = MHLALMCache(model.config)
        steps = [model(x[:, :10], past_key_values=cache, use_cache=True).logits]
        for t in range(10, x.shape[1]):
            steps.append(model(x[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
            sizes.append(cache.nbytes())
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-9, atol=1e-9)
    # flat once past the learned rows: the same sizes in every later block (the open block's cached prefix is
    # dropped at each block end and rebuilt by its first token)
    assert set(sizes[2 * 16:]) == set(sizes[2 * 16:2 * 16 + 4]) and max(sizes) == max(sizes[2 * 16:])
    state = cache.layer_state(0).attn
    assert state.block_summaries.shape[2] == 3 and state.window == extension_window(4, rule)
