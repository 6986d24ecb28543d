"""Opt-in half block summaries (``MHLA_SUMMARY_DTYPE=input``) of the Triton path: their error against fp64.

With the option the kernels store the block summaries ``S``, key sums ``z`` and their mix ``P``, ``p`` in the
input dtype (fp32 accumulation, rounded at the store; running sums and gradients stay fp32). Criterion: as
``tests/ops/test_kernels_triton.py`` (``err = max|x - x_fp64| / max(max|x_fp64|, 1)`` of the output and the
gradients of q, k, v and the mixing), against the torch path in float64 on the same rounded inputs, and next to
the same call with the default fp32 summaries:

* the error with half summaries is at most ``max(TOL[dtype], 2 * err of the torch path in the same dtype)``
  (the fp16 / bf16 tolerances of the kernel tests: 5e-3 / 1e-2);
* and it exceeds the error with fp32 summaries by at most ``EXTRA[dtype]``.

Observed under the CPU interpreter, fp16 inputs (summaries rounded to 11 significant bits), per tensor, over the
shapes below: o, dq, dk, dv <= 4.8e-4 with fp32 summaries and <= 5.6e-4 with fp16 summaries, the mixing gradient
<= 1.3e-3 with either; the largest increase 1.7e-4 (dq of a non-causal call without the normalizer, 3.2e-4 ->
4.9e-4). Under the interpreter bf16 inputs are computed in fp32 (numpy has no bf16), so bf16 summaries (8
significant bits) are checked on a GPU only (``gpu`` test).
"""

import math

import pytest
import torch

import helpers.triton_env  # noqa: E402, F401  (first: sets TRITON_INTERPRET)

from mhla.ops.mhla.triton.utils import SUMMARY_DTYPE_ENV, summary_dtype  # noqa: E402

from helpers.kernel_cases import TOL, make_inputs, rel_err, run  # noqa: E402

#: how much half summaries may add to the error of fp32 summaries (observed: 1.7e-4 in fp16)
EXTRA = {torch.float16: 1e-3, torch.bfloat16: 8e-3}

CASES = [  # causal, B, T, H, D, Dv, C, normalize
    (False, 1, 100, 2, 48, 40, 20, True),
    (False, 1, 256, 2, 64, 64, 64, False),  # C = D = 64, the benchmark's summaries
    (True, 1, 100, 2, 48, 40, 16, True),
    (True, 2, 200, 2, 32, 32, 100, True),  # running sums
    (True, 1, 256, 2, 64, 64, 64, False),
]


def errors(q, k, v, mix, w, C, monkeypatch, **kw):
    """``{tensor: (err with fp32 summaries, err with input-dtype summaries, err of the torch path)}``."""
    names = ("o", "dq", "dk", "dv", "dmixing")
    got = {}
    for mode in ("fp32", "input"):
        monkeypatch.setenv(SUMMARY_DTYPE_ENV, mode)
        got[mode] = run("triton", q, k, v, mix, w, C, **kw)
    monkeypatch.delenv(SUMMARY_DTYPE_ENV)
    same = run("torch", q, k, v, mix, w, C, **kw)
    exact = run("torch", *(x.double() for x in (q, k, v, mix, w)), C, **kw)
    return {n: (rel_err(a, r), rel_err(b, r), rel_err(c, r))
            for n, a, b, c, r in zip(names, got["fp32"], got["input"], same, exact)}


def check(errs, dtype):
    bad = {n: e for n, e in errs.items() if not (e[1] <= max(TOL[dtype], 2 * e[2]) and e[1] <= e[0] + EXTRA[dtype])}
    assert not bad, f"(fp32 summaries, {dtype} summaries, torch) errors vs fp64: {bad} (all: {errs})"


@pytest.mark.parametrize("case", CASES, ids=lambda c: "{}-T{}-D{}-C{}-{}".format(
    "causal" if c[0] else "noncausal", c[2], c[4], c[6], "paper" if c[7] else "none"))
def test_fp16_summaries_against_fp64(monkeypatch, case):
    causal, B, T, H, D, Dv, C, normalize = case
    q, k, v, mix, w = make_inputs(B, T, H, D, Dv, math.ceil(T / C), per_head=True, dtype=torch.float16)
    check(errors(q, k, v, mix, w, C, monkeypatch, causal=causal, normalize=normalize), torch.float16)


def test_default_is_fp32_and_the_option_is_checked(monkeypatch):
    monkeypatch.delenv(SUMMARY_DTYPE_ENV, raising=False)
    assert summary_dtype(torch.bfloat16) == torch.float32
    monkeypatch.setenv(SUMMARY_DTYPE_ENV, "input")
    assert summary_dtype(torch.bfloat16) == torch.bfloat16 and summary_dtype(torch.float32) == torch.float32
    monkeypatch.setenv(SUMMARY_DTYPE_ENV, "bf16")
    with pytest.raises(ValueError, match=SUMMARY_DTYPE_ENV):
        summary_dtype(torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_bf16_summaries_against_fp64(monkeypatch, causal):
    """bf16 inputs and summaries on a GPU (8 significant bits), the benchmark's blocks of 64 at D 64."""
    B, T, H, D, C = 2, 1024, 4, 64, 64
    q, k, v, mix, w = make_inputs(B, T, H, D, D, T // C, per_head=False, dtype=torch.bfloat16)
    check(errors(q, k, v, mix, w, C, monkeypatch, causal=causal, normalize=True), torch.bfloat16)
