"""Compile every kernel variant the ops launch for CUDA archs without a GPU, and read ``ptxas -v``.

Run ``python -m mhla.ops.mhla.triton.compile_check [--set NAME] [--arch 90] [--jobs 2] [--table PREFIX]``;
``--table results/bench/kernel_resources`` writes the committed table (``.md`` and ``.json``).

The CPU interpreter checks what the kernels compute but not that they compile (loop-carried types, ``tl.dot``
shapes, shared memory) nor what they cost in registers. This module

1. finds the kernels: every ``triton.autotune`` / ``triton.jit`` kernel object in every module of the
   ``mhla.ops.*.triton`` packages (jitted helpers that another jitted function calls are not kernels);
2. finds their variants by driving the ops on small CPU tensors with the kernel launches intercepted
   (:func:`capture_launches`): every op path (causal or not, normalizer on / off, a continued state, forward and
   backward, cross-attention's query side) for each dtype, head dim and block size of the case grid
   (:func:`cases`). Each intercepted launch is bound with Triton's own binder, so the compiled source has the
   signature, constexprs (flags, ``BT`` / ``BK`` / ``BV``, ``PREC``) and argument specialisations (16-byte
   alignment, divisibility by 16) that the JIT would give it on a GPU;
3. compiles each variant for each autotune config (``num_warps`` x ``num_stages`` of the kernel's
   ``triton.autotune``; on each ``--arch`` the configs of that arch's list, :func:`.utils.configs_for_arch`) and
   each ``--arch`` with Triton's real pipeline (TTIR -> PTX -> cubin with the bundled
   ``ptxas``), and runs the bundled ``ptxas -v`` (Triton's flags) on the PTX for registers per thread, spill
   stores / loads and stack frame bytes; shared memory is Triton's (``metadata.shared``, dynamic shared memory).

Variant sets (:data:`VARIANT_SETS`): ``default`` (bf16 inputs, D 64 and 128 with the tiles the ops choose:
``feature_tile``, and 128 at D 128 in the wide kernels, ``chunk.Geometry.wide``; blocks of 128 tokens: the
largest chunk tile, 64, looping over two chunks; and calls of ``MANY_BLOCKS`` blocks for the mix kernels'
general tiles) is what
``tests/ops/test_kernel_resources.py`` checks (no spills, equal to the committed table); ``small blocks`` (blocks
of 16 / 32 / 64 tokens: chunk tiles 16 / 32 / 64, one chunk per block), ``fp16``, ``fp32`` (exact ``ieee`` dots)
and ``cap 128 (not used by default)`` (D 128 with the feature tiles at 128, ``BK = BV = 128``: does a 128-wide tile
spill?) are in the table only. ``--quick`` is ``--set default``.

The figures are cached next to Triton's own cache entry of each kernel (``$TRITON_CACHE_DIR``, default
``~/.triton/cache``), so a second run is fast. It must run *without* ``TRITON_INTERPRET=1``.

Exit status: 0 every variant compiled (and, with ``--check-spills``, none spills); 1 a variant failed (or spilled,
with ``--check-spills``); 3 cannot compile here (interpreter on, no CUDA backend). A kernel that no case launches is
named in a warning and in the ``--json`` output.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

#: Variant sets: name -> (input dtypes, head dims, MHLA block sizes, feature tile override). Blocks of 128 tokens
#: use the largest chunk tile (64) with two chunks per block (the general loop); smaller blocks give the chunk tiles
#: 16 / 32 / 64 with one chunk per block. Cross-attention's query side runs with 16 and 64 queries per block in
#: every set (query tiles 16 and 32).
VARIANT_SETS = {
    "default": (("bf16",), (64, 128), (128,), None),
    "cap 128 (not used by default)": (("bf16",), (128,), (128,), 128),
    "fp32": (("fp32",), (64, 128), (128,), None),
    "fp16": (("fp16",), (64, 128), (128,), None),
    "small blocks": (("bf16",), (64, 128), (16, 32, 64), None),
}
SETS = tuple(VARIANT_SETS)
CAP128 = SETS[1]
ARCHS = (90, 80)
QUERIES_PER_BLOCK = (16, 64)
NUM_BLOCKS = 64  # blocks per call (MHLA) and query blocks (cross-attention)
#: the default set's extra MHLA calls with more blocks than the mix kernels hold in one tile (``mix.W_ONCE_MAX``):
#: their general tiles (rows of 128, ``dx`` columns of 64), bf16, D 64, blocks of 128 tokens (the chunk kernels'
#: variants are the default ones), normalizer on
MANY_BLOCKS = 256
#: the default set's causal calls with compact ``MixingRows`` (``window``, path, rows require a gradient), bf16, D 64,
#: blocks of 128 tokens: the banded mix kernels (:mod:`.banded`) of the LM's window (0, 31) (band tiles of 32 rows),
#: and of a window with head blocks (band tiles of 16) without and with a state (kept head, folded and kept recent
#: columns; frozen rows: no coefficient gradient)
ROWS_CASES = (((0, 31), "causal", True), ((2, 5), "causal", True), ((2, 5), "causal+state", False))
ROW_FIELDS = ("kernel", "set", "dtype", "flags", "tiles", "PREC", "spec", "num_warps", "num_stages",
              "arch", "registers", "spill_stores", "spill_loads", "stack", "shared")
FIGURES = ("registers", "spill_stores", "spill_loads", "stack", "shared")


# ------------------------------------------------------------------------------------------- the kernels


def kernel_modules() -> list:
    """Every module of the ``mhla.ops.*.triton`` packages (imported), this one excepted."""
    import mhla.ops

    mods = []
    for pkg in pkgutil.iter_modules(mhla.ops.__path__, "mhla.ops."):
        if not pkg.ispkg:
            continue
        try:
            tri = importlib.import_module(pkg.name + ".triton")
        except ModuleNotFoundError:
            continue
        for sub in pkgutil.iter_modules(tri.__path__, tri.__name__ + "."):
            if sub.name != __name__:
                mods.append(importlib.import_module(sub.name))
    return mods


def _jit_function(obj):
    """The ``JITFunction`` under ``obj`` (an autotuner / heuristics wrapper or the function), else None."""
    from triton.runtime.jit import JITFunction

    while obj is not None and not isinstance(obj, JITFunction):
        obj = getattr(obj, "fn", None)
    return obj


def discover_kernels() -> dict:
    """``{"module:name": kernel object}``: the launchable kernels of :func:`kernel_modules`.

    An autotuned object is a kernel; a plain ``JITFunction`` is one unless another jitted function of its module
    calls it (then it is an inlined helper)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    found = {}
    for mod in kernel_modules():
        jitted = {name: obj for name, obj in vars(mod).items()
                  if isinstance(obj, (Autotuner, JITFunction)) and _jit_function(obj).fn.__module__ == mod.__name__}
        sources = {name: _jit_function(obj).src for name, obj in jitted.items()}
        for name, obj in jitted.items():
            called = any(re.search(rf"\b{re.escape(name)}\s*\(", src) for other, src in sources.items()
                         if other != name)
            if isinstance(obj, Autotuner) or not called:
                found[f"{mod.__name__}:{name}"] = obj
    return found


# ------------------------------------------------------------------------------------- the launches


@dataclasses.dataclass(frozen=True)
class Case:
    """One op call the capture drives. ``op``: "mhla" or "mhla_cross"; ``path``: "noncausal", "causal",
    "causal+state" (a call that returns a state, then one that continues it mid-block) or "query". ``window``:
    compact causal :class:`~mhla.ops.MixingRows` with that ``(head, recent)`` instead of a dense mixing (the banded
    kernels, :mod:`.banded`); ``rows_grad``: whether the rows require a gradient (else the backward skips the
    coefficient gradients)."""

    op: str
    path: str
    dtype: str
    D: int
    block_size: int
    normalize: bool
    set: str = "default"
    blocks: int = NUM_BLOCKS
    window: tuple | None = None
    rows_grad: bool = True


@dataclasses.dataclass
class Launch:
    """An intercepted kernel launch: the kernel, its arguments, the configs its autotuner would try."""

    kernel: str
    fn: object  # JITFunction
    args: tuple
    kwargs: dict
    configs: tuple
    case: Case


def cases(sets: tuple = SETS) -> Iterator[Case]:
    """The case grid of each variant set: every op path x normalizer x dtype x head dim x block size."""
    for set_name in sets:
        dtypes, head_dims, block_sizes, _ = VARIANT_SETS[set_name]
        for dtype in dtypes:
            for D in head_dims:
                for normalize in (True, False):
                    for block_size in block_sizes:
                        for path in ("noncausal", "causal", "causal+state"):
                            yield Case("mhla", path, dtype, D, block_size, normalize, set_name)
                    for queries_per_block in QUERIES_PER_BLOCK:
                        yield Case("mhla_cross", "query", dtype, D, queries_per_block, normalize, set_name)
        if set_name == "default":
            for path in ("noncausal", "causal"):
                yield Case("mhla", path, "bf16", 64, 128, True, set_name, blocks=MANY_BLOCKS)
            for window, path, grad in ROWS_CASES:
                for normalize in (True, False):
                    yield Case("mhla", path, "bf16", 64, 128, normalize, set_name, window=window, rows_grad=grad)


_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def run_case(case: Case) -> None:
    """Call the op of ``case`` (forward and backward) on small CPU tensors; the launches must be intercepted.

    Shapes: B 2, H 16, D = Dv; ``case.blocks`` MHLA blocks (``T = blocks * block_size``: ``NUM_BLOCKS``, or
    ``MANY_BLOCKS``) or query blocks. ``H`` and the block count are multiples of 16 and ``B > 1``, as at the
    benchmark shape, so the arguments get the specialisations of real calls; 64 blocks give the mix GEMMs their
    one-tile form (coefficients held), 256 their general tiles."""
    import torch

    dtype = getattr(torch, _DTYPES[case.dtype])
    gen = torch.Generator().manual_seed(0)
    B, H, T, D = 2, 16, case.blocks * case.block_size, case.D

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(dt).requires_grad_()

    from unittest import mock

    with contextlib.ExitStack() as stack:
        cap = VARIANT_SETS[case.set][3]
        if cap is not None:  # the ops' feature tiles capped at ``cap``, wherever a kernel module reads them
            from mhla.ops.mhla.triton.utils import feature_tile

            for mod in kernel_modules():
                if getattr(mod, "feature_tile", None) is feature_tile:
                    stack.enter_context(mock.patch.object(mod, "feature_tile",
                                                          functools.partial(feature_tile, max_tile=cap)))
        CASE_RUNNERS[case.op](case, rand, gen, dtype, B, H, T, D)


def _run_cross(case: Case, rand, gen, dtype, B: int, H: int, T: int, D: int) -> None:
    import torch

    from mhla.ops.mhla_cross.triton.query import CrossQueryFunction

    Mq = T // case.block_size
    q = rand(B, T, H, D)
    P, Pz = rand(B, H, Mq, D, D, dt=torch.float32), rand(B, H, Mq, D, dt=torch.float32)
    CrossQueryFunction.apply(q, P, Pz, case.normalize, 1e-6, dtype)


def _run_mhla(case: Case, rand, gen, dtype, B: int, H: int, T: int, D: int) -> None:
    from unittest import mock

    import torch

    from mhla.ops.mhla.triton import backend

    C = case.block_size
    normalize = "paper" if case.normalize else "none"
    mixing = torch.rand(H, T // C, T // C, generator=gen).requires_grad_()
    q, k, v = rand(B, T, H, D), rand(B, T, H, D), rand(B, T, H, D)
    with mock.patch.object(backend, "_check_device", lambda q: None):  # CPU tensors: nothing runs
        if case.window is not None:  # compact rows: the banded mix kernels
            from mhla.ops import MixingRows

            mixing = MixingRows(0, *(torch.rand(H, T // C, *shape, generator=gen).requires_grad_(case.rows_grad)
                                     for shape in ((), (case.window[0],), (case.window[1],), ())))
        if case.path == "causal+state":
            split = T // 2 + 16  # the second call starts 16 tokens into a block
            o1, state = backend.mhla_triton(q[:, :split], k[:, :split], v[:, :split], mixing, C, causal=True,
                                            normalize=normalize, output_final_state=True)
            o2 = backend.mhla_triton(q[:, split:], k[:, split:], v[:, split:], mixing, C, causal=True,
                                     normalize=normalize, initial_state=state)
            loss = o1.float().sum() + o2.float().sum()
        else:
            o = backend.mhla_triton(q, k, v, mixing, C, causal=case.path == "causal", normalize=normalize)
            loss = o.float().sum()
    loss.backward()


#: how :func:`run_case` calls each op of the cases (``case.op``), with the same arguments
CASE_RUNNERS = {"mhla": _run_mhla, "mhla_cross": _run_cross}


def _stand_in(arg):
    """A one-element tensor with the dtype of tensor ``arg`` and its address modulo 16 (all Triton's binder reads
    of a pointer argument), so the recorded launches do not keep the case's tensors alive; other values as they
    are."""
    import torch

    if not isinstance(arg, torch.Tensor):
        return arg
    base = torch.empty(32 // arg.element_size(), dtype=arg.dtype)
    for i in range(base.numel()):
        if (base[i:].data_ptr() - arg.data_ptr()) % 16 == 0:
            return base[i:i + 1]
    return arg


@contextlib.contextmanager
def capture_launches(case_box: list) -> Iterator[list]:
    """Intercept every kernel launch (``Autotuner.run``, ``JITFunction.run``): record it as a :class:`Launch` of
    the case in ``case_box[0]`` instead of running it."""
    from unittest import mock

    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    launches = []
    names = {id(_jit_function(obj)): name for name, obj in discover_kernels().items()}

    def record(fn, args, kwargs, configs):
        kwargs = {k: _stand_in(v) for k, v in kwargs.items() if k not in ("grid", "warmup")}
        launches.append(Launch(names.get(id(fn), f"{fn.module}:{fn.__name__}"), fn,
                               tuple(_stand_in(a) for a in args), kwargs, tuple(configs), case_box[0]))

    def autotuned(self, *args, **kwargs):
        record(_jit_function(self), args, kwargs, self.configs)

    def jitted(self, *args, **kwargs):
        from triton import Config

        opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        record(self, args, kwargs, [Config({}, **opts)])

    with mock.patch.object(Autotuner, "run", autotuned), mock.patch.object(JITFunction, "run", jitted):
        yield launches


def collect_launches(sets: tuple = SETS) -> list:
    """The launches of every case of :func:`cases` in ``sets``."""
    box = [None]
    with capture_launches(box) as launches:
        for case in cases(sets):
            box[0] = case
            run_case(case)
    return launches


# ------------------------------------------------------------------------------------------ compiling


@dataclasses.dataclass(frozen=True)
class Variant:
    """A kernel compile: the Triton source and options of one launch, one config and one arch."""

    kernel: str
    set: str
    dtype: str
    arch: int
    num_warps: int
    num_stages: int
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    fn: object = dataclasses.field(compare=False, repr=False)

    def describe(self) -> dict:
        """The table columns that name the variant: flags on, tiles, precision, and ``spec``: the integer
        arguments the JIT specialised away from the plain case (``=1``: a constant; ``%16``: not a multiple of
        16)."""
        names = list(self.signature)
        consts = {names[path[0]]: value for path, value in self.constexprs.items()}
        declared = {param.name for param in self.fn.params if param.is_constexpr}
        flags = [name for name in names if name in declared and consts[name] is True]
        spec = []
        for i, (name, ty) in enumerate(self.signature.items()):
            if name not in declared and name in consts:
                spec.append(f"{name}={consts[name]}")
            elif ty in ("i32", "i64") and not self.attrs.get((i,)):
                spec.append(f"{name}%16")
        tiles = " ".join(f"{name}={consts[name]}" for name in names
                         if name in declared and name != "PREC" and not isinstance(consts[name], bool))
        return {"kernel": self.kernel.split(":")[1], "set": self.set, "dtype": self.dtype,
                "flags": ",".join(flags) or "-", "tiles": tiles or "-", "PREC": consts.get("PREC", "-"),
                "spec": ",".join(spec) or "-", "num_warps": self.num_warps, "num_stages": self.num_stages,
                "arch": f"sm_{self.arch}"}

    def key(self) -> tuple:
        return (self.kernel, self.arch, self.num_warps, self.num_stages, repr(sorted(self.signature.items())),
                repr(sorted(self.constexprs.items())), repr(sorted(self.attrs.items())))


@functools.cache
def _binder(fn, arch: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    return backend, create_function_from_signature(fn.signature, fn.params, backend)


def bind(launch: Launch, config, arch: int) -> Variant:
    """What ``JITFunction.run`` would compile for ``launch`` with ``config`` on ``arch`` (Triton's binder and
    argument packing)."""
    from triton import knobs

    fn = launch.fn
    backend, binder = _binder(fn, arch)
    kwargs = {**launch.kwargs, **config.all_kwargs()}
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return Variant(launch.kernel, launch.case.set, launch.case.dtype, arch, options.num_warps, options.num_stages,
                   signature, constexprs, attrs, dict(options.__dict__), fn)


def variants(launches: list, archs=ARCHS, configs=None) -> list:
    """The distinct :class:`Variant` s of ``launches`` x configs (each kernel's own, or ``configs``) x ``archs``.
    A kernel's own configs are compiled for the archs whose autotune list holds them (:func:`.utils.configs_for_arch`).
    A variant already in an earlier set (e.g. a cap-128 one equal to a default one) is kept there only."""
    from .utils import configs_for_arch

    seen, out = set(), []
    for launch in sorted(launches, key=lambda ln: SETS.index(ln.case.set)):
        for config in configs or launch.configs:
            for arch in archs:
                if configs is None and not configs_for_arch([config], arch):
                    continue
                v = bind(launch, config, arch)
                if v.key() not in seen:
                    seen.add(v.key())
                    out.append(v)
    return out


_PTXAS_LINE = {
    "stack": r"(\d+) bytes stack frame",
    "spill_stores": r"(\d+) bytes spill stores",
    "spill_loads": r"(\d+) bytes spill loads",
    "registers": r"Used (\d+) registers",
}


def parse_ptxas_log(log: str) -> dict | None:
    """Registers, spill stores / loads and stack frame bytes from a ``ptxas -v`` log (None if it has none)."""
    found = {name: re.search(pattern, log) for name, pattern in _PTXAS_LINE.items()}
    if not all(found.values()):
        return None
    return {name: int(m.group(1)) for name, m in found.items()}


def ptxas_figures(ptx: str, arch: int) -> dict:
    """:func:`parse_ptxas_log` of the bundled ``ptxas -v`` run on ``ptx`` with Triton's flags (``make_cubin`` of
    Triton's NVIDIA backend)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(arch)}", src, "-o", os.path.join(tmp, "k.cubin")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    figures = parse_ptxas_log(log)
    if figures is None:
        raise RuntimeError(f"ptxas -v printed no resource usage:\n{log}")
    return figures


def compile_variant(v: Variant) -> dict:
    """Compile ``v`` (Triton's cache answers a repeat) and return its figures, cached next to the kernel. A fresh
    compile prints Triton's own ``ptxas -v`` log (``knobs.nvidia.dump_ptxas_log``), read here; a cached kernel
    without figures runs ptxas again."""
    import io

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.cache import get_cache_manager

    printed = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(printed):
        knobs.nvidia.dump_ptxas_log = True
        kernel = triton.compile(ASTSource(v.fn, v.signature, v.constexprs, v.attrs),
                                target=GPUTarget("cuda", v.arch, 32), options=v.options)
    cache = get_cache_manager(kernel.hash)
    path = cache.get_file("ptxas_v.json")
    if path is not None:
        with open(path) as f:
            figures = json.load(f)
    else:
        figures = parse_ptxas_log(printed.getvalue()) or ptxas_figures(kernel.asm["ptx"], v.arch)
        cache.put(json.dumps(figures), "ptxas_v.json", binary=False)
    return {**figures, "shared": kernel.metadata.shared}


def _log(line: str) -> None:
    print(line, flush=True)


_POOL_VARIANTS: list = []  # the variants the forked workers of compile_all read


def _compile_one(i: int) -> tuple:
    try:
        return i, compile_variant(_POOL_VARIANTS[i]), None
    except Exception as e:  # noqa: BLE001
        return i, None, repr(e)


def compile_all(vs: list, jobs: int = 1, log=None) -> tuple[list, list]:
    """Compile every variant, in ``jobs`` forked processes: ``(rows, failures)``; a row is ``describe()`` plus
    the figures, a failure names the variant and the error."""
    import multiprocessing

    log = log or _log
    _POOL_VARIANTS[:] = vs
    rows, failures = [], []
    t0 = time.time()
    with contextlib.ExitStack() as stack:
        if jobs > 1:
            pool = stack.enter_context(multiprocessing.get_context("fork").Pool(jobs))
            results = pool.imap_unordered(_compile_one, range(len(vs)))
        else:
            results = map(_compile_one, range(len(vs)))
        for n, (i, figures, error) in enumerate(results, 1):
            d = vs[i].describe()
            label = " ".join(f"{k}={d[k]}" for k in ROW_FIELDS[:ROW_FIELDS.index("arch") + 1])
            if error is not None:
                failures.append(f"{label}: {error}"[:4000])
                log(f"FAIL {label}: {error}"[:4000])
                continue
            rows.append({**d, **figures})
            log(f"[{n}/{len(vs)} {time.time() - t0:.0f} s] {label}: {figures['registers']} regs, spills "
                f"{figures['spill_stores']}/{figures['spill_loads']} B, shared {figures['shared']} B")
    _POOL_VARIANTS.clear()
    return rows, failures


# ------------------------------------------------------------------------------------------ the table


def dedupe_rows(rows: list) -> list:
    """Rows less those that repeat a compile of an earlier set (a cap-128 run also launches the kernels the cap does
    not touch); :func:`variants` does the same when the sets are compiled together."""
    seen, out = set(), []
    for r in sorted(rows, key=lambda r: SETS.index(r["set"])):
        key = tuple(r[f] for f in ROW_FIELDS if f != "set" and f not in FIGURES)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def sort_rows(rows: list) -> list:
    def key(r):
        return (SETS.index(r["set"]), r["kernel"], r["dtype"], r["flags"], r["tiles"], r["spec"],
                r["arch"], r["num_warps"], r["num_stages"])

    return sorted(rows, key=key)


#: What each variant set holds (the md's legend).
SET_NOTES = {
    "default": "bf16 inputs, D 64 and 128 with the tiles the ops choose (`feature_tile`, `chunk_tile`; 128 at D 128 "
               "in the wide kernels, `Geometry.wide`), blocks of "
               "128 tokens (the largest chunk tile, two chunks per block)",
    "small blocks": "the same with blocks of 16, 32 and 64 tokens (`BT` 16 / 32 / 64, one chunk per block, so "
                    "`NC` is specialised to 1)",
    "fp16": "the default set with fp16 inputs",
    "fp32": "the default set with fp32 inputs (`PREC = ieee`: exact fp32 dots, no tensor cores)",
    CAP128: "D 128 with the feature tiles capped at 128 instead of 64 (`feature_tile(128, max_tile=128)`: `BK = "
            "BV = 128`), bf16, blocks of 128 tokens; the ops launch them only in the wide kernels (`Geometry.wide`)",
}


#: The most shared memory one program may use (bytes): A100 (sm_80) 163 KB, H100 (sm_90) 227 KB.
SHARED_LIMIT = {"sm_80": 166912, "sm_90": 232448}


def over_shared_limit(rows: list) -> list:
    """Rows that need more shared memory than their arch has (the autotuner skips such a config)."""
    return [r for r in rows if r["shared"] > SHARED_LIMIT.get(r["arch"], float("inf"))]


def spilling(rows: list) -> list:
    return [r for r in rows if r["spill_stores"] or r["spill_loads"]]


def summary(rows: list) -> list:
    """Per kernel and set: the registers range, the rows that spill and the most shared memory."""
    out = []
    for kernel in sorted({r["kernel"] for r in rows}):
        for set_name in SETS:
            rs = [r for r in rows if r["kernel"] == kernel and r["set"] == set_name]
            if rs:
                out.append({"kernel": kernel, "set": set_name, "rows": len(rs),
                            "registers": [min(r["registers"] for r in rs), max(r["registers"] for r in rs)],
                            "spilling_rows": len(spilling(rs)), "max_spill_bytes": max(
                                max(r["spill_stores"], r["spill_loads"]) for r in rs),
                            "max_shared": max(r["shared"] for r in rs)})
    return out


def write_table(prefix: str, rows: list, meta: dict) -> None:
    """``prefix.json`` (every row) and ``prefix.md`` (the summary, then every row)."""
    import triton

    rows = sort_rows(dedupe_rows(rows))
    meta = {**meta, "triton": triton.__version__, "command": "python -m mhla.ops.mhla.triton.compile_check "
            f"--table {prefix}"}
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    with open(prefix + ".json", "w") as f:
        json.dump({"meta": meta, "summary": summary(rows), "rows": rows}, f, indent=1)
        f.write("\n")
    lines = [
        "# Kernel resources (static, no GPU)",
        "",
        (f"Made by `{meta['command']}` (triton {meta['triton']}, bundled ptxas). Each row is one compile of a Triton "
        "kernel for one arch, one autotune config (`num_warps` x `num_stages`) and one variant the ops launch "
        "(flags on; tiles: `BT` chunk, `BK` / `BV` feature tiles, `BM` / `BK` / `BN` of the mix GEMMs; `PREC` of "
        "`tl.dot` on fp32 operands; `spec`: integer arguments "
        "specialised away from a multiple of 16, `=1` a constant). Registers are per thread, spills and stack in "
        "bytes per thread (`ptxas -v`), shared memory in bytes per program (Triton's allocation)."),
        "",
        f"Cases: {meta['cases']}.",
        "",
        ("Sets: " + "; ".join(f"`{name}`: {text}" for name, text in SET_NOTES.items() if name in meta["sets"])
         + ". The `default` set is what `tests/ops/test_kernel_resources.py` checks (every kernel launched, no "
        "spills, figures equal to this table's)."),
        "",
        *([f"Not in this table (add them with `--set NAME`): {', '.join(f'`{m}`' for m in missing)}.", ""]
          if (missing := [name for name in SETS if name not in meta["sets"]]) else []),
        "## Summary",
        "",
        "| kernel | set | rows | registers | rows that spill | max spill B | max shared B |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for s in summary(rows):
        lines.append(f"| {s['kernel']} | {s['set']} | {s['rows']} | {s['registers'][0]}-{s['registers'][1]} | "
                     f"{s['spilling_rows']} | {s['max_spill_bytes']} | {s['max_shared']} |")
    if meta.get("findings"):
        lines += ["", "## What it shows", ""] + [f"- {x}" for x in meta["findings"]]
    lines += ["", "## Every compile", "", "| " + " | ".join(ROW_FIELDS) + " |",
              "|" + "---|" * len(ROW_FIELDS)]
    lines += ["| " + " | ".join(str(r[k]) for k in ROW_FIELDS) + " |" for r in rows]
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


_VARIANT_FIELDS = ("kernel", "dtype", "flags", "tiles", "PREC", "spec")  # a row less its config and arch


def _where(r: dict) -> str:
    return (f"{r['kernel']} {r['dtype']} [{r['flags']}] {r['tiles']}, {r['num_warps']} warps "
            f"x {r['num_stages']} stages, {r['arch']}")


def _groups(rows: list, figure) -> str:
    """``kernel [flags] arch: warps x stages, ... (up to N B)`` per kernel variant and arch, ``figure(row)`` the
    bytes shown."""
    groups = {}
    for r in rows:
        groups.setdefault(f"{r['kernel']} {r['dtype']} [{r['flags']}] {r['tiles']} {r['arch']}", []).append(r)
    parts = []
    for name, rs in sorted(groups.items()):
        configs = ", ".join(sorted({f"{r['num_warps']}x{r['num_stages']}" for r in rs}))
        parts.append(f"{name}: {configs} (up to {max(figure(r) for r in rs)} B)")
    return "; ".join(parts)


def findings(rows: list) -> list:
    """Plain statements the md makes from the rows: spills and shared memory per set, and the cap-128 answer."""
    out = []
    for set_name in SETS:
        rs = [r for r in rows if r["set"] == set_name]
        if not rs:
            continue
        sp, big = spilling(rs), over_shared_limit(rs)
        line = (f"`{set_name}`: {len(rs)} compiles, registers {min(r['registers'] for r in rs)}-"
                f"{max(r['registers'] for r in rs)}, shared memory up to {max(r['shared'] for r in rs)} B; ")
        if not sp:
            line += "none spills"
        else:
            line += (f"{len(sp)} spill (kernel, variant, arch: the configs `num_warps x num_stages` that spill, "
                     f"most spill-store bytes): {_groups(sp, lambda r: r['spill_stores'])}")
        if big:
            line += (f". {len(big)} need more shared memory than the arch has (the autotuner skips such a config): "
                     f"{_groups(big, lambda r: r['shared'])}")
        out.append(line + ".")
    cap = [r for r in rows if r["set"] == CAP128]
    base = [r for r in rows if r["set"] == "default"]
    if cap and base:
        kernels = sorted({r["kernel"] for r in cap})
        per_kernel = []
        for k in kernels:
            c = [r for r in cap if r["kernel"] == k]
            b = [r for r in base if r["kernel"] == k]
            per_kernel.append(f"{k} {max(r['registers'] for r in b)} -> {max(r['registers'] for r in c)} regs, "
                              f"shared {max(r['shared'] for r in b)} -> {max(r['shared'] for r in c)} B, "
                              f"{len(spilling(c))}/{len(c)} compiles spill")
        usable = [r for r in cap if not (r["spill_stores"] or r["spill_loads"]) and r not in over_shared_limit(cap)]
        stuck = sorted({f"{r['kernel']} [{r['flags']}] on {r['arch']}" for r in cap
                        if not any(u["arch"] == r["arch"] and all(u[f] == r[f] for f in _VARIANT_FIELDS)
                                   for u in usable)})
        out.append(f"D 128 with 128-wide feature tiles (`{CAP128}`) against the default 64-wide tiles (most per "
                   f"kernel): {'; '.join(per_kernel)}. {len(usable)} of {len(cap)} cap-128 compiles neither spill "
                   "nor exceed the arch's shared memory; variants with no such autotune config: "
                   f"{', '.join(stuck) or 'none'}.")
    return out


# ------------------------------------------------------------------------------------------ the command


def describe_cases(sets: tuple) -> str:
    blocks = sorted({b for name in sets for b in VARIANT_SETS[name][2]})
    return (f"B 2, H 16, D = Dv, {NUM_BLOCKS} blocks (T = {NUM_BLOCKS} x block size), per-head mixing; MHLA blocks "
            f"of {', '.join(map(str, blocks))} tokens "
            "(non-causal, causal, and causal returning a state then continuing it 16 tokens into a block; forward "
            "and backward; normalizer paper and none); cross-attention's query side with "
            f"{' and '.join(map(str, QUERIES_PER_BLOCK))} queries per block"
            + (f"; default set: also non-causal and causal calls of {MANY_BLOCKS} blocks of 128 tokens (D 64, the "
               "mix kernels' general tiles), and causal calls with compact MixingRows of windows "
               f"{', '.join(f'{w} ({p})' for w, p, _ in ROWS_CASES)} (the banded mix kernels; with a state, rows "
               "frozen)" if "default" in sets else ""))


def run(archs=ARCHS, sets=SETS, configs=None, jobs=1, log=None) -> tuple[list, list, list]:
    """Collect, bind and compile: ``(rows, failures, kernels no case launched)``."""
    log = log or _log
    launches = collect_launches(sets)
    missing = sorted(set(discover_kernels()) - {ln.kernel for ln in launches})
    vs = variants(launches, archs, configs)
    log(f"{len(launches)} launches -> {len(vs)} compiles ({len(archs)} archs, {jobs} jobs)")
    rows, failures = compile_all(vs, jobs, log)
    return rows, failures, missing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, action="append", help="CUDA compute capability, repeatable "
                   f"(default {' and '.join(map(str, ARCHS))})")
    p.add_argument("--quick", action="store_true", help="the default set only (same as --set default)")
    p.add_argument("--set", action="append", choices=SETS, help="variant sets to compile, repeatable (default: "
                   "all)")
    p.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    p.add_argument("--num-warps", type=int, help="compile this many warps instead of the autotune configs")
    p.add_argument("--num-stages", type=int, help="with --num-warps: this many stages (default 2)")
    p.add_argument("--table", metavar="PREFIX", help="write PREFIX.md and PREFIX.json (with --set: replace those "
                   "sets' rows of an existing table, keep the others)")
    p.add_argument("--json", metavar="PATH", help="write the rows (and failures) as JSON to PATH")
    p.add_argument("--check-spills", action="store_true", help="exit 1 when a compile spills")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("unset TRITON_INTERPRET: the interpreter does not compile", file=sys.stderr)
        return 3
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        make_backend(GPUTarget("cuda", 90, 32))
    except Exception as e:  # noqa: BLE001
        print(f"cannot compile here: {e!r}", file=sys.stderr)
        return 3
    archs = tuple(args.arch or ARCHS)
    configs = None
    if args.num_warps or args.num_stages:
        configs = [triton.Config({}, num_warps=args.num_warps or 4, num_stages=args.num_stages or 2)]
    sets = ("default",) if args.quick else tuple(s for s in SETS if s in (args.set or SETS))
    t0 = time.time()
    rows, failures, missing = run(archs, sets, configs, args.jobs)
    for name in missing:
        print(f"WARNING not launched {name}: no case of cases() launches this kernel, so nothing here checks it")
    spills = spilling(rows)
    for r in spills:
        print(f"SPILLS {r['kernel']} {r['set']} {r['dtype']} {r['flags']} {r['tiles']} "
              f"{r['num_warps']}w x {r['num_stages']}s {r['arch']}: stores {r['spill_stores']} B, "
              f"loads {r['spill_loads']} B")
    print(f"{len(rows)} compiled, {len(failures)} failed, {len(spills)} spill, {len(missing)} kernels not launched, "
          f"{time.time() - t0:.0f} s")
    meta = {"archs": [f"sm_{a}" for a in archs], "sets": list(sets), "cases": describe_cases(sets)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": sort_rows(rows), "failures": failures, "not_launched": missing}, f,
                      indent=1)
    if args.table:
        if len(sets) < len(SETS) and os.path.exists(args.table + ".json"):  # keep the other sets' rows
            with open(args.table + ".json") as f:
                kept = [r for r in json.load(f)["rows"] if r["set"] not in sets]
            rows = rows + kept
            meta["sets"] = [s for s in SETS if any(r["set"] == s for r in rows)]
            meta["cases"] = describe_cases(tuple(meta["sets"]))
        rows = dedupe_rows(rows)
        write_table(args.table, rows, {**meta, "findings": findings(rows)})
    bad = failures or (args.check_spills and spills)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
