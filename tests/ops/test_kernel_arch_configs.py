"""Per-arch autotune lists of the Triton kernels (:func:`mhla.ops.mhla.triton.utils.autotune`).

A kernel declares its sm_90 configs (H100 / H200) and, where some spill on an A100, its own sm_80 configs, possibly
with constexprs of an A100-only code shape (``_bwd_dqk_kernel``'s ``HALF_V``: the V loop by half tiles). A device
autotunes over its arch's list only (``early_config_prune``), and ``compile_check`` compiles each arch's list for
that arch (``tests/ops/test_kernel_resources.py`` checks that the two agree).

Here, on the CPU: the lists and the pruning, and every declared config's constexprs run under the interpreter (the
autotuner keeps one plain config there) against the fp64 torch path, as ``test_kernels_triton.py`` does. With a GPU
the bf16 checks force each arch's configs on whatever device runs them (bf16 is computed in fp32 under the
interpreter, so the kernels' bf16-only branches run on a GPU only).
"""

import types

import pytest
import torch

import helpers.triton_env  # noqa: E402, F401  (first: sets TRITON_INTERPRET)

import triton  # noqa: E402

from helpers.kernel_cases import TOL, make_inputs, rel_err, run  # noqa: E402

from mhla.ops.mhla.triton import chunk, mix, utils  # noqa: E402
from mhla.ops.mhla.triton.compile_check import kernel_modules  # noqa: E402


def _declared_kernels() -> dict:
    """``{name: kernel}``: every kernel of the ``mhla.ops.*.triton`` packages made with :func:`utils.autotune`."""
    return {f"{mod.__name__}:{name}": obj for mod in kernel_modules() for name, obj in vars(mod).items()
            if hasattr(obj, "declared_configs")}


def _shape(config) -> tuple:
    return config.num_warps, config.num_stages, tuple(sorted(config.kwargs.items()))


# ------------------------------------------------------------------------------------------ the lists


def test_config_arch():
    assert [utils.config_arch(c) for c in (70, 75, 80, 86, 89, 90, 100, 120)] == [80] * 5 + [90] * 3


def test_arch_configs_shared_and_own_lists():
    both = utils.arch_configs(warps=(4, 8), stages=(2, 3))
    assert [_shape(c) for c in both] == [(4, 2, ()), (4, 3, ()), (8, 2, ()), (8, 3, ())]
    assert all(c.archs == (90, 80) for c in both)
    own = utils.arch_configs(warps=(8,), stages=(2, 3), sm80=[(8, 3), (4, 2, {"X": True})])
    assert [_shape(c) for c in utils.configs_for_arch(own, 90)] == [(8, 2, ()), (8, 3, ())]
    assert [_shape(c) for c in utils.configs_for_arch(own, 80)] == [(8, 3, ()), (4, 2, (("X", True),))]
    assert [_shape(c) for c in utils.configs_for_arch(own, 86)] == [(8, 3, ()), (4, 2, (("X", True),))]
    assert len(own) == 3  # 8 x 3 is in both lists, once
    listed = utils.arch_configs(sm90=[(8, 2), (8, 2, {"X": True})], sm80=[(8, 2, {"X": True})])
    assert [_shape(c) for c in utils.configs_for_arch(listed, 90)] == [(8, 2, ()), (8, 2, (("X", True),))]
    assert [_shape(c) for c in utils.configs_for_arch(listed, 80)] == [(8, 2, (("X", True),))]
    assert len(listed) == 2  # the X config is in both lists, once
    plain = triton.Config({}, num_warps=4, num_stages=2)  # a config without archs is every arch's
    assert utils.configs_for_arch([plain], 80) == utils.configs_for_arch([plain], 90) == [plain]


def test_device_configs_prunes_to_the_current_arch(monkeypatch):
    own = utils.arch_configs(warps=(8,), stages=(2,), sm80=[(8, 1)])
    for backend, arch, want in (("cuda", 90, [(8, 2, ())]), ("cuda", 80, [(8, 1, ())]), ("cuda", 89, [(8, 1, ())]),
                                ("hip", "gfx942", [(8, 2, ()), (8, 1, ())])):
        monkeypatch.setattr(utils, "current_target", lambda b=backend, a=arch: types.SimpleNamespace(backend=b,
                                                                                                     arch=a))
        assert [_shape(c) for c in utils.device_configs(own, {})] == want, (backend, arch)


def test_every_arch_list_is_nonempty_and_distinct():
    kernels = _declared_kernels()
    assert {"_bwd_dqk_kernel", "_fwd_output_kernel", "_mix_bwd_dw_kernel"} <= {n.split(":")[1] for n in kernels}
    for name, kernel in kernels.items():
        for arch in utils.CONFIG_ARCHS:
            shapes = [_shape(c) for c in utils.configs_for_arch(kernel.declared_configs, arch)]
            assert shapes, (name, arch)
            # one config per warps x stages x constexprs: compile_check's rows name a config by them (its flags)
            assert len(set(shapes)) == len(shapes), (name, arch, shapes)


def test_the_a100_lists_differ_where_the_h100_configs_spill():
    """The sm_80 lists these kernels declare (the H100 configs they drop spill on an A100). Not the figures, which
    ``test_kernel_resources.py`` checks: that the A100 code shape is the one declared."""
    dqk80 = utils.configs_for_arch(chunk._bwd_dqk_kernel.declared_configs, 80)
    assert dqk80 and all(c.kwargs == {"HALF_V": True} for c in dqk80)
    dqk90 = utils.configs_for_arch(chunk._bwd_dqk_kernel.declared_configs, 90)
    assert {_shape(c) for c in dqk90} == {(8, 2, ()), (8, 2, (("HALF_V", True),)), (8, 3, (("HALF_V", True),))}
    assert {_shape(c) for c in utils.configs_for_arch(mix._mix_bwd_dw_kernel.declared_configs, 80)} == {(4, 2, ())}


# ------------------------------------------------------------------------------------- what they compute


def _forced(monkeypatch, kernel, config):
    """Make ``kernel`` run ``config`` (its constexprs, and off the interpreter its warps and stages) on any
    device: a copy without ``archs``, so that no pruning drops it."""
    interp = utils.INTERPRET_AT_IMPORT
    monkeypatch.setattr(kernel, "configs", [triton.Config(dict(config.kwargs), num_warps=4 if interp else
                                                          config.num_warps, num_stages=1 if interp else
                                                          config.num_stages)])


def _variants() -> list:
    """``(kernel name, config)``: each declared config with constexprs (under the interpreter only those change
    what runs), or every declared config on a GPU."""
    out = []
    for name, kernel in sorted(_declared_kernels().items()):
        for config in kernel.declared_configs:
            if config.kwargs or not utils.INTERPRET_AT_IMPORT:
                out.append((name, config))
    return out


VARIANTS = _variants()


def _check(q, k, v, mix_, w, C, dtype, **kw):
    got = run("triton", q, k, v, mix_, w, C, **kw)
    same = run("torch", q, k, v, mix_, w, C, **kw)
    exact = run("torch", *(x.double() for x in (q, k, v, mix_, w)), C, **kw)
    bad = {}
    for name, a, b, r in zip(("o", "dq", "dk", "dv", "dmixing"), got, same, exact):
        if not rel_err(a, r) <= max(TOL[dtype], 2 * rel_err(b, r)):
            bad[name] = (rel_err(a, r), rel_err(b, r))
    assert not bad, f"(triton, torch) errors vs fp64 above {TOL[dtype]:.0e}: {bad}"


#: B, T, H, D, Dv, C: Dv 64 (V tiles of 64, the loop by 32 with HALF_V), 40 (one padded tile of 64: the second
#: half step partly masked), 96 (tiles of 32, steps of 16), blocks of one and of two chunks (T a multiple of C:
#: the non-causal op needs it; the fp16 test ends in a partial block)
SHAPES = [(1, 128, 2, 32, 64, 64), (1, 256, 1, 48, 40, 128), (1, 96, 1, 32, 96, 32)]


def _variant_id(v) -> str:
    name, config = v
    kwargs = ",".join(f"{k}={x}" for k, x in sorted(config.kwargs.items())) or "-"
    return f"{name.split(':')[1]}-{config.num_warps}x{config.num_stages}-{kwargs}"


@pytest.mark.skipif(not VARIANTS, reason="no declared config sets constexprs")
@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-D{}-Dv{}-C{}".format(*s[1:2], *s[3:]))
@pytest.mark.parametrize("causal,normalize", [(True, True), (True, False), (False, True)])
def test_declared_config_matches_torch(monkeypatch, variant, shape, causal, normalize):
    name, config = variant
    _forced(monkeypatch, _declared_kernels()[name], config)
    B, T, H, D, Dv, C = shape
    dtype = torch.float32 if utils.INTERPRET_AT_IMPORT else torch.bfloat16
    M = -(-T // C)
    q, k, v, mix_, w = make_inputs(B, T, H, D, Dv, M, per_head=True, dtype=dtype,
                                   device="cpu" if utils.INTERPRET_AT_IMPORT else "cuda")
    _check(q, k, v, mix_, w, C, dtype, causal=causal, normalize=normalize)


@pytest.mark.skipif(not VARIANTS, reason="no declared config sets constexprs")
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v[1].kwargs], ids=_variant_id)
def test_declared_config_fp16(monkeypatch, variant):
    """fp16 inputs: the kernels' half-precision branches (under the interpreter too)."""
    name, config = variant
    _forced(monkeypatch, _declared_kernels()[name], config)
    device = "cpu" if utils.INTERPRET_AT_IMPORT else "cuda"
    q, k, v, mix_, w = make_inputs(1, 100, 2, 32, 64, 2, per_head=True, dtype=torch.float16, device=device)
    _check(q, k, v, mix_, w, 64, torch.float16, causal=True, normalize=True)


@pytest.mark.gpu
@pytest.mark.skipif(not VARIANTS, reason="no declared config sets constexprs")
@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_declared_config_bf16(monkeypatch, variant, causal):
    """On the GPU (the campaign's ``-m gpu`` stage): each declared config forced on this device in bf16, the
    kernels' bf16-only branches included, at a longer sequence than the interpreter cases."""
    name, config = variant
    _forced(monkeypatch, _declared_kernels()[name], config)
    q, k, v, mix_, w = make_inputs(2, 1024, 4, 64, 64, 16, per_head=True, dtype=torch.bfloat16, device="cuda")
    _check(q, k, v, mix_, w, 64, torch.bfloat16, causal=causal, normalize=True)
