"""The Triton kernels (backend="triton") against the torch path: forward and every gradient.

Without a GPU the kernels run in Triton's CPU interpreter. Triton reads ``TRITON_INTERPRET`` when
``@triton.jit`` decorates a function: our kernels (when ``mhla.ops.mhla.triton`` is imported) and
triton.language's own helpers (when triton is first imported, which other test modules do indirectly through
diffusers / transformers). So ``tests/conftest.py`` sets it before anything is collected, and this module sets
it again for a run of this file alone. It is only set when CUDA is absent, so on a GPU machine the same tests
run the compiled kernels on CUDA tensors, and the ``gpu`` tests add bf16 checks at realistic shapes.

Criterion (``check_against_torch``): the output and the gradients of q, k, v and mixing of the loss
``sum(o * w)`` (fixed random ``w``) are compared with the torch path run in float64 on the same (rounded)
inputs; per tensor, ``err = max|x - x_fp64| / max(max|x_fp64|, 1)``. The Triton error must be at most
``max(TOL[dtype], 2 * err of the torch path in the same dtype)``:
    fp32: TOL 1e-5  (observed: Triton <= 1.6e-6, the torch path <= 1.9e-6)
    fp16: TOL 5e-3  (observed: Triton <= 1.3e-3, the torch path <= 7e-4; the mixing gradient is the
                     largest, it reads the fp16-rounded output through the normalizer's backward)
    bf16: TOL 1e-2  (GPU tests; 8 mantissa bits)
Comparing with float64 rather than with the fp32 torch path matters for the mixing gradient of a
normalized block: it is a difference of nearly equal sums (a normalized output does not depend on the
scale of its mixing row), so both fp32 paths carry ~1e-5 relative noise there. The floor of 1 in the
denominator covers a single normalized block, whose mixing gradient is zero up to rounding.
"""

import itertools
import math
import os

import pytest
import torch

from helpers.triton_env import triton_backend  # noqa: E402  (first: sets TRITON_INTERPRET)

from mhla.ops import mhla_attention

from helpers.kernel_cases import DEVICE, TOL, make_inputs, rel_err, run  # noqa: E402


def check_against_torch(q, k, v, mix, w, C, dtype, **kw):
    """Triton vs the fp64 torch path on the same (rounded) inputs, next to the torch path in ``dtype``."""
    got = run("triton", q, k, v, mix, w, C, **kw)
    same = run("torch", q, k, v, mix, w, C, **kw)
    exact = run("torch", *(x.double() for x in (q, k, v, mix, w)), C, **kw)
    names = ("o", "dq", "dk", "dv", "dmixing")
    errs, bad = {}, {}
    for name, a, b, r in zip(names, got, same, exact):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        errs[name] = (rel_err(a, r), rel_err(b, r))
        if not errs[name][0] <= max(TOL[dtype], 2 * errs[name][1]):
            bad[name] = errs[name]
    assert not bad, f"(triton, torch) errors vs fp64 above {TOL[dtype]:.0e}: {bad} (all: {errs})"
    return errs


def compare(B, T, H, D, Dv, C, *, causal, normalize, per_head, dtype, M=None, seed=0):
    M = M or math.ceil(T / C)
    q, k, v, mix, w = make_inputs(B, T, H, D, Dv, M, per_head=per_head, dtype=dtype, seed=seed)
    check_against_torch(q, k, v, mix, w, C, dtype, causal=causal, normalize=normalize)


# ------------------------------------------------------------------------------------------ non-causal

NONCAUSAL = [  # B, T, H, D, Dv, C
    (2, 63, 2, 16, 16, 9),  # 7 blocks of 9 (one masked chunk each)
    (1, 100, 2, 48, 40, 20),  # head dims not powers of two
    (1, 300, 2, 32, 24, 100),  # blocks of two chunks, the second partial
    (1, 1000, 1, 32, 32, 125),
    (1, 200, 1, 96, 80, 100),  # 3 K tiles and 3 V tiles of 32
]


@pytest.mark.parametrize("shape", NONCAUSAL, ids=lambda s: "B{}-T{}-H{}-D{}-Dv{}-C{}".format(*s))
@pytest.mark.parametrize("normalize", [True, False])
def test_noncausal_fp32(shape, normalize):
    per_head = shape[1] % 2 == 0  # alternate shared and per-head mixing over the shapes
    compare(*shape, causal=False, normalize=normalize, per_head=per_head, dtype=torch.float32)


@pytest.mark.parametrize("per_head", [False, True])
def test_noncausal_fp32_mixing_kinds(per_head):
    compare(2, 64, 3, 16, 8, 16, causal=False, normalize=True, per_head=per_head, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- causal

CAUSAL = [  # B, T, H, D, Dv, C
    (2, 63, 2, 16, 16, 8),  # 8 blocks, the last partial
    (1, 100, 2, 48, 40, 16),  # non-power-of-two head dims
    (1, 100, 2, 32, 32, 64),  # one chunk per block, partial last block
    (1, 100, 1, 16, 16, 100),  # one block of two chunks, the second partial
    (1, 200, 2, 16, 24, 128),  # two chunks per block
    (1, 1000, 2, 32, 32, 100),  # 10 blocks of two chunks
    (1, 1000, 1, 48, 40, 64),
    (1, 150, 1, 96, 80, 100),  # 3 K tiles and 3 V tiles of 32, two chunks per block
    (1, 70, 1, 160, 256, 32),  # 5 K tiles of 32, 4 V tiles of 64
    (1, 150, 1, 128, 128, 100),  # D 128 in fp32: the per-V-tile kernels (half inputs: all_v, below)
]


@pytest.mark.parametrize("shape", CAUSAL, ids=lambda s: "B{}-T{}-H{}-D{}-Dv{}-C{}".format(*s))
@pytest.mark.parametrize("normalize", [True, False])
def test_causal_fp32(shape, normalize):
    per_head = shape[1] != 100
    extra_rows = 2 if normalize else 0  # more mixing rows than blocks is allowed
    M = math.ceil(shape[1] / shape[5]) + extra_rows
    compare(*shape, causal=True, normalize=normalize, per_head=per_head, dtype=torch.float32, M=M)


@pytest.mark.parametrize("per_head", [False, True])
def test_causal_fp32_mixing_kinds(per_head):
    compare(2, 90, 3, 16, 8, 32, causal=True, normalize=True, per_head=per_head, dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ fp16

HALF = [  # causal, B, T, H, D, Dv, C
    (False, 1, 100, 2, 48, 40, 20),
    (False, 1, 300, 2, 32, 32, 100),
    (True, 1, 63, 2, 32, 32, 8),
    (True, 1, 100, 2, 48, 40, 16),
    (True, 1, 1000, 1, 32, 32, 100),
    (True, 1, 130, 1, 128, 128, 64),  # the all_v kernels: one K tile of 128, 2 V tiles of 64
    (True, 1, 150, 1, 128, 128, 100),  # all_v, two chunks per block (running sums)
    (True, 1, 90, 2, 64, 160, 32),  # all_v: one K tile of 64, 5 V tiles of 32
]


@pytest.mark.parametrize("case", HALF, ids=lambda s: "{}-T{}-D{}-C{}".format(
    "causal" if s[0] else "noncausal", s[2], s[4], s[6]))
def test_fp16(case):
    causal, *shape = case
    compare(*shape, causal=causal, normalize=True, per_head=True, dtype=torch.float16)


def test_fp16_without_normalizer():
    compare(1, 100, 2, 32, 32, 16, causal=True, normalize=False, per_head=False, dtype=torch.float16)
    compare(1, 100, 1, 128, 128, 50, causal=True, normalize=False, per_head=False, dtype=torch.float16)  # all_v


def test_all_v_kernels_take_half_inputs_with_one_k_tile():
    """The shapes above that say all_v run the all_v kernels (``chunk.all_v_tiles``); fp32 and D 64 do not."""
    from mhla.ops.mhla.triton.chunk import Geometry, all_v_tiles

    def takes(D, Dv, C, dtype):
        return all_v_tiles(Geometry.make(torch.zeros(1, 8, 1, D), torch.zeros(1, 8, 1, Dv), C), dtype)

    assert takes(128, 128, 64, torch.float16) and takes(128, 128, 100, torch.bfloat16)
    assert takes(64, 160, 32, torch.float16)
    assert not takes(128, 128, 64, torch.float32)  # fp32: the per-V-tile kernels
    assert not takes(64, 64, 64, torch.bfloat16)  # one V tile
    assert not takes(96, 80, 64, torch.bfloat16)  # K tiles of 32
    assert not takes(160, 256, 32, torch.bfloat16)  # D above 128


@pytest.mark.parametrize("T,C", [(256, 64), (256, 128), (192, 32)])  # 1, 2 and 1 chunks per block
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_causal_small_first_diagonal(T, C, dtype):
    """A small ``mixing[h, 0, 0]``: block 0 has no mixed prefix, so its normalized output does not depend on
    the scale of ``m_0`` and the gradient of ``m_0`` is ``sum_t dn_t . V_t eps / d_t`` (tiny). The general
    form ``dn . V + dd a`` reaches it by cancelling terms ~1/m_0 times larger, and ``dd`` reads the output
    rounded to fp16 (``delta = do . o``): at m_0 = 1e-3 it gave 1.6e-1 (dmixing[1, 0, 0] = -4.8 for -0.13;
    the fp16 torch path 3.5e-4). The kernels now use the closed form for block 0 without state columns."""
    q, k, v, mix, w = make_inputs(1, T, 2, 64, 64, T // C, per_head=True, dtype=dtype)
    mix[1, 0, 0] = 1e-3
    check_against_torch(q, k, v, mix, w, C, dtype, causal=True, normalize=True)


def test_causal_small_first_diagonal_after_state():
    """As above through a state that ends inside block 0 (its running sum seeds R; no state columns): the
    gradient of m_0 = 1e-3 (fp16) was 5.5e-2 off, now at the torch path's level."""
    q, k, v, mix, w = make_inputs(1, 256, 2, 64, 64, 4, per_head=True, dtype=torch.float16)
    mix[1, 0, 0] = 1e-3

    def run_split(backend, q, k, v, mix, w):
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v, mix)]
        _, state = mhla_attention(*(x[:, :30] for x in xs[:3]), xs[3], 64, causal=True, output_final_state=True,
                                  backend=backend)
        o = mhla_attention(*(x[:, 30:] for x in xs[:3]), xs[3], 64, causal=True, initial_state=state,
                           backend=backend)
        (o.float() * w[:, 30:]).sum().backward()
        return xs[3].grad

    got = run_split("triton", q, k, v, mix, w)
    same = run_split("torch", q, k, v, mix, w)
    exact = run_split("torch", *(x.double() for x in (q, k, v, mix, w)))
    assert rel_err(got, exact) <= max(TOL[torch.float16], 2 * rel_err(same, exact))


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_returns_bf16(causal):
    """bf16 in, bf16 out (under the interpreter computed in fp32, since numpy has no bf16)."""
    q, k, v, mix, w = make_inputs(1, 64, 2, 32, 32, 4, per_head=False, dtype=torch.bfloat16)
    got = run("triton", q, k, v, mix, w, 16, causal=causal)
    want = run("torch", q, k, v, mix, w, 16, causal=causal)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        assert rel_err(a, b) <= TOL[torch.bfloat16]


# ------------------------------------------------------------------------------------------------ state


@pytest.mark.parametrize("T,C,splits", [(70, 8, [7, 8, 9, 61]), (250, 100, [130, 170]), (100, 64, [64])])
@pytest.mark.parametrize("normalize", [True, False])
def test_causal_state_split_and_resume(T, C, splits, normalize):
    """Chunked prefill on the kernels equals one call, and the final states agree with the torch path."""
    B, H, D = 1, 2, 16
    q, k, v, mix, _ = make_inputs(B, T, H, D, D, math.ceil(T / C), per_head=True, dtype=torch.float32)
    full, full_state = mhla_attention(q, k, v, mix, C, causal=True, normalize=normalize,
                                      output_final_state=True, backend="torch")
    bounds = [0, *splits, T]
    outs, state = [], None
    for a, b in itertools.pairwise(bounds):
        o, state = mhla_attention(q[:, a:b], k[:, a:b], v[:, a:b], mix, C, causal=True, normalize=normalize,
                                  initial_state=state, output_final_state=True, backend="triton")
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)
    assert state.num_tokens == T and state.block_size == C
    for name in ("block_summaries", "block_key_sums", "current_summary", "current_key_sum"):
        torch.testing.assert_close(getattr(state, name), getattr(full_state, name), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("normalize", [True, False])
def test_causal_state_gradients_match_torch(normalize):
    """Gradients flow through the state: an empty initial state and two chained calls on each backend, a
    loss on the outputs and on the final state; the same gradients (q, k, v, mixing, initial state)."""
    from mhla.ops import init_state

    B, T, H, D, C, cut = 1, 90, 2, 16, 16, 37
    q, k, v, mix, w = make_inputs(B, T, H, D, D, 6, per_head=True, dtype=torch.float32)
    grads = []
    for backend in ("torch", "triton"):
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v, mix)]
        qq, kk, vv, mm = xs
        st0 = init_state(B, H, D, D, C, device=DEVICE)
        st0.current_summary.requires_grad_()
        kw = {"causal": True, "normalize": normalize, "output_final_state": True, "backend": backend}
        o1, st = mhla_attention(qq[:, :cut], kk[:, :cut], vv[:, :cut], mm, C, initial_state=st0, **kw)
        o2, st2 = mhla_attention(qq[:, cut:], kk[:, cut:], vv[:, cut:], mm, C, initial_state=st, **kw)
        loss = (torch.cat([o1, o2], 1) * w).sum() + 1e-2 * st2.block_summaries.sum() \
            + 1e-2 * st2.current_summary.sum() + 1e-3 * (st2.current_key_sum ** 2).sum() \
            + 1e-3 * (st2.block_key_sums ** 2).sum()
        loss.backward()
        grads.append([x.grad for x in xs] + [st0.current_summary.grad])
    for name, a, b in zip(("dq", "dk", "dv", "dmixing", "dstate"), grads[1], grads[0]):
        assert rel_err(a, b) <= 1e-5, name


def test_causal_state_all_v_half():
    """The all_v kernels (fp16, D 128) continuing a state in the middle of a block (their ``OFFSET`` and running
    sums from the state): two chained calls against one fp64 torch call, output and the gradients of q, k, v."""
    B, T, H, D, C, cut = 1, 150, 1, 128, 64, 90  # the second call starts 26 tokens into block 1
    q, k, v, mix, w = make_inputs(B, T, H, D, D, 3, per_head=False, dtype=torch.float16)
    outs = []
    for backend, dtype in (("triton", torch.float16), ("torch", torch.float64)):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        kw = {"causal": True, "output_final_state": True, "backend": backend}
        o1, st = mhla_attention(*(x[:, :cut] for x in xs), mix.to(dtype), C, **kw)
        o2, _ = mhla_attention(*(x[:, cut:] for x in xs), mix.to(dtype), C, initial_state=st, **kw)
        o = torch.cat([o1, o2], 1)
        (o.double() * w.double()).sum().backward()
        outs.append([o] + [x.grad for x in xs])
    for name, a, b in zip(("o", "dq", "dk", "dv"), *outs):
        assert rel_err(a, b) <= TOL[torch.float16], name


# ------------------------------------------------------------------------------------- routing, errors


def test_available_here():
    assert triton_backend.available()


def test_official_normalizer_and_fp64_use_the_torch_path():
    q, k, v, mix, _ = make_inputs(1, 32, 2, 8, 8, 4, per_head=False, dtype=torch.float64)
    a = mhla_attention(q, k, v, mix.double(), 8, backend="triton")  # fp64: torch path
    b = mhla_attention(q, k, v, mix.double(), 8, backend="torch")
    torch.testing.assert_close(a, b)
    qf, kf, vf = q.float(), k.float(), v.float()
    a = mhla_attention(qf, kf, vf, mix, 8, normalize="official", backend="triton")
    b = mhla_attention(qf, kf, vf, mix, 8, normalize="official", backend="torch")
    torch.testing.assert_close(a, b)


def test_noncausal_state_is_rejected():
    q, k, v, mix, _ = make_inputs(1, 32, 2, 8, 8, 4, per_head=False, dtype=torch.float32)
    with pytest.raises(ValueError, match="causal=True only"):
        triton_backend.mhla_triton(q, k, v, mix, 8, output_final_state=True)


# ------------------------------------------------------------------------------------------- compiling


# Compiling every kernel variant for sm_90 / sm_80 with Triton's real pipeline (no GPU needed), with registers,
# spills and shared memory: tests/ops/test_kernel_resources.py.


# ------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_bf16_realistic_shapes(causal, D):
    B, T, H, M = 2, 4096, 8, 64
    q, k, v, mix, w = make_inputs(B, T, H, D, D, M, per_head=True, dtype=torch.bfloat16, device="cuda")
    check_against_torch(q, k, v, mix, w, T // M, torch.bfloat16, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_auto_picks_triton_and_odd_dims(causal):
    """backend="auto" on CUDA uses the kernels; head dims 96 / 160, blocks of 3 chunks, bf16."""
    from mhla.ops import resolve_backend

    q, k, v, mix, w = make_inputs(2, 1536, 4, 96, 160, 8, per_head=False, dtype=torch.bfloat16,
                                  device="cuda")
    assert resolve_backend("auto", q, causal=causal) == "triton"
    got = run("auto", q, k, v, mix, w, 192, causal=causal)
    want = run("triton", q, k, v, mix, w, 192, causal=causal)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    check_against_torch(q, k, v, mix, w, 192, torch.bfloat16, causal=causal)


@pytest.mark.gpu
def test_gpu_causal_long_sequence_fp32():
    """fp32 (exact dot products) on a long causal sequence: 128 blocks of 64."""
    q, k, v, mix, w = make_inputs(1, 8192, 4, 64, 64, 128, per_head=True, dtype=torch.float32,
                                  device="cuda")
    check_against_torch(q, k, v, mix, w, 64, torch.float32, causal=True)


def test_interpreter_needs_triton_imported_after_the_variable():
    """A triton imported before TRITON_INTERPRET=1 keeps tl.zeros etc. compiled: the backend must say so
    (not crash inside a kernel), and with the variable set first it is usable."""
    import subprocess
    import sys

    code = ("import os, triton; os.environ['TRITON_INTERPRET'] = '1'\n"
            "from mhla.ops.mhla.triton import utils, backend as triton_backend\n"
            "print(utils.INTERPRET_AT_IMPORT, utils.INTERPRETER_USABLE, triton_backend.available())\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    assert out == ["True", "False", "False"]
    code_ok = "import os; os.environ['TRITON_INTERPRET'] = '1'\n" + code.split("\n", 1)[1].replace(
        "from mhla", "import triton\nfrom mhla")
    out = subprocess.run([sys.executable, "-c", code_ok], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    assert out == ["True", "True", "True"]


# ------------------------------------------------------------------------------------------ feature tile cap
@pytest.mark.parametrize("causal", [False, True])
def test_feature_tiles_of_128_match_torch(causal):
    """scripts/probe_kernels.py times D = 128 with one 128-wide feature tile instead of two of 64: the kernels
    must still compute the same thing (forward and every gradient) when the cap is raised."""
    from mhla.ops.mhla.triton.chunk import Geometry
    from scripts.probe_kernels import feature_tile_cap

    q = torch.zeros(1, 40, 1, 128)
    with feature_tile_cap(128):
        g = Geometry.make(q, q, 20)
        assert (g.BK, g.BV) == (128, 128)
        compare(1, 40, 1, 128, 128, 20, causal=causal, normalize=True, per_head=False, dtype=torch.float32)
    assert Geometry.make(q, q, 20).BK == 64  # restored
