"""The traffic and launch model (:mod:`mhla.ops.mhla.triton.traffic`) against what the Triton path does.

The real op runs under the CPU interpreter, forward and ``torch.autograd.grad`` backward, and every launch is
recorded:

* Triton kernels: each launch of a kernel of the package (:mod:`.chunk`, :mod:`.mix`), and the bytes its
  programs load and store (unmasked elements of every ``tl.load`` / ``tl.store``, counted in the
  interpreter's builder);
* torch ops: a ``TorchDispatchMode`` sees every aten op; views, allocations and ops on empty tensors launch
  nothing; the rest are launches, with the model's byte convention (each tensor operand read once over its
  addressed elements, the output written once).

The model must list the same launches with the same bytes, per phase. A kernel or a torch op added, removed or
changed without the model fails here. The same recorder counts host-device synchronisations: none on the
Triton path.
"""

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mhla.ops import mhla_attention  # noqa: E402
from mhla.ops.mhla.triton import traffic  # noqa: E402

triton_backend = pytest.importorskip("mhla.ops.mhla.triton.backend")
INTERPRETED = triton_backend.INTERPRET_AT_IMPORT and triton_backend.available()
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="counts the loads in Triton's CPU interpreter")

ROOT = Path(__file__).resolve().parents[2]

#: Ops that read a tensor's value on the host (a host-device synchronisation on a GPU).
SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "item", "nonzero", "equal", "_assert_async", "tolist"}
#: Ops that allocate or re-describe memory without running a kernel.
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
             "alias", "lift_fresh", "detach", "set_"}
#: Factory ops whose tensor argument only gives the dtype and device.
NO_READ = {"new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like"}


def addressed_bytes(t: torch.Tensor) -> int:
    """Bytes of the elements a tensor view addresses (a broadcast dim, stride 0, counts once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0


class LaunchRecorder(TorchDispatchMode):
    """Records ``(phase, name, bytes_read, bytes_written)`` per launch and the host syncs."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.launches = []
        self.syncs = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.syncs[name] += 1
            return out
        if func.is_view or name in NO_KERNEL:
            return out
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not any(t.numel() for t in outs):
            return out
        ins = {id(t): t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        read = 0 if name in NO_READ else sum(addressed_bytes(t) for t in ins.values())
        if func._schema.is_mutable:  # in-place / out=: the output is an input, not a new tensor
            raise AssertionError(f"in-place op {func} on the MHLA path: extend the byte convention")
        written = sum(t.numel() * t.element_size() for t in outs)
        self.launches.append((self.phase, f"aten.{name}", read, written))
        return out


@pytest.fixture
def recorder(monkeypatch):
    """A :class:`LaunchRecorder` that also sees the Triton launches of the package and counts their loads
    and stores in the interpreter (the interpreter's own host copies of the arguments are not recorded)."""
    from triton.runtime import Autotuner, JITFunction, interpreter

    from mhla.ops.mhla.triton.utils import SUMMARY_DTYPE_ENV

    monkeypatch.delenv(SUMMARY_DTYPE_ENV, raising=False)  # the default, fp32 summaries (a test may opt in)
    rec = LaunchRecorder()
    io = [0, 0]
    builder = interpreter.interpreter_builder

    def masked_load(ptrs, mask, other, *a, _real=builder.create_masked_load):
        io[0] += _bytes(ptrs, mask)
        return _real(ptrs, mask, other, *a)

    def masked_store(ptrs, value, mask, *a, _real=builder.create_masked_store):
        io[1] += _bytes(ptrs, mask)
        return _real(ptrs, value, mask, *a)

    monkeypatch.setattr(builder, "create_masked_load", masked_load)
    monkeypatch.setattr(builder, "create_masked_store", masked_store)
    kernels = {}  # every kernel of the package's modules (Autotuner or bare @triton.jit), once
    for module in [m for n, m in sys.modules.items() if n.startswith("mhla.ops.mhla.triton.")]:
        for name, obj in vars(module).items():
            if isinstance(obj, (Autotuner, JITFunction, interpreter.InterpretedFunction)):
                kernels.setdefault(id(obj), (name, obj))
    assert len(kernels) >= 5, "the Triton kernels were not found"
    for name, kernel in kernels.values():
        def run(*args, _real=kernel.run, _name=name, **kw):
            io[:] = [0, 0]
            with _disable_current_modes():
                result = _real(*args, **kw)
            rec.launches.append((rec.phase, _name, io[0], io[1]))
            return result
        monkeypatch.setattr(kernel, "run", run)
    return rec


def _bytes(ptrs, mask) -> int:
    """Bytes a masked load or store of the interpreter moves: its unmasked elements."""
    n = int(np.broadcast_to(mask.data, ptrs.data.shape).sum())
    return n * (ptrs.get_element_ty().primitive_bitwidth // 8)


def run_op(rec: LaunchRecorder, B, T, H, D, C, *, causal, per_head, dtype, mix_dtype, normalize=True,
           window=None, final_state=False):
    """One forward and ``torch.autograd.grad`` backward under ``rec``. ``window``: compact
    :class:`~mhla.ops.MixingRows` with that ``(head, recent)`` (random rows) instead of a dense matrix;
    ``final_state``: the call also returns its state (not used by the loss)."""
    from mhla.ops import MixingRows

    g = torch.Generator().manual_seed(0)
    q, k = (torch.rand(B, T, H, D, generator=g).to(dtype).requires_grad_() for _ in range(2))
    v = torch.randn(B, T, H, D, generator=g).to(dtype).requires_grad_()
    M = -(-T // C)
    lead = (H,) if per_head else ()
    if window is None:
        leaves = [torch.rand(*lead, M, M, generator=g).to(mix_dtype).requires_grad_()]
        mix = leaves[0]
    else:
        leaves = [torch.rand(*lead, *shape, generator=g).to(mix_dtype).requires_grad_()
                  for shape in [(M,), (M, window[0]), (M, window[1]), (M,)]]
        mix = MixingRows(0, *leaves)
    do = torch.randn(B, T, H, D, generator=g).to(dtype)
    with rec:
        o = mhla_attention(q, k, v, mix, C, causal=causal, normalize=normalize, backend="triton",
                           output_final_state=final_state)
        if final_state:
            o, state = o
            assert state.num_tokens == T
        rec.phase = "backward"
        grads = torch.autograd.grad(o, [t for t in (q, k, v, *leaves) if t.numel()], do)
    assert all(gr is not None and torch.isfinite(gr).all() for gr in grads)
    return o


def assert_model_matches(rec: LaunchRecorder, model: traffic.Traffic) -> None:
    """The recorded launches equal the model's, per phase (as multisets of ``(name, read, written)``)."""
    for phase in ("forward", "backward"):
        got = collections.Counter(x[1:] for x in rec.launches if x[0] == phase)
        want = collections.Counter()
        for kern in model.phase(phase):
            want[(kern.name, kern.bytes_read, kern.bytes_written)] += kern.launches
        assert got == want, (f"{phase}: measured but not modelled {dict(got - want)}; "
                             f"modelled but not measured {dict(want - got)}")
    assert rec.syncs == collections.Counter()


CASES = [  # B, T, H, D, C, causal, per_head, dtype, mixing dtype, normalize
    (2, 64, 2, 32, 16, False, False, torch.float32, torch.float32, True),
    (2, 64, 2, 96, 16, False, True, torch.float16, torch.float16, True),  # 3 K x 3 V tiles, casts
    (1, 128, 3, 32, 64, False, True, torch.float32, torch.float32, False),
    (2, 70, 2, 32, 16, True, False, torch.float32, torch.float32, True),  # partial last block
    (2, 100, 2, 40, 80, True, True, torch.float16, torch.float16, True),  # 3 chunks per block: running sums
    (1, 50, 2, 32, 32, True, False, torch.float32, torch.float32, False),
    (1, 64, 2, 128, 32, False, False, torch.float16, torch.float16, True),  # D 128: the wide (128) tiles
    (1, 64, 2, 128, 32, True, True, torch.float32, torch.float32, True),  # causal D 128, no running sums
    (1, 100, 2, 128, 80, True, False, torch.float16, torch.float16, True),  # causal D 128, fp16: all_v, 5 chunks
    (1, 136, 1, 16, 2, False, False, torch.float32, torch.float32, True),  # 68 blocks: the mix's general tiles
    (1, 134, 2, 16, 2, True, True, torch.float16, torch.float16, True),  # 67 blocks, causal
]


def _case_id(c) -> str:
    return (f"{'causal' if c[5] else 'noncausal'}-T{c[1]}-D{c[3]}-C{c[4]}-{'head' if c[6] else 'shared'}"
            f"-{str(c[7])[6:]}-{'paper' if c[9] else 'none'}")


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_model_lists_every_launch_and_its_bytes(recorder, case):
    B, T, H, D, C, causal, per_head, dtype, mix_dtype, normalize = case
    run_op(recorder, B, T, H, D, C, causal=causal, per_head=per_head, dtype=dtype, mix_dtype=mix_dtype,
           normalize=normalize)
    model = traffic.mhla_traffic(B, T, H, D, block_size=C, dtype_bytes=torch.finfo(dtype).bits // 8,
                                 causal=causal, mixing="per_head" if per_head else "shared",
                                 mixing_bytes=torch.finfo(mix_dtype).bits // 8, normalize=normalize)
    assert_model_matches(recorder, model)


STATE_CASES = [  # B, T, H, D, C, window (None: dense), per_head, dtype, rows dtype, normalize, final state
    (2, 134, 2, 16, 2, (0, 31), False, torch.float16, torch.float16, True, False),  # the LM's window, 3 band tiles
    (1, 100, 2, 16, 16, (0, 3), False, torch.float32, torch.float32, True, True),  # far blocks folded
    (2, 100, 2, 40, 80, (2, 3), True, torch.float16, torch.float16, True, True),  # running sums, per-head rows
    (1, 70, 2, 32, 16, (3, 0), True, torch.float32, torch.float32, False, True),  # last_row's window, key sums kept
    (2, 64, 2, 16, 4, (1, 5), False, torch.float32, torch.float32, False, False),
    (1, 80, 2, 16, 2, (0, 33), False, torch.float32, torch.float32, True, False),  # recent > 32: BandedMix's torch
    # reference (traffic.banded_mix_ops)
    (1, 50, 2, 32, 64, (0, 3), False, torch.float32, torch.float16, True, True),  # one block: no finished block
    (1, 96, 2, 16, 16, None, False, torch.float32, torch.float32, True, True),  # dense, ends on a block boundary
    (1, 70, 2, 32, 16, None, True, torch.float16, torch.float16, False, True),  # dense, partial last block
]


def _state_case_id(c) -> str:
    return (f"T{c[1]}-D{c[3]}-C{c[4]}-{'dense' if c[5] is None else 'rows%d,%d' % c[5]}"
            f"-{'head' if c[6] else 'shared'}-{str(c[7])[6:]}-{'paper' if c[9] else 'none'}"
            f"{'-final' if c[10] else ''}")


@needs_interpreter
@pytest.mark.parametrize("case", STATE_CASES, ids=_state_case_id)
def test_model_lists_the_compact_rows_and_final_state(recorder, case):
    """Causal :class:`~mhla.ops.MixingRows` (:class:`~mhla.ops.mhla.triton.mix.BandedMix`, the LM's bounded
    rows) and a returned final state: the same launches and bytes as the model."""
    B, T, H, D, C, window, per_head, dtype, mix_dtype, normalize, final = case
    run_op(recorder, B, T, H, D, C, causal=True, per_head=per_head, dtype=dtype, mix_dtype=mix_dtype,
           normalize=normalize, window=window, final_state=final)
    model = traffic.mhla_traffic(B, T, H, D, block_size=C, dtype_bytes=torch.finfo(dtype).bits // 8,
                                 causal=True, mixing="per_head" if per_head else "shared",
                                 mixing_bytes=torch.finfo(mix_dtype).bits // 8, normalize=normalize,
                                 window=window, output_final_state=final)
    assert_model_matches(recorder, model)


HALF_SUMMARY_CASES = [  # B, T, H, D, C, causal, per_head, compact rows' window or None (fp16 inputs and
    # mixing, the normalizer)
    (2, 64, 2, 32, 16, False, False, None),
    (2, 64, 2, 96, 16, False, True, None),  # 3 K x 3 V tiles
    (2, 70, 2, 32, 16, True, False, None),  # partial last block
    (2, 100, 2, 40, 80, True, True, None),  # running sums
    (1, 134, 2, 16, 2, True, True, None),  # 67 blocks: the mix's general tiles
    (2, 134, 2, 16, 2, True, False, (0, 31)),  # the LM's window on the banded kernels, 3 band tiles
    (1, 70, 2, 32, 16, True, True, (2, 3)),  # head blocks, per-head rows
]


@needs_interpreter
@pytest.mark.parametrize("case", HALF_SUMMARY_CASES, ids=lambda c: "{}-T{}-D{}-C{}{}".format(
    "causal" if c[5] else "noncausal", c[1], c[3], c[4], "" if c[7] is None else "-rows%d,%d" % c[7]))
def test_model_of_half_summaries(recorder, monkeypatch, case):
    """``MHLA_SUMMARY_DTYPE=input``: ``S`` and ``P`` stored (and read) in the input dtype, fp16 here: the model's
    ``summary_bytes=2``, launch for launch and byte for byte (dense mixing, and compact rows on the banded
    kernels)."""
    from mhla.ops.mhla.triton.utils import SUMMARY_DTYPE_ENV

    B, T, H, D, C, causal, per_head, window = case
    monkeypatch.setenv(SUMMARY_DTYPE_ENV, "input")
    run_op(recorder, B, T, H, D, C, causal=causal, per_head=per_head, dtype=torch.float16, mix_dtype=torch.float16,
           window=window)
    model = traffic.mhla_traffic(B, T, H, D, block_size=C, dtype_bytes=2, causal=causal,
                                 mixing="per_head" if per_head else "shared", mixing_bytes=2, summary_bytes=2,
                                 window=window)
    assert_model_matches(recorder, model)


#: Host syncs of one forward + backward of the torch path (B 1, T 64, H 2, D 16, C 16), docs/kernels.md.
TORCH_PATH_SYNCS = {False: 1, True: 2}


@needs_interpreter
@pytest.mark.parametrize("causal", [False, True])
def test_triton_path_has_no_host_sync_and_torch_path_has_the_documented_ones(recorder, causal):
    """Forward + backward of ``backend="triton"`` reads nothing on the host. The torch path (docs/kernels.md):
    the mixing's value check (one ``_local_scalar_dense``), and causal, ``mhla_causal_torch``'s test that
    every summary is finite (one more); its backward none."""
    B, T, H, D, C = 1, 64, 2, 16, 16
    run_op(recorder, B, T, H, D, C, causal=causal, per_head=False, dtype=torch.float32,
           mix_dtype=torch.float32)
    assert recorder.syncs == collections.Counter()

    torch_rec = LaunchRecorder()
    g = torch.Generator().manual_seed(0)
    q, k = (torch.rand(B, T, H, D, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(B, T, H, D, generator=g).requires_grad_()
    mix = torch.rand(T // C, T // C, generator=g).requires_grad_()
    with torch_rec:
        o = mhla_attention(q, k, v, mix, C, causal=causal, backend="torch")
        torch.autograd.grad(o, (q, k, v, mix), torch.ones_like(o))
    assert dict(torch_rec.syncs) == {"_local_scalar_dense": TORCH_PATH_SYNCS[causal]}


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_triton_path_runs_under_cuda_sync_errors(causal):
    """On a GPU: forward + backward of the kernels (after a warm-up call that compiles and autotunes) under
    ``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising CUDA call."""
    g = torch.Generator().manual_seed(0)
    B, T, H, D, C = 2, 1024, 4, 64, 64
    q, k = (torch.rand(B, T, H, D, generator=g).cuda().bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(B, T, H, D, generator=g).cuda().bfloat16().requires_grad_()
    mix = torch.rand(T // C, T // C, generator=g).cuda().requires_grad_()
    do = torch.randn(B, T, H, D, generator=g).cuda().bfloat16()

    def step():
        o = mhla_attention(q, k, v, mix, C, causal=causal, backend="triton")
        return torch.autograd.grad(o, (q, k, v, mix), do)

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("causal", [False, True])
def test_triton_path_skips_the_value_check_unless_asked(monkeypatch, causal):
    """Negative mixing: a ValueError on the torch path (and on the Triton path with MHLA_CHECK_VALUES=1); the
    Triton path does not read the values by default."""
    from mhla.ops.utils.validation import CHECK_VALUES_ENV, checks_mixing_values

    monkeypatch.delenv(CHECK_VALUES_ENV, raising=False)
    assert checks_mixing_values("torch") and checks_mixing_values("reference")
    assert not checks_mixing_values("triton")
    q = k = v = torch.rand(1, 32, 2, 8)
    bad = -torch.rand(4, 4)
    with pytest.raises(ValueError, match="nonnegative"):
        mhla_attention(q, k, v, bad, 8, causal=causal, backend="torch")
    if not triton_backend.available():
        return
    mhla_attention(q, k, v, bad, 8, causal=causal, backend="triton")  # no check, no sync
    monkeypatch.setenv(CHECK_VALUES_ENV, "1")
    with pytest.raises(ValueError, match="nonnegative"):
        mhla_attention(q, k, v, bad, 8, causal=causal, backend="triton")


def test_floors_and_targets():
    """The floors are 4 and 11 tensors; the benchmark shape's counts are what docs/kernels.md says."""
    t = traffic.mhla_traffic(8, 4096, 16, 64, block_size=64, dtype_bytes=2)
    assert t.floor_forward == 4 * t.tensor_bytes and t.floor_total == 11 * t.tensor_bytes
    assert t.tensor_bytes == 8 * 4096 * 16 * 64 * 2
    assert t.launches("forward") == 3  # summaries, the mix GEMM (S and z in one launch), output
    per_head = traffic.mhla_traffic(8, 4096, 16, 64, block_size=64, dtype_bytes=2, mixing="per_head")
    assert per_head.launches("forward") == 3  # the mix kernel reads per-head coefficients by a head stride
    causal = traffic.mhla_traffic(8, 4096, 16, 64, block_size=64, dtype_bytes=2, causal=True)
    assert causal.launches("forward") == 3  # the kernels read the mixing's diagonal in place: no copy
    for causal in (False, True):  # a bf16 mixing: read in its dtype by the kernels, no cast launch
        bf16 = traffic.bench_traffic(4096, 64, causal)
        assert bf16.launches("forward") == 3 and not any(k.name.startswith("aten.") for k in bf16.phase("forward"))
    with pytest.raises(ValueError, match="multiple"):
        traffic.mhla_traffic(1, 100, 1, 16, block_size=64)


def test_lm_setting_is_linear_and_half_summaries_halve_the_summary_passes():
    """The LM setting (compact rows, window (0, 31), blocks of 64): bytes and launches per call linear in T (the
    issue's goal: at most 17x the T 4k cost at T 64k); half summaries (``MHLA_SUMMARY_DTYPE=input``) at the
    benchmark's T 4k, D 64: about 8 tensors forward (2.06x, from 3.07x), as docs/kernels.md says."""
    base = traffic.lm_traffic(4096, 64)
    for T in (16384, 65536):
        t = traffic.lm_traffic(T, 64)
        assert t.bytes("forward") / base.bytes("forward") <= T / 4096 * 1.001
        assert t.launches() == base.launches()
    # forward + backward affine in T past the first band tile (the backward's scan reads every band tile but the
    # first twice): equal increments per 4x, and at most 17x at T 64k
    b4, b16, b64 = (traffic.lm_traffic(T, 64).bytes() for T in (4096, 16384, 65536))
    assert b64 - b16 == pytest.approx(4 * (b16 - b4), rel=1e-9)
    assert b64 / b4 <= 17
    full = traffic.mhla_traffic(8, 4096, 16, 64, block_size=64, dtype_bytes=2, mixing_bytes=2)
    half = traffic.mhla_traffic(8, 4096, 16, 64, block_size=64, dtype_bytes=2, mixing_bytes=2, summary_bytes=2)
    assert round(full.ratio_forward, 2) == 3.07 and round(half.ratio_forward, 2) == 2.06
    assert half.launches() == full.launches()
    # the banded kernels' compact rows take half summaries too; a returned state and the torch fallback's windows
    # (recent > 32) keep fp32
    kw = dict(block_size=64, dtype_bytes=2, causal=True)
    for window, final, same in (((0, 3), False, False), ((0, 3), True, True), ((0, 40), False, True)):
        a, b = (traffic.mhla_traffic(1, 256, 2, 64, window=window, output_final_state=final, summary_bytes=sb,
                                     **kw).bytes() for sb in (2, 4))
        assert (a == b) == same, (window, final)
    lm, lm_half = traffic.lm_traffic(4096, 64), traffic.lm_traffic(4096, 64, summary_bytes=2)
    assert lm_half.ratio_forward < lm.ratio_forward - 0.9 and lm_half.launches() == lm.launches()


def test_lm_setting_mixes_the_rows_in_fused_kernels():
    """The LM setting's compact rows go through the banded kernels (one launch forward; the scan, dx and the sum
    of the partial coefficient gradients backward), which read the fp32 summaries about once per pass: forward
    within 1.3x of reading ``S`` (and ``z``) and writing ``P`` (and ``p``) once, at D 64 and 128."""
    for D in (64, 128):
        for T in (4096, 65536):
            t = traffic.lm_traffic(T, D)
            fwd = [k for k in t.phase("forward") if k.group == "banded mix"]
            bwd = [k for k in t.phase("backward") if k.group == "banded mix"]
            assert [k.name for k in fwd] == ["_banded_fwd_kernel"]
            assert [k.name for k in bwd] == ["_banded_bwd_scan_kernel", "_banded_bwd_dx_kernel", "aten.sum"]
            NB = T // 64
            once = 2 * 8 * 16 * NB * (D * D + D) * 4  # S and z read, P and p written, fp32
            assert once <= fwd[0].bytes <= 1.3 * once
            assert not any(k.group == "banded mix (torch)" for k in t.kernels)


BANDED_LAYOUTS = [  # window, first (state's finished blocks), rows, G, features of the two parts, need_dcoeff
    ((2, 5), 9, 30, 1, (20, 6), True),  # kept head, folded, kept recent
    ((2, 5), 3, 30, 2, (20, 6), True),  # a state shorter than head + recent
    ((4, 3), 2, 31, 1, (136, 0), True),  # the call's first blocks are head blocks; 2 feature tiles, one part
    ((0, 31), 40, 70, 2, (20, 6), False),  # frozen rows: no coefficient gradients
    ((1, 0), 6, 17, 1, (20, 6), True),
]


@needs_interpreter
@pytest.mark.parametrize("case", BANDED_LAYOUTS, ids=lambda c: f"w{c[0][0]},{c[0][1]}-first{c[1]}-dw{int(c[5])}")
def test_banded_model_of_the_state_layouts(recorder, case):
    """:func:`traffic.banded_kernel_traffic` for the layouts the op-level cases do not reach (a continued state's
    kept head / folded / kept recent columns, frozen rows, one part), against :class:`BandedMix` called directly."""
    from mhla.ops.mhla.state import kept_blocks
    from mhla.ops.mhla.triton.mix import BandedMix

    window, first, NB, G, (F1, F2), need = case
    kh, kr = kept_blocks(first, window)
    folded = first > kh + kr
    mixer = BandedMix(window, first, kh, folded, kr, NB)
    B, H, N = 2, 2, mixer.state_columns + NB
    g = torch.Generator().manual_seed(0)
    coefficients = [torch.rand(G, NB, *s, generator=g) for s in ((window[0],), (window[1],), ())]
    xs = [torch.randn(B, H, N, F1, generator=g), torch.randn(B, H, N, F2, generator=g) if F2 else None]
    dps = [torch.randn(B, H, NB, F1, generator=g), torch.randn(B, H, NB, F2, generator=g) if F2 else None]
    with recorder:
        mixer.mix(coefficients, xs)
        recorder.phase = "backward"
        mixer.backward(coefficients, xs, dps, need)
    fwd, bwd = traffic.banded_kernel_traffic(B, H, G, NB, F1, F2, window, first=first, kept_head=kh, folded=folded,
                                             kept_recent=kr, need_dcoeff=need)
    model = traffic.Traffic(B, 0, H, 1, 1, 1, 4, True, "shared")
    model.kernels = [traffic.KernelTraffic(name, 1, r, w, phase, "", "")
                     for phase, ops in (("forward", fwd), ("backward", bwd)) for name, r, w in ops]
    assert_model_matches(recorder, model)


def test_docs_table_is_the_cli_output():
    """docs/kernels.md's tables between the markers: ``python -m mhla.ops.mhla.triton.traffic --markdown``."""
    doc = (ROOT / "docs" / "kernels.md").read_text()
    found = re.search(r"<!-- traffic-table:start -->\n(.*?)<!-- traffic-table:end -->", doc, re.S)
    assert found, "docs/kernels.md lacks the traffic-table markers"
    out = subprocess.run([sys.executable, "-m", "mhla.ops.mhla.triton.traffic", "--markdown"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    assert found.group(1) == out.stdout, "regenerate: python -m mhla.ops.mhla.triton.traffic --markdown"
