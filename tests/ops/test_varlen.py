"""Variable-length (packed) calls, ``cu_seqlens`` in flash-linear-attention's convention: every sequence of a
packed batch equals a separate call on it alone (forward, gradients of q, k, v and mixing, final states), states
chain across calls, on the torch path (fp64) and the Triton kernels (fp32; the CPU interpreter without a GPU).
Also the length buckets of the stateless path, the plain linear / softmax ops and the input checks."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mhla.ops import (
    MHLAState,
    init_state,
    linear_attention,
    mhla_attention,
    mhla_causal_torch,
    softmax_attention,
)
from mhla.ops.utils import CALL_COST_TOKENS, bucket_sequences, run_varlen

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STATE_FIELDS = ("block_summaries", "block_key_sums", "current_summary", "current_key_sum")
# lengths: 1, 0 (empty), multiples of the chunk (4) and not
LENGTHS = [5, 1, 0, 9, 4, 8, 3]


def cu_of(lengths, device="cpu", dtype=torch.int32):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype, device=device)


def make_inputs(lengths, *, H=2, D=4, Dv=3, M=4, per_head=True, dtype=torch.float64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = torch.rand(1, T, H, D, generator=g, dtype=torch.float64)
    k = torch.rand(1, T, H, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, T, H, Dv, generator=g, dtype=torch.float64)
    mix = torch.rand(*((H, M, M) if per_head else (M, M)), generator=g, dtype=torch.float64)
    w = torch.randn(1, T, H, Dv, generator=g, dtype=torch.float64)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, mix, w)]


def leaves(*xs):
    return [x.detach().clone().requires_grad_() for x in xs]


def per_sequence(fn, lengths, q, k, v):
    """``fn`` on each non-empty sequence alone, outputs concatenated."""
    cu = cu_of(lengths).tolist()
    return torch.cat([fn(q[:, a:b], k[:, a:b], v[:, a:b]) for a, b in zip(cu[:-1], cu[1:]) if b > a], dim=1)


def assert_states_equal(a: MHLAState, b: MHLAState, **tol):
    assert a.num_tokens == b.num_tokens and a.block_size == b.block_size
    for name in STATE_FIELDS:
        torch.testing.assert_close(getattr(a, name), getattr(b, name), **tol)


# ------------------------------------------------------------------------------------------- torch, fp64
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("stateful", [False, True], ids=["padded-batch", "per-sequence"])
def test_torch_forward_and_gradients_equal_separate_calls(normalize, per_head, stateful):
    """Outputs and the gradients of q, k, v, mixing equal those of one call per sequence (fp64). ``stateful``
    asks for the final states, which takes the per-sequence path instead of the padded batch."""
    C = 4
    q, k, v, mix, w = make_inputs(LENGTHS, per_head=per_head)
    kw = dict(causal=True, normalize=normalize, backend="torch")
    xs = leaves(q, k, v, mix)
    o = mhla_attention(*xs[:3], xs[3], C, cu_seqlens=cu_of(LENGTHS), output_final_state=stateful, **kw)
    o = o[0] if stateful else o
    (o * w).sum().backward()
    ys = leaves(q, k, v, mix)
    ref = per_sequence(lambda a, b, c: mhla_attention(a, b, c, ys[3], C, **kw), LENGTHS, *ys[:3])
    (ref * w).sum().backward()
    torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("dq", "dk", "dv", "dmixing"), xs, ys):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_torch_random_lengths(seed):
    """Random lengths (1 .. 3 chunks, any remainder), int64 offsets, shared mixing."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 13, (6,), generator=g).tolist()
    q, k, v, mix, _ = make_inputs(lengths, M=4, per_head=False, seed=seed)
    o = mhla_attention(q, k, v, mix, 4, causal=True, cu_seqlens=cu_of(lengths, dtype=torch.int64), backend="torch")
    ref = per_sequence(lambda a, b, c: mhla_attention(a, b, c, mix, 4, causal=True, backend="torch"), lengths, q, k, v)
    torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-12)


def test_torch_final_states_equal_separate_calls():
    """The N final states are those of the separate calls (an empty sequence: an empty state)."""
    q, k, v, mix, _ = make_inputs(LENGTHS)
    _, states = mhla_attention(q, k, v, mix, 4, causal=True, cu_seqlens=cu_of(LENGTHS), output_final_state=True,
                               backend="torch")
    assert isinstance(states, list) and len(states) == len(LENGTHS)
    cu = cu_of(LENGTHS).tolist()
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        if a == b:
            want = init_state(1, 2, 4, 3, 4, dtype=torch.float64)
        else:
            _, want = mhla_attention(q[:, a:b], k[:, a:b], v[:, a:b], mix, 4, causal=True, output_final_state=True,
                                     backend="torch")
        assert_states_equal(states[n], want, rtol=1e-12, atol=1e-12)


def split_lengths(lengths, seed=0):
    """A random cut of every sequence into a prefill part and the rest (either may be empty)."""
    g = torch.Generator().manual_seed(seed)
    first = [int(torch.randint(0, n + 1, (1,), generator=g)) for n in lengths]
    return first, [n - f for n, f in zip(lengths, first)]


def gather(x, lengths, part_lengths, offset_lengths=None):
    """The tokens ``[offset_n, offset_n + part_n)`` of every sequence of ``x [1, T, ...]``, packed."""
    cu = cu_of(lengths).tolist()
    offs = offset_lengths or [0] * len(lengths)
    return torch.cat([x[:, a + o:a + o + p] for a, o, p in zip(cu[:-1], offs, part_lengths)], dim=1)


@pytest.mark.parametrize("normalize", [True, False])
def test_torch_states_chain_across_calls(normalize):
    """Prefill a part of every sequence, then the rest from the returned states: the outputs, final states and
    gradients (q, k, v, mixing) equal one call over the whole sequences."""
    C = 4
    q, k, v, mix, w = make_inputs(LENGTHS, M=3)
    first, rest = split_lengths(LENGTHS)
    kw = dict(causal=True, normalize=normalize, backend="torch", output_final_state=True)
    xs = leaves(q, k, v, mix)
    o1, st = mhla_attention(*(gather(x, LENGTHS, first) for x in xs[:3]), xs[3], C, cu_seqlens=cu_of(first), **kw)
    o2, st2 = mhla_attention(*(gather(x, LENGTHS, rest, first) for x in xs[:3]), xs[3], C, cu_seqlens=cu_of(rest),
                             initial_state=st, **kw)
    ys = leaves(q, k, v, mix)
    full, st_full = mhla_attention(*ys[:3], ys[3], C, cu_seqlens=cu_of(LENGTHS), **kw)
    torch.testing.assert_close(gather(full, LENGTHS, first), o1, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gather(full, LENGTHS, rest, first), o2, rtol=1e-12, atol=1e-12)
    for a, b in zip(st2, st_full):
        assert_states_equal(a, b, rtol=1e-12, atol=1e-12)
    loss = lambda o1, o2, st: (gather(w, LENGTHS, first) * o1).sum() + (gather(w, LENGTHS, rest, first) * o2).sum() \
        + sum(1e-2 * s.current_summary.sum() + 1e-2 * s.block_summaries.sum() for s in st)  # noqa: E731
    loss(o1, o2, st2).backward()
    loss(gather(full, LENGTHS, first), gather(full, LENGTHS, rest, first), st_full).backward()
    for name, a, b in zip(("dq", "dk", "dv", "dmixing"), xs, ys):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_batched_initial_state_is_split():
    """A single MHLAState of batch N (all sequences after the same tokens) works as the list of its rows."""
    lengths = [3, 6]
    q, k, v, mix, _ = make_inputs([5, 5] + lengths, M=4)
    _, st = mhla_attention(q[:, :10].reshape(2, 5, 2, 4), k[:, :10].reshape(2, 5, 2, 4), v[:, :10].reshape(2, 5, 2, 3),
                           mix, 4, causal=True, output_final_state=True, backend="torch")
    rest = (q[:, 10:], k[:, 10:], v[:, 10:])
    a = mhla_attention(*rest, mix, 4, causal=True, cu_seqlens=cu_of(lengths), initial_state=st, backend="torch")
    rows = [MHLAState(**{**st.__dict__, **{f: getattr(st, f)[i:i + 1] for f in STATE_FIELDS}}) for i in range(2)]
    b = mhla_attention(*rest, mix, 4, causal=True, cu_seqlens=cu_of(lengths), initial_state=rows, backend="torch")
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_reference_backend_and_fp32_default_path():
    """backend='reference' (stateless) and the fp32 'auto' path agree with separate calls."""
    q, k, v, mix, _ = make_inputs(LENGTHS)
    ref = mhla_attention(q, k, v, mix, 4, causal=True, cu_seqlens=cu_of(LENGTHS), backend="reference")
    sep = per_sequence(lambda a, b, c: mhla_attention(a, b, c, mix, 4, causal=True, backend="torch"), LENGTHS, q, k, v)
    torch.testing.assert_close(ref, sep, rtol=1e-10, atol=1e-12)
    f = [x.float() for x in (q, k, v, mix)]
    o = mhla_attention(*f[:3], f[3], 4, causal=True, cu_seqlens=cu_of(LENGTHS))
    assert o.dtype == torch.float32
    torch.testing.assert_close(o.double(), sep, rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------------------- Triton
def _triton_or_skip():
    pytest.importorskip("triton")
    backend = pytest.importorskip("mhla.ops.mhla.triton.backend")
    if not backend.available():
        pytest.skip("Triton kernels cannot run here (no CUDA and not built for the interpreter)")


@pytest.mark.parametrize("stateful", [False, True], ids=["padded-batch", "per-sequence"])
def test_triton_equals_separate_calls(stateful):
    """backend='triton' (fp32): outputs and gradients equal separate Triton calls, and the fp64 torch path."""
    _triton_or_skip()
    lengths = [5, 1, 0, 9, 3]
    q, k, v, mix, w = make_inputs(lengths, M=3, dtype=torch.float32, device=DEVICE)
    kw = dict(causal=True, backend="triton")
    cu = cu_of(lengths, device=DEVICE)
    xs = leaves(q, k, v, mix)
    o = mhla_attention(*xs[:3], xs[3], 4, cu_seqlens=cu, output_final_state=stateful, **kw)
    o = o[0] if stateful else o
    (o * w).sum().backward()
    ys = leaves(q, k, v, mix)
    ref = per_sequence(lambda a, b, c: mhla_attention(a, b, c, ys[3], 4, **kw), lengths, *ys[:3])
    (ref * w).sum().backward()
    exact = mhla_attention(*(x.double() for x in (q, k, v)), mix.double(), 4, causal=True, cu_seqlens=cu,
                           backend="torch")
    torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o.double(), exact, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("dq", "dk", "dv", "dmixing"), xs, ys):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_triton_states_chain_across_calls():
    """Prefill on the kernels, continue on the kernels from the per-sequence states = the torch path (fp64)."""
    _triton_or_skip()
    lengths = [7, 2, 10]
    first, rest = [3, 0, 6], [4, 2, 4]
    q, k, v, mix, _ = make_inputs(lengths, M=3, dtype=torch.float32, device=DEVICE)
    kw = dict(causal=True, backend="triton", output_final_state=True)
    o1, st = mhla_attention(*(gather(x, lengths, first) for x in (q, k, v)), mix, 4, cu_seqlens=cu_of(first, DEVICE),
                            **kw)
    o2, st2 = mhla_attention(*(gather(x, lengths, rest, first) for x in (q, k, v)), mix, 4,
                             cu_seqlens=cu_of(rest, DEVICE), initial_state=st, **kw)
    full, st_full = mhla_attention(*(x.double() for x in (q, k, v)), mix.double(), 4, causal=True,
                                   cu_seqlens=cu_of(lengths, DEVICE), output_final_state=True, backend="torch")
    torch.testing.assert_close(o1.double(), gather(full, lengths, first), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o2.double(), gather(full, lengths, rest, first), rtol=1e-5, atol=1e-5)
    for a, b in zip(st2, st_full):
        assert a.num_tokens == b.num_tokens
        for name in STATE_FIELDS:
            torch.testing.assert_close(getattr(a, name).double(), getattr(b, name), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ length buckets
SKEWED = [1412, 5, 1700, 1838, 1547, 7267, 521, 2094]  # bench_ops.py --varlen, total_T = 16384


def bucket_cost(lengths, groups, c):
    return sum(len(g) * max(lengths[n] for n in g) for g in groups) + c * len(groups)


def best_cost(lengths, c):
    """The O(N^2) dynamic program over the sorted lengths (the reference for bucket_sequences)."""
    L = sorted(n for n in lengths if n > 0)
    f = [0]
    for j in range(1, len(L) + 1):
        f.append(min(f[i] + (j - i) * L[j - 1] + c for i in range(j)))
    return f[-1]


@pytest.mark.parametrize("c", [0, 1, 64, 512, 4096, 10**9, *CALL_COST_TOKENS.values()])
def test_bucket_plan_covers_every_sequence_once(c):
    """Every non-empty sequence in exactly one group (an empty one in none), groups contiguous in sorted
    length, padded tokens <= 1.25 total_T + c * groups, and the plan's cost is the optimum."""
    lengths = SKEWED[:3] + [0] + SKEWED[3:]
    groups = bucket_sequences(lengths, c)
    assert sorted(n for g in groups for n in g) == [n for n, x in enumerate(lengths) if x > 0]
    flat = [lengths[n] for g in groups for n in g]
    assert flat == sorted(flat)
    padded = sum(len(g) * lengths[g[-1]] for g in groups)
    assert padded <= 1.25 * sum(lengths) + c * len(groups)
    assert bucket_cost(lengths, groups, c) == best_cost(lengths, c)
    if c == 0:
        assert len(groups) == 8  # no padding at all
    if c == 10**9:
        assert len(groups) == 1


def test_bucket_plan_is_optimal_on_random_lengths():
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(0, 25, (1,), generator=g))
        hi = int(torch.randint(1, 3000, (1,), generator=g))
        lengths = torch.randint(0, hi + 1, (n,), generator=g).tolist()
        c = [0, 3, 100, 2000][int(torch.randint(0, 4, (1,), generator=g))]
        groups = bucket_sequences(lengths, c)
        assert sorted(m for grp in groups for m in grp) == [m for m, x in enumerate(lengths) if x > 0]
        assert bucket_cost(lengths, groups, c) == best_cost(lengths, c)
    assert bucket_sequences([], 5) == [] and bucket_sequences([0, 0], 5) == []
    with pytest.raises(ValueError):
        bucket_sequences([3], -1)


@pytest.mark.parametrize("c,num_groups", [(0, 9), (6, None), (10**9, 1)], ids=["alone", "several", "one"])
def test_buckets_equal_per_sequence_loop(c, num_groups):
    """run_varlen with a small call cost (several groups) and a huge one (a single group): outputs and
    gradients (q, k, v, mixing) equal one call per sequence (fp64), one op call per group."""
    lengths = [14, 0, 5, 17, 18, 15, 72, 1, 52, 21]  # the skewed shape of SKEWED, scaled, C = 4
    groups = bucket_sequences(lengths, c)
    assert len(groups) == num_groups if num_groups else 1 < len(groups) < 9
    q, k, v, mix, w = make_inputs(lengths, M=18)
    calls = []

    def op(q, k, v, state, final):
        calls.append(q.shape[:2])
        return mhla_causal_torch(q, k, v, xs[3], 4, initial_state=state, output_final_state=final)

    xs = leaves(q, k, v, mix)
    o = run_varlen(op, tuple(xs[:3]), cu_of(lengths), call_cost_tokens=c)
    (o * w).sum().backward()
    assert sorted(tuple(s) for s in calls) == sorted((len(g), lengths[g[-1]]) for g in groups)
    ys = leaves(q, k, v, mix)
    ref = per_sequence(lambda a, b, c: mhla_causal_torch(a, b, c, ys[3], 4), lengths, *ys[:3])
    (ref * w).sum().backward()
    torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("dq", "dk", "dv", "dmixing"), xs, ys):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("c", [0, 3, 10**9])
def test_buckets_any_op_and_empty_sequences(c):
    """Op-agnostic: a causal cumulative sum over extra trailing dims; empty sequences anywhere, all empty."""
    for lengths in ([0, 3, 0, 1, 6, 0], [2, 2, 2], [7], [0, 0]):
        x = torch.randn(1, sum(lengths), 2, 3, dtype=torch.float64)
        o = run_varlen(lambda x, st, f: x.cumsum(1), (x,), cu_of(lengths), call_cost_tokens=c)
        cu = cu_of(lengths).tolist()
        ref = torch.cat([x[:, a:b].cumsum(1) for a, b in zip(cu[:-1], cu[1:])], dim=1)
        assert o.shape == x.shape
        torch.testing.assert_close(o, ref, rtol=0, atol=0)


# ----------------------------------------------------------------------------------- linear, softmax
@pytest.mark.parametrize("normalize", [True, False])
def test_linear_attention_varlen(normalize):
    """Causal linear attention: stateless, and chained through per-sequence (S, z) states."""
    q, k, v, _, _ = make_inputs(LENGTHS)
    kw = dict(causal=True, normalize=normalize, chunk_size=4)
    sep = per_sequence(lambda a, b, c: linear_attention(a, b, c, **kw), LENGTHS, q, k, v)
    torch.testing.assert_close(linear_attention(q, k, v, cu_seqlens=cu_of(LENGTHS), **kw), sep, rtol=1e-12,
                               atol=1e-12)
    first, rest = split_lengths(LENGTHS, seed=3)
    o1, st = linear_attention(*(gather(x, LENGTHS, first) for x in (q, k, v)), cu_seqlens=cu_of(first),
                              output_final_state=True, **kw)
    o2 = linear_attention(*(gather(x, LENGTHS, rest, first) for x in (q, k, v)), cu_seqlens=cu_of(rest),
                          initial_state=st, **kw)
    assert len(st) == len(LENGTHS) and st[0][0].shape == (1, 2, 4, 3)
    torch.testing.assert_close(o1, gather(sep, LENGTHS, first), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o2, gather(sep, LENGTHS, rest, first), rtol=1e-12, atol=1e-12)


def test_softmax_attention_varlen():
    q, k, v, _, _ = make_inputs(LENGTHS, Dv=4)
    sep = per_sequence(lambda a, b, c: softmax_attention(a, b, c, causal=True), LENGTHS, q, k, v)
    torch.testing.assert_close(softmax_attention(q, k, v, causal=True, cu_seqlens=cu_of(LENGTHS)), sep,
                               rtol=1e-12, atol=1e-12)


# -------------------------------------------------------------------------------------------- checks
@pytest.mark.parametrize("cu,match", [
    (torch.tensor([0, 3, 29], dtype=torch.int32), "end at total_T"),
    (torch.tensor([1, 3, 30], dtype=torch.int32), "start at 0"),
    (torch.tensor([0, 20, 10, 30], dtype=torch.int32), "non-decreasing"),
    (torch.tensor([0.0, 30.0]), "int32/int64"),
    (torch.tensor([[0, 30]], dtype=torch.int32), "int32/int64"),
    (torch.tensor([0], dtype=torch.int32), "int32/int64"),
    ([0, 30], "torch.Tensor"),
])
def test_bad_cu_seqlens(cu, match):
    q, k, v, mix, _ = make_inputs([10, 20], M=8)
    with pytest.raises(ValueError, match=match):
        mhla_attention(q, k, v, mix, 4, causal=True, cu_seqlens=cu, backend="torch")


def test_bad_varlen_calls():
    q, k, v, mix, _ = make_inputs([10, 20], M=8)
    cu = cu_of([10, 20])
    with pytest.raises(ValueError, match="causal=True only"):
        mhla_attention(q, k, v, mix, 4, cu_seqlens=cu)
    with pytest.raises(ValueError, match="batch 2"):
        mhla_attention(q.reshape(2, 15, 2, 4), k.reshape(2, 15, 2, 4), v.reshape(2, 15, 2, 3), mix, 4, causal=True,
                       cu_seqlens=cu_of([15]))
    with pytest.raises(ValueError, match="mixing has 4 rows but the sequence needs 5"):
        mhla_attention(q, k, v, mix[:, :4, :4], 4, causal=True, cu_seqlens=cu)  # the 20-token sequence: 5 blocks
    mhla_attention(q, k, v, mix[:, :5, :5], 4, causal=True, cu_seqlens=cu)  # not ceil(30 / 4) = 8
    with pytest.raises(ValueError, match="2 sequences but initial_state holds 1"):
        mhla_attention(q, k, v, mix, 4, causal=True, cu_seqlens=cu, initial_state=[None])
    st = init_state(2, 2, 4, 3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"initial_state\[1\].*expected"):
        mhla_attention(q, k, v, mix, 4, causal=True, cu_seqlens=cu, initial_state=[None, st])
    with pytest.raises(ValueError, match="no state"):
        mhla_attention(q, k, v, mix, 4, causal=True, cu_seqlens=cu, output_final_state=True, backend="reference")


def test_mixing_values_are_checked_once_per_varlen_call(monkeypatch):
    """A NaN or negative mixing is refused by the variable-length call, and its values are scanned once per call,
    not once per length bucket (the scan was most of a bucket call's cost at large M)."""
    from mhla.ops.mhla import api, chunk

    lengths = [2, 3, 300, 700]  # too different to share a padded bucket
    q, k, v, mix, _ = make_inputs(lengths, M=175)
    cu = cu_of(lengths)
    with pytest.raises(ValueError, match="NaN"):
        mhla_attention(q, k, v, torch.full_like(mix, float("nan")), 4, causal=True, cu_seqlens=cu)
    with pytest.raises(ValueError, match="nonnegative"):
        mhla_attention(q, k, v, -mix, 4, causal=True, cu_seqlens=cu)
    scans = []
    for mod in (api, chunk):
        real = mod.check_mixing
        monkeypatch.setattr(mod, "check_mixing", lambda *a, _real=real, **kw: (
            scans.append(kw.get("check_values", True)), _real(*a, **kw))[1])
    mhla_attention(q, k, v, mix, 4, causal=True, cu_seqlens=cu, backend="torch")
    assert len(scans) > 2 and sum(scans) == 1  # several bucket calls, one value scan
