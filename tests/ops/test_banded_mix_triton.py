"""The fused banded mix (``mhla/ops/mhla/triton/banded.py``): compact causal rows mixed by Triton kernels.

Checked under Triton's CPU interpreter without a GPU (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``, and this
module again for a run of it alone), on a GPU with CUDA:

* :class:`~mhla.ops.mhla.triton.mix.BandedMix` on the kernels against its torch reference
  (:meth:`~mhla.ops.mhla.triton.mix.BandedMix.mix_reference`, run in fp64) and against the fp64 dense coefficients
  of the same rows (``row_coefficients``): the mixed summaries, their gradient and every coefficient gradient (head,
  recent, far), shared and per-head rows, odd block counts, windows whose recent part is smaller and larger than a
  band tile of 16 (and the LM's (0, 31): tiles of 32), head blocks, a state's kept head / folded / kept recent
  columns, several feature tiles and chunks, the two parts (summaries and key sums) in one launch, summaries in
  fp32, fp16 and bf16;
* a NaN or inf in a summary: the same rows and features turn NaN as the reference (``causal_product``'s
  convention), the same gradients, and no host synchronisation;
* the fallback: windows past the kernels' register tiles, and fp64, run the torch reference;
* ``mhla_attention(backend="triton")`` with compact rows on the kernels against the fp64 torch path (fp32, fp16,
  bf16; the LM's window over several band tiles; a chained state), and that the kernels did run.
"""

import math

import pytest
import torch

from helpers.triton_env import DEVICE  # noqa: E402  (first: sets TRITON_INTERPRET)

from mhla.ops import MixingRows, init_state, mhla_attention  # noqa: E402
from mhla.ops.mhla.state import kept_block_ids, kept_blocks, row_coefficients  # noqa: E402

from mhla.ops.mhla.triton import banded  # noqa: E402
from mhla.ops.mhla.triton.mix import BandedMix, band_tile  # noqa: E402

F64 = torch.float64
#: max |error| / max(max |reference|, 1) against fp64, by the summaries' dtype (they are rounded to it; the
#: kernels accumulate in fp32)
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def rel_err(a, b):
    a, b = a.double(), b.double()
    if b.numel() == 0:  # an empty window part (no coefficient)
        return 0.0 if a.shape == b.shape else float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


def mixer_for(window, first, NB):
    kh, kr = kept_blocks(first, window)
    return BandedMix(window, first, kh, first > kh + kr, kr, NB)


def random_coefficients(G, NB, window, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(G, NB, *s, generator=g) * 0.9 + 0.1 for s in ((window[0],), (window[1],), ())]


def dense_columns(coefficients, window, first, NB):
    """The fp64 coefficients of rows ``first ..`` on the columns BandedMix reads (kept head, folded, kept recent,
    the call's blocks), from ``row_coefficients`` of the same rows: ``[G, NB, state columns + NB]``."""
    head, recent, far = (c.double() for c in coefficients)
    rows = MixingRows(first, torch.zeros_like(far), head, recent, far)
    kh, kr = kept_blocks(first, window)
    ids = torch.tensor(kept_block_ids(first, window) + list(range(first, first + NB)), device=far.device)
    coeff = row_coefficients(rows, first, NB, ids)
    folded = [far.unsqueeze(-1)] if first > kh + kr else []
    return torch.cat([coeff[..., :kh], *folded, coeff[..., kh:]], dim=-1)


def summaries(mixer, B, H, feats, dtype, seed, two=True):
    """``xs`` (summaries ``[B, H, N, *feats]``, key sums ``[B, H, N, 3]`` or None) and ``dps`` alike."""
    g = torch.Generator().manual_seed(seed)
    N = mixer.state_columns + mixer.rows
    xs = [torch.randn(B, H, N, *feats, generator=g), torch.randn(B, H, N, 3, generator=g) if two else None]
    dps = [torch.randn(B, H, mixer.rows, *feats, generator=g), torch.randn(B, H, mixer.rows, 3, generator=g)
           if two else None]
    cast = lambda ts: [None if t is None else t.to(DEVICE, dtype) for t in ts]  # noqa: E731
    return cast(xs), cast(dps)


def reference(mixer, coefficients, xs, dps):
    """``(P, dx, dcoefficients)`` of the torch reference in fp64 (the summaries as given, rounded to their dtype)."""
    up = lambda ts: [None if t is None else t.double() for t in ts]  # noqa: E731
    cs = up(coefficients)
    ps = mixer.mix_reference(cs, up(xs))
    dxs, dcs = mixer.backward_reference(cs, up(xs), up(dps), True)
    return ps, dxs, dcs


def check_against_references(mixer, coefficients, xs, dps, dtype):
    assert mixer.fused(xs), "the kernels must run this case"
    ps = mixer.mix(coefficients, xs)
    dxs, dcs = mixer.backward(coefficients, xs, dps, True)
    want_ps, want_dxs, want_dcs = reference(mixer, coefficients, xs, dps)
    tol = TOL[dtype]
    for name, got, want in [("P", ps, want_ps), ("dx", dxs, want_dxs)]:
        for part, a, b in zip(("S", "z"), got, want):
            if b is None:
                assert a is None
                continue
            want_dtype = dtype if name == "P" else torch.float32  # gradients in fp32
            assert a.dtype == want_dtype and a.shape == b.shape, (name, part, a.dtype)
            assert rel_err(a, b) < tol, (name, part, rel_err(a, b))
    for name, a, b, c in zip(("dhead", "drecent", "dfar"), dcs, want_dcs, coefficients):
        assert a.shape == c.shape and a.dtype == c.dtype, name
        assert rel_err(a, b) < tol, (name, rel_err(a, b))
    # the same against the dense coefficients of the rows (fp64): P = coeff @ x, dx = coeff^T dP
    dense = dense_columns(coefficients, mixer.window, mixer.first, mixer.rows)
    for x, p, dp, dx in zip(xs, ps, dps, dxs):
        if x is None:
            continue
        flat = x.double().flatten(3)
        gh = dense.expand(x.shape[1], -1, -1) if dense.shape[0] == 1 else dense
        want = torch.einsum("hin,bhnf->bhif", gh, flat)
        assert rel_err(p.flatten(3), want) < tol
        want_dx = torch.einsum("hin,bhif->bhnf", gh, dp.double().flatten(3))
        assert rel_err(dx.flatten(3), want_dx) < tol


# window, first (0: the training call; else a state's columns), NB, G (1 shared, else per head), features
CASES = [
    ((1, 2), 0, 37, 1, (5,)),  # recent smaller than a band tile (16), odd NB: 3 tiles, the last partial
    ((0, 3), 0, 5, 2, (4, 2)),  # fewer blocks than a tile, per-head rows
    ((2, 8), 0, 33, 2, (6,)),  # head blocks
    ((0, 17), 0, 41, 1, (5,)),  # recent larger than 16: tiles of 32
    ((0, 31), 0, 70, 1, (12, 12)),  # the LM's window: 3 tiles of 32; 144 features: 2 feature tiles, 8 / 1 chunks
    ((3, 0), 0, 20, 2, (5,)),  # no recent blocks: the far sum only (last_row's window)
    ((16, 32), 0, 50, 1, (3,)),  # the largest window the kernels take
    ((2, 5), 3, 30, 2, (5,)),  # a state shorter than head + recent: kept head and recent, nothing folded
    ((4, 3), 2, 31, 1, (5,)),  # a state inside the head: the call's first blocks are head blocks
    ((2, 5), 9, 30, 1, (12, 12)),  # kept head, folded far sum, kept recent
    ((0, 31), 40, 9, 2, (5,)),  # folded, 31 kept recent blocks, fewer rows than a tile
    ((1, 0), 6, 17, 1, (5,)),  # folded, no recent blocks
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"w{c[0][0]},{c[0][1]}-first{c[1]}-NB{c[2]}-G{c[3]}")
def test_kernels_equal_the_torch_reference_and_the_dense_rows(case):
    window, first, NB, G, feats = case
    mixer = mixer_for(window, first, NB)
    B, H = 2, 2
    coefficients = [c.to(DEVICE) for c in random_coefficients(G if G == 1 else H, NB, window, seed=NB)]
    xs, dps = summaries(mixer, B, H, feats, torch.float32, seed=first + NB)
    check_against_references(mixer, coefficients, xs, dps, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window,first,NB", [((0, 31), 0, 40), ((2, 5), 9, 23)])
def test_half_summaries(dtype, window, first, NB):
    """Summaries (and ``dP``) in fp16 / bf16: loaded as fp32, accumulated in fp32, P stored in their dtype; dx
    fp32 (the causal path keeps gradients in fp32); the coefficient gradients fp32 (the coefficients' dtype)."""
    mixer = mixer_for(window, first, NB)
    coefficients = [c.to(DEVICE) for c in random_coefficients(1, NB, window, seed=1)]
    xs, dps = summaries(mixer, 2, 2, (5,), dtype, seed=2)
    check_against_references(mixer, coefficients, xs, dps, dtype)


def test_one_part_and_no_coefficient_gradients():
    """The summaries alone (no key sums), and the backward without coefficient gradients (frozen rows)."""
    window, first, NB = (2, 8), 6, 33
    mixer = mixer_for(window, first, NB)
    coefficients = [c.to(DEVICE) for c in random_coefficients(2, NB, window, seed=3)]
    xs, dps = summaries(mixer, 1, 2, (7,), torch.float32, seed=4, two=False)
    want_ps, want_dxs, _ = reference(mixer, coefficients, xs, dps)
    (p, none) = mixer.mix(coefficients, xs)
    assert none is None and rel_err(p, want_ps[0]) < TOL[torch.float32]
    dxs, dcs = mixer.backward(coefficients, xs, dps, False)
    assert dcs is None and dxs[1] is None and rel_err(dxs[0], want_dxs[0]) < TOL[torch.float32]


@pytest.mark.parametrize("first,col", [(0, 11), (9, 20), (9, 1), (9, 3)])
def test_a_non_finite_summary_reaches_the_later_rows_only(first, col):
    """A NaN and an inf in column ``col`` (a call block, or the state's kept head / folded column): the rows
    after it turn NaN in those features, exactly where the reference does; every other entry, and every gradient
    (``dP`` of those rows dropped), equals the reference."""
    window, NB = (2, 5), 30
    mixer = mixer_for(window, first, NB)
    coefficients = [c.to(DEVICE) for c in random_coefficients(1, NB, window, seed=5)]
    xs, dps = summaries(mixer, 1, 2, (20,), torch.float32, seed=6)
    xs[0][0, 1, col, 3] = float("nan")
    xs[0][0, 0, col, 17] = float("inf")
    xs[1][0, 1, col, 2] = float("-inf")
    ps = mixer.mix(coefficients, xs)
    dxs, dcs = mixer.backward(coefficients, xs, dps, True)
    want_ps, want_dxs, want_dcs = reference(mixer, coefficients, xs, dps)
    for a, b in zip(ps, want_ps):
        assert torch.equal(a.isnan(), b.isnan())
        assert a.isnan().any()  # the non-finite value did reach the rows after it
        assert rel_err(a.nan_to_num(0.0), b.nan_to_num(0.0)) < TOL[torch.float32]
    later = col - mixer.state_columns + 1  # the first row that reads column col
    assert not ps[0][:, :, :max(later, 0)].isnan().any()
    for a, b in list(zip(dxs, want_dxs)) + list(zip(dcs, want_dcs)):
        assert torch.isfinite(a).all() and rel_err(a, b) < TOL[torch.float32]


def test_outside_the_kernels_the_reference_runs(monkeypatch):
    """Windows past the register tiles (head > 16 or recent > 32) and fp64 summaries take the torch reference
    (the kernels are not launched); the kernels' windows and dtypes do launch them."""
    calls = []
    for name in ("banded_mix", "banded_mix_backward"):
        real = getattr(banded, name)
        monkeypatch.setattr("mhla.ops.mhla.triton.mix." + name,
                            lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    NB = 40
    for window, dtype, fused in [((17, 3), torch.float32, False), ((0, 33), torch.float32, False),
                                 ((0, 31), torch.float64, False), ((16, 32), torch.float32, True)]:
        mixer = mixer_for(window, 0, NB)
        coefficients = [c.to(DEVICE, dtype) for c in random_coefficients(1, NB, window, seed=7)]
        xs, dps = summaries(mixer, 1, 1, (4,), dtype, seed=8)
        assert mixer.fused(xs) == fused == banded.fused_supported(window, dtype)
        calls.clear()
        ps = mixer.mix(coefficients, xs)
        dxs, _ = mixer.backward(coefficients, xs, dps, True)
        assert len(calls) == (2 if fused else 0)
        want_ps, want_dxs, _ = reference(mixer, coefficients, xs, dps)
        assert rel_err(ps[0], want_ps[0]) < TOL[torch.float32] and rel_err(dxs[0], want_dxs[0]) < TOL[torch.float32]


def test_band_tile_is_the_mixers():
    for recent in (0, 1, 15, 16, 17, 31, 32):
        assert banded.band_tile(recent) == band_tile(recent)
        assert banded.banded_tiles((0, recent), 4096)[0] == band_tile(recent)


# ---------------------------------------------------------------------------------------- through mhla_attention
def run_rows(backend, q, k, v, rows, w, C, **kw):
    """Output and gradients (q, k, v, diag, head, recent, far) of ``sum(o * w)``."""
    xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    cs = [c.detach().clone().requires_grad_() for c in (rows.diag, rows.head, rows.recent, rows.far)]
    o = mhla_attention(*xs, MixingRows(rows.first, *cs), C, causal=True, backend=backend, **kw)
    (o.double() * w.double()).sum().backward()
    return [o.detach()] + [x.grad for x in xs + cs]


def random_rows(G, n, window, seed):
    g = torch.Generator().manual_seed(seed)
    lead = (G,) if G > 1 else ()
    return MixingRows(0, *(torch.rand(*lead, n, *s, generator=g).to(DEVICE) * 0.9 + 0.1
                           for s in ((), (window[0],), (window[1],), ())))


@pytest.fixture
def launches(monkeypatch):
    """Counts the banded kernels' host calls (forward and backward) through the op."""
    count = {"fwd": 0, "bwd": 0}
    for name, key in (("banded_mix", "fwd"), ("banded_mix_backward", "bwd")):
        real = getattr(banded, name)

        def spy(*a, _real=real, _key=key, **k):
            count[_key] += 1
            return _real(*a, **k)
        monkeypatch.setattr("mhla.ops.mhla.triton.mix." + name, spy)
    return count


# T, C, window, per-head rows, normalize, dtype, rows in the input dtype (as in a half model; else fp32)
OP_CASES = [
    (134, 2, (0, 31), False, True, torch.float32, False),  # the LM's window over 67 blocks: 3 band tiles of 32
    (134, 2, (0, 31), False, True, torch.bfloat16, False),
    (134, 2, (0, 31), False, True, torch.float16, True),  # half rows, read in place
    (90, 4, (2, 8), True, False, torch.float16, False),  # head blocks, per-head rows, no normalizer
    (63, 3, (1, 2), True, True, torch.bfloat16, True),
]


@pytest.mark.parametrize("case", OP_CASES, ids=lambda c: "T{}-C{}-w{},{}-{}{}".format(
    c[0], c[1], *c[2], str(c[5])[6:], "-half-rows" if c[6] else ""))
def test_op_with_compact_rows_matches_the_fp64_torch_path(case, launches):
    T, C, window, per_head, normalize, dtype, half_rows = case
    B, H, D, Dv = 1, 2, 16, 8
    g = torch.Generator().manual_seed(T)
    q, k = (torch.rand(B, T, H, D, generator=g).to(DEVICE, dtype) for _ in range(2))
    v = torch.randn(B, T, H, Dv, generator=g).to(DEVICE, dtype)
    w = torch.randn(B, T, H, Dv, generator=g).to(DEVICE)
    rows = random_rows(H if per_head else 1, math.ceil(T / C), window, seed=1)
    if half_rows:
        rows = rows.to(dtype)
    norm = "paper" if normalize else "none"
    got = run_rows("triton", q, k, v, rows, w, C, normalize=norm)
    assert launches == {"fwd": 1, "bwd": 1}
    grads = got[4:]  # the rows' gradients, in the rows' dtype
    assert all(gr.dtype == rows.diag.dtype for gr in grads if gr is not None), [gr.dtype for gr in grads]
    exact = run_rows("torch", q.double(), k.double(), v.double(), rows.to(F64), w, C, normalize=norm)
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]
    for name, a, b in zip(("o", "dq", "dk", "dv", "ddiag", "dhead", "drecent", "dfar"), got, exact):
        if b is None or b.numel() == 0:
            continue
        assert rel_err(a, b) <= tol, (name, rel_err(a, b))


def test_op_half_summaries_with_compact_rows(monkeypatch):
    """``MHLA_SUMMARY_DTYPE=input`` with compact rows (the LM setting's opt-in): fp16 inputs, the summaries and
    their mix stored in fp16 and mixed by the banded kernels; every output and gradient within the fp16 kernel
    tolerance of fp64, and at most 1e-3 above the same call with fp32 summaries (as the dense path's test)."""
    from mhla.ops.mhla.triton.utils import SUMMARY_DTYPE_ENV

    T, C, window, B, H, D, Dv = 134, 2, (0, 31), 1, 2, 16, 8
    g = torch.Generator().manual_seed(5)
    q, k = (torch.rand(B, T, H, D, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    v = torch.randn(B, T, H, Dv, generator=g).to(DEVICE, torch.float16)
    w = torch.randn(B, T, H, Dv, generator=g).to(DEVICE)
    rows = random_rows(1, math.ceil(T / C), window, seed=3)
    stored = []
    real = banded.banded_mix

    def spy(coefficients, xs, **kw):
        stored.append({x.dtype for x in xs if x is not None})
        return real(coefficients, xs, **kw)
    monkeypatch.setattr("mhla.ops.mhla.triton.mix.banded_mix", spy)
    got = {}
    for mode in ("fp32", "input"):
        monkeypatch.setenv(SUMMARY_DTYPE_ENV, mode)
        got[mode] = run_rows("triton", q, k, v, rows, w, C)
    assert stored == [{torch.float32}, {torch.float16}]
    exact = run_rows("torch", q.double(), k.double(), v.double(), rows.to(F64), w, C)
    for n, name in enumerate(("o", "dq", "dk", "dv", "ddiag", "dhead", "drecent", "dfar")):
        if exact[n] is None or exact[n].numel() == 0:
            continue
        e32, e16 = rel_err(got["fp32"][n], exact[n]), rel_err(got["input"][n], exact[n])
        assert e16 <= 5e-3 and e16 <= e32 + 1e-3, (name, e32, e16)


def test_op_chained_state_on_the_kernels(launches):
    """Two calls through a state (the second starts mid-block, with kept head, folded and kept recent columns) on
    the kernels: the output equals one fp64 call, the rows' gradients the torch path's."""
    B, T, H, D, C, window, split = 1, 70, 2, 8, 2, (2, 5), 33
    g = torch.Generator().manual_seed(0)
    q, k = (torch.rand(B, T, H, D, generator=g).to(DEVICE) for _ in range(2))
    v = torch.randn(B, T, H, D, generator=g).to(DEVICE)
    base = random_rows(H, math.ceil(T / C), window, seed=2)
    grads = []
    for backend in ("torch", "triton"):
        cs = [c.detach().clone().requires_grad_() for c in (base.diag, base.head, base.recent, base.far)]
        rows = MixingRows(0, *cs)
        st = init_state(B, H, D, D, C, device=DEVICE, window=window)
        o1, st = mhla_attention(q[:, :split], k[:, :split], v[:, :split], rows, C, causal=True, initial_state=st,
                                output_final_state=True, backend=backend)
        o2 = mhla_attention(q[:, split:], k[:, split:], v[:, split:], rows, C, causal=True, initial_state=st,
                            backend=backend)
        o = torch.cat([o1, o2], 1)
        (o * v).sum().backward()
        grads.append([o.detach()] + [c.grad for c in cs])
    assert launches == {"fwd": 2, "bwd": 2}
    exact = mhla_attention(q.double(), k.double(), v.double(), base.to(F64), C, causal=True, backend="torch")
    assert rel_err(grads[1][0], exact) <= 1e-5
    for name, a, b in zip(("ddiag", "dhead", "drecent", "dfar"), grads[1][1:], grads[0][1:]):
        assert rel_err(a, b) <= 1e-5, name


@pytest.mark.gpu
@pytest.mark.parametrize("window,first,NB,feats", [((0, 31), 0, 64, (64, 64)), ((0, 31), 0, 256, (64, 64)),
                                                  ((2, 5), 9, 64, (128, 128))])
def test_gpu_lm_shapes(window, first, NB, feats):
    """On the GPU (the campaign's ``-m gpu`` stage): the LM's window at T 4k and 16k with blocks of 64 (summaries
    D x Dv = 64 x 64, fp32 as the kernels store them; the tf32x3 dots on tensor cores), and a state at D 128."""
    mixer = mixer_for(window, first, NB)
    coefficients = [c.to(DEVICE) for c in random_coefficients(1, NB, window, seed=NB)]
    xs, dps = summaries(mixer, 2, 4, feats, torch.float32, seed=NB)
    check_against_references(mixer, coefficients, xs, dps, torch.float32)
