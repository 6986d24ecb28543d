"""Small helpers shared by the Triton kernels: interpreter detection, tile sizes, autotune configs, dtypes.

Nothing here launches a kernel. The module imports ``triton``; :mod:`mhla.ops.mhla.triton.backend` catches
the ``ImportError`` where triton is missing.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when ``@triton.jit`` builds CPU-interpreted kernels (``TRITON_INTERPRET=1``).

    Triton 3.x reads the variable when ``@triton.jit`` *decorates* a function, i.e. when the kernel modules
    of this package are imported, not at launch. :data:`INTERPRET_AT_IMPORT` records what the kernels were
    built with; this function reports the environment now.
    """
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # older triton without knobs
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


#: Whether the kernels of this package were decorated under the interpreter (fixed at import).
INTERPRET_AT_IMPORT = interpreting()


def language_interpreted() -> bool:
    """True when triton.language's own jitted helpers (``tl.zeros``, ``tl.cdiv``, ...) were built for the
    interpreter. They are decorated when triton is first imported, so a triton imported *before*
    ``TRITON_INTERPRET=1`` was set keeps them compiled, and interpreted kernels that call them fail with
    "Cannot call @triton.jit'd outside of the scope of a kernel"."""
    return type(tl.zeros).__name__ == "InterpretedFunction"


#: Whether the CPU interpreter can run these kernels in this process.
INTERPRETER_USABLE = INTERPRET_AT_IMPORT and language_interpreted()

def device_helper(fn):
    """Decorator for the small ``@triton.jit`` helpers the kernels call.

    Compiled, it is ``triton.jit`` (the helpers are inlined). Under the interpreter the plain Python
    function is kept: the kernel body already runs with ``triton.language`` patched to numpy, and an
    interpreted ``@triton.jit`` call re-patches the language on every call, which made the helpers the
    main cost of the CPU tests.
    """
    return fn if INTERPRET_AT_IMPORT else triton.jit(fn)


#: Tile sizes the kernels may use. ``tl.dot`` needs every dimension >= 16 on a GPU.
MIN_TILE = 16
MAX_TILE = 64


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def feature_tile(dim: int, max_tile: int = MAX_TILE) -> int:
    """Tile size for a head dimension ``dim`` (32..256, not only powers of two).

    The tile is a power of two in ``[32, max_tile]`` (16 for tiny dims); the last tile is masked when it
    overruns ``dim``. Pick the one with the least padding, the larger on ties:
    48 -> 64 (one tile), 96 -> 32 (three), 128 -> 64, 160 -> 32 (five), 256 -> 64.
    """
    if dim <= MIN_TILE:
        return MIN_TILE
    best, best_pad = None, None
    tile = max_tile
    while tile >= 2 * MIN_TILE:
        padded = triton.cdiv(dim, tile) * tile
        if best is None or padded < best_pad:
            best, best_pad = tile, padded
        tile //= 2
    return min(best, next_pow2(dim))


def chunk_tile(block_size: int, max_tile: int = MAX_TILE) -> int:
    """Chunk length ``c`` (the kernels' token tile) for MHLA blocks of ``block_size`` tokens.

    Every block is cut into ``ceil(C / c)`` chunks; the last chunk of a block is masked when ``c`` does
    not divide ``C``, so any block size works. A block that fits in one tile uses a single chunk; larger
    blocks use ``max_tile`` unless a smaller power of two wastes clearly less padding.
    """
    if block_size <= max_tile:
        return max(MIN_TILE, next_pow2(block_size))
    best, best_pad = max_tile, triton.cdiv(block_size, max_tile) * max_tile
    tile = max_tile // 2
    while tile >= MIN_TILE:
        padded = triton.cdiv(block_size, tile) * tile
        if padded * 1.25 < best_pad:  # only trade tile size for a real saving (>= 20%)
            best, best_pad = tile, padded
        tile //= 2
    return best


#: The CUDA archs the autotune lists are written for (compute capability x 10): 90 (H100 / H200, what the kernels
#: are tuned for) and 80 (A100). A device of capability 9.0 or more autotunes over a kernel's sm_90 list, an older
#: one over its sm_80 list (:func:`config_arch`); :mod:`.compile_check` compiles each arch's list for that arch.
CONFIG_ARCHS = (90, 80)


def config_arch(capability: int) -> int:
    """The autotune list (90 or 80) a device of compute capability ``capability`` (major * 10 + minor) uses."""
    return 90 if capability >= 90 else 80


def _entries(listed) -> list:
    return [(w, s, kw[0] if kw else {}) for w, s, *kw in listed]


def arch_configs(warps=(4, 8), stages=(2, 3), sm80=None, sm90=None) -> list:
    """A kernel's declared autotune configs (also under the interpreter): ``warps x stages`` (or the ``sm90`` list)
    for sm_90 and, unless ``sm80`` lists its own, for sm_80.

    ``sm80`` / ``sm90``: ``(num_warps, num_stages)`` or ``(num_warps, num_stages, kwargs)`` entries, ``kwargs``
    constexprs of the kernel the config sets (a code shape, e.g. ``_bwd_dqk_kernel``'s ``HALF_V``). Each config's
    ``archs`` attribute names the lists that hold it; a config in both lists is one config."""
    sm90 = [(w, s, {}) for w in warps for s in stages] if sm90 is None else _entries(sm90)
    lists = {90: sm90, 80: sm90 if sm80 is None else _entries(sm80)}
    out = {}
    for arch, entries in lists.items():
        assert entries, f"no autotune config for sm_{arch}"
        for w, s, kwargs in entries:
            key = (w, s, tuple(sorted(kwargs.items())))
            if key not in out:
                out[key] = triton.Config(dict(kwargs), num_warps=w, num_stages=s)
                out[key].archs = ()
            out[key].archs += (arch,)
    return list(out.values())


def configs_for_arch(configs, arch: int) -> list:
    """The configs of ``configs`` in the list of compute capability ``arch`` (a config without ``archs``: every
    arch's)."""
    return [c for c in configs if config_arch(arch) in getattr(c, "archs", CONFIG_ARCHS)]


def autotune_configs(warps=(4, 8), stages=(2, 3), sm80=None, sm90=None) -> list:
    """Autotune configurations (:func:`arch_configs`); a single one under the interpreter (there is nothing to
    tune)."""
    if INTERPRET_AT_IMPORT:
        return [triton.Config({}, num_warps=4, num_stages=1)]
    return arch_configs(warps, stages, sm80, sm90)


def current_target():
    """The target Triton compiles a launch for now (the current device's)."""
    return triton.runtime.driver.active.get_current_target()


def device_configs(configs, named_args=None, **kwargs) -> list:
    """``early_config_prune`` of :func:`autotune`: the configs of the current device's arch
    (:func:`current_target`); all of them off CUDA."""
    target = current_target()
    if target.backend != "cuda":
        return configs
    return configs_for_arch(configs, target.arch)


def autotune(key, warps=(4, 8), stages=(2, 3), sm80=None, sm90=None):
    """``triton.autotune`` over :func:`autotune_configs`, pruned to the device's arch (:func:`device_configs`). The
    declared configs of every arch, whatever the interpreter, are the kernel's ``declared_configs`` (tests run the
    sm_80 kwargs under the interpreter with them)."""

    def wrap(fn):
        tuner = triton.autotune(configs=autotune_configs(warps, stages, sm80, sm90), key=key,
                                prune_configs_by={"early_config_prune": device_configs})(fn)
        tuner.declared_configs = arch_configs(warps, stages, sm80, sm90)
        return tuner

    return wrap


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` for ``tl.dot`` on fp32 operands.

    fp32 inputs get exact ("ieee") products so the fp32 path matches the torch path tightly; for half
    inputs the fp32 operands are summaries and intermediate products, where TF32 (10 mantissa bits, more
    than bf16's 7) is accurate enough and twice as fast.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: Opt-in: ``MHLA_SUMMARY_DTYPE=input`` stores the block summaries ``S``, key sums ``z`` and their mix ``P``, ``p``
#: in the input dtype (bf16 / fp16; flash-linear-attention's default for its chunk states) instead of fp32 (the
#: default, also ``fp32``). Half the bytes of the summary passes, at the cost of rounding them to 8 (bf16) or 11
#: (fp16) significant bits; accumulation stays fp32, and the running sums and every gradient stay fp32. Dense
#: mixing without a state only (compact ``MixingRows`` and state calls keep fp32 summaries). Meant for bf16: fp16
#: summaries overflow above 65504 (a block's sum of ``k_s v_s^T``, and its mix over the blocks).
SUMMARY_DTYPE_ENV = "MHLA_SUMMARY_DTYPE"


def summary_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the block summaries for inputs of ``dtype`` (read from :data:`SUMMARY_DTYPE_ENV` at each
    call): fp32 unless it says ``input``."""
    mode = os.environ.get(SUMMARY_DTYPE_ENV, "fp32").strip().lower()
    if mode in ("", "fp32", "float32"):
        return torch.float32
    if mode == "input":
        return dtype
    raise ValueError(f"{SUMMARY_DTYPE_ENV} must be 'fp32' or 'input', got {mode!r}")
