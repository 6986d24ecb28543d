#!/usr/bin/env python
"""Benchmark the attention ops: MHLA vs plain linear attention vs softmax (SDPA), forward and fwd+bwd.

    python scripts/bench_ops.py                  # CPU, T in {1k, 4k, 16k, 64k}; ~5-10 min on 2 cores
    python scripts/bench_ops.py --quick          # tiny smoke run
    python scripts/bench_ops.py --ops mhla linear --seq-lens 4096   # a subset (writes ops_cpu_mhla-linear.*)
    python scripts/bench_ops.py --device cuda    # GPU: CUDA-event timing, peak memory from the allocator
    python scripts/bench_ops.py --varlen         # variable-length batches (below); --quick: total_T 512

Non-causal: MHLA (torch backend, locality mixing, M blocks with M^2 <= T), linear attention, SDPA.
Causal: MHLA chunkwise (block 64), our chunkwise linear attention, the plain chunked causal linear attention
(``plain_linear``: the textbook form in a dozen tensor ops, no checks or state; the anchor of the ratios),
SDPA causal, and a reimplementation of the authors' release's form (python loops over 64-token chunks; checked
equal to ours before timing).

On CPU each case runs in a fresh subprocess; on CUDA all cases run in one process (``--in-process``: a
subprocess per case costs ~15 s of start-up and Triton autotuning, which would spend a rented GPU's time) and
``<stem>.partial.json`` keeps the records measured so far, so a run cut short by a time limit loses nothing.
Time: median (and p25-p75) over repeated runs after warm-up (wall
clock with ``time.perf_counter`` on CPU; CUDA events on GPU). Memory: on CPU the growth of the process's peak
RSS (``ru_maxrss``) over the fwd+bwd runs, relative to the RSS after the inputs were made; on GPU
``torch.cuda.max_memory_allocated`` minus the inputs. Cases whose estimated time exceeds ``--max-case-s``
are skipped and marked with the estimate. Writes ``results/bench/ops_<device>.json``, ``.md`` and ``.png`` (time
and memory against T per op, log-log); ``--plot-only`` redraws the ``.png`` from the ``.json``.

Load (every mode): :class:`tasks.common.records.Measurement` around the run (commit, 1-minute load before
and after, other processes' CPU share), stored as ``measurement``; a CPU run refuses to start on a busy machine
and a busy run is not written (exit status 2) unless ``--allow-busy``, which writes it marked BUSY
(``tasks.common.results.write_result``). Each case also keeps its own ``other_cpu_frac`` (flagged "busy").

``--varlen``: causal MHLA on a packed batch of N documents (``--num-docs``, default 8; a seeded uniform split
of total_T, document lengths not multiples of the block, one 5-token document), ``--seq-lens`` the total
lengths (default 4096 16384 on CPU, 16384 65536 on GPU, 512 with ``--quick``), batch 1, for backend
``torch`` and ``auto`` where that resolves to another backend (the fused kernels on CUDA). Three ways,
forward and fwd+bwd: (a) one call with ``cu_seqlens`` on ``[1, total_T, H, D]``; (b) one call on the
concatenation without ``cu_seqlens`` (the cost floor, not the same result); (c) a Python loop of one call
per document (the same result as (a)). Before timing, max |a - c| (outputs; gradients relative) is measured
and stored; a case above the tolerance is not timed and the run exits 1. Timing is in-process (no
subprocess per case, no memory): the three ways timed in turn, round by round, median over the rounds.
Writes ``results/bench/varlen_<device>[_quick].json`` and ``.md`` (ratios a/b, c/a; load average).

``--causal-overhead``: the per-call cost of the causal torch path, side by side in one process: causal MHLA
(``backend="torch"``), the project's causal linear attention and the plain chunked form
(:func:`plain_chunked_linear`, the anchor), fwd and fwd+bwd, timed in turn round by round (as ``--varlen``),
at ``--seq-lens`` (default 1024 4096 16384), B 1, H 4, D 64, block 64 unless given. Writes
``results/bench/causal_overhead_<device>[_quick]`` .json and .md with the ratios to the plain form and the
load average before and after.
"""

from __future__ import annotations

import argparse
import functools
import gc
import inspect
import itertools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import mhla
from mhla.mixing import distances_1d, mixing_init
from mhla.ops.utils import bucket_sequences, default_call_cost_tokens
from tasks.common.fileio import atomic_write
from tasks.common.results import BusyMachine, write_result
from tasks.common.plots import colors_for, loglog_lines, pyplot, save_figure
from tasks.common.records import Measurement, busy_cpu_s, own_cpu_s
from tasks.common.utils import system_info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OPS = {
    False: ["mhla", "mhla_torch", "linear", "sdpa"],
    True: ["mhla", "mhla_torch", "linear", "plain_linear", "fla_linear", "sdpa", "release_loop"],
}
TIME_METHOD = ("each case in a fresh subprocess; one fwd+bwd at full size as warm-up, then the median (and "
               "p25-p75) over N runs, N = min(--repeats, --budget-s / first run), at least 3; CPU wall clock "
               "(time.perf_counter), GPU CUDA events. fwd runs under torch.no_grad(); fwd+bwd backpropagates "
               "a fixed random output gradient to q, k, v (and the mixing matrix for MHLA / release loop).")
TIME_METHOD_IN_PROCESS = TIME_METHOD.replace("each case in a fresh subprocess", "all cases in one process "
                                              "(--in-process), the allocator's peak reset per case")
MEMORY_METHOD = ("CPU: growth of the subprocess's peak RSS (getrusage ru_maxrss) over the fwd and fwd+bwd "
                 "runs, relative to the peak after a small warm-up run and the inputs were made (coarse: "
                 "includes allocator caching, not the inputs); GPU: torch.cuda.max_memory_allocated minus "
                 "the memory allocated before the runs.")


BUSY_WARN = 0.10  # flag a case when other processes used more than this fraction of the CPUs meanwhile



def forward_call(fn):
    """A timed call of ``fn`` (no arguments) without autograd."""
    def run():
        with torch.no_grad():
            fn()
    return run


def forward_backward_call(fn, params, grad):
    """A timed forward + backward of ``fn``: the gradients of ``params`` cleared, then ``fn().backward(grad)``."""
    def run():
        for p in params:
            p.grad = None
        fn().backward(grad)
    return run

def measurement(args) -> Measurement:
    """The load guard of a run (:class:`tasks.common.records.Measurement`; other processes' CPU share counts
    on a CPU). ``args.threads`` (0 or absent: torch's own count) is the CPU run's thread count."""
    threads = getattr(args, "threads", 0) or torch.get_num_threads()
    return Measurement(threads=1 if args.device == "cuda" else threads,
                       watch_other_cpu=args.device == "cpu")


def write_measured(stem: str, out: dict, markdown, plot, load: Measurement, args) -> bool:
    """``<stem>`` .json / .md (``markdown(out)``) / .png (``plot``, or None) through
    :func:`tasks.common.results.write_result` with the run's measurement (its loads also go to the header's
    ``loadavg_start`` / ``loadavg_end``, which the tables quote); False (nothing written, the reason printed)
    when the machine was busy and not ``--allow-busy``."""
    out["header"].update(loadavg_start=load.record["load_before"], loadavg_end=load.record["load_after"])
    try:
        write_result(stem, markdown(out), out, plot, measurement=load.record, allow_busy=args.allow_busy,
                     indent=2)
    except BusyMachine as e:
        print(e, file=sys.stderr)
        return False
    return True


# ---------------------------------------------------------------------------------------- the ops
def release_loop_causal(q, k, v, mixing, chunk: int):
    """The authors' release's causal form, re-implemented: python loops over chunks, no normalizer.

    q, k: [B, T, H, D]; v: [B, T, H, Dv]; mixing [n, n] lower-triangular over chunks.
    """
    B, T, H, D = q.shape
    n = math.ceil(T / chunk)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, d]
    summaries, outs = [], []
    for i in range(n):
        sl = slice(i * chunk, min(T, (i + 1) * chunk))
        qi, ki, vi = qh[:, :, sl], kh[:, :, sl], vh[:, :, sl]
        prefix = torch.zeros(B, H, D, v.shape[-1], dtype=q.dtype, device=q.device)
        for b in range(i):
            prefix = prefix + mixing[i, b] * summaries[b]
        c = qi.shape[2]
        mask = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        intra = (qi @ ki.transpose(-1, -2)).masked_fill(~mask, 0.0) @ vi
        outs.append(qi @ prefix + mixing[i, i] * intra)
        summaries.append(ki.transpose(-1, -2) @ vi)
    return torch.cat(outs, dim=2).transpose(1, 2)


def plain_chunked_linear(q, k, v, chunk: int, eps: float = 1e-6):
    """Normalised causal linear attention in the plain chunked form, the anchor of the causal per-call cost:
    per chunk of ``chunk`` tokens the masked scores and the exclusive prefix sums of the chunk summaries, in a
    dozen tensor ops, with no input checks, no state and no guard for non-finite values.

    q, k: ``[B, T, H, D]`` (nonnegative); v: ``[B, T, H, Dv]``; ``T`` a multiple of ``chunk`` or not (zero
    padding). Returns ``[B, T, H, Dv]``."""
    B, T, H, D = q.shape
    n = math.ceil(T / chunk)
    pad = n * chunk - T

    def blocks(x):  # [B, T, H, d] -> [B, H, n, chunk, d]
        if pad:
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
        return x.reshape(B, n, chunk, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    S = kb.transpose(-1, -2) @ vb  # [B, H, n, D, Dv]
    z = kb.sum(-2)  # [B, H, n, D]
    prefix_s, prefix_z = S.cumsum(2) - S, z.cumsum(2) - z
    mask = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    scores = (qb @ kb.transpose(-1, -2)).masked_fill(~mask, 0.0)
    num = qb @ prefix_s + scores @ vb
    den = (qb @ prefix_z.unsqueeze(-1)).squeeze(-1) + scores.sum(-1)
    out = num / (den.unsqueeze(-1) + eps)
    return out.permute(0, 2, 3, 1, 4).reshape(B, n * chunk, H, -1)[:, :T]


def check_plain_equivalence() -> float:
    """Max |plain chunked form - mhla.linear_attention(causal=True)| on a small input (fp64)."""
    g = torch.Generator().manual_seed(2)
    q, k = (torch.rand(2, 203, 3, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 203, 3, 8, generator=g, dtype=torch.float64)
    diff = plain_chunked_linear(q, k, v, 64) - mhla.linear_attention(q, k, v, causal=True)
    return diff.abs().max().item()


def choose_num_blocks(T: int) -> int:
    """Largest power-of-4 square count M (so 2-D grids would split evenly) with M^2 <= T, at least 1."""
    m = 1
    while (m * 4) ** 2 <= T and T % (m * 4) == 0:
        m *= 4
    return m


def with_half_summaries(fn):
    """``fn`` called with ``MHLA_SUMMARY_DTYPE=input`` (the Triton kernels' opt-in half block summaries; read at
    each forward call, whose backward keeps the dtype it chose), the variable restored after."""
    from mhla.ops.mhla.triton.utils import SUMMARY_DTYPE_ENV  # noqa: PLC0415

    def call():
        old = os.environ.get(SUMMARY_DTYPE_ENV)
        os.environ[SUMMARY_DTYPE_ENV] = "input"
        try:
            return fn()
        finally:
            if old is None:
                os.environ.pop(SUMMARY_DTYPE_ENV, None)
            else:
                os.environ[SUMMARY_DTYPE_ENV] = old
    return call


@dataclass(frozen=True)
class Case:
    """The inputs of one benchmark case, which :attr:`BenchOp.build` turns into a call: q, k (nonnegative
    features unless the op takes raw scores), v ``[B, T, H, D]``; ``mix`` the dense locality mixing ``[M, M]``
    (causal: ``M = ceil(T / block)``); ``block`` the block size."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mix: torch.Tensor
    block: int
    causal: bool
    T: int
    args: argparse.Namespace
    device: str


@dataclass(frozen=True)
class BenchOp:
    """One op of the benchmarks (``scripts/bench_ops.py``, ``scripts/gpu_campaign.py``): how a case's call is
    built and what the scripts need to know of the op, so that no script dispatches on the op's name.

    build: ``Case -> (fn, params, info)``: a call without arguments, the tensors it takes gradients for, and
        what the record should say of it (backend, learned blocks, ...).
    label: the op in plots. complexity: growth exponent in T for the skip estimates.
    gpu_only: runs only on a GPU (fla's Triton kernels) or only makes sense there.
    features: q and k are nonnegative feature maps (False: softmax's raw scores).
    mixing: the mixing the op reads (``"dense"``: the ``[M, M]`` matrix; ``"window"``: the LM's compact rows;
        None: none); its records show M and the block size.
    triton: the call goes through MHLA's Triton kernels where the backend resolves to them (the campaign checks
        them against the torch path and sets the traffic model beside the time).
    half_of: this op is ``half_of`` with the kernels' opt-in half block summaries (:func:`with_half_summaries`).
    needs_fla: the op is flash-linear-attention's (skipped, with the reason, where ``fla`` does not import).
    """
    label: str
    build: Callable[[Case], tuple] | None = None
    complexity: int = 1
    gpu_only: bool = False
    features: bool = True
    mixing: str | None = None
    triton: bool = False
    half_of: str | None = None
    needs_fla: bool = False


def make_case(op: str, causal: bool, T: int, args, device):
    """``(fn, params, info)`` of op ``op`` (:data:`BENCH_OPS`) on seeded inputs of length ``T``: ``fn()`` the
    call, ``params`` the tensors backpropagated to, ``info`` the case's block size, M and what the op adds."""
    spec = BENCH_OPS[op]
    if spec.half_of:  # the same case, its forward with the opt-in half summaries
        fn, params, info = make_case(spec.half_of, causal, T, args, device)
        return with_half_summaries(fn), params, {**info, "summaries": "input dtype"}
    g = torch.Generator(device="cpu").manual_seed(0)
    B, H, D = args.batch, args.heads, args.dim
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]

    def rand(*shape, pos=False):
        x = torch.randn(*shape, generator=g)
        x = torch.relu(x) + 1e-6 if pos else x
        return x.to(device=device, dtype=dtype).requires_grad_()

    q, k = rand(B, T, H, D, pos=spec.features), rand(B, T, H, D, pos=spec.features)
    v = rand(B, T, H, D)
    if causal:
        C = args.block
        n = math.ceil(T / C)
        mix = mixing_init("locality", distances_1d(n), causal=True).to(device=device, dtype=dtype)
        info = {"block_size": C, "M": n}
    else:
        M = choose_num_blocks(T)
        C = T // M
        mix = mixing_init("locality", distances_1d(M)).to(device=device, dtype=dtype)
        info = {"block_size": C, "M": M}
    mix.requires_grad_()
    fn, params, extra = spec.build(Case(q, k, v, mix, C, causal, T, args, device))
    return fn, params, {**info, **extra}


def _mhla_case(c: Case, backend: str | None = None):
    backend = backend or c.args.backend
    return (lambda: mhla.mhla_attention(c.q, c.k, c.v, c.mix, c.block, causal=c.causal, backend=backend),
            [c.q, c.k, c.v, c.mix], {"backend": mhla.ops.resolve_backend(backend, c.q, causal=c.causal)})


def _mhla_window_case(c: Case):
    rows = window_mixing_rows(math.ceil(c.T / c.block), c.device, c.q.dtype)
    fn = lambda: mhla.mhla_attention(c.q, c.k, c.v, rows, c.block, causal=True, backend=c.args.backend)  # noqa: E731
    return (fn, [c.q, c.k, c.v, rows.diag, rows.head, rows.recent, rows.far],
            {"backend": mhla.ops.resolve_backend(c.args.backend, c.q, causal=True), "learned_blocks": WINDOW_BLOCKS})


def _qkv_case(make):
    """A case of an op that takes q, k, v only: ``make(case)`` returns its call."""
    return lambda c: (make(c), [c.q, c.k, c.v], {})


def fla_linear_attention(q, k, v):
    """flash-linear-attention's chunked (causal, normalised) linear attention, ``[B, T, H, D]`` layout.

    Raises ImportError when ``fla`` is not installed (the case is then reported as skipped)."""
    from fla.ops.linear_attn import chunk_linear_attn  # noqa: PLC0415

    kw = {"normalize": True}
    if "head_first" in inspect.signature(chunk_linear_attn).parameters:
        kw["head_first"] = False
    return lambda: chunk_linear_attn(q, k, v, scale=1.0, **kw)[0]


def fla_simple_gla(q, k, v):
    """flash-linear-attention's ``chunk_simple_gla`` without gates: unnormalised causal linear attention, the
    plainest chunked kernel (``[B, T, H, D]``). Raises ImportError when ``fla`` is not installed."""
    from fla.ops.simple_gla import chunk_simple_gla  # noqa: PLC0415

    return lambda: chunk_simple_gla(q, k, v, scale=1.0)[0]


WINDOW_BLOCKS = 32  # learned mixing rows of op "mhla_window": the 340M LM's 2048-token context / 64-token chunks


def window_mixing_rows(num_blocks: int, device, dtype):
    """The compact causal mixing rows of op ``mhla_window`` (the LM's setting): :data:`WINDOW_BLOCKS` learned
    rows (uniform init) extended by ``uniform_far`` (a bounded window, the far blocks folded into one sum), for
    ``num_blocks`` blocks (:meth:`mhla.mixing.MixingMatrix.causal_rows`), as leaf tensors that take gradients."""
    from mhla.mixing import MixingMatrix  # noqa: PLC0415

    rows = MixingMatrix(WINDOW_BLOCKS, causal=True, init="uniform").causal_rows(0, num_blocks)
    return mhla.ops.MixingRows(rows.first, *(t.detach().to(device=device, dtype=dtype).requires_grad_()
                                             for t in (rows.diag, rows.head, rows.recent, rows.far)))


def sdpa_call(q, k, v, causal: bool, device: str):
    """SDPA; on CUDA pinned to the FlashAttention backend (an error if it cannot run these inputs)."""
    if device != "cuda":
        return lambda: mhla.softmax_attention(q, k, v, causal=causal)
    def fn():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return mhla.softmax_attention(q, k, v, causal=causal)

    return fn


#: every op the benchmarks can time, by the name ``--ops`` and the records use
BENCH_OPS: dict[str, BenchOp] = {
    "mhla": BenchOp("MHLA", _mhla_case, mixing="dense", triton=True),
    "mhla_torch": BenchOp("MHLA (torch path)", functools.partial(_mhla_case, backend="torch"), gpu_only=True,
                          mixing="dense"),
    "mhla_window": BenchOp("MHLA, LM window", _mhla_window_case, mixing="window", triton=True),
    "mhla_half": BenchOp("MHLA, half summaries", gpu_only=True, mixing="dense", triton=True, half_of="mhla"),
    "mhla_window_half": BenchOp("MHLA, LM window, half summaries", gpu_only=True, mixing="window", triton=True,
                                half_of="mhla_window"),
    "linear": BenchOp("linear", _qkv_case(lambda c: lambda: mhla.linear_attention(c.q, c.k, c.v,
                                                                                  causal=c.causal))),
    "plain_linear": BenchOp("linear (plain chunked)",
                            _qkv_case(lambda c: lambda: plain_chunked_linear(c.q, c.k, c.v, c.args.block))),
    "fla_linear": BenchOp("linear (fla)", _qkv_case(lambda c: fla_linear_attention(c.q, c.k, c.v)), gpu_only=True,
                          needs_fla=True),
    "fla_simple_gla": BenchOp("simple GLA (fla, no gates)", _qkv_case(lambda c: fla_simple_gla(c.q, c.k, c.v)),
                              gpu_only=True, needs_fla=True),
    "sdpa": BenchOp("SDPA (softmax)", _qkv_case(lambda c: sdpa_call(c.q, c.k, c.v, c.causal, c.device)),
                    complexity=2, features=False),
    "release_loop": BenchOp("MHLA, release's loop",
                            lambda c: (lambda: release_loop_causal(c.q, c.k, c.v, c.mix, c.block),
                                       [c.q, c.k, c.v, c.mix], {}), complexity=2, mixing="dense"),
}


def copy_bandwidth_gbps(device: str, nbytes: int = 2**30, repeats: int = 20) -> float:
    """Measured device copy bandwidth (read + write bytes per second, GB/s): the roofline of a memory-bound op.

    ``dst.copy_(src)`` of ``nbytes``; median of ``repeats`` timed copies after a warm-up."""
    n = nbytes // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = timer(lambda: dst.copy_(src), device, repeats)
    return 2 * nbytes / (statistics.median(times) / 1e3) / 1e9


def min_bytes_moved(rec: dict, args) -> int:
    """Bytes a forward must at least move: read q, k, v and write o (``[B, T, H, D]`` each)."""
    elem = {"fp32": 4, "bf16": 2, "fp16": 2}[args.dtype]
    return 4 * args.batch * rec["T"] * args.heads * args.dim * elem


def timer(fn, device: str, repeats: int) -> list[float]:
    """Milliseconds per call of ``fn`` (CUDA events on GPU, perf_counter on CPU)."""
    out = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return out


def run_case(op: str, causal: bool, T: int, args, passes=("fwd", "fwdbwd")) -> dict:
    """Time one case in this process (called in a subprocess by :func:`main`). ``passes``: which of ``fwd``
    and ``fwdbwd`` to time (scripts/gpu_campaign.py times the forwards of every case before any backward); the
    record holds ``<pass>_ms`` and ``<pass>_ms_iqr`` for those only."""
    torch.set_num_threads(args.threads or torch.get_num_threads())
    device = args.device
    backward = "fwdbwd" in passes
    # Warm the runtime (autograd threads, allocator pools) on a small input so the memory baseline below
    # does not charge one-off start-up costs to the case.
    wfn, wparams, _ = make_case(op, causal, min(T, 256), args, device)
    if backward:
        wout = wfn()
        wout.backward(torch.randn_like(wout))
    else:
        with torch.no_grad():
            wout = wfn()
    del wfn, wparams, wout
    fn, params, info = make_case(op, causal, T, args, device)
    # output gradient made without running the op, so the baseline below excludes the op's memory
    grad = torch.randn(args.batch, T, args.heads, args.dim, device=device, dtype=params[2].dtype)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_gpu = torch.cuda.memory_allocated()

    def fwd():
        with torch.no_grad():
            fn()

    def fwdbwd():
        for p in params:
            p.grad = None
        fn().backward(grad)

    # warm-up and a first measurement to size the number of repeats
    first = timer(fwdbwd if backward else fwd, device, 1)[0]
    repeats = max(3, min(args.repeats, int(args.budget_s * 1e3 / max(first, 1e-3))))
    times = {name: timer(call, device, repeats) for name, call in (("fwd", fwd), ("fwdbwd", fwdbwd))
             if name in passes}
    if device == "cuda":
        peak_mb = (torch.cuda.max_memory_allocated() - base_gpu) / 2**20
    else:
        peak_mb = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) / 1024
    timed = {}
    for name, ts in times.items():
        timed.update({f"{name}_ms": statistics.median(ts), f"{name}_ms_iqr": quartiles(ts)})
    return {"op": op, "causal": causal, "T": T, **info, **timed, "peak_mem_mb": peak_mb, "repeats": repeats}


def quartiles(xs: list[float]) -> list[float]:
    """[p25, p75] of the timings (the run-to-run spread; a 2-core VM is noisy)."""
    if len(xs) < 2:
        return [xs[0], xs[0]]
    q = statistics.quantiles(xs, n=4)
    return [q[0], q[2]]


def check_release_equivalence(args) -> float:
    """Max |ours - release loop| on a small input (fp64); the benchmark aborts if it is not ~0."""
    g = torch.Generator().manual_seed(1)
    q, k = (torch.rand(2, 203, 3, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 203, 3, 8, generator=g, dtype=torch.float64)
    mix = torch.rand(4, 4, generator=g, dtype=torch.float64).tril()
    ours = mhla.mhla_attention(q, k, v, mix, 64, causal=True, normalize=False, backend="torch")
    theirs = release_loop_causal(q, k, v, mix, 64)
    return (ours - theirs).abs().max().item()


# ------------------------------------------------------------------------------- variable-length batches
VARLEN_WAYS = {"a": "one variable-length call (cu_seqlens) on [1, total_T, H, D]",
               "b": "one ordinary call on the concatenation [1, total_T, H, D], no cu_seqlens "
                    "(the cost floor, not the same result)",
               "c": "a Python loop of one call per document (the same result as a)"}
VARLEN_TOL = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 1e-2}  # max |a - c| (outputs) before timing, else abort
VARLEN_SHORT_DOC = 5  # tokens of the one very short document of every split
VARLEN_TIME_METHOD = (
    "in-process (one process for all cases, no subprocess per case): one fwd+bwd of each way as warm-up, "
    "then N rounds, each timing (a), (b), (c) once in turn, so that load changes hit all three alike; "
    "N = min(--repeats, --budget-s / one round), at least 3; median (p25-p75 in the .json). CPU wall clock "
    "(time.perf_counter), GPU CUDA events. fwd under torch.no_grad(); fwd+bwd backpropagates a fixed random "
    "output gradient to q, k, v and the mixing matrix.")
VARLEN_PADDING_NOTE = (
    "How (a) runs (mhla.ops.utils.run_varlen, no states): the documents are sorted by length and cut into "
    "length buckets by a dynamic program that minimises padded tokens + call_cost_tokens x buckets "
    "(call_cost_tokens: the fixed cost of one op call in tokens, {cost} on {device}); each bucket runs as "
    "one right-padded batch [bucket size, longest in bucket, H, D] (a bucket of one: the document's own slice, "
    "unpadded), and the outputs are put back in the packed order. 'buckets': how many op calls (a) makes "
    "(their lengths below); 'padded / total_T': the tokens (a) computes over those of (b). Before the "
    "buckets, (a) padded every document to the longest ('N x max len / total_T') and cost 3.4x-8.3x (b) here "
    "(results of 2026-11-24). (b) is not the same computation: one sequence of total_T tokens, and on the "
    "torch path the cost per token grows with the sequence length (the mixing between blocks is quadratic in "
    "the number of blocks, and the mixing matrix's values are checked on every call), so documents run apart "
    "-- (a) and (c) -- can cost less than (b). (c) computes only the documents' own tokens, one call each.")


def varlen_lengths(total_T: int, num_docs: int, block: int, seed: int = 0) -> list[int]:
    """A fixed random split of ``total_T`` tokens into ``num_docs`` document lengths (all >= 1).

    Uniform random cut points (seeded), plus one very short document (:data:`VARLEN_SHORT_DOC` tokens, second
    in order); a length that is a multiple of ``block`` is moved by one token so that documents end inside
    blocks (the last one may still be a multiple by chance)."""
    if num_docs < 2 or total_T < VARLEN_SHORT_DOC + 2 * (num_docs - 1):
        raise ValueError(f"cannot split {total_T} tokens into {num_docs} documents (need N >= 2)")
    g = torch.Generator().manual_seed(seed)
    rest = total_T - VARLEN_SHORT_DOC
    cuts = sorted((torch.randperm(rest - 1, generator=g)[:num_docs - 2] + 1).tolist())
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, rest])]
    lengths.insert(1, VARLEN_SHORT_DOC)
    for i in range(len(lengths) - 1):
        if lengths[i] % block == 0 and lengths[i + 1] > 1:
            lengths[i] += 1
            lengths[i + 1] -= 1
    assert sum(lengths) == total_T and min(lengths) >= 1
    return lengths


def varlen_cases(args, total_T: int, backend: str, device: str):
    """The three ways (:data:`VARLEN_WAYS`) for one total length, as ``{"a": fn, "b": fn, "c": fn}``.

    Inputs from :func:`make_case` (causal MHLA, batch 1, mixing sized for the whole concatenation, which
    (a) and (c) read only the top-left of). Returns ``(fns, params, lengths, block)``."""
    _, params, info = make_case("mhla_torch", True, total_T, args, device)  # tensors only; backend set below
    q, k, v, mix = params
    C = info["block_size"]
    lengths = varlen_lengths(total_T, args.num_docs, C)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    bounds = list(itertools.pairwise(offsets))

    def call(x_q, x_k, x_v, **kw):
        return mhla.mhla_attention(x_q, x_k, x_v, mix, C, causal=True, backend=backend, **kw)

    fns = {"a": lambda: call(q, k, v, cu_seqlens=cu),
           "b": lambda: call(q, k, v),
           "c": lambda: torch.cat([call(q[:, s:e], k[:, s:e], v[:, s:e]) for s, e in bounds], dim=1)}
    return fns, params, lengths, C


def varlen_equality(fns, params, grad) -> dict:
    """Max |a - c| of the outputs, and of the gradients relative to their largest entry."""
    with torch.no_grad():
        fwd = (fns["a"]().float() - fns["c"]().float()).abs().max().item()
    grads = {}
    for way in ("a", "c"):
        for p in params:
            p.grad = None
        fns[way]().backward(grad)
        grads[way] = [p.grad.float().clone() for p in params]
    rel = max(((ga - gc).abs().max() / ga.abs().max().clamp_min(1e-30)).item()
              for ga, gc in zip(grads["a"], grads["c"]))
    return {"max_abs_diff_a_c": fwd, "grad_max_rel_diff_a_c": rel}


def time_round_robin(fns: dict, device: str, repeats: int) -> dict[str, list[float]]:
    """``repeats`` rounds, each timing every function once (:func:`timer`), in turn."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            out[name] += timer(fn, device, 1)
    return out


def varlen_case(args, total_T: int, backend: str) -> dict:
    """Check (a) == (c), then time (a), (b), (c), forward and fwd+bwd, for one total length and backend."""
    device = args.device
    fns, params, lengths, C = varlen_cases(args, total_T, backend, device)
    grad = torch.randn(1, total_T, args.heads, args.dim, generator=torch.Generator().manual_seed(2))
    grad = grad.to(device=device, dtype=params[2].dtype)
    rec = {"backend": backend, "resolved_backend": mhla.ops.resolve_backend(backend, params[0], causal=True),
           "total_T": total_T, "N": len(lengths), "lengths": lengths, "block_size": C,
           "max_len": max(lengths), "pad_all_tokens": len(lengths) * max(lengths)}
    cost = default_call_cost_tokens(device)
    buckets = [[lengths[n] for n in g] for g in bucket_sequences(lengths, cost)]
    rec.update(call_cost_tokens=cost, buckets=buckets, padded_tokens=sum(len(g) * g[-1] for g in buckets))
    rec.update(varlen_equality(fns, params, grad))
    print(f"  {backend} total_T={total_T}: max |a - c| = {rec['max_abs_diff_a_c']:.2e} (outputs), "
          f"{rec['grad_max_rel_diff_a_c']:.2e} (gradients, relative)", flush=True)
    if rec["max_abs_diff_a_c"] > VARLEN_TOL[args.dtype]:
        return rec  # not timed: run_varlen reports the mismatch

    fwd = forward_call
    fwdbwd = functools.partial(forward_backward_call, params=params, grad=grad)

    busy0, own0, t0 = busy_cpu_s(), own_cpu_s(), time.monotonic()
    first = time_round_robin({w: fwdbwd(fn) for w, fn in fns.items()}, device, 1)  # warm-up, sizes repeats
    round_ms = max(sum(t[0] for t in first.values()), 1e-3)
    repeats = max(3, min(args.repeats, int(args.budget_s * 1e3 / round_ms)))
    for label, wrap in (("fwd", fwd), ("fwdbwd", fwdbwd)):
        times = time_round_robin({w: wrap(fn) for w, fn in fns.items()}, device, repeats)
        for way, ts in times.items():
            rec[f"{way}_{label}_ms"] = statistics.median(ts)
            rec[f"{way}_{label}_ms_iqr"] = quartiles(ts)
        rec[f"a_over_b_{label}"] = rec[f"a_{label}_ms"] / rec[f"b_{label}_ms"]
        rec[f"c_over_a_{label}"] = rec[f"c_{label}_ms"] / rec[f"a_{label}_ms"]
    busy1, own1, wall = busy_cpu_s(), own_cpu_s(), time.monotonic() - t0
    rec["repeats"] = repeats
    if busy0 is not None and busy1 is not None:
        other = max(0.0, (busy1 - busy0) - (own1 - own0))  # CPU seconds of other processes meanwhile
        rec["other_cpu_frac"] = round(other / (wall * (os.cpu_count() or 1)), 3)
    return rec


def varlen_backends(args) -> list[str]:
    """``torch``, and ``auto`` when it resolves to another backend on this device (the fused kernels)."""
    probe = torch.zeros(1, 1, 1, 1, device=args.device)
    return ["torch"] + (["auto"] if mhla.ops.resolve_backend("auto", probe, causal=True) != "torch" else [])


def run_varlen(args, command: str) -> int:
    """``--varlen``: the variable-length benchmark; writes ``<out-dir>/varlen_<device>[_quick]`` .json, .md.

    Returns the exit status: 1 when a case's (a) differs from its (c) (that case is not timed)."""
    torch.set_num_threads(args.threads or torch.get_num_threads())
    header = system_info(args.device)
    print("machine:", json.dumps(header))
    records, failed = [], []
    with measurement(args) as load:
        if load.refuses_to_start(args.allow_busy):
            return 2
        for backend in varlen_backends(args):
            for total_T in sorted(args.seq_lens):
                rec = varlen_case(args, total_T, backend)
                records.append(rec)
                if "a_fwd_ms" not in rec:
                    failed.append(rec)
                    print(f"ERROR: {backend} total_T={total_T}: the variable-length call differs from the "
                          f"per-document loop by {rec['max_abs_diff_a_c']:.2e} (> "
                          f"{VARLEN_TOL[args.dtype]:.0e}); not timed", file=sys.stderr)
                    continue
                ms = "; ".join(label + " " + " ".join(f"{w} {rec[f'{w}_{key}_ms']:.2f}" for w in "abc")
                               + " ms" for label, key in (("fwd", "fwd"), ("fwd+bwd", "fwdbwd")))
                print(f"{backend:6s} total_T={total_T:6d} N={rec['N']}: {ms}; "
                      f"a/b {rec['a_over_b_fwdbwd']:.2f}, c/a {rec['c_over_a_fwdbwd']:.2f} (fwd+bwd)", flush=True)
    keys = ("device", "heads", "dim", "dtype", "block", "num_docs", "seq_lens", "repeats", "budget_s",
            "threads", "quick")
    settings = {k: getattr(args, k) for k in keys}
    out = {"header": header, "command": command, "settings": settings, "ways": VARLEN_WAYS,
           "time_method": VARLEN_TIME_METHOD, "records": records}
    stem = os.path.join(args.out_dir, f"varlen_{args.device}" + ("_quick" if args.quick else ""))
    if not write_measured(stem, out, varlen_markdown, None, load, args):
        return 2
    print(f"wrote {stem}.json and .md")
    return 1 if failed else 0


def varlen_markdown(out: dict) -> str:
    """The ``.md`` of a ``--varlen`` run: machine line, the three ways, a row per backend and total length."""
    h, s = out["header"], out["settings"]
    la0, la1 = h.get("loadavg_start"), h.get("loadavg_end")

    def fmt(la):
        return "/".join(f"{x:.2f}" for x in la) if la else "n/a"

    machine = (f"Machine: {h.get('gpu') or h.get('cpu', '?')}, {h.get('cpu_count')} CPUs, "
               f"torch {h.get('torch')} ({h.get('torch_threads')} threads), {h.get('date')}; load average "
               f"(1/5/15 min) {fmt(la0)} at the start, {fmt(la1)} at the end.")
    lines = [f"# Variable-length batch: causal MHLA ({h['device']})", "", f"Command: `{out['command']}`", "",
             machine, ""]
    cpus = h.get("cpu_count") or 1
    if h["device"] == "cpu" and max((la0 or [0])[0], (la1 or [0])[0]) > 0.5 * cpus:
        lines += [(f"NOTE: the machine was loaded (load average above {0.5 * cpus:g} on {cpus} CPUs: other "
                   "jobs were running); absolute times are inflated and noisy, the ratios less so (the three "
                   "ways are timed in turn, round by round)."), ""]
    lines += [(f"Settings: H={s['heads']}, D={s['dim']}, {s['dtype']}, block C={s['block']}, "
               f"N={s['num_docs']} documents (seeded uniform split plus one {VARLEN_SHORT_DOC}-token "
               "document)."), ""]
    lines += [f"- ({w}) {d}" for w, d in out["ways"].items()] + ["", f"Time: {out['time_method']}", ""]
    costs = sorted({(r["call_cost_tokens"]) for r in out["records"]})
    lines += [VARLEN_PADDING_NOTE.format(cost="/".join(map(str, costs)), device=h["device"]), ""]
    busy = [r for r in out["records"] if r.get("other_cpu_frac", 0.0) > BUSY_WARN]
    if busy:
        worst = max(r["other_cpu_frac"] for r in busy)
        lines += [(f"WARNING: other processes used more than {BUSY_WARN:.0%} of the CPUs during {len(busy)} "
                   f"case(s) (worst {worst:.0%}), marked (busy)."), ""]
    lines += [("| backend | total_T | N | buckets | padded / total_T | N x max len / total_T | a fwd ms "
               "| b fwd ms | c fwd ms | a fwd+bwd ms | b fwd+bwd ms | c fwd+bwd ms | a/b fwd | a/b fwd+bwd "
               "| c/a fwd | c/a fwd+bwd | max abs diff a-c |"),
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["records"]:
        be = r["backend"] + (f" ({r['resolved_backend']})" if r["resolved_backend"] != r["backend"] else "")
        pad = f"{r['padded_tokens'] / r['total_T']:.2f} | {r['pad_all_tokens'] / r['total_T']:.2f}"
        head = f"| {be} | {r['total_T']} | {r['N']} | {len(r['buckets'])} | {pad} |"
        if "a_fwd_ms" not in r:
            lines.append(head + " not timed: a != c |" + " |" * 9 + f" {r['max_abs_diff_a_c']:.1e} |")
            continue
        flag = " (busy)" if r.get("other_cpu_frac", 0.0) > BUSY_WARN else ""
        ms = " | ".join(f"{r[f'{w}_{x}_ms']:.2f}" for x in ("fwd", "fwdbwd") for w in "abc")
        ratios = " | ".join(f"{r[k]:.2f}" for k in ("a_over_b_fwd", "a_over_b_fwdbwd", "c_over_a_fwd",
                                                     "c_over_a_fwdbwd"))
        lines.append(f"{head} {ms}{flag} | {ratios} | {r['max_abs_diff_a_c']:.1e} |")
    timed = [r for r in out["records"] if "a_fwd_ms" in r]
    if timed:
        lines += ["", "Result: " + "; ".join(
            f"{r['backend']} total_T={r['total_T']}: (a) costs {r['a_over_b_fwd']:.2f}x (b) forward and "
            f"{r['a_over_b_fwdbwd']:.2f}x fwd+bwd; (c) costs {r['c_over_a_fwd']:.2f}x / "
            f"{r['c_over_a_fwdbwd']:.2f}x (a)"
            for r in timed) + "."]
    lines += ["", "Document lengths (and the buckets of (a)):", ""]
    seen = set()
    for r in out["records"]:
        if (r["total_T"], r["call_cost_tokens"]) not in seen:
            seen.add((r["total_T"], r["call_cost_tokens"]))
            lines.append(f"- total_T={r['total_T']}: {r['lengths']}; buckets {r['buckets']}")
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------------------- main
def to_markdown(header: dict, records: list[dict], command: str, equiv: float) -> str:
    lines = [f"# Op benchmark ({header['device']})", "", f"Command: `{command}`", ""]
    lines += ["| machine | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in header.items()] + [""]
    lines.append(f"Release-loop form equals our causal MHLA (normalize=False) to {equiv:.1e} (fp64).")
    lines.append("")
    lines.append(f"Time: {TIME_METHOD}")
    lines.append("")
    lines.append(f"Memory: {MEMORY_METHOD}")
    lines.append("")
    if "copy_bandwidth_GBps" in header:
        lines.append(f"Roofline: measured copy bandwidth {header['copy_bandwidth_GBps']} GB/s (read + write of a "
                     "1 GiB bf16 tensor); '% of copy BW' = (bytes of q, k, v read + o written) / fwd time / that.")
        lines.append("")
    busy = [r for r in records if r.get("other_cpu_frac", 0.0) > BUSY_WARN]
    if busy:
        worst = max(r["other_cpu_frac"] for r in busy)
        lines.append(f"WARNING: other processes used more than {BUSY_WARN:.0%} of the CPUs during "
                     f"{len(busy)} case(s) (worst {worst:.0%}), marked (busy); their times are inflated. "
                     "Re-run on an idle machine.")
        lines.append("")
    for causal in (False, True):
        lines += [f"## {'Causal' if causal else 'Non-causal'}", "",
                  "| op | T | M | block | fwd ms | fwd+bwd ms | fwd+bwd p25-p75 | peak mem MB |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in records:
            if r["causal"] != causal:
                continue
            if r.get("skipped"):
                lines.append(f"| {r['op']} | {r['T']} | | | {r['skipped']} | | | |")
            else:
                spec = BENCH_OPS.get(r["op"])
                m, c = (r.get("M", ""), r.get("block_size", "")) if spec and spec.mixing else ("", "")
                iqr = r.get("fwdbwd_ms_iqr")
                spread = f"{iqr[0]:.1f}-{iqr[1]:.1f}" if iqr else "n/a"
                flag = " (busy)" if r.get("other_cpu_frac", 0.0) > BUSY_WARN else ""
                bw = f" ({r['fwd_frac_of_copy_bw']:.0%} of copy BW)" if "fwd_frac_of_copy_bw" in r else ""
                lines.append(f"| {r['op']} | {r['T']} | {m} | {c} | "
                             f"{r['fwd_ms']:.2f}{bw} | {r['fwdbwd_ms']:.2f}{flag} | {spread} | "
                             f"{r['peak_mem_mb']:.1f} |")
        lines += ["", "| T | MHLA / fastest linear (fwd+bwd) | SDPA / MHLA (fwd+bwd) | MHLA / plain chunked "
                  "linear (fwd+bwd) | linear / plain chunked linear (fwd+bwd) |", "|---|---|---|---|---|"]
        by = {(r["op"], r["T"]): r for r in records if r["causal"] == causal and not r.get("skipped")}
        for T in sorted({r["T"] for r in records}):
            m, sd, pl = by.get(("mhla", T)), by.get(("sdpa", T)), by.get(("plain_linear", T))
            linears = [by[(op, T)] for op in ("linear", "fla_linear") if (op, T) in by]
            lin = min(linears, key=lambda r: r["fwdbwd_ms"]) if linears else None
            a = f"{m['fwdbwd_ms'] / lin['fwdbwd_ms']:.2f}x" if m and lin else "n/a"
            b = f"{sd['fwdbwd_ms'] / m['fwdbwd_ms']:.1f}x" if m and sd else "n/a (SDPA skipped)"
            ours = by.get(("linear", T))
            c = f"{m['fwdbwd_ms'] / pl['fwdbwd_ms']:.2f}x" if m and pl else "n/a"
            d = f"{ours['fwdbwd_ms'] / pl['fwdbwd_ms']:.2f}x" if ours and pl else "n/a"
            lines.append(f"| {T} | {a} | {b} | {c} | {d} |")
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------- causal per-call cost, side by side
OVERHEAD_OPS = {"plain": "plain chunked causal linear attention (plain_chunked_linear; the anchor)",
                "mhla": "causal MHLA, mhla.mhla_attention(causal=True, backend='torch'), locality mixing",
                "linear": "the project's causal linear attention, mhla.linear_attention(causal=True)"}


OVERHEAD_TIME_METHOD = (
    "in-process (one process for all lengths): two fwd+bwd rounds of the three ops as warm-up, then N rounds,"
    " each timing the three once in turn, so that load changes hit all three alike; N = min(--repeats, "
    "--budget-s / one round), at least 3; median (p25-p75 in the .json). CPU wall clock (time.perf_counter), "
    "GPU CUDA events. fwd under torch.no_grad(); fwd+bwd backpropagates a fixed random output gradient to q, "
    "k, v (and MHLA's mixing).")


def overhead_fns(args, T: int):
    """The three ops of ``--causal-overhead`` on one set of inputs: ``({name: fn}, {name: params}, grad)``."""
    device = args.device
    _, params, info = make_case("mhla_torch", True, T, args, device)  # q, k, v nonnegative features, mixing
    q, k, v, mix = params
    C = info["block_size"]
    fns = {"plain": lambda: plain_chunked_linear(q, k, v, C),
           "mhla": lambda: mhla.mhla_attention(q, k, v, mix, C, causal=True, backend="torch"),
           "linear": lambda: mhla.linear_attention(q, k, v, causal=True, chunk_size=C)}
    ps = {"plain": [q, k, v], "mhla": [q, k, v, mix], "linear": [q, k, v]}
    grad = torch.randn(args.batch, T, args.heads, args.dim, generator=torch.Generator().manual_seed(3))
    return fns, ps, grad.to(device=device, dtype=q.dtype)


def run_causal_overhead(args, command: str) -> int:
    """``--causal-overhead``: causal MHLA and linear attention against the plain chunked form, timed in turn
    in one process; writes ``<out-dir>/causal_overhead_<device>[_quick]`` .json and .md. Returns the exit
    status (1 when the plain form does not equal the project's linear attention)."""
    torch.set_num_threads(args.threads or torch.get_num_threads())
    header = system_info(args.device)
    equiv = check_plain_equivalence()
    print("machine:", json.dumps(header), f"\nplain form == linear_attention to {equiv:.1e}", flush=True)
    if equiv > 1e-9:
        print("ERROR: the plain chunked form does not match mhla.linear_attention", file=sys.stderr)
        return 1
    records = []
    with measurement(args) as load:
        if load.refuses_to_start(args.allow_busy):
            return 2
        for T in sorted(args.seq_lens):
            fns, ps, grad = overhead_fns(args, T)

            fwd = forward_call
            fwdbwd = functools.partial(forward_backward_call, grad=grad)

            busy0, own0, t0 = busy_cpu_s(), own_cpu_s(), time.monotonic()
            # warm-up
            first = time_round_robin({n: fwdbwd(fn, ps[n]) for n, fn in fns.items()}, args.device, 2)
            round_ms = max(sum(t[-1] for t in first.values()), 1e-3)
            repeats = max(3, min(args.repeats, int(args.budget_s * 1e3 / round_ms)))
            rec = {"T": T, "repeats": repeats}
            for label, times in (("fwd", time_round_robin({n: fwd(fn) for n, fn in fns.items()}, args.device,
                                                          repeats)),
                                 ("fwdbwd", time_round_robin({n: fwdbwd(fn, ps[n]) for n, fn in fns.items()},
                                                             args.device, repeats))):
                for name, ts in times.items():
                    rec[f"{name}_{label}_ms"] = statistics.median(ts)
                    rec[f"{name}_{label}_ms_iqr"] = quartiles(ts)
                for name in ("mhla", "linear"):
                    rec[f"{name}_over_plain_{label}"] = rec[f"{name}_{label}_ms"] / rec[f"plain_{label}_ms"]
            busy1, own1, wall = busy_cpu_s(), own_cpu_s(), time.monotonic() - t0
            if busy0 is not None and busy1 is not None:
                other = max(0.0, (busy1 - busy0) - (own1 - own0))
                rec["other_cpu_frac"] = round(other / (wall * (os.cpu_count() or 1)), 3)
            records.append(rec)
            print(f"T={T:6d}: fwd+bwd plain {rec['plain_fwdbwd_ms']:.2f} ms, "
                  f"MHLA {rec['mhla_fwdbwd_ms']:.2f} ms "
                  f"({rec['mhla_over_plain_fwdbwd']:.2f}x), linear {rec['linear_fwdbwd_ms']:.2f} ms "
                  f"({rec['linear_over_plain_fwdbwd']:.2f}x)", flush=True)
    settings = {k: getattr(args, k) for k in ("device", "batch", "heads", "dim", "dtype", "block", "seq_lens",
                                              "repeats", "budget_s", "threads", "quick")}
    out = {"header": header, "command": command, "settings": settings, "ops": OVERHEAD_OPS,
           "plain_max_abs_diff": equiv, "time_method": OVERHEAD_TIME_METHOD,
           "records": records}
    stem = os.path.join(args.out_dir, f"causal_overhead_{args.device}" + ("_quick" if args.quick else ""))
    if not write_measured(stem, out, overhead_markdown, None, load, args):
        return 2
    print(f"wrote {stem}.json and .md")
    return 0


def overhead_markdown(out: dict) -> str:
    """The ``.md`` of a ``--causal-overhead`` run: machine, load, ops, a row per length with the ratios."""
    h, s = out["header"], out["settings"]
    la0, la1 = h.get("loadavg_start"), h.get("loadavg_end")
    fmt = lambda la: "/".join(f"{x:.2f}" for x in la) if la else "n/a"  # noqa: E731
    cpus = h.get("cpu_count") or 1
    lines = [f"# Causal per-call cost: MHLA and linear attention against the plain chunked form "
             f"({h['device']})",
             "", f"Command: `{out['command']}`", "",
             f"Machine: {h.get('gpu') or h.get('cpu', '?')}, {cpus} CPUs, torch {h.get('torch')} "
             f"({h.get('torch_threads')} threads), {h.get('date')}; load average (1/5/15 min) {fmt(la0)} at "
             f"the start, {fmt(la1)} at the end.", ""]
    if h["device"] == "cpu" and max((la0 or [0])[0], (la1 or [0])[0]) > 0.5 * cpus:
        lines += [f"NOTE: the machine was loaded (load average above {0.5 * cpus:g} on {cpus} CPUs); the "
                  "times are inflated and the ratios noisy. Re-run on an idle machine.", ""]
    lines += [f"Settings: B={s['batch']}, H={s['heads']}, D={s['dim']}, {s['dtype']}, block {s['block']}. "
              "The plain form equals `mhla.linear_attention(causal=True)` to "
              f"{out['plain_max_abs_diff']:.1e} (fp64).", ""]
    lines += [f"- `{k}`: {v}" for k, v in out["ops"].items()] + ["", f"Time: {out['time_method']}", ""]
    lines += ["| T | plain fwd ms | MHLA fwd ms | linear fwd ms | plain fwd+bwd ms | MHLA fwd+bwd ms | "
              "linear fwd+bwd ms | MHLA / plain fwd | MHLA / plain fwd+bwd | linear / plain fwd+bwd |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["records"]:
        flag = " (busy)" if r.get("other_cpu_frac", 0.0) > BUSY_WARN else ""
        ms = " | ".join(f"{r[f'{n}_{x}_ms']:.2f}" for x in ("fwd", "fwdbwd")
                        for n in ("plain", "mhla", "linear"))
        lines.append(f"| {r['T']} | {ms}{flag} | {r['mhla_over_plain_fwd']:.2f}x | "
                     f"{r['mhla_over_plain_fwdbwd']:.2f}x | {r['linear_over_plain_fwdbwd']:.2f}x |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--seq-lens", type=int, nargs="+", default=None,
                   help="default 1024 4096 16384 65536 (256 512 with --quick)")
    p.add_argument("--batch", type=int, default=None, help="default 1 (CPU), 8 (CUDA)")
    p.add_argument("--heads", type=int, default=None, help="default 8 (CPU), 16 (CUDA)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--block", type=int, default=64, help="causal MHLA block (chunk) size")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="default fp32 (CPU), bf16 (CUDA)")
    p.add_argument("--backend", default=None, help="MHLA backend for op 'mhla': torch | triton | auto "
                   "(default torch on CPU, triton on CUDA; op 'mhla_torch' is always the torch path)")
    p.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=None,
                   help="time every case in this process (default on CUDA; on CPU each case needs a fresh "
                        "process for its peak RSS)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=4.0, help="time budget per measurement loop")
    p.add_argument("--max-case-s", type=float, default=120.0, help="skip cases estimated to take longer")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out-dir", default=os.path.join(ROOT, "results", "bench"))
    p.add_argument("--ops", nargs="+", choices=sorted(set(OPS[True])), default=None,
                   help="only these ops (default: all)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--varlen", action="store_true",
                   help="the variable-length benchmark instead (module docstring); --seq-lens: total lengths")
    p.add_argument("--num-docs", type=int, default=8, help="--varlen: documents per packed batch")
    p.add_argument("--causal-overhead", action="store_true",
                   help="the causal per-call cost benchmark instead (module docstring): MHLA and linear "
                        "against the plain chunked form, side by side; default B 1, H 4, --seq-lens 1024 "
                        "4096 16384")
    p.add_argument("--plot-only", action="store_true",
                   help="redraw <out-dir>/<stem>.png from the .json these options name; measure nothing")
    p.add_argument("--allow-busy", action="store_true",
                   help="measure and write on a busy machine (tasks.common.records.BUSY_RULE), marked BUSY")
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: op,causal,T -> run one case, print JSON
    args = p.parse_args(argv)
    if args.varlen:
        if args.plot_only or args.case or args.ops:
            p.error("--varlen takes none of --plot-only, --ops")
        if args.batch not in (None, 1):
            p.error("--varlen packs the documents into a batch of one (cu_seqlens); leave --batch out")
        args.batch = 1
    if args.causal_overhead:
        if args.varlen or args.plot_only or args.ops:
            p.error("--causal-overhead takes none of --varlen, --plot-only, --ops")
        args.batch = 1 if args.batch is None else args.batch
        args.heads = 4 if args.heads is None else args.heads
        if args.seq_lens is None:
            args.seq_lens = [256, 512] if args.quick else [1024, 4096, 16384]
    if args.quick:
        args.heads, args.dim, args.repeats, args.budget_s = 2, 16, 3, 0.5
    gpu = args.device == "cuda"
    # GPU mode (the setting): bf16, B = 8, H = 16, T in {1k, 4k, 16k, 64k}, fused kernels for MHLA
    for name, cpu_value, gpu_value in (("batch", 1, 8), ("heads", 8, 16), ("dtype", "fp32", "bf16"),
                                       ("backend", "torch", "triton")):
        if getattr(args, name) is None:
            setattr(args, name, gpu_value if gpu else cpu_value)
    if args.seq_lens is None and args.varlen:
        args.seq_lens = [512] if args.quick else [16384, 65536] if gpu else [4096, 16384]
    if args.seq_lens is None:
        if args.quick:
            args.seq_lens = [256, 512]
        else:
            args.seq_lens = [1024, 4096, 16384, 65536]
    if args.in_process is None:
        args.in_process = gpu
    if args.in_process and not gpu:
        p.error("--in-process needs --device cuda: on a CPU each case's peak RSS needs a fresh process")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.case:
        op, causal, T = args.case.split(",")
        print(json.dumps(run_case(op, causal == "1", int(T), args)))
        return 0
    if args.plot_only:
        stem = os.path.join(args.out_dir, out_stem(args))
        with open(stem + ".json") as f:
            print(f"wrote {plot_ops(json.load(f), stem + '.png')}")
        return 0
    if args.varlen:
        given = argv if argv is not None else sys.argv[1:]
        return run_varlen(args, "python scripts/bench_ops.py " + " ".join(given))
    if args.causal_overhead:
        given = argv if argv is not None else sys.argv[1:]
        return run_causal_overhead(args, "python scripts/bench_ops.py " + " ".join(given))
    header = system_info(args.device)
    if args.device == "cuda":
        header["copy_bandwidth_GBps"] = round(copy_bandwidth_gbps("cuda"), 1)
    print("machine:", json.dumps(header))
    equiv = check_release_equivalence(args)
    print(f"release-loop equivalence: max abs diff {equiv:.2e}")
    if equiv > 1e-9:
        print("ERROR: the release-loop reimplementation does not match mhla_attention", file=sys.stderr)
        return 1
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--quick"]
    if args.quick:
        passthrough += ["--heads", str(args.heads), "--dim", str(args.dim), "--repeats", str(args.repeats),
                        "--budget-s", str(args.budget_s)]
    records = []
    command = "python scripts/bench_ops.py " + " ".join(passthrough)
    settings = {k: v for k, v in vars(args).items() if k not in ("case", "out_dir", "plot_only")}
    out = {"header": header, "command": command, "settings": settings, "release_loop_max_abs_diff": equiv,
           "time_method": TIME_METHOD_IN_PROCESS if args.in_process else TIME_METHOD,
           "memory_method": MEMORY_METHOD, "records": records}
    stem = os.path.join(args.out_dir, out_stem(args))
    with measurement(args) as load:
        if load.refuses_to_start(args.allow_busy):
            return 2
        for causal in (False, True):
            for op in OPS[causal]:
                if args.ops and op not in args.ops:
                    continue
                if BENCH_OPS[op].gpu_only and args.device != "cuda":
                    continue
                prev = None
                for T in sorted(args.seq_lens):
                    if prev is not None:
                        est_s = 2 * prev["fwdbwd_ms"] / 1e3 * (T / prev["T"]) ** BENCH_OPS[op].complexity * 3
                        if est_s > args.max_case_s:
                            reason = f"skipped (est. {est_s:.0f}s)"
                            records.append({"op": op, "causal": causal, "T": T, "skipped": reason})
                            print(f"{op:12s} causal={causal!s:5s} T={T:6d}: skipped (est. {est_s:.0f}s)")
                            continue
                    busy0, kids0, t0 = busy_cpu_s(), own_cpu_s(), time.monotonic()
                    rec, failure = measure_case(op, causal, T, args, passthrough)
                    busy1, kids1, wall = busy_cpu_s(), own_cpu_s(), time.monotonic() - t0
                    if failure is not None:
                        records.append({"op": op, "causal": causal, "T": T, "skipped": f"failed: {failure}"})
                        print(f"{op:12s} causal={causal!s:5s} T={T:6d}: FAILED {failure}")
                        write_partial(stem, out)
                        continue
                    if busy0 is not None and busy1 is not None:
                        # CPU time other processes used while the case ran, as a fraction of all cores
                        other = max(0.0, (busy1 - busy0) - (kids1 - kids0))
                        rec["other_cpu_frac"] = round(other / (wall * (os.cpu_count() or 1)), 3)
                    if "copy_bandwidth_GBps" in header:
                        gbps = min_bytes_moved(rec, args) / (rec["fwd_ms"] / 1e3) / 1e9
                        rec["fwd_frac_of_copy_bw"] = round(gbps / header["copy_bandwidth_GBps"], 3)
                    records.append(rec)
                    write_partial(stem, out)
                    prev = rec
                    busy = rec.get("other_cpu_frac", 0.0)
                    print(f"{op:12s} causal={causal!s:5s} T={T:6d} M={rec['M']:5d}: "
                          f"fwd {rec['fwd_ms']:9.2f} ms  "
                          f"fwd+bwd {rec['fwdbwd_ms']:9.2f} ms  peak {rec['peak_mem_mb']:8.1f} MB"
                          + (f"  WARNING: other processes used {busy:.0%} of the CPUs" if busy > BUSY_WARN
                             else ""), flush=True)
    if not write_measured(stem, out, lambda o: ops_markdown(o, os.path.basename(stem)),
                          lambda png: plot_ops(out, png), load, args):
        return 2
    if os.path.exists(stem + PARTIAL):
        os.remove(stem + PARTIAL)
    print(f"wrote {stem}.json, .md and .png")
    return 0


PARTIAL = ".partial.json"


def write_partial(stem: str, out: dict) -> None:
    """``<stem>.partial.json``: the records measured so far, rewritten after every case, so that a run cut
    short (a time limit on a rented GPU) keeps what it measured; removed when the full result is written. It
    has no load measurement yet (``"complete": false``): a record to read, not a result to cite as finished."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    text = json.dumps({**out, "complete": False}, indent=2, default=str)
    atomic_write(stem + PARTIAL, lambda tmp: Path(tmp).write_text(text))


def measure_case(op: str, causal: bool, T: int, args, passthrough: list[str]) -> tuple[dict | None, str | None]:
    """``(record, None)`` or ``(None, why it failed)`` for one case: in a fresh subprocess (the CPU default:
    peak RSS only grows, so each case needs its own process), or in this process with ``--in-process`` (the
    CUDA default: the allocator's peak is reset per case, and a subprocess per case costs ~15 s of start-up,
    CUDA context and Triton autotuning, which alone would spend a GPU lease)."""
    if args.in_process:
        try:
            return run_case(op, causal, T, args), None
        except (RuntimeError, ValueError, NotImplementedError, ImportError) as e:  # incl. torch.OutOfMemoryError
            return None, (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        finally:
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    cmd = [sys.executable, os.path.abspath(__file__), "--case", f"{op},{int(causal)},{T}", *passthrough]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return None, (proc.stderr.strip().splitlines() or ["failed"])[-1][:120]
    return json.loads(proc.stdout.strip().splitlines()[-1]), None


def out_stem(args) -> str:
    """``ops_<device>[_quick][_<op>-<op>...]``: the file name (without extension) of this run's results."""
    stem = f"ops_{args.device}" + ("_quick" if args.quick else "")
    return stem + ("_" + "-".join(args.ops) if args.ops else "")


def ops_markdown(out: dict, name: str | None = None) -> str:
    """The ``.md`` of an op run: its tables and the plot's line (``name``: the file's stem, default from the
    device and settings)."""
    name = name or "ops_" + out["header"]["device"]
    md = to_markdown(out["header"], out["records"], out["command"], out["release_loop_max_abs_diff"])
    return md + f"\nPlot: `{name}.png` ({PLOT_NOTE}).\n"


def write_results(stem: str, out: dict) -> str:
    """``<stem>.json`` (``out``), ``.md`` (its tables) and ``.png`` (:func:`plot_ops`) through
    :func:`tasks.common.results.write_result` (``out["measurement"]``, when it has one, is kept: a busy one
    stays marked); returns ``stem``."""
    return write_result(stem, ops_markdown(out, os.path.basename(stem)), out, lambda png: plot_ops(out, png),
                        indent=2)


def op_label(op: str) -> str:
    """The op's label in plots (:attr:`BenchOp.label`; an op no longer in :data:`BENCH_OPS`: its name)."""
    return BENCH_OPS[op].label if op in BENCH_OPS else op


PLOT_NOTE = ("fwd, fwd+bwd time and peak memory against T per op, log-log; non-causal above, causal below; "
             "skipped cases left out; redraw from the .json with `--plot-only`")


def plot_ops(out: dict, path: str) -> str:
    """Time (fwd, fwd+bwd) and peak memory against T, one line per op, log-log: non-causal and causal rows."""
    recs = [r for r in out["records"] if not r.get("skipped")]
    colors = colors_for(op_label(r["op"]) for r in out["records"])
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5), squeeze=False)
    cols = (("fwd_ms", "forward ms"), ("fwdbwd_ms", "forward + backward ms"), ("peak_mem_mb", "peak memory MB"))
    for row, causal in enumerate((False, True)):
        for ax, (key, label) in zip(axes[row], cols):
            series: dict = {}
            for r in recs:
                if r["causal"] == causal:
                    series.setdefault(op_label(r["op"]), []).append((r["T"], r.get(key)))
            loglog_lines(ax, series, "sequence length T", label,
                         f"{'causal' if causal else 'non-causal'}: {label}", colors)
    s, h = out.get("settings", {}), out["header"]
    fig.suptitle(f"Attention ops on {h.get('gpu') or h.get('cpu', h.get('device', ''))} ({h.get('device')}): "
                 f"B={s.get('batch', '?')}, H={s.get('heads', '?')}, D={s.get('dim', '?')}, {s.get('dtype', '')}",
                 fontsize=11)
    return save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
