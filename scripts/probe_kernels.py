#!/usr/bin/env python
"""Probe two open questions about the fused MHLA kernels (docs/kernels.md), on a GPU.

1. ``tiles``: the kernels cut the head dimension into feature tiles of at most 64, so at D = 128 each program
   reads its q / k / v rows twice. Is that why D = 128 was 3.2x slower than D = 64 for twice the data? The
   Triton MHLA forward and fwd+bwd at D 64 and 128, with the feature tile capped at 64 (the kernels' choice)
   and at 128, non-causal and causal, each checked against the torch path before it is timed. Where the causal
   kernels take their ``all_v`` form (half inputs, D 128: a K tile of 128, the V tiles walked in one program,
   ``chunk.all_v_tiles``), the same case also runs with it off (``all_v`` False): the control of that choice.
2. ``per_call``: why was MHLA's forward at T = 1024 about 4x SDPA's? For MHLA (Triton), MHLA (torch path) and
   SDPA (FlashAttention on CUDA): the time per call (CUDA events), the host time to issue one call (no
   synchronisation), and, from ``torch.profiler``, the device kernels per call and their summed time. A call
   whose kernels add up to far less than its time is bound by launches and host work, not by the GPU.

    python scripts/probe_kernels.py --device cuda                 # both -> results/bench/probe_kernels_cuda.*
    python scripts/probe_kernels.py --device cuda --only tiles

Settings as ``make bench-gpu``: B 8, H 16, bf16, locality mixing, M from ``bench_ops.choose_num_blocks``
(non-causal) or blocks of 64 (causal). On a CPU it runs only as a smoke test (``--quick``, the Triton
kernels under ``TRITON_INTERPRET=1``); its times mean nothing there. Writes ``<out-dir>/probe_kernels_<device>
[_quick]`` .json and .md with the machine, the load before and after (:class:`tasks.common.records.Measurement`)
and the command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch

import mhla
from mhla.ops.mhla.triton import chunk as triton_chunk
from mhla.ops.mhla.triton import utils as triton_utils
from scripts.bench_ops import (
    copy_bandwidth_gbps,
    forward_backward_call,
    forward_call,
    make_case,
    measurement,
    quartiles,
    timer,
    write_measured,
)
from tasks.common.utils import system_info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TILE_CAPS = (64, 128)
PER_CALL_OPS = ("mhla", "mhla_torch", "sdpa")


@contextlib.contextmanager
def feature_tile_cap(cap: int):
    """Within the block, the Triton kernels pick feature tiles of at most ``cap`` (the kernels' own cap is
    :data:`mhla.ops.mhla.triton.utils.MAX_TILE`). The autotune key holds the tile sizes, so each cap compiles
    and tunes its own kernels."""
    chosen = triton_chunk.feature_tile
    triton_chunk.feature_tile = lambda dim: triton_utils.feature_tile(dim, max_tile=cap)
    try:
        yield
    finally:
        triton_chunk.feature_tile = chosen


def case_args(args, dim: int) -> argparse.Namespace:
    """The options :func:`scripts.bench_ops.make_case` reads, for head dimension ``dim``."""
    return argparse.Namespace(batch=args.batch, heads=args.heads, dim=dim, dtype=args.dtype, block=args.block,
                              backend="triton")


def max_diff_to_torch(fn, params, causal: bool, C: int) -> float:
    """Largest |output - torch path's output| on the case's inputs (blocks of ``C`` tokens; the tile changes the
    summation order)."""
    q, k, v, mix = params
    with torch.no_grad():
        ref = mhla.mhla_attention(q, k, v, mix, C, causal=causal, backend="torch").float()
        return (fn().float() - ref).abs().max().item()


def timed(call, device: str, repeats: int) -> dict:
    """Median and [p25, p75] milliseconds of ``call`` after two warm-up calls."""
    timer(call, device, 2)
    ts = timer(call, device, repeats)
    return {"ms": statistics.median(ts), "ms_iqr": quartiles(ts)}


@contextlib.contextmanager
def all_v_kernels(on: bool):
    """Within the block, the causal kernels may (``on``) or may not take their ``all_v`` form."""
    kept = triton_chunk.ALL_V_KERNELS
    triton_chunk.ALL_V_KERNELS = on
    try:
        yield
    finally:
        triton_chunk.ALL_V_KERNELS = kept


def tile_variants(dim: int, causal: bool, dtype: torch.dtype) -> list[tuple[int, bool]]:
    """``(tile cap, all_v)`` cases of the tile probe: each cap, and at cap 64 the ``all_v`` kernels off too where
    the causal kernels would take them (``chunk.all_v_tiles``)."""
    out = []
    for cap in TILE_CAPS:
        out.append((cap, True))
        if causal and cap == triton_utils.MAX_TILE:
            q = torch.zeros(1, 1, 1, dim)
            if triton_chunk.all_v_tiles(triton_chunk.Geometry.make(q, q, 64), dtype):
                out.append((cap, False))
    return out


def probe_tiles(args) -> list[dict]:
    """One record per (D, causal, tile cap, all_v): the feature tile used, the difference to the torch path, and
    forward / fwd+bwd times; a cap the kernels cannot compile becomes a ``failed`` record."""
    rows = []
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    for dim in args.dims:
        cargs = case_args(args, dim)
        for causal in (False, True):
            for cap, all_v in tile_variants(dim, causal, dtype):
                row = {"D": dim, "causal": causal, "T": args.tile_len, "tile_cap": cap, "all_v": all_v,
                       "feature_tile": triton_utils.feature_tile(dim, max_tile=cap)}
                try:
                    with feature_tile_cap(cap), all_v_kernels(all_v):
                        fn, params, info = make_case("mhla", causal, args.tile_len, cargs, args.device)
                        grad = torch.randn_like(params[2])
                        row.update(M=info["M"], block_size=info["block_size"],
                                   max_abs_diff_to_torch=max_diff_to_torch(fn, params, causal,
                                                                            info["block_size"]))
                        fwd = timed(forward_call(fn), args.device, args.repeats)
                        both = timed(forward_backward_call(fn, params, grad), args.device, args.repeats)
                    row.update(fwd_ms=fwd["ms"], fwd_ms_iqr=fwd["ms_iqr"], fwdbwd_ms=both["ms"],
                               fwdbwd_ms_iqr=both["ms_iqr"])
                except (RuntimeError, ValueError) as e:  # a tile that does not fit: out of resources
                    row["failed"] = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    return rows


def host_ms(call, device: str, repeats: int) -> float:
    """Median host milliseconds to issue one call (the device synchronised before each, not after)."""
    out = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        out.append((time.perf_counter() - t) * 1e3)
    if device == "cuda":
        torch.cuda.synchronize()
    return statistics.median(out)


def kernel_profile(call, device: str, calls: int, top: int = 8) -> dict:
    """Device kernels per call and their summed milliseconds per call (``torch.profiler`` over ``calls``
    calls), with the ``top`` kernels by time; on a CPU there are no device kernels (None)."""
    if device != "cuda":
        return {"kernels_per_call": None, "kernel_ms_per_call": None, "top_kernels": []}
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name, []).append(e.time_range.elapsed_us() / 1e3)
    total = sum(sum(v) for v in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"kernels_per_call": sum(len(v) for v in kernels.values()) / calls,
            "kernel_ms_per_call": total / calls,
            "top_kernels": [{"name": n[:100], "per_call": len(v) / calls, "ms_per_call": sum(v) / calls}
                            for n, v in ranked]}


def probe_per_call(args) -> list[dict]:
    """One record per (T, op, forward | fwd+bwd): time per call, host time to issue it, kernels and their
    time per call, and ``kernel_share`` (kernel time over call time)."""
    rows = []
    cargs = case_args(args, args.dims[0])
    for T in args.call_lens:
        for op in PER_CALL_OPS:
            fn, params, _ = make_case(op, False, T, cargs, args.device)
            grad = torch.randn_like(params[2])
            for kind, call in (("fwd", forward_call(fn)), ("fwdbwd", forward_backward_call(fn, params, grad))):
                row = {"T": T, "op": op, "pass": kind, "D": cargs.dim, **timed(call, args.device, args.repeats)}
                row["host_ms"] = host_ms(call, args.device, args.repeats)
                row.update(kernel_profile(call, args.device, calls=args.profile_calls))
                if row["kernel_ms_per_call"] is not None:
                    row["kernel_share"] = row["kernel_ms_per_call"] / row["ms"]
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}), flush=True)
    return rows


def to_markdown(out: dict) -> str:
    h, s = out["header"], out["settings"]
    lines = [f"# Kernel probes ({h.get('gpu') or h.get('cpu', h['device'])})", "",
             f"Command: `{out['command']}`", "",
             f"Machine: {h.get('gpu') or h.get('cpu', '?')}, torch {h.get('torch')}, {h.get('date')}; load "
             f"average {h.get('loadavg_start')} at the start, {h.get('loadavg_end')} at the end"
             + (f"; copy bandwidth {h['copy_bandwidth_GBps']} GB/s." if "copy_bandwidth_GBps" in h else "."),
             "", f"Settings: B {s['batch']}, H {s['heads']}, {s['dtype']}, locality mixing; times are medians "
             f"of {s['repeats']} calls after 2 warm-up calls (CUDA events on a GPU).", ""]
    if s["device"] != "cuda":
        lines += ["NOTE: a CPU smoke run (Triton interpreter): the times mean nothing.", ""]
    if out.get("tiles"):
        lines += ["## Feature tile cap (Triton MHLA)", "",
                  "| D | causal | T | tile cap | tile | all_v kernels allowed | max abs diff to torch | fwd ms | "
                  "fwd+bwd ms |", "|---|---|---|---|---|---|---|---|---|"]
        for r in out["tiles"]:
            tail = (f"failed: {r['failed']} | | |" if "failed" in r else
                    f"{r['max_abs_diff_to_torch']:.2e} | {r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} |")
            lines.append(f"| {r['D']} | {r['causal']} | {r['T']} | {r['tile_cap']} | {r['feature_tile']} | "
                         f"{r.get('all_v', True)} | {tail}")
        lines.append("")
    if out.get("per_call"):
        lines += ["## Per-call cost (non-causal)", "",
                  "| T | op | pass | ms per call | host ms to issue | kernels per call | kernel ms per call | "
                  "kernel share |", "|---|---|---|---|---|---|---|---|"]
        for r in out["per_call"]:
            k = r["kernel_ms_per_call"]
            lines.append(f"| {r['T']} | {r['op']} | {r['pass']} | {r['ms']:.3f} | {r['host_ms']:.3f} | "
                         + (f"{r['kernels_per_call']:g} | {k:.3f} | {r['kernel_share']:.2f} |" if k is not None
                            else "n/a | n/a | n/a |"))
        lines.append("")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--only", choices=["tiles", "per_call"], help="one probe (default: both)")
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128], help="head dims of the tile probe; the "
                   "per-call probe uses the first")
    p.add_argument("--tile-len", type=int, default=16384, help="T of the tile probe")
    p.add_argument("--call-lens", type=int, nargs="+", default=[1024, 4096], help="T of the per-call probe")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--block", type=int, default=64, help="causal block size")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--profile-calls", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="smoke-test sizes (B 1, H 2, D 32, T 64)")
    p.add_argument("--allow-busy", action="store_true", help="write a run made on a busy machine, marked BUSY")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "results", "bench"))
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (on a CPU only --device cpu --quick, a smoke test)")
    if args.device == "cpu" and not args.quick:
        p.error("on a CPU the Triton kernels run in the interpreter, so only --quick (a smoke test) is allowed")
    if args.quick:
        args.batch, args.heads, args.dims, args.tile_len, args.call_lens = 1, 2, [32], 64, [64]
        args.repeats, args.profile_calls = 3, 1
        args.dtype = "fp32" if args.device == "cpu" else args.dtype
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    given = argv if argv is not None else sys.argv[1:]
    header = system_info(args.device)
    if args.device == "cuda":
        header["copy_bandwidth_GBps"] = round(copy_bandwidth_gbps("cuda"), 1)
    print("machine:", json.dumps(header), flush=True)
    settings = {k: v for k, v in vars(args).items() if k != "out_dir"}
    out = {"header": header, "command": "python scripts/probe_kernels.py " + " ".join(given),
           "settings": settings}
    with measurement(args) as load:
        if args.only in (None, "tiles"):
            out["tiles"] = probe_tiles(args)
        if args.only in (None, "per_call"):
            out["per_call"] = probe_per_call(args)
    stem = os.path.join(args.out_dir, f"probe_kernels_{args.device}" + ("_quick" if args.quick else ""))
    if not write_measured(stem, out, to_markdown, None, load, args):
        return 2
    print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
