#!/usr/bin/env python
"""Benchmark the attention ops: MHLA vs plain linear attention vs softmax (SDPA), forward and fwd+bwd.

    python scripts/bench_ops.py                  # CPU, T in {1k, 4k, 16k, 64k}; ~5-10 min on 2 cores
    python scripts/bench_ops.py --quick          # tiny smoke run
    python scripts/bench_ops.py --device cuda    # GPU timing with CUDA events (peak memory from the allocator)

Non-causal: MHLA (torch backend, locality mixing, M blocks with M^2 <= T), linear attention, SDPA.
Causal: MHLA chunkwise (block 64), our chunkwise linear attention, SDPA causal, and a reimplementation of the
authors' release's form (python loops over 64-token chunks; checked equal to ours before timing).

Each case runs in a fresh subprocess. Time: median over repeated runs after warm-up (wall clock with
``time.perf_counter`` on CPU; CUDA events on GPU). Memory: on CPU the growth of the process's peak RSS
(``ru_maxrss``) over the fwd+bwd runs, relative to the RSS after the inputs were made; on GPU
``torch.cuda.max_memory_allocated`` minus the inputs. Cases whose estimated time exceeds ``--max-case-s``
are skipped and marked with the estimate. Writes ``results/bench/ops_<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

OPS = {
    False: ["mhla", "linear", "sdpa"],
    True: ["mhla", "linear", "sdpa", "release_loop"],
}
COMPLEXITY = {"mhla": 1, "linear": 1, "sdpa": 2, "release_loop": 2}  # growth exponent in T for skip estimates


# ------------------------------------------------------------------------------------------- header
def machine_header(device: str) -> dict:
    from tasks.common.utils import cpu_model  # noqa: PLC0415

    h = {
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "device": device,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if device == "cuda":
        h["gpu"] = torch.cuda.get_device_name(0)
    return h


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


def choose_num_blocks(T: int) -> int:
    """Largest power-of-4 square count M (so 2-D grids would split evenly) with M^2 <= T, at least 1."""
    m = 1
    while (m * 4) ** 2 <= T and T % (m * 4) == 0:
        m *= 4
    return m


def make_case(op: str, causal: bool, T: int, args, device):
    import mhla  # noqa: PLC0415
    from mhla.mixing import distances_1d, mixing_init  # noqa: PLC0415

    g = torch.Generator(device="cpu").manual_seed(0)
    B, H, D = args.batch, args.heads, args.dim
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]

    def rand(*shape, pos=False):
        x = torch.randn(*shape, generator=g)
        x = torch.relu(x) + 1e-6 if pos else x
        return x.to(device=device, dtype=dtype).requires_grad_()

    q, k = rand(B, T, H, D, pos=op != "sdpa"), rand(B, T, H, D, pos=op != "sdpa")
    v = rand(B, T, H, D)
    info = {}
    if causal:
        C = args.block
        n = math.ceil(T / C)
        mix = mixing_init("locality", distances_1d(n), causal=True).to(device=device, dtype=dtype)
        info.update(block_size=C, M=n)
    else:
        M = choose_num_blocks(T)
        C = T // M
        mix = mixing_init("locality", distances_1d(M)).to(device=device, dtype=dtype)
        info.update(block_size=C, M=M)
    mix.requires_grad_()
    if op == "mhla":
        fn = lambda: mhla.mhla_attention(q, k, v, mix, C, causal=causal, backend=args.backend)  # noqa: E731
        params = [q, k, v, mix]
    elif op == "linear":
        fn = lambda: mhla.linear_attention(q, k, v, causal=causal)  # noqa: E731
        params = [q, k, v]
    elif op == "sdpa":
        fn = lambda: mhla.softmax_attention(q, k, v, causal=causal)  # noqa: E731
        params = [q, k, v]
    elif op == "release_loop":
        fn = lambda: release_loop_causal(q, k, v, mix, C)  # noqa: E731
        params = [q, k, v, mix]
    else:
        raise ValueError(op)
    return fn, params, info


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


def run_case(op: str, causal: bool, T: int, args) -> dict:
    """Time one case in this process (called in a subprocess by :func:`main`)."""
    torch.set_num_threads(args.threads or torch.get_num_threads())
    device = args.device
    # Warm the runtime (autograd threads, allocator pools) on a small input so the memory baseline below
    # does not charge one-off start-up costs to the case.
    wfn, wparams, _ = make_case(op, causal, min(T, 256), args, device)
    wout = wfn()
    wout.backward(torch.randn_like(wout))
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
    first = timer(fwdbwd, device, 1)[0]
    repeats = max(3, min(args.repeats, int(args.budget_s * 1e3 / max(first, 1e-3))))
    fwd_ms = statistics.median(timer(fwd, device, repeats))
    fwdbwd_ms = statistics.median(timer(fwdbwd, device, repeats))
    if device == "cuda":
        peak_mb = (torch.cuda.max_memory_allocated() - base_gpu) / 2**20
    else:
        peak_mb = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) / 1024
    return {"op": op, "causal": causal, "T": T, **info, "fwd_ms": fwd_ms, "fwdbwd_ms": fwdbwd_ms,
            "peak_mem_mb": peak_mb, "repeats": repeats}


def check_release_equivalence(args) -> float:
    """Max |ours - release loop| on a small input (fp64); the benchmark aborts if it is not ~0."""
    import mhla  # noqa: PLC0415

    g = torch.Generator().manual_seed(1)
    q, k = (torch.rand(2, 203, 3, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 203, 3, 8, generator=g, dtype=torch.float64)
    mix = torch.rand(4, 4, generator=g, dtype=torch.float64).tril()
    ours = mhla.mhla_attention(q, k, v, mix, 64, causal=True, normalize=False, backend="torch")
    theirs = release_loop_causal(q, k, v, mix, 64)
    return (ours - theirs).abs().max().item()


# -------------------------------------------------------------------------------------------- main
def to_markdown(header: dict, records: list[dict], command: str, equiv: float) -> str:
    lines = [f"# Op benchmark ({header['device']})", "", f"Command: `{command}`", ""]
    lines += ["| machine | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in header.items()] + [""]
    lines.append(f"Release-loop form equals our causal MHLA (normalize=False) to {equiv:.1e} (fp64).")
    lines.append("")
    for causal in (False, True):
        lines += [f"## {'Causal' if causal else 'Non-causal'}", "",
                  "| op | T | M | block | fwd ms | fwd+bwd ms | peak mem MB |", "|---|---|---|---|---|---|---|"]
        for r in records:
            if r["causal"] != causal:
                continue
            if r.get("skipped"):
                lines.append(f"| {r['op']} | {r['T']} | | | {r['skipped']} | | |")
            else:
                uses_blocks = r["op"] in ("mhla", "release_loop")
                m, c = (r.get("M", ""), r.get("block_size", "")) if uses_blocks else ("", "")
                lines.append(f"| {r['op']} | {r['T']} | {m} | {c} | "
                             f"{r['fwd_ms']:.2f} | {r['fwdbwd_ms']:.2f} | {r['peak_mem_mb']:.1f} |")
        lines += ["", "| T | MHLA / linear (fwd+bwd) | SDPA / MHLA (fwd+bwd) |", "|---|---|---|"]
        by = {(r["op"], r["T"]): r for r in records if r["causal"] == causal and not r.get("skipped")}
        for T in sorted({r["T"] for r in records}):
            m, lin, sd = by.get(("mhla", T)), by.get(("linear", T)), by.get(("sdpa", T))
            a = f"{m['fwdbwd_ms'] / lin['fwdbwd_ms']:.2f}x" if m and lin else "n/a"
            b = f"{sd['fwdbwd_ms'] / m['fwdbwd_ms']:.1f}x" if m and sd else "n/a (SDPA skipped)"
            lines.append(f"| {T} | {a} | {b} |")
        lines.append("")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--block", type=int, default=64, help="causal MHLA block (chunk) size")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--backend", default="torch", help="MHLA backend (torch | triton | auto)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=4.0, help="time budget per measurement loop")
    p.add_argument("--max-case-s", type=float, default=120.0, help="skip cases estimated to take longer")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out-dir", default=os.path.join(ROOT, "results", "bench"))
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: op,causal,T -> run one case, print JSON
    args = p.parse_args(argv)
    if args.quick:
        args.seq_lens, args.heads, args.dim, args.repeats, args.budget_s = [256, 512], 2, 16, 3, 0.5
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.case:
        op, causal, T = args.case.split(",")
        print(json.dumps(run_case(op, causal == "1", int(T), args)))
        return 0
    header = machine_header(args.device)
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
    for causal in (False, True):
        for op in OPS[causal]:
            prev = None
            for T in sorted(args.seq_lens):
                if prev is not None:
                    est_s = 2 * prev["fwdbwd_ms"] / 1e3 * (T / prev["T"]) ** COMPLEXITY[op] * 3
                    if est_s > args.max_case_s:
                        records.append({"op": op, "causal": causal, "T": T, "skipped": f"skipped (est. {est_s:.0f}s)"})
                        print(f"{op:12s} causal={causal!s:5s} T={T:6d}: skipped (est. {est_s:.0f}s)")
                        continue
                cmd = [sys.executable, os.path.abspath(__file__), "--case", f"{op},{int(causal)},{T}", *passthrough]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    reason = (proc.stderr.strip().splitlines() or ["failed"])[-1][:120]
                    records.append({"op": op, "causal": causal, "T": T, "skipped": f"failed: {reason}"})
                    print(f"{op:12s} causal={causal!s:5s} T={T:6d}: FAILED {reason}")
                    continue
                rec = json.loads(proc.stdout.strip().splitlines()[-1])
                records.append(rec)
                prev = rec
                print(f"{op:12s} causal={causal!s:5s} T={T:6d} M={rec['M']:5d}: fwd {rec['fwd_ms']:9.2f} ms  "
                      f"fwd+bwd {rec['fwdbwd_ms']:9.2f} ms  peak {rec['peak_mem_mb']:8.1f} MB", flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    command = "python scripts/bench_ops.py " + " ".join(passthrough)
    settings = {k: v for k, v in vars(args).items() if k not in ("case", "out_dir")}
    out = {"header": header, "command": command, "settings": settings, "release_loop_max_abs_diff": equiv,
           "memory_method": ("CPU: growth of peak RSS (ru_maxrss) during fwd+bwd over the RSS after inputs; "
                             "GPU: torch.cuda.max_memory_allocated minus inputs"),
           "records": records}
    stem = f"ops_{args.device}" + ("_quick" if args.quick else "")
    with open(os.path.join(args.out_dir, stem + ".json"), "w") as f:
        json.dump(out, f, indent=2)
    with open(os.path.join(args.out_dir, stem + ".md"), "w") as f:
        f.write(to_markdown(header, records, command, equiv) + "\n")
    print(f"wrote {os.path.join(args.out_dir, stem + '.json')} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
