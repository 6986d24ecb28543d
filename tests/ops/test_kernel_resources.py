"""Static resources of the Triton kernels, without a GPU (:mod:`mhla.ops.mhla.triton.compile_check`).

Every kernel of the ``mhla.ops.*.triton`` packages, in every variant the ops launch in the ``default`` set (bf16,
D 64 and 128, blocks of 128 tokens, cross-attention's query side) and every autotune config of each arch's list
(``utils.autotune``: a kernel may keep its own sm_80 list), is compiled for sm_90 and sm_80 with Triton's real
pipeline, and ``ptxas -v`` is read. The tests require that every kernel is launched by some case, that each arch
compiles exactly the configs a device of that arch autotunes over, that every compile succeeds without spilling and
fits its arch's shared memory, and that the figures equal the committed table
``results/bench/kernel_resources.json`` (so a change that adds registers, spills or shared memory shows in review).

One subprocess compiles everything (the test process has ``TRITON_INTERPRET=1``, which does not compile); its
figures are cached with Triton's own cache, so a second run takes seconds. Cold: about 2 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLE = os.path.join(ROOT, "results", "bench", "kernel_resources")
REGENERATE = ("python -m mhla.ops.mhla.triton.compile_check --set default --table results/bench/kernel_resources "
              "--jobs 2 (replaces the default rows, keeps the other sets')")
IDENTITY = ("kernel", "set", "dtype", "flags", "tiles", "PREC", "spec", "num_warps", "num_stages", "arch")
FIGURES = ("registers", "spill_stores", "spill_loads", "stack", "shared")

#: Variants that spill (kernel, flags, num_warps, num_stages, arch); their bytes are in
#: results/bench/kernel_resources.md. None today on sm_90 (H100 / H200, what the kernels are tuned for) or sm_80
#: (A100): each kernel's autotune lists keep only the configs that do not spill on their arch (``utils.autotune``,
#: with an sm_80 list of its own where the sm_90 configs spill there), and an sm_90 entry here fails the test. The
#: test fails when any other variant spills, and warns when one of these stops spilling (delete it here then).
KNOWN_SPILLS: set = set()


def test_no_sm90_spill_is_allowed():
    assert not [k for k in KNOWN_SPILLS if k[-1] == "sm_90"], "sm_90 takes 0 spill bytes: fix the kernel or its configs"



@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The JSON of ``compile_check --set default`` (rows, failures, kernels not launched)."""
    out = tmp_path_factory.mktemp("kernel_resources") / "default.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "mhla.ops.mhla.triton.compile_check", "--set", "default", "--jobs", "2",
           "--json", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode == 3:
        pytest.skip(f"cannot compile for CUDA here: {proc.stderr.strip()[-300:]}")
    assert out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def _label(row: dict) -> str:
    return " ".join(f"{k}={row[k]}" for k in IDENTITY)


def test_every_kernel_is_launched_by_a_case(compiled):
    assert not compiled["not_launched"], (
        f"kernels no case of compile_check.cases() launches, so nothing checks them: {compiled['not_launched']}; "
        "wire them into an op or add a case")


@pytest.fixture(scope="module")
def autotune_lists():
    """``{kernel: {arch: [[num_warps, num_stages, {constexpr: value}], ...]}}``: each autotuned kernel's configs
    for each arch, as a device of that arch autotunes over them (``utils.configs_for_arch``; read in a process
    without the interpreter, which keeps one plain config)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    code = ("import json\n"
            "from mhla.ops.mhla.triton import compile_check as cc, utils\n"
            "print(json.dumps({name.split(':')[1]: {f'sm_{a}': [[c.num_warps, c.num_stages, c.kwargs]\n"
            "    for c in utils.configs_for_arch(k.configs, a)] for a in cc.ARCHS}\n"
            "    for name, k in cc.discover_kernels().items() if hasattr(k, 'configs')}))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_default_variant_and_config_compiles_for_sm90_and_sm80(compiled, autotune_lists):
    assert not compiled["failures"], "\n".join(compiled["failures"])
    rows = compiled["rows"]
    assert {r["arch"] for r in rows} == {"sm_90", "sm_80"}
    kernels = {r["kernel"] for r in rows}
    assert {"_fwd_block_summaries_kernel", "_fwd_output_kernel", "_bwd_dqk_kernel", "_cross_query_kernel"} <= kernels
    assert set(autotune_lists) <= kernels, set(autotune_lists) - kernels
    for kernel, lists in autotune_lists.items():
        for arch, configs in lists.items():
            # exactly the configs a device of this arch autotunes over (warps, stages and the constexprs a config
            # sets True, which are in its rows' flags): no hidden ones, none compiled for nothing
            compiled_here = [r for r in rows if r["kernel"] == kernel and r["arch"] == arch]
            names = {n for _, _, kwargs in configs for n in kwargs}  # constexprs a config sets: in the rows' flags
            want = {(w, st, frozenset(n for n, value in kwargs.items() if value is True)) for w, st, kwargs in configs}
            assert ({(r["num_warps"], r["num_stages"], frozenset(set(r["flags"].split(",")) & names))
                     for r in compiled_here} == want), (kernel, arch, configs)
            assert len(want) == len(configs), (kernel, arch, configs)


def test_every_config_fits_its_arch_shared_memory(compiled):
    from mhla.ops.mhla.triton.compile_check import over_shared_limit

    big = over_shared_limit(compiled["rows"])
    assert not big, "configs a device would skip (more shared memory than it has):\n" + "\n".join(
        f"{_label(r)}: {r['shared']} B" for r in big)


def test_no_default_variant_spills(compiled):
    spills = {(r["kernel"], r["flags"], r["num_warps"], r["num_stages"], r["arch"]): r for r in compiled["rows"]
              if r["spill_stores"] or r["spill_loads"]}
    new = [f"{_label(r)}: spill stores {r['spill_stores']} B, loads {r['spill_loads']} B, {r['registers']} regs"
           for key, r in sorted(spills.items()) if key not in KNOWN_SPILLS]
    assert not new, "kernel variants that spill registers:\n" + "\n".join(new)
    fixed = KNOWN_SPILLS - set(spills)
    if fixed:
        warnings.warn(f"these no longer spill, delete them from KNOWN_SPILLS: {sorted(fixed)}", stacklevel=1)


def test_committed_table_matches_the_compile(compiled):
    with open(TABLE + ".json") as f:
        committed = {tuple(r[k] for k in IDENTITY): r for r in json.load(f)["rows"] if r["set"] == "default"}
    now = {tuple(r[k] for k in IDENTITY): r for r in compiled["rows"]}
    diff = [f"only in the committed table: {_label(r)}" for key, r in committed.items() if key not in now]
    diff += [f"new: {_label(r)}" for key, r in now.items() if key not in committed]
    for key in committed.keys() & now.keys():
        was, is_ = committed[key], now[key]
        changed = [f"{k} {was[k]} -> {is_[k]}" for k in FIGURES if was[k] != is_[k]]
        if changed:
            diff.append(f"{_label(is_)}: {', '.join(changed)}")
    assert not diff, (f"{len(diff)} differences between the kernels and {TABLE}.json (default set):\n"
                      + "\n".join(sorted(diff)[:40])
                      + f"\nIf the change is intended, regenerate the table and review its diff: {REGENERATE}")
