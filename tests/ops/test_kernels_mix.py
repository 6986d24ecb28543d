"""The block mix of the Triton path (``mhla/ops/mhla/triton/mix.py``): the GEMM kernels of a dense mixing matrix
and the linear-time banded mix of compact causal rows (:class:`mhla.ops.MixingRows`).

Checked, under Triton's CPU interpreter without a GPU (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``, and this
module again for a run of it alone):

* the GEMM kernels against torch in fp64 (causal and not, shared and per-head coefficients, a state's columns,
  odd sizes), and causal: a NaN in a later block never reaches an earlier row;
* the banded mix against the dense coefficients of the same rows (``row_coefficients``), forward and every
  gradient, over windows and state layouts (kept head / folded / kept recent columns);
* ``mhla_attention(backend="triton")`` with compact rows against the fp64 torch path (output and the gradients
  of q, k, v and the rows' head / recent / far / diagonal coefficients, fp32 and fp16), against the Triton path
  with the equivalent dense matrix, through chained states split anywhere (mid-block included, gradients
  through the state), and with a NaN in a later block;
* that the compact path's work is linear in the sequence length: the elements its torch ops produce (forward
  and backward) grow 4x for 4x the blocks, where a dense coefficient matrix grows them ~16x.
"""

import itertools
import math

import pytest
import torch

from helpers.triton_env import DEVICE  # noqa: E402  (first: sets TRITON_INTERPRET)

from mhla.ops import MixingRows, init_state, mhla_attention
from mhla.ops.mhla.state import kept_block_ids, kept_blocks, row_coefficients

from mhla.ops.mhla.triton.mix import BandedMix, mix_gemm, mix_gemm_backward

F64 = torch.float64
TOL = {torch.float32: 1e-5, torch.float16: 5e-3}


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


# ------------------------------------------------------------------------------------------- GEMM kernels
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("NB,first,F", [(37, 5, 20), (16, 0, 64), (3, 2, 17), (70, 3, 20), (5, 66, 9)])
def test_mix_gemm_matches_torch(causal, G, NB, first, F):
    """P = coeff @ x, dx = coeff^T dP, dcoeff = dP x^T (summed over the batch, and heads when shared). Up to 64
    blocks and columns the kernels hold the coefficients once per program; (70, 3) and (5, 66) take the general
    tiles."""
    g = torch.Generator().manual_seed(NB)
    B, H, N = 2, 3, first + NB
    coeff = torch.rand(G, NB, N, generator=g, dtype=F64)
    x = torch.randn(B, H, N, F, generator=g, dtype=F64)
    dP = torch.randn(B, H, NB, F, generator=g, dtype=F64)
    mask = torch.arange(N)[None, :] < first + torch.arange(NB)[:, None]
    if not causal:
        mask = torch.ones_like(mask)
    c = torch.where(mask, coeff, 0.0).requires_grad_()
    xx = x.clone().requires_grad_()
    want = torch.matmul(c, xx)
    want.backward(dP)
    got = mix_gemm(coeff.float(), x.float(), causal=causal, first=first)
    dx, dc = mix_gemm_backward(coeff.float(), x.float(), dP.float(), causal=causal, first=first)
    assert rel_err(got, want) < 1e-6 and rel_err(dx, xx.grad) < 1e-6
    assert dc.shape == (G, NB, N) and rel_err(dc, torch.where(mask, c.grad, 0.0)) < 1e-6
    assert not dc[:, ~mask].any()  # nothing above the diagonal


def test_mix_gemm_keeps_a_later_nan_out_of_earlier_rows():
    B, H, NB, first, F = 1, 2, 40, 3, 24
    g = torch.Generator().manual_seed(0)
    coeff = torch.rand(1, NB, first + NB, generator=g)
    x = torch.randn(B, H, first + NB, F, generator=g)
    clean = mix_gemm(coeff, x, causal=True, first=first)
    bad = first + 17  # column of row 17's own block: rows 18.. read it
    x[:, :, bad, 5] = float("nan")
    x[:, :, bad, 6] = float("inf")
    got = mix_gemm(coeff, x, causal=True, first=first)
    torch.testing.assert_close(got[:, :, :18], clean[:, :, :18])
    assert got[:, :, 18:, 5:7].isnan().all()
    torch.testing.assert_close(got[..., :5], clean[..., :5])  # other features untouched


# ----------------------------------------------------------------------------------------------- banded
def random_rows(G, first, n, window, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    lead = (G,) if G > 1 else ()
    return MixingRows(first, *(torch.rand(*lead, n, *s, generator=g, dtype=dtype) * 0.9 + 0.1
                               for s in ((), (window[0],), (window[1],), ())))


def dense_columns(rows, first, NB, window, far):
    """The coefficients of rows ``first ..`` on the columns BandedMix reads (kept head, folded, kept recent,
    the call's blocks), built densely by ``row_coefficients``: ``[G, NB, state columns + NB]``."""
    kh, kr = kept_blocks(first, window)
    ids = torch.tensor(kept_block_ids(first, window) + list(range(first, first + NB)))
    coeff = row_coefficients(rows, first, NB, ids)
    folded = [far.unsqueeze(-1)] if first > kh + kr else []
    return torch.cat([coeff[..., :kh], *folded, coeff[..., kh:]], dim=-1)


@pytest.mark.parametrize("window", [(0, 3), (3, 0), (2, 5), (1, 17), (0, 0)])
@pytest.mark.parametrize("first", [0, 2, 6, 40])
@pytest.mark.parametrize("G", [1, 2])
def test_banded_mix_equals_the_dense_coefficients(window, first, G):
    """Forward and the gradients of the summaries and of head / recent / far, fp64, every column layout."""
    for NB in (1, 5, 35):
        rows = random_rows(G, first, NB, window, seed=NB)
        _, head, recent, far = (t.clone().requires_grad_() for t in rows.rows(first, first + NB))
        kh, kr = kept_blocks(first, window)
        mixer = BandedMix(window, first, kh, first > kh + kr, kr, NB)
        dense = dense_columns(MixingRows(first, rows.rows(first, first + NB)[0], head, recent, far), first, NB,
                              window, far)
        x = torch.randn(2, 2, mixer.state_columns + NB, 3, 2, dtype=F64, generator=torch.Generator().manual_seed(1))
        assert dense.shape[-1] == x.shape[2]
        xx = x.clone().requires_grad_()
        want = torch.einsum("hin,bhnde->bhide", dense.expand(x.shape[1], -1, -1), xx)
        dP = torch.randn_like(want)
        want.backward(dP)
        (got,) = mixer.mix((head, recent, far), [x])
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        (dx,), dcs = mixer.backward((head, recent, far), [x], [dP], True)
        torch.testing.assert_close(dx, xx.grad, rtol=1e-12, atol=1e-12)
        for name, a, b in zip(("head", "recent", "far"), dcs, (head, recent, far)):
            ref = torch.zeros_like(b) if b.grad is None else b.grad
            torch.testing.assert_close(a, ref, rtol=1e-12, atol=1e-12, msg=name)


def test_banded_mix_keeps_a_later_nan_out_of_earlier_rows():
    window, first, NB = (2, 4), 9, 30
    kh, kr = kept_blocks(first, window)
    mixer = BandedMix(window, first, kh, True, kr, NB)
    _, head, recent, far = random_rows(1, first, NB, window).rows(first, first + NB)
    x = torch.randn(1, 2, mixer.state_columns + NB, 8, dtype=F64)
    (clean,) = mixer.mix((head, recent, far), [x])
    x[:, :, mixer.state_columns + 20, 3] = float("nan")  # the own block of row 20
    (got,) = mixer.mix((head, recent, far), [x])
    torch.testing.assert_close(got[:, :, :21], clean[:, :, :21])
    assert got[:, :, 21:, 3].isnan().all() and not got[..., :3].isnan().any()


# ---------------------------------------------------------------------------------- through mhla_attention
def run_rows(backend, q, k, v, rows, w, C, **kw):
    """Output and gradients (q, k, v, diag, head, recent, far) of ``sum(o * w)``."""
    xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    cs = [c.detach().clone().requires_grad_() for c in (rows.diag, rows.head, rows.recent, rows.far)]
    o = mhla_attention(*xs, MixingRows(rows.first, *cs), C, causal=True, backend=backend, **kw)
    (o.to(w.dtype) * w).sum().backward()
    return [o.detach()] + [x.grad for x in xs + cs]


def inputs(B, T, H, D, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.rand(B, T, H, D, generator=g) for _ in range(2))
    v, w = (torch.randn(B, T, H, Dv, generator=g) for _ in range(2))
    return [x.to(DEVICE, dtype) for x in (q, k, v)] + [w.to(DEVICE)]


COMPACT = [  # T, C, window, per_head, normalize
    (63, 4, (0, 3), False, True),  # 16 blocks, the last partial
    (100, 8, (3, 0), True, True),  # last_row's window
    (150, 4, (2, 5), True, False),  # head and recent, no normalizer
    (70, 16, (0, 1), False, True),  # one chunk per block
    (130, 80, (0, 2), True, True),  # two chunks per block, the second partial
]


@pytest.mark.parametrize("case", COMPACT, ids=lambda c: "T{}-C{}-w{}-{}-{}".format(
    c[0], c[1], c[2], "head" if c[3] else "shared", "norm" if c[4] else "none"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compact_rows_match_the_fp64_torch_path(case, dtype):
    T, C, window, per_head, normalize = case
    B, H, D, Dv = 1, 2, 16, 24
    q, k, v, w = inputs(B, T, H, D, Dv, dtype)
    rows = random_rows(H if per_head else 1, 0, math.ceil(T / C), window, dtype=torch.float32)
    rows = MixingRows(0, *(t.to(DEVICE) for t in (rows.diag, rows.head, rows.recent, rows.far)))
    got = run_rows("triton", q, k, v, rows, w, C, normalize=normalize)
    same = run_rows("torch", q, k, v, rows, w, C, normalize=normalize)
    exact = run_rows("torch", q.double(), k.double(), v.double(), rows.to(F64), w.double(), C, normalize=normalize)
    errs = {}
    for name, a, b, r in zip(("o", "dq", "dk", "dv", "ddiag", "dhead", "drecent", "dfar"), got, same, exact):
        if r is None or r.numel() == 0:  # an empty window: no coefficient
            assert a is None or not a.any(), name
            continue
        errs[name] = (rel_err(a, r), rel_err(b, r))
        assert errs[name][0] <= max(TOL[dtype], 2 * errs[name][1]), errs


def dense_matrix(rows, n):
    """The ``[G, n, n]`` causal matrix of compact rows 0 .. n - 1."""
    diag, _, _, _ = rows.rows(0, n)
    return row_coefficients(rows, 0, n, torch.arange(n, device=diag.device)) + torch.diag_embed(diag)


@pytest.mark.parametrize("window", [(0, 3), (2, 1)])
def test_compact_rows_equal_the_dense_matrix_on_the_kernels(window):
    """The banded mix and the dense GEMM kernel give the same output and q, k, v gradients."""
    T, C, H = 90, 4, 2
    q, k, v, w = inputs(1, T, H, 16, 16, torch.float32, seed=3)
    n = math.ceil(T / C)
    rows = random_rows(H, 0, n, window, dtype=torch.float32)
    rows = MixingRows(0, *(t.to(DEVICE) for t in (rows.diag, rows.head, rows.recent, rows.far)))
    banded = run_rows("triton", q, k, v, rows, w, C)
    xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = mhla_attention(*xs, dense_matrix(rows, n), C, causal=True, backend="triton")
    (o * w).sum().backward()
    for name, a, b in zip(("o", "dq", "dk", "dv"), banded, [o.detach()] + [x.grad for x in xs]):
        assert rel_err(a, b) <= 1e-5, name


@pytest.mark.parametrize("window,splits", [((0, 3), [7, 9, 30, 61, 62]), ((3, 0), [13, 40]), ((1, 2), [50])])
def test_chained_states_and_their_gradients(window, splits):
    """Chunked prefill with compact rows on the kernels, split anywhere (mid-block, single tokens): the output and
    final state equal one fp64 call, and the gradients (q, k, v, the rows, the initial state, through a loss on
    the outputs and the final state) equal the torch path's."""
    B, T, H, D, C = 1, 90, 2, 16, 4
    q, k, v, w = inputs(B, T, H, D, D, torch.float32, seed=5)
    base = random_rows(H, 0, math.ceil(T / C), window, dtype=torch.float32)
    bounds = [0, *splits, T]
    grads, results = [], []
    for backend in ("torch", "triton"):
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        cs = [c.detach().to(DEVICE).clone().requires_grad_() for c in (base.diag, base.head, base.recent, base.far)]
        rows = MixingRows(0, *cs)
        st = st0 = init_state(B, H, D, D, C, device=DEVICE, window=window)
        st0.current_summary.requires_grad_()
        outs = []
        for a, b in itertools.pairwise(bounds):
            o, st = mhla_attention(*(x[:, a:b] for x in xs), rows, C, causal=True, initial_state=st,
                                   output_final_state=True, backend=backend)
            outs.append(o)
        o = torch.cat(outs, 1)
        loss = (o * w).sum() + 1e-2 * (st.block_summaries.sum() + st.far_summary.sum() + st.current_summary.sum()) \
            + 1e-3 * ((st.far_key_sum ** 2).sum() + (st.block_key_sums ** 2).sum())
        loss.backward()
        results.append((o.detach(), st))
        grads.append([x.grad for x in xs + cs] + [st0.current_summary.grad])
    exact = mhla_attention(q.double(), k.double(), v.double(), base.to(F64), C, causal=True, backend="torch")
    assert rel_err(results[1][0], exact) <= 1e-5
    for name in ("block_summaries", "far_summary", "current_summary", "far_key_sum", "current_key_sum"):
        assert rel_err(getattr(results[1][1], name), getattr(results[0][1], name)) <= 1e-5, name
    names = ("dq", "dk", "dv", "ddiag", "dhead", "drecent", "dfar", "dstate")
    for name, a, b in zip(names, grads[1], grads[0]):
        if b is not None and b.numel():
            assert rel_err(a, b) <= 1e-5, name


def test_a_nan_in_a_later_block_stays_there():
    """Compact rows on the kernels: a NaN value in block 9 leaves every earlier output as it was."""
    T, C, H = 80, 4, 2
    q, k, v, _ = inputs(1, T, H, 16, 16, torch.float32, seed=7)
    rows = random_rows(1, 0, T // C, (1, 3), dtype=torch.float32)
    rows = MixingRows(0, *(t.to(DEVICE) for t in (rows.diag, rows.head, rows.recent, rows.far)))
    clean = mhla_attention(q, k, v, rows, C, causal=True, backend="triton")
    v = v.clone()
    v[:, 9 * C + 1, 0] = float("nan")
    got = mhla_attention(q, k, v, rows, C, causal=True, backend="triton")
    torch.testing.assert_close(got[:, :9 * C + 1], clean[:, :9 * C + 1])
    assert got[:, 9 * C + 1:, 0].isnan().all()


# ----------------------------------------------------------------------------------------------- linear cost
def produced_elements(fn) -> int:
    """Elements of every tensor the torch ops produce while ``fn()`` runs (views included): a measure of the
    work of the torch parts of a call (the Triton kernels themselves are not torch ops)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Count.total += sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
            return out

    with Count():
        fn()
    return Count.total


class _Captured(Exception):
    pass


def mix_work(nb: int, compact: bool, monkeypatch) -> int:
    """The work of the mix in a causal call of ``nb`` blocks: the coefficient elements the backend hands to the
    autograd Function plus the elements its mixer's torch ops produce, forward and backward, on summaries of one
    feature (the Function is stopped before the kernels run)."""
    from mhla.ops.mhla.triton import causal

    H, C = 2, 1
    q = torch.rand(1, nb * C, H, 2, device=DEVICE)
    rows = random_rows(H, 0, nb, (1, 3), dtype=torch.float32)
    rows = MixingRows(0, *(t.to(DEVICE) for t in (rows.diag, rows.head, rows.recent, rows.far)))
    seen = {}

    def capture(*args):
        seen["args"] = args
        raise _Captured

    with monkeypatch.context() as m:
        m.setattr(causal.MHLACausalFunction, "apply", capture)
        with pytest.raises(_Captured):
            mhla_attention(q, q, q, rows if compact else dense_matrix(rows, nb), C, causal=True, backend="triton")
    args = seen["args"]
    mixer, mdiag, columns, coefficients = args[8], args[3], args[10], args[causal._N_ARGS:]
    x = torch.randn(1, H, columns + mdiag.shape[-1], 1, device=DEVICE)

    def mix_and_back():
        (P,) = mixer.mix(coefficients, [x])
        mixer.backward(coefficients, [x], [torch.ones_like(P)], True)

    return sum(c.numel() for c in coefficients) + produced_elements(mix_and_back)


def test_the_compact_path_is_linear_in_the_blocks(monkeypatch):
    """4x the blocks: ~4x the work of the mix for compact rows; a dense matrix (the quadratic mix) shows ~16x, so
    the measure sees a dense coefficient matrix or a quadratic mixer used for compact rows."""
    compact = mix_work(256, True, monkeypatch) / mix_work(64, True, monkeypatch)
    dense = mix_work(256, False, monkeypatch) / mix_work(64, False, monkeypatch)
    assert 3.0 < compact < 5.0, compact
    assert dense > 12.0, dense
