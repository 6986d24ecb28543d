"""Compile every kernel variant for a CUDA arch without a GPU.

Run ``python -m mhla.ops.mhla.triton.compile_check [--arch 90] [--quick]``.

The CPU interpreter checks what the kernels compute but not that they compile (loop-carried types,
``tl.dot`` shapes, shared memory). This runs Triton's real pipeline (TTIR -> PTX -> cubin with the
bundled ``ptxas``) for each flag combination and dtype, for ``--arch`` (default 90, H100), and reports the
shared memory each variant needs. It must run *without* ``TRITON_INTERPRET=1``.

Exit status: 0 all compiled, 1 a variant failed, 3 cannot compile here (interpreter on, no CUDA backend).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

FLAGS = {
    "_fwd_block_summaries_kernel": ("HAS_R", "HAS_INIT", "STORE_Z"),
    "_fwd_output_kernel": ("CAUSAL", "HAS_R", "NORMALIZE"),
    "_bwd_block_grads_kernel": ("HAS_R", "NORMALIZE"),
    "_bwd_dv_kernel": ("CAUSAL", "HAS_R", "NORMALIZE"),
    "_bwd_dqk_kernel": ("CAUSAL", "HAS_R", "NORMALIZE"),
}
_INT_ARGS = {"T", "H", "D", "Dv", "OFFSET", "C", "NC", "NB", "stride_mh"}
_INPUT_ARGS = {"q", "k", "v", "o", "do", "dq", "dk", "dv"}  # in the input dtype; other pointers are fp32


def _signature(fn, dtype: str, constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in _INT_ARGS:
            sig[name] = "i32"
        elif name == "eps":
            sig[name] = "fp32"
        else:
            sig[name] = "*" + (dtype if name in _INPUT_ARGS else "fp32")
    return sig


def variants(quick: bool):
    """(kernel name, dtype, constexprs) to compile. ``quick``: all flags on / the non-causal set, bf16."""
    dtypes = (("bf16", "tf32"),) if quick else (("bf16", "tf32"), ("fp16", "tf32"), ("fp32", "ieee"))
    for name, flags in FLAGS.items():
        for dtype, prec in dtypes:
            for values in itertools.product((False, True), repeat=len(flags)):
                f = dict(zip(flags, values))
                if f.get("HAS_R") and f.get("CAUSAL") is False:
                    continue  # running sums exist only in the causal form
                if quick and not (all(values) or f.get("CAUSAL") is False and f.get("NORMALIZE", True)):
                    continue
                yield name, dtype, dict(BT=64, BK=64, BV=64, PREC=prec, **f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    p.add_argument("--quick", action="store_true", help="bf16 only, a few flag combinations per kernel")
    p.add_argument("--num-warps", type=int, default=8)
    p.add_argument("--num-stages", type=int, default=2)
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("unset TRITON_INTERPRET: the interpreter does not compile", file=sys.stderr)
        return 3
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from . import chunk
    except Exception as e:  # noqa: BLE001
        print(f"cannot compile here: {e!r}", file=sys.stderr)
        return 3
    target = GPUTarget("cuda", args.arch, 32)
    options = {"num_warps": args.num_warps, "num_stages": args.num_stages}
    failed = 0
    for name, dtype, consts in variants(args.quick):
        fn = getattr(chunk, name).fn  # the autotuner wraps the JITFunction
        flags = ",".join(k for k, v in consts.items() if v is True) or "-"
        t0 = time.time()
        try:
            kernel = triton.compile(ASTSource(fn, _signature(fn, dtype, consts), constexprs=consts),
                                    target=target, options=options)
        except Exception as e:  # noqa: BLE001
            failed += 1
            print(f"FAIL {name} {dtype} {flags}: {e!r}"[:4000], flush=True)
            continue
        print(f"ok   {name} {dtype} {flags}: shared {kernel.metadata.shared} B, {time.time() - t0:.1f} s",
              flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
