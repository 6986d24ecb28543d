#!/usr/bin/env python
"""One GPU window, measured in one time-boxed run: the campaign of issue 46 (items 4 and 5).

    bash scripts/gpu_campaign.sh                      # on a lent GPU machine: wheels, then this script -> $OUT
    python scripts/gpu_campaign.py --out-dir DIR      # on a CUDA machine with the project installed
    python scripts/gpu_campaign.py --dry              # the same code on this CPU, tiny shapes, a tiny budget
    make gpu-campaign [DRY=1] [EXTRA='--stages ops --budget-s 200']

This process orchestrates; each stage runs in a subprocess of its own (``--worker STAGE``), in this order (the
most valuable first, so a cut window loses the least):

1. ``ops``: the op benchmark in ONE process (Triton autotuning once), :func:`scripts.bench_ops.run_case` per case:
   bf16, B 8, H 16, T 1k..64k; the forwards at D 64 (non-causal, then causal), then the forwards+backwards at
   D 64, then both at D 128. Ops: MHLA (Triton), MHLA in the LM's setting (``mhla_window``: 32 learned rows,
   far blocks folded), both with the kernels' opt-in half block summaries (``mhla_half``, ``mhla_window_half``:
   ``MHLA_SUMMARY_DTYPE=input``), MHLA (torch path), our linear attention, flash-linear-attention's ``chunk_linear_attn``
   and ``chunk_simple_gla`` (when ``fla`` imports), SDPA (FlashAttention). Each case: median of CUDA-event
   timings after a warm-up, its percent of the floor (4 bf16 tensors read or written once forward, 11 forward
   + backward) over the measured copy bandwidth and over the datasheet's, the largest relative difference of
   the Triton output to the torch path on the same inputs, and the bytes and launches the traffic model
   (``mhla.ops.mhla.triton.traffic``, when present) predicts for the ``mhla`` op.
2. ``gpu_tests``: ``pytest -m gpu`` on the test files that hold GPU tests, one case per test.
3. ``table14``: the paper's Table 14, DiT-S/2 latency and memory at N 256 / 1024 / 4096 across M 4..1024
   (:func:`scripts.tables.benchmark.time_m`) with softmax and linear beside it
   (:func:`scripts.bench_models.build_case` / :func:`~scripts.bench_models.measure`); DeiT-S/16 throughput and
   memory at N 256 / 1024.
4. ``train_throughput``: training steps per second of DeiT-T (softmax, linear, MHLA) and of the 340M LM at 2k
   and 8k tokens of context (bf16 autocast, AdamW).
5. ``train_bf16``: ``train.py`` for 20 steps of each task's mini config in bf16 and in fp32 (side by side,
   same seed and batches): every bf16 loss finite, and the bf16 run tracks the fp32 one (:data:`TRACK_RULE`).

Time: ``--budget-s`` (default 480 s on a GPU: a 15-minute lease less the machine's start) counts from
``--started-at`` (the wrapper passes the time before the wheels were installed). Each stage has a nominal
budget (:data:`STAGES`); it gets ``nominal x (time left / nominal of the stages left)``, so what an early stage
leaves unused goes to the later ones. A stage whose share is under its minimum is recorded ``not run: out of
time``; inside a stage, a case whose estimate (from the same series' last case) does not fit the time left is
recorded ``not run: out of time``; a worker still running at its deadline (plus a grace) is stopped, its
unfinished cases recorded ``cut`` / ``not run``. Nothing is skipped silently.

Files (under ``--out-dir``, default ``$OUT``, else ``outputs/gpu_campaign``; ``--dry``: a new temp folder):
``campaign.partial.json`` (rewritten after every case; removed once the final files exist), ``campaign.json``
(everything: machine header, settings, stages and their cases, goals, checks), ``campaign.md`` (the tables)
and ``campaign.log`` (the workers' output). The goals of issue 46 item 5 are printed last as met / not met /
not measured, each with its measured number and its target (:func:`goals`).

``--dry`` runs every stage on the CPU with tiny shapes (:func:`campaign_settings`), the MHLA op on the torch
path, and the goals' T levels mapped to the tiny lengths: its numbers mean nothing; it keeps the campaign
working between GPU windows (tests/scripts/test_gpu_campaign.py runs it in CI).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTIAL, FINAL_JSON, FINAL_MD, LOG = "campaign.partial.json", "campaign.json", "campaign.md", "campaign.log"


@dataclass(frozen=True)
class Stage:
    name: str
    title: str
    budget_s: float  # nominal seconds on one H100 (dry: on this CPU)
    min_s: float  # a stage with less time than this is not started
    dry_budget_s: float
    dry_min_s: float


STAGES = (
    Stage("ops", "op benchmark (one process)", 230, 20, 12, 4),
    Stage("gpu_tests", "GPU tests (pytest -m gpu)", 80, 15, 12, 4),
    Stage("table14", "Table 14: DiT-S/2 across M, DeiT-S/16", 50, 10, 12, 4),
    Stage("train_throughput", "training-step throughput: DeiT-T, LM 2k / 8k", 45, 10, 10, 4),
    Stage("train_bf16", "20-step bf16 training of each task's mini config vs fp32", 60, 20, 40, 10),
)
STAGE_NAMES = tuple(s.name for s in STAGES)
RESERVE_S = 6.0  # kept back at the end for the final files
GRACE_S = {False: 10.0, True: 4.0}  # after a worker's deadline, before it is stopped (dry: True)
DEFAULT_BUDGET_S = {False: 480.0, True: 60.0}

# H100 SXM (HBM3) and H200 (HBM3e) datasheet bandwidths, GB/s; PCIe / NVL parts are named so by nvidia-smi
DATASHEET_GBPS = (("H100 PCIe", 2000.0), ("H100 NVL", 3900.0), ("H100", 3350.0), ("H200", 4800.0))
# the floor in [B, T, H, D] tensors moved once: forward reads q, k, v and writes o; the backward then reads q, k,
# v, do and writes dq, dk, dv
FLOOR_TENSORS = {"fwd": 4, "fwdbwd": 11}
TRACK_REL_TOL = 0.05
TRACK_RULE = (f"the mean training loss of the last 5 steps of the bf16 run within {TRACK_REL_TOL:.0%} of the fp32 "
              "run's (same seed, same batches), and every bf16 loss finite")
MAX_REL_DIFF_BF16 = 2e-2  # Triton vs the torch path on the same bf16 inputs (forward output, relative to max |o|)


# ------------------------------------------------------------------------------------------- settings
def campaign_settings(dry: bool) -> dict:
    """Every shape, size and count the stages use: the issue's setting on a GPU, tiny ones with ``dry``."""
    if not dry:
        return {
            "dry": False, "device": "cuda", "amp": True,
            "ops": {"batch": 8, "heads": 16, "dims": [64, 128], "seq_lens": [1024, 4096, 16384, 65536],
                    "dtype": "bf16", "backend": "triton", "block": 64, "repeats": 10, "budget_s": 0.5,
                    "max_case_s": 10.0, "first_case_s": 4.0, "copy_bytes": 2**30, "matmul_n": 8192},
            "t_levels": {"1k": 1024, "4k": 4096, "16k": 16384, "64k": 65536},
            "table14": {"dit_res": [256, 512, 1024], "dit_ms": [4, 16, 64, 256, 1024], "dit_batch": 32,
                        "deit_res": [256, 512], "deit_batch": 64, "deit_blocks": 16, "repeats": 5,
                        "first_case_s": 5.0},
            "throughput": {"deit_res": 224, "deit_batch": 256, "deit_blocks": 16, "lm_hidden": 1024,
                           "lm_layers": 24, "lm_heads": 4, "lm_vocab": 32000, "lm_contexts": [2048, 8192],
                           "lm_tokens_per_step": 16384, "repeats": 5, "first_case_s": 6.0},
            "train_bf16": {"tasks": list(TRAIN_TASKS), "steps": 20, "jobs": 12},
        }
    return {
        "dry": True, "device": "cpu", "amp": False,
        "ops": {"batch": 1, "heads": 2, "dims": [16, 32], "seq_lens": [64, 128, 256], "dtype": "fp32",
                "backend": "torch", "block": 64, "repeats": 2, "budget_s": 0.02, "max_case_s": 5.0,
                "first_case_s": 0.3, "copy_bytes": 2**22, "matmul_n": 256},
        "t_levels": {"1k": 64, "4k": 128, "16k": 256, "64k": 256},
        "table14": {"dit_res": [64], "dit_ms": [4], "dit_batch": 1, "deit_res": [64], "deit_batch": 1,
                    "deit_blocks": 4, "repeats": 1, "first_case_s": 2.0},
        "throughput": {"deit_res": 64, "deit_batch": 2, "deit_blocks": 4, "lm_hidden": 64, "lm_layers": 1,
                       "lm_heads": 2, "lm_vocab": 256, "lm_contexts": [128, 256], "lm_tokens_per_step": 256,
                       "repeats": 1, "first_case_s": 2.0},
        "train_bf16": {"tasks": ["mqar"], "steps": 3, "jobs": 2},
    }


# ------------------------------------------------------------------------------ the record on disk
def load_state(out_dir: str) -> dict:
    with open(os.path.join(out_dir, PARTIAL)) as f:
        return json.load(f)


def save_state(out_dir: str, state: dict, name: str = PARTIAL) -> None:
    """``state`` as ``<out_dir>/<name>``, written atomically (a worker stopped mid-write leaves the last one)."""
    from tasks.common.fileio import atomic_write  # noqa: PLC0415

    text = json.dumps(state, indent=1, default=str)
    atomic_write(os.path.join(out_dir, name), lambda tmp: Path(tmp).write_text(text))


def stage_entry(state: dict, name: str) -> dict:
    return next(s for s in state["stages"] if s["name"] == name)


class Recorder:
    """A worker's view of the partial record: its stage's cases, each added or updated in place, the whole
    file rewritten after every change (the orchestrator waits while a worker runs: one writer at a time)."""

    def __init__(self, out_dir: str, stage: str, deadline: float):
        self.out_dir, self.deadline = out_dir, deadline
        self.state = load_state(out_dir)
        self.stage = stage_entry(self.state, stage)
        self.settings = self.state["settings"]

    def save(self) -> None:
        save_state(self.out_dir, self.state)

    def plan(self, case_ids) -> None:
        """List the cases this stage means to run, ``pending``, so that a cut run shows what it did not reach."""
        known = {c["case"] for c in self.stage["cases"]}
        self.stage["cases"] += [{"case": c, "status": "pending"} for c in case_ids if c not in known]
        self.save()

    def update(self, case_id: str, **fields) -> dict:
        case = next((c for c in self.stage["cases"] if c["case"] == case_id), None)
        if case is None:
            case = {"case": case_id}
            self.stage["cases"].append(case)
        case.update(fields)
        self.save()
        return case

    def note(self, **fields) -> None:
        """Stage-wide measurements (e.g. the copy bandwidth), under the stage's ``info``."""
        self.stage.setdefault("info", {}).update(fields)
        self.save()

    def left_s(self) -> float:
        return self.deadline - time.time()

    def run(self, case_id: str, estimate_s: float, fn, **meta) -> dict | None:
        """``fn()`` as case ``case_id`` unless its estimate does not fit the time left (then ``not run: out of
        time``); its dict is the case's fields (status ``ok``), an exception its ``failed: ...`` status."""
        left = self.left_s()
        if estimate_s > left:
            self.update(case_id, status=f"not run: out of time (estimated {estimate_s:.1f} s, {left:.1f} s "
                                        "left in the stage)", **meta)
            return None
        self.update(case_id, status="running", **meta)
        t0 = time.monotonic()
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001  (an out-of-memory, a kernel that fails: recorded, the stage goes on)
            line = (str(e).strip().splitlines() or [""])[0][:200]
            self.update(case_id, status=f"failed: {type(e).__name__}: {line}",
                        wall_s=round(time.monotonic() - t0, 2))
            free_memory(collect=True)
            return None
        return self.update(case_id, status="ok", wall_s=round(time.monotonic() - t0, 2), **result)


def free_memory(collect: bool = False) -> None:
    """Give the CUDA allocator's cached blocks back between cases; ``collect``: first free reference cycles too
    (after a failure, whose traceback holds the case's tensors; ~50 ms, too slow to do after every case)."""
    import torch  # noqa: PLC0415

    if collect:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ machine header
def machine_header(dry: bool) -> dict:
    """GPU name, driver, CUDA, torch, triton, fla, python, commit and dirty flag, host, load, date; with no
    GPU the CPU's name instead. Read without initialising CUDA in this (orchestrating) process."""
    from importlib import metadata  # noqa: PLC0415

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    h = {"hostname": socket.gethostname(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
         "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
         "loadavg": [round(x, 2) for x in os.getloadavg()], "dry": dry,
         "torch": version("torch"), "triton": version("triton"),
         "fla": version("flash-linear-attention"), "fla_core": version("fla-core")}
    try:
        import torch  # noqa: PLC0415

        h["cuda"] = torch.version.cuda
    except ImportError:
        h["cuda"] = None
    h.update(gpu_from_nvidia_smi())
    h.update(commit_and_dirty())
    return h


def gpu_from_nvidia_smi() -> dict:
    """``gpu``, ``driver``, ``gpu_memory_mib`` from nvidia-smi ({} without one)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return {}
    if out.returncode != 0 or not out.stdout.strip():
        return {}
    name, driver, mem = (x.strip() for x in out.stdout.strip().splitlines()[0].split(","))
    return {"gpu": name, "driver": driver, "gpu_memory_mib": int(float(mem))}


def commit_and_dirty() -> dict:
    """The checkout's commit and whether it had uncommitted changes (:func:`tasks.common.records.code_version`;
    a copy without ``.git`` reads ``MHLA_COMMIT`` and ``MHLA_DIRTY`` = 0 / 1 from the environment)."""
    try:
        from tasks.common.records import code_version  # noqa: PLC0415

        v = code_version()
    except ImportError:
        v = {"commit": os.environ.get("MHLA_COMMIT"), "dirty": None}
    if v.get("dirty") is None and os.environ.get("MHLA_DIRTY") in ("0", "1"):
        v["dirty"] = os.environ["MHLA_DIRTY"] == "1"
    return v


def datasheet_gbps(gpu: str | None) -> float | None:
    for key, gbps in DATASHEET_GBPS:
        if gpu and key in gpu:
            return gbps
    return None


# ======================================================================================= the stages
# ---------------------------------------------------------------------------------------- ops
PRIMARY_OPS = {False: ["mhla", "sdpa"], True: ["mhla_window", "fla_linear", "mhla"]}
SECONDARY_OPS = {False: ["mhla_half", "linear", "mhla_torch"],
                 True: ["mhla_window_half", "fla_simple_gla", "linear", "sdpa", "mhla_torch"]}


def op_case_id(D: int, kind: str, causal: bool, op: str, T: int) -> str:
    return f"D{D}/{kind}/{'causal' if causal else 'noncausal'}/{op}/T{T}"


def op_plan(o: dict) -> list[tuple[int, str, bool, str, int]]:
    """(D, pass, causal, op, T) in the order they run: per (D, pass) phase -- forwards at the first D, then its
    forwards+backwards, then the next D -- the goals' ops first (non-causal, causal), then the others."""
    plan = []
    for D in o["dims"]:
        for kind in ("fwd", "fwdbwd"):
            for ops in (PRIMARY_OPS, SECONDARY_OPS):
                for causal in (False, True):
                    plan += [(D, kind, causal, op, T) for op in ops[causal] for T in o["seq_lens"]]
    return plan


def floor_bytes(o: dict, D: int, T: int, kind: str) -> int:
    """Bytes the op must at least move: :data:`FLOOR_TENSORS` tensors of ``[B, T, H, D]`` in its dtype."""
    elem = {"fp32": 4, "bf16": 2, "fp16": 2}[o["dtype"]]
    return FLOOR_TENSORS[kind] * o["batch"] * T * o["heads"] * D * elem


def matmul_tflops(device: str, n: int, repeats: int = 10) -> float:
    """Measured dense matrix-product rate (bf16 on a GPU, fp32 on a CPU), TFLOP/s: the tensor-core ceiling."""
    import torch  # noqa: PLC0415

    from scripts.bench_ops import timer  # noqa: PLC0415

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    a @ b  # warm-up (cuBLAS handle, heuristics)
    ms = statistics.median(timer(lambda: a @ b, device, repeats))
    return 2 * n**3 / (ms / 1e3) / 1e12


def modelled_traffic(op: str, causal: bool, kind: str, o: dict, D: int, T: int, block_size: int) -> dict | None:
    """What the traffic model (``mhla.ops.mhla.triton.traffic.mhla_traffic``, optional) predicts for a case of
    the ``mhla`` op (dense mixing, as the benchmark's) or of ``mhla_window`` (the LM's compact rows: their
    ``(head, recent)`` window taken from the rows the benchmark builds): bytes and launches of the forward
    (``fwd``) or of the forward and backward (``fwdbwd``); None for other ops or without the module, ``{"error"}``
    if it fails."""
    from scripts.bench_ops import BENCH_OPS  # noqa: PLC0415

    spec = BENCH_OPS[op]
    if not spec.triton or spec.mixing is None:
        return None
    try:
        from mhla.ops.mhla.triton.traffic import mhla_traffic  # noqa: PLC0415  (optional: the kernels' model)
    except ImportError:
        return None
    elem = {"fp32": 4, "bf16": 2, "fp16": 2}[o["dtype"]]
    try:
        window = None
        if spec.mixing == "window":
            import torch  # noqa: PLC0415

            from scripts.bench_ops import window_mixing_rows  # noqa: PLC0415

            rows = window_mixing_rows(-(-T // block_size), "meta", torch.float32)
            window = (rows.head.shape[-1], rows.recent.shape[-1])
        kw = {"summary_bytes": elem} if spec.half_of else {}  # opt-in half summaries: S and P in the input dtype
        t = mhla_traffic(o["batch"], T, o["heads"], D, block_size=block_size, dtype_bytes=elem, causal=causal,
                         mixing="shared", mixing_bytes=elem, window=window, **kw)
    except Exception as e:  # noqa: BLE001  (a model whose signature moved must not stop the benchmark)
        return {"error": f"{type(e).__name__}: {str(e)[:120]}"}
    phase = "forward" if kind == "fwd" else None
    return {"bytes": t.bytes(phase), "launches": t.launches(phase)}


def diff_to_torch(op: str, causal: bool, T: int, cargs, device: str) -> float:
    """max |o - o_torch| / max |o_torch| of a Triton op against the torch path on the same (seeded) inputs."""
    import torch  # noqa: PLC0415

    from scripts.bench_ops import make_case  # noqa: PLC0415

    ours, _, _ = make_case(op, causal, T, cargs, device)
    ref, _, _ = make_case(op, causal, T, argparse.Namespace(**{**vars(cargs), "backend": "torch"}), device)
    with torch.no_grad():
        a, b = ours().float(), ref().float()
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def fla_status() -> str | None:
    """None when flash-linear-attention's kernels import, else why not."""
    try:
        from fla.ops.linear_attn import chunk_linear_attn  # noqa: F401, PLC0415
        from fla.ops.simple_gla import chunk_simple_gla  # noqa: F401, PLC0415
    except Exception as e:  # noqa: BLE001  (ImportError, or triton failing to initialise without a GPU)
        return f"{type(e).__name__}: {str(e)[:100]}"
    return None


def stage_ops(rec: Recorder) -> None:
    import torch  # noqa: PLC0415

    from scripts.bench_ops import BENCH_OPS, copy_bandwidth_gbps, run_case  # noqa: PLC0415

    s, o = rec.settings, rec.settings["ops"]
    device = s["device"]
    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    bw = copy_bandwidth_gbps(device, nbytes=o["copy_bytes"])
    rec.note(copy_bandwidth_GBps=float(f"{bw:.4g}"), datasheet_GBps=datasheet_gbps(gpu),
             matmul_tflops=float(f"{matmul_tflops(device, o['matmul_n']):.4g}"), gpu=gpu)
    info = rec.stage["info"]
    plan = op_plan(o)
    rec.plan([op_case_id(*p) for p in plan])
    no_fla = fla_status()
    last: dict = {}  # (D, pass, causal, op) -> (T, wall seconds) of its last measured case
    for D, kind, causal, op, T in plan:
        cid = op_case_id(D, kind, causal, op, T)
        meta = {"op": op, "causal": causal, "T": T, "D": D, "pass": kind}
        if BENCH_OPS[op].needs_fla and no_fla:
            rec.update(cid, status=f"skipped: flash-linear-attention not importable ({no_fla})", **meta)
            continue
        series = (D, kind, causal, op)
        if series in last:
            t_prev, wall_prev = last[series]
            est = wall_prev * (T / t_prev) ** BENCH_OPS[op].complexity
        else:
            est = o["first_case_s"]
        if est > o["max_case_s"]:
            rec.update(cid, status=f"skipped: estimated {est:.1f} s > max_case_s {o['max_case_s']}", **meta)
            continue
        cargs = argparse.Namespace(batch=o["batch"], heads=o["heads"], dim=D, dtype=o["dtype"], block=o["block"],
                                   backend=o["backend"], threads=0, repeats=o["repeats"], budget_s=o["budget_s"],
                                   device=device)

        def measure(op=op, causal=causal, T=T, kind=kind, cargs=cargs, D=D):
            r = run_case(op, causal, T, cargs, passes=(kind,))
            ms = r.pop(f"{kind}_ms")
            out = {**r, "ms": ms, "ms_iqr": r.pop(f"{kind}_ms_iqr"), "floor_bytes": floor_bytes(o, D, T, kind)}
            out["pct_floor_copy"] = pct_of_floor(out["floor_bytes"], ms, info["copy_bandwidth_GBps"])
            out["pct_floor_datasheet"] = pct_of_floor(out["floor_bytes"], ms, info["datasheet_GBps"])
            spec = BENCH_OPS[op]
            if spec.triton and kind == "fwd" and r.get("backend") != "torch":  # checked against the torch path
                out["max_rel_diff_to_torch"] = diff_to_torch(op, causal, T, cargs, device)
            if spec.mixing == "dense" and causal:  # dense learned M x M: the O(M^2 D^2) mix of the summaries
                M = r["M"]
                out["mix_gflop"] = 2 * o["batch"] * o["heads"] * M * (M - 1) / 2 * D * D / 1e9
                out["mix_ms_at_matmul_peak"] = out["mix_gflop"] / max(info["matmul_tflops"], 1e-9)
            traffic = modelled_traffic(op, causal, kind, o, D, T, r["block_size"])
            if traffic is not None:
                if "bytes" in traffic:  # the model's bytes at the measured copy bandwidth, against the time
                    traffic["ms_at_copy_bw"] = traffic["bytes"] / (info["copy_bandwidth_GBps"] * 1e9) * 1e3
                out["modelled"] = traffic
            return out

        t0 = time.monotonic()
        got = rec.run(cid, est, measure, **meta)
        free_memory()
        if got is not None:
            last[series] = (T, time.monotonic() - t0)
            print(f"{cid:40s} {got['ms']:9.3f} ms  {fmt_pct(got.get('pct_floor_datasheet'))} of the floor "
                  f"(datasheet), {fmt_pct(got['pct_floor_copy'])} (copy)", flush=True)
        else:
            print(f"{cid:40s} {stage_case(rec, cid)['status']}", flush=True)


def stage_case(rec: Recorder, cid: str) -> dict:
    return next(c for c in rec.stage["cases"] if c["case"] == cid)


def pct_of_floor(nbytes: int, ms: float, gbps: float | None) -> float | None:
    """The floor's time (``nbytes`` at ``gbps``) over the measured ``ms``, in percent."""
    if not gbps or not ms:
        return None
    return round(100 * nbytes / (gbps * 1e9) / (ms / 1e3), 2)


def fmt_pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}%"


# ----------------------------------------------------------------------------------- GPU tests
def gpu_test_files() -> list[str]:
    """The test files (any depth under tests/) that mark GPU tests."""
    files = []
    for path in sorted(Path(ROOT, "tests").rglob("test_*.py")):
        text = path.read_text(errors="replace")
        if "pytest.mark.gpu" in text:
            files.append(str(path.relative_to(ROOT)))
    return files


class GpuTestRecorder:
    """A pytest plugin: every collected test planned as a case, each result recorded as it comes, and no new
    test started past the deadline (the rest stay ``not run: out of time``)."""

    def __init__(self, rec: Recorder):
        self.rec = rec

    def pytest_collection_finish(self, session):
        self.rec.plan([item.nodeid for item in session.items])  # after -m gpu deselected the others

    def pytest_runtest_protocol(self, item, nextitem):
        if self.rec.left_s() <= 0:
            self.rec.update(item.nodeid, status="not run: out of time (the stage's deadline passed)")
            return True  # handled: not run
        self.rec.update(item.nodeid, status="running")
        return None

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            status = {"passed": "ok", "failed": "failed", "skipped": "skipped"}[report.outcome]
            detail = ""
            if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
                detail = str(report.longrepr[2])
            elif report.outcome == "failed":
                detail = (str(report.longrepr).strip().splitlines() or [""])[-1]
            self.rec.update(report.nodeid, status=status + (f": {detail[:200]}" if detail else ""),
                            phase=report.when, seconds=round(report.duration, 2))


def stage_gpu_tests(rec: Recorder) -> None:
    import pytest  # noqa: PLC0415

    files = gpu_test_files()
    rec.note(files=files)
    os.chdir(ROOT)
    args = ["-q", "-m", "gpu", "-p", "no:cacheprovider", "--timeout=120", "-rN", *files]
    code = pytest.main(args, plugins=[GpuTestRecorder(rec)])
    rec.note(pytest_exit_code=int(code))


# ------------------------------------------------------------------------------- model helpers
@contextlib.contextmanager
def peak_memory(device: str, out: dict):
    """``out["peak_mem_mb"]``: the CUDA allocator's peak during the block over what was allocated before it
    (weights, optimizer state and activations made inside count); None on a CPU."""
    import torch  # noqa: PLC0415

    if device != "cuda":
        yield
        out["peak_mem_mb"] = None
        return
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    yield
    torch.cuda.synchronize()
    out["peak_mem_mb"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)


def autocast(device: str, amp: bool):
    import torch  # noqa: PLC0415

    return torch.autocast(device, dtype=torch.bfloat16) if amp else contextlib.nullcontext()


def time_steps(step, device: str, repeats: int, warmup: int = 2) -> dict:
    """Median and [p25, p75] milliseconds of ``step()`` after ``warmup`` calls (CUDA events on a GPU)."""
    from scripts.bench_ops import quartiles, timer  # noqa: PLC0415

    for _ in range(warmup):
        step()
    ts = timer(step, device, repeats)
    return {"ms": statistics.median(ts), "ms_iqr": quartiles(ts), "repeats": repeats}


def estimate(last: tuple | None, n: int, power: int, first_s: float) -> float:
    """Seconds for a case of size ``n`` from the last one of its series ``(n, seconds)``, scaled by
    ``(n / n_last) ** power``; ``first_s`` for the first of a series."""
    if last is None:
        return first_s
    return last[1] * (n / last[0]) ** power


# --------------------------------------------------------------------------------------- Table 14
def stage_table14(rec: Recorder) -> None:
    import torch  # noqa: PLC0415

    from mhla.registry import grows_with_context, takes_blocks  # noqa: PLC0415
    from models.deit import deit  # noqa: PLC0415
    from scripts import bench_models as bm  # noqa: PLC0415
    from scripts.tables import benchmark as tb  # noqa: PLC0415

    s, t = rec.settings, rec.settings["table14"]
    device, amp, reps = s["device"], s["amp"], t["repeats"]
    dit = [(res, m) for res in t["dit_res"] for m in ["softmax", "linear", *t["dit_ms"]]
           if not isinstance(m, int) or m * 4 <= (res // 16) ** 2]
    deit_cases = [(res, attn) for res in t["deit_res"] for attn in ("softmax", "linear", "mhla")]
    rec.plan([f"dit/N{(res // 16) ** 2}/{'M' + str(m) if isinstance(m, int) else m}" for res, m in dit]
             + [f"deit_s/N{(res // 16) ** 2}/{attn}" for res, attn in deit_cases])
    last: dict = {}
    for res, m in dit:
        n = (res // 16) ** 2
        label = f"M{m}" if isinstance(m, int) else m
        cid = f"dit/N{n}/{label}"

        def run(res=res, m=m, n=n):
            out: dict = {}
            with peak_memory(device, out):
                if isinstance(m, int):
                    row = tb.time_m({"model": "DiT-S/2", "cpe_gate": False}, m, res // 8, t["dit_batch"], device, reps)
                    out.update(row, attn="mhla")
                else:
                    torch.manual_seed(0)
                    model, inputs, _, cfg = bm.build_case("DiT-S/2", res, m, t["dit_batch"], device, False)
                    secs = bm.measure(model, inputs, "fwd", device, reps, amp)
                    med = statistics.median(secs)
                    out.update(attn=m, n_tokens=n, ms=med * 1e3, images_per_s=t["dit_batch"] / med)
                    del model, inputs
            return {**out, "res": res, "batch": t["dit_batch"], "model": "DiT-S/2"}

        key = ("dit", "softmax" if grows_with_context(str(m)) else "linear")
        t0 = time.monotonic()
        got = rec.run(cid, estimate(last.get(key), n, 2 if grows_with_context(str(m)) else 1, t["first_case_s"]), run)
        free_memory()
        if got is not None:
            last[key] = (n, time.monotonic() - t0)
        print(f"table14 {cid}: {stage_case(rec, cid)['status']}" + (f" {got['ms']:.2f} ms" if got else ""), flush=True)
    for res, attn in deit_cases:
        n = (res // 16) ** 2
        cid = f"deit_s/N{n}/{attn}"

        def run(res=res, attn=attn, n=n):
            out: dict = {}
            with peak_memory(device, out):
                torch.manual_seed(0)
                model = deit("small", attn, img_size=res, num_blocks=t["deit_blocks"]).to(device).eval()
                x = torch.randn(t["deit_batch"], 3, res, res, device=device)

                def step():
                    with torch.no_grad(), autocast(device, amp):
                        model(x)

                out.update(time_steps(step, device, reps, warmup=1))
            return {**out, "attn": attn, "res": res, "n_tokens": n, "batch": t["deit_batch"], "model": "DeiT-S/16",
                    "M": t["deit_blocks"] if takes_blocks(attn) else None,
                    "images_per_s": t["deit_batch"] / (out["ms"] / 1e3)}

        key = ("deit", grows_with_context(attn))
        t0 = time.monotonic()
        got = rec.run(cid, estimate(last.get(key), n, 2 if grows_with_context(attn) else 1, t["first_case_s"]), run)
        free_memory()
        if got is not None:
            last[key] = (n, time.monotonic() - t0)
        print(f"table14 {cid}: {stage_case(rec, cid)['status']}" + (f" {got['ms']:.2f} ms" if got else ""), flush=True)


# -------------------------------------------------------------------------------- train throughput
def stage_train_throughput(rec: Recorder) -> None:
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    from models.deit import deit  # noqa: PLC0415
    from models.lm import MHLALMConfig, MHLALMForCausalLM  # noqa: PLC0415

    s, t = rec.settings, rec.settings["throughput"]
    device, amp, reps = s["device"], s["amp"], t["repeats"]
    attns = ("softmax", "linear", "mhla")
    rec.plan([f"deit_t/{a}" for a in attns] + [f"lm/ctx{c}/{a}" for c in t["lm_contexts"] for a in attns])

    def train_step(model, loss_fn):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            with autocast(device, amp):
                loss = loss_fn()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return step

    for attn in attns:
        def run_deit(attn=attn):
            out: dict = {}
            with peak_memory(device, out):
                torch.manual_seed(0)
                model = deit("tiny", attn, img_size=t["deit_res"], num_blocks=t["deit_blocks"]).to(device).train()
                x = torch.randn(t["deit_batch"], 3, t["deit_res"], t["deit_res"], device=device)
                y = torch.randint(0, 1000, (t["deit_batch"],), device=device)
                out.update(time_steps(train_step(model, lambda: F.cross_entropy(model(x).float(), y)), device, reps))
            return {**out, "model": "DeiT-T", "attn": attn, "res": t["deit_res"], "batch": t["deit_batch"],
                    "images_per_s": t["deit_batch"] / (out["ms"] / 1e3)}

        got = rec.run(f"deit_t/{attn}", t["first_case_s"], run_deit)
        free_memory()
        print(f"throughput deit_t/{attn}: {stage_case(rec, f'deit_t/{attn}')['status']}"
              + (f" {got['images_per_s']:.1f} img/s" if got else ""), flush=True)
    for ctx in t["lm_contexts"]:
        batch = max(1, t["lm_tokens_per_step"] // ctx)
        for attn in attns:
            def run_lm(attn=attn, ctx=ctx, batch=batch):
                out: dict = {}
                with peak_memory(device, out):
                    torch.manual_seed(0)
                    cfg = MHLALMConfig(attn={"name": attn}, vocab_size=t["lm_vocab"], hidden_size=t["lm_hidden"],
                                       num_hidden_layers=t["lm_layers"], num_heads=t["lm_heads"],
                                       max_position_embeddings=ctx)
                    with torch.device(device):
                        model = MHLALMForCausalLM(cfg).train()
                    ids = torch.randint(0, t["lm_vocab"], (batch, ctx), device=device)
                    params = sum(p.numel() for p in model.parameters())
                    out.update(time_steps(train_step(model, lambda: model(input_ids=ids, labels=ids).loss),
                                          device, reps))
                return {**out, "model": f"LM {params / 1e6:.3g}M", "attn": attn, "context": ctx, "batch": batch,
                        "tokens_per_s": batch * ctx / (out["ms"] / 1e3)}

            cid = f"lm/ctx{ctx}/{attn}"
            got = rec.run(cid, t["first_case_s"], run_lm)
            free_memory()
            print(f"throughput {cid}: {stage_case(rec, cid)['status']}"
                  + (f" {got['tokens_per_s']:.0f} tokens/s" if got else ""), flush=True)


# ------------------------------------------------------------------------------------- bf16 runs
# Each task's mini config as train.py runs it, 20 steps; the overrides keep its evaluation and samples short
# and read no data the GPU machine lacks (lm_mini's corpus: this repository's docs/, one document per line,
# instead of the gensim wheel's text, which is too large to carry).
TRAIN_TASKS = {
    "mnist": ["data.eval_limit=1000"],
    "mnist_gen": ["task.sample.steps=10"],
    "lm_mini": ["data.source=text", f"data.path={ROOT}/docs", "data.doc_per_line=true"],
    "mqar": [],
    "video_mini": ["sample.num_steps=4"],
    "sana_mini": [],
}
DRY_TASK_OVERRIDES = {"mqar": ["data.num_train=512", "data.num_test=64"]}


def train_command(task: str, precision: str, steps: int, device: str, run_dir: str, dry: bool) -> list[str]:
    extra = list(TRAIN_TASKS.get(task, [])) + (DRY_TASK_OVERRIDES.get(task, []) if dry else [])
    if task == "lm_mini":  # a tokenizer cache per run: the bf16 and fp32 runs train theirs side by side
        extra.append(f"data.cache_dir={run_dir}/cache")
    return [sys.executable, os.path.join(ROOT, "train.py"), f"task={task}", "logger=none", "seed=0",
            f"trainer.precision={precision}", f"trainer.device={device}", f"trainer.max_steps={steps}",
            "trainer.max_epochs=null", "trainer.log_every=1", "trainer.progress_bar=false",
            "trainer.count_flops=false", "trainer.num_workers=0", f"hydra.run.dir={run_dir}", *extra]


def train_losses(run_dir: str) -> list[float]:
    """The per-step training losses a run logged (``metrics.jsonl``, ``train/loss``)."""
    path = Path(run_dir, "metrics.jsonl")
    if not path.exists():
        return []
    losses = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rec = json.loads(line)
            if "train/loss" in rec:
                losses.append(float(rec["train/loss"]))
    return losses


def track_verdict(bf16: list[float], fp32: list[float], steps: int) -> dict:
    """Whether the bf16 losses are finite and track the fp32 ones (:data:`TRACK_RULE`)."""
    k = min(5, steps)
    out = {"bf16_finite": bool(bf16) and all(math.isfinite(x) for x in bf16)}
    if len(bf16) < steps or len(fp32) < steps:
        out.update(tracks=False, why=f"runs logged {len(bf16)} (bf16) / {len(fp32)} (fp32) of {steps} steps")
        return out
    a, b = statistics.fmean(bf16[-k:]), statistics.fmean(fp32[-k:])
    rel = abs(a - b) / max(abs(b), 1e-12)
    out.update(bf16_last_mean=a, fp32_last_mean=b, rel_diff=rel, tracks=out["bf16_finite"] and rel <= TRACK_REL_TOL)
    return out


def stage_train_bf16(rec: Recorder) -> None:
    s, t = rec.settings, rec.settings["train_bf16"]
    runs = [(task, prec) for task in t["tasks"] for prec in ("bf16", "fp32")]
    rec.plan([f"{task}/{prec}" for task, prec in runs] + [f"{task}/track" for task in t["tasks"]])
    base = tempfile.mkdtemp(prefix="campaign_train_")
    pending, running, done = list(runs), {}, {}
    while pending or running:
        while pending and len(running) < t["jobs"] and rec.left_s() > 5:
            task, prec = pending.pop(0)
            run_dir = os.path.join(base, f"{task}_{prec}")
            os.makedirs(run_dir, exist_ok=True)
            log = open(os.path.join(run_dir, "stdout.log"), "w")  # noqa: SIM115  (closed when the run ends)
            cmd = train_command(task, prec, t["steps"], s["device"], run_dir, s["dry"])
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            running[(task, prec)] = (proc, log, run_dir, time.monotonic())
            rec.update(f"{task}/{prec}", status="running", command=" ".join(cmd[1:]))
        if not pending and not running:
            break
        if rec.left_s() <= 0 or (pending and not running):
            for (task, prec), (proc, log, run_dir, t0) in running.items():
                proc.kill()
                proc.wait()
                log.close()
                rec.update(f"{task}/{prec}", status="cut: stopped at the stage's deadline",
                           losses=train_losses(run_dir))
            for task, prec in pending:
                rec.update(f"{task}/{prec}", status="not run: out of time")
            running, pending = {}, []
            break
        time.sleep(0.5)
        for key, (proc, log, run_dir, t0) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            losses = train_losses(run_dir)
            fields = {"losses": losses, "seconds": round(time.monotonic() - t0, 1), "exit_code": proc.returncode}
            status = "ok" if proc.returncode == 0 else "failed: " + error_line(Path(run_dir, "stdout.log"))
            done[key] = rec.update(f"{key[0]}/{key[1]}", status=status, **fields)
            print(f"train_bf16 {key[0]}/{key[1]}: {status} ({fields['seconds']} s, {len(losses)} losses)", flush=True)
            del running[key]
    for task in t["tasks"]:
        b, f = done.get((task, "bf16")), done.get((task, "fp32"))
        if b is None or f is None:
            rec.update(f"{task}/track", status="not run: a run did not finish")
            continue
        verdict = track_verdict(b["losses"], f["losses"], t["steps"])
        failed = [f"{prec} run {r['status']}" for prec, r in (("bf16", b), ("fp32", f)) if r["status"] != "ok"]
        if failed:
            verdict.update(tracks=False, why="; ".join(failed))
        rec.update(f"{task}/track", status="ok", **verdict)
    shutil.rmtree(base, ignore_errors=True)


def error_line(log: Path) -> str:
    """The last line of a failed run's output that names an exception (else its last line)."""
    lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", ln)]
    return ((errors or lines or ["no output"])[-1]).strip()[:200]


WORKERS = {"ops": stage_ops, "gpu_tests": stage_gpu_tests, "table14": stage_table14,
           "train_throughput": stage_train_throughput, "train_bf16": stage_train_bf16}


def run_worker(args) -> int:
    """``--worker STAGE``: run one stage, recording into ``<out-dir>/campaign.partial.json``."""
    rec = Recorder(args.out_dir, args.worker, args.deadline)
    if rec.settings["dry"]:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    WORKERS[args.worker](rec)
    return 0


# ===================================================================================== orchestration
def allotted_s(stage: Stage, later: list[Stage], left_s: float, dry: bool) -> float:
    """This stage's share of the time left: its nominal budget scaled by (time left / the nominal budgets of
    this and the later stages), so that time an earlier stage did not use goes to the later ones."""
    budget = (lambda st: st.dry_budget_s) if dry else (lambda st: st.budget_s)
    total = budget(stage) + sum(budget(st) for st in later)
    return max(0.0, left_s) * budget(stage) / total


def stage_share(stage: Stage, later: list[Stage], left_s: float, dry: bool) -> float:
    """The seconds a stage gets: :func:`allotted_s`, raised to the stage's minimum when the time left allows
    (an earlier stage goes before the later ones); under its minimum it is not run."""
    need = stage.dry_min_s if dry else stage.min_s
    return min(max(allotted_s(stage, later, left_s, dry), need), max(left_s, 0.0))


def run_stage_process(args, stage: Stage, deadline: float, log) -> tuple[int | None, bool]:
    """The stage's worker in a new process group, its output to stdout and ``log``; stopped (the whole group:
    train.py children too) at ``deadline`` plus the grace. Returns (exit code, whether it was stopped)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", stage.name, "--out-dir", args.out_dir,
           "--deadline", f"{deadline:.3f}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.dry:
        env.setdefault("TRITON_INTERPRET", "1")
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    # its own process group (not a new session: a device machine ends a command's processes when it returns,
    # except those of a new session)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            process_group=0)
    stopped = False
    kill_at = deadline + GRACE_S[args.dry]

    def stop(*_):
        nonlocal stopped
        stopped = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    import threading  # noqa: PLC0415

    timer = threading.Timer(max(0.0, kill_at - time.time()), stop)
    timer.start()
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        proc.wait()
    finally:
        timer.cancel()
    return proc.returncode, stopped


def finish_stage(state: dict, name: str, code: int | None, stopped: bool, seconds: float) -> None:
    """The stage's status from its worker's exit, and every case it left ``pending`` or ``running``."""
    st = stage_entry(state, name)
    st["seconds"] = round(seconds, 1)
    if stopped:
        st["status"] = "cut: stopped at its budget"
    elif code == 0:
        st["status"] = "done"
    else:
        st["status"] = f"failed: worker exit code {code}"
    for c in st["cases"]:
        if c["status"] == "pending":
            c["status"] = "not run: out of time" if stopped else f"not run: the stage ended ({st['status']})"
        elif c["status"] == "running":
            c["status"] = "cut: stopped at the stage's budget" if stopped else f"failed: {st['status']}"


def orchestrate(args) -> int:
    t0 = args.started_at or time.time()
    os.makedirs(args.out_dir, exist_ok=True)
    settings = campaign_settings(args.dry)
    chosen = [st for st in STAGES if st.name in args.stages]
    state = {"campaign": "issue 46 GPU campaign", "complete": False, "dry": args.dry,
             "command": "python scripts/gpu_campaign.py " + " ".join(args.argv),
             "header": machine_header(args.dry),
             "settings": {**settings, "budget_s": args.budget_s, "started_at": t0,
                          "stage_budgets_s": {st.name: st.dry_budget_s if args.dry else st.budget_s for st in chosen},
                          "track_rule": TRACK_RULE},
             "stages": [{"name": st.name, "title": st.title, "status": "pending", "cases": []} for st in chosen]}
    print("machine:", json.dumps(state["header"]), flush=True)
    save_state(args.out_dir, state)
    with open(os.path.join(args.out_dir, LOG), "a") as log:
        for i, st in enumerate(chosen):
            left = args.budget_s - (time.time() - t0) - RESERVE_S
            need = st.dry_min_s if args.dry else st.min_s
            share = stage_share(st, chosen[i + 1:], left, args.dry)
            entry = stage_entry(state, st.name)
            entry["allotted_s"] = round(share, 1)
            if share < need:
                entry["status"] = (f"not run: out of time ({max(left, 0):.0f} s left of the budget, it needs at "
                                   f"least {need:.0f} s)")
                print(f"== {st.name}: {entry['status']}", flush=True)
                save_state(args.out_dir, state)
                continue
            entry["status"] = "running"
            save_state(args.out_dir, state)
            print(f"== {st.name}: {st.title}, {share:.0f} s", flush=True)
            start = time.time()
            code, stopped = run_stage_process(args, st, start + share, log)
            state = load_state(args.out_dir)  # the worker's cases
            finish_stage(state, st.name, code, stopped, time.time() - start)
            print(f"== {st.name}: {stage_entry(state, st.name)['status']} in {time.time() - start:.0f} s", flush=True)
            save_state(args.out_dir, state)
    state["goals"], state["checks"] = goals(state), checks(state)
    state["complete"] = True
    state["seconds"] = round(time.time() - t0, 1)
    save_state(args.out_dir, state, FINAL_JSON)
    Path(args.out_dir, FINAL_MD).write_text(to_markdown(state))
    os.remove(os.path.join(args.out_dir, PARTIAL))
    print(f"\nwrote {args.out_dir}/{FINAL_JSON}, {FINAL_MD} ({state['seconds']:.0f} s)\n")
    print(goals_table(state))
    return 0


# ========================================================================================== goals
def op_records(state: dict) -> list[dict]:
    st = next((s for s in state["stages"] if s["name"] == "ops"), None)
    return [c for c in st["cases"] if c["status"] == "ok"] if st else []


def ops_info(state: dict) -> dict:
    st = next((s for s in state["stages"] if s["name"] == "ops"), None)
    return (st or {}).get("info", {})


def goal(gid: str, text: str, target: str, values: list[tuple[str, float]], ok, unit: str = "",
         detail: str = "") -> dict:
    """One goal row: ``values`` are ``(what, number)`` pairs (every measured case the goal covers), ``ok(x)``
    its test; met when every value passes, not measured when there is none; the measured column shows the
    worst (the first that fails, else the one nearest its bound: the caller orders them worst first)."""
    if not values:
        return {"id": gid, "goal": text, "target": target, "status": "not measured", "measured": "-",
                "detail": detail or "no case of this goal was measured"}
    failing = [(w, x) for w, x in values if not ok(x)]
    what, x = (failing or values)[0]
    misses = f"{len(failing)} of {len(values)} cases miss it" if failing else ""
    return {"id": gid, "goal": text, "target": target, "status": "not met" if failing else "met",
            "measured": f"{x:.3g}{unit} ({what})", "values": {w: v for w, v in values},
            "detail": "; ".join(t for t in (detail, misses) if t)}


def goals(state: dict) -> list[dict]:
    """Issue 46 item 5, from the op benchmark's records (D = the first of the campaign's dims, T levels as in
    ``settings["t_levels"]``; the floor over the datasheet bandwidth when the GPU is known, else over the
    measured copy bandwidth)."""
    s, recs = state["settings"], op_records(state)
    lv, dims = s["t_levels"], s["ops"]["dims"]
    d64, d128 = dims[0], dims[-1]
    pct_key = "pct_floor_datasheet" if ops_info(state).get("datasheet_GBps") else "pct_floor_copy"
    floor_note = ("floor over the datasheet bandwidth" if pct_key == "pct_floor_datasheet"
                  else "floor over the measured copy bandwidth (no datasheet figure for this device)")

    def get(op, causal, kind, D=d64):
        return {r["T"]: r for r in recs if (r["op"], r["causal"], r["pass"], r["D"]) == (op, causal, kind, D)}

    def pcts(op, causal, kind, tmin, tmax=None):
        rows = get(op, causal, kind)
        vals = [(f"T {T}", rows[T][pct_key]) for T in sorted(rows) if T >= tmin and (tmax is None or T <= tmax)
                and rows[T].get(pct_key) is not None]
        return sorted(vals, key=lambda v: v[1])

    def ratios(num, den, tmin=0, lower_better=True):
        vals = []
        for T, a in num.items():
            if T >= tmin and T in den:
                vals.append((f"T {T}", a["ms"] / den[T]["ms"]))
        return sorted(vals, key=lambda v: -v[1] if lower_better else v[1])

    out = []
    t64k = get("mhla", False, "fwd").get(lv["64k"])
    ms_note = f"T {lv['64k']}: {t64k['ms']:.2f} ms" if t64k else ""
    out.append(goal("nc_fwd_long", f"non-causal forward, MHLA (Triton), D {d64}, T >= {lv['16k']}",
                    ">= 50% of the 4-tensor floor (T 65536, D 64: <= 2.6 ms)",
                    pcts("mhla", False, "fwd", lv["16k"]), lambda x: x >= 50, "%", f"{floor_note}; {ms_note}"))
    out.append(goal("nc_fwd_4k", f"non-causal forward, MHLA (Triton), D {d64}, T {lv['4k']}",
                    ">= 35% of the 4-tensor floor", pcts("mhla", False, "fwd", lv["4k"], lv["4k"]),
                    lambda x: x >= 35, "%", floor_note))
    out.append(goal("nc_fwdbwd", f"non-causal forward+backward, MHLA (Triton), D {d64}, T >= {lv['16k']}",
                    ">= 33% of the 11-tensor floor", pcts("mhla", False, "fwdbwd", lv["16k"]),
                    lambda x: x >= 33, "%", floor_note))
    both = []
    for kind in ("fwd", "fwdbwd"):
        both += [(f"{kind} {w}", x) for w, x in ratios(get("mhla_window", True, kind), get("mhla", False, kind),
                                                          lv["4k"])]
    out.append(goal("causal_vs_noncausal", f"causal MHLA in the LM's setting (32 learned rows, far blocks folded) "
                    f"over non-causal MHLA, same shape, D {d64}, T >= {lv['4k']}, fwd and fwd+bwd", "<= 1.5x",
                    sorted(both, key=lambda v: -v[1]), lambda x: x <= 1.5, "x"))
    scal = []
    for kind in ("fwd", "fwdbwd"):
        rows = get("mhla_window", True, kind)
        if lv["4k"] in rows and lv["64k"] in rows and lv["64k"] > lv["4k"]:
            scal.append((kind, rows[lv["64k"]]["ms"] / rows[lv["4k"]]["ms"]))
    out.append(goal("causal_scaling", f"causal MHLA in the LM's setting, T {lv['64k']} over T {lv['4k']}, D {d64}",
                    "<= 17x (16x the tokens)", sorted(scal, key=lambda v: -v[1]), lambda x: x <= 17, "x"))
    fla = []
    for D in sorted(set(dims)):
        for kind in ("fwd", "fwdbwd"):
            fla += [(f"D {D} {kind} {w}", x) for w, x in ratios(get("mhla_window", True, kind, D),
                                                                get("fla_linear", True, kind, D))]
    out.append(goal("vs_fla", "causal MHLA (LM setting) over flash-linear-attention's chunk_linear_attn, same "
                    "shape, every T, D and pass", "<= 1.25x", sorted(fla, key=lambda v: -v[1]),
                    lambda x: x <= 1.25, "x"))
    out.append(goal("vs_sdpa", f"non-causal forward, MHLA (Triton) over SDPA (FlashAttention), D {d64}, "
                    f"T >= {lv['1k']}", "< 1x (faster)", ratios(get("mhla", False, "fwd"), get("sdpa", False, "fwd"),
                                                              lv["1k"]), lambda x: x < 1, "x"))
    d_ratio = []
    if d128 != d64:
        for kind in ("fwd", "fwdbwd"):
            a, b = get("mhla", False, kind, d128), get("mhla", False, kind, d64)
            d_ratio += [(f"{kind} {w}", x) for w, x in ratios(a, b)]
    out.append(goal("d128_vs_d64", f"non-causal MHLA (Triton), D {d128} over D {d64}, same T, fwd and fwd+bwd",
                    "<= 2.2x (2x the data)", sorted(d_ratio, key=lambda v: -v[1]), lambda x: x <= 2.2, "x"))
    out.append(goal("cpu_bound", "on the CPU: MHLA over plain linear attention, causal and not, T 1k-16k",
                    "<= 1.3x", [], lambda x: x <= 1.3, "x",
                    "a CPU bound, not measured by this campaign: make bench / the CPU tests keep it"))
    return out


def checks(state: dict) -> list[dict]:
    """What must hold for the goals to mean anything: the GPU tests pass, the Triton outputs agree with the
    torch path, and every task's bf16 training stays finite and tracks fp32."""
    out = []
    tests = next((s for s in state["stages"] if s["name"] == "gpu_tests"), None)
    if tests is not None:
        sts = [c["status"].split(":")[0] for c in tests["cases"]]
        n_ok, n_fail = sts.count("ok"), sts.count("failed")
        out.append({"check": "GPU tests pass", "status": "not measured" if not n_ok + n_fail else
                    ("met" if not n_fail else "not met"),
                    "measured": f"{n_ok} passed, {n_fail} failed, {sts.count('skipped')} skipped, "
                                f"{len(sts) - n_ok - n_fail - sts.count('skipped')} not run or cut"})
    diffs = [(r["case"], r["max_rel_diff_to_torch"]) for r in op_records(state) if "max_rel_diff_to_torch" in r]
    worst = max(diffs, key=lambda v: v[1]) if diffs else None
    out.append({"check": f"Triton output vs the torch path, same inputs: max rel diff <= {MAX_REL_DIFF_BF16:g}",
                "status": "not measured" if worst is None else ("met" if worst[1] <= MAX_REL_DIFF_BF16 else "not met"),
                "measured": "-" if worst is None else f"{worst[1]:.2e} (worst: {worst[0]}, {len(diffs)} cases)"})
    train = next((s for s in state["stages"] if s["name"] == "train_bf16"), None)
    if train is not None:
        for c in train["cases"]:
            if not c["case"].endswith("/track"):
                continue
            task = c["case"].split("/")[0]
            if c["status"] != "ok":
                out.append({"check": f"{task}: bf16 training finite and tracks fp32", "status": "not measured",
                            "measured": c["status"]})
                continue
            rel = c.get("rel_diff")
            measured = [f"bf16 {c['bf16_last_mean']:.4g} vs fp32 {c['fp32_last_mean']:.4g} ({rel:.1%})"
                        if rel is not None else "", c.get("why", ""),
                        "" if c["bf16_finite"] else "bf16 losses not finite (or none logged)"]
            out.append({"check": f"{task}: bf16 training finite and tracks fp32",
                        "status": "met" if c["tracks"] else "not met",
                        "measured": "; ".join(m for m in measured if m)})
    return out


# ======================================================================================= markdown
def goals_table(state: dict) -> str:
    lines = ["Goals (issue 46 item 5)" + (" -- DRY RUN on a CPU: the numbers mean nothing" if state["dry"] else ""),
             "", "| goal | target | measured | status |", "|---|---|---|---|"]
    for g in state["goals"]:
        lines.append(f"| {g['goal']} | {g['target']} | {g['measured']} | **{g['status']}** |")
    lines += ["", "| check | measured | status |", "|---|---|---|"]
    for c in state["checks"]:
        lines.append(f"| {c['check']} | {c['measured']} | **{c['status']}** |")
    return "\n".join(lines) + "\n"


def fmt(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec)


def to_markdown(state: dict) -> str:
    h, s = state["header"], state["settings"]
    o = s["ops"]
    device = h.get("gpu") or f"CPU ({h.get('platform')})"
    lines = [f"# GPU campaign (issue 46): {device}" + (" -- DRY RUN" if state["dry"] else ""), "",
             f"Command: `{state['command']}`; {state['seconds']:.0f} s of a {s['budget_s']:.0f} s budget "
             f"(counted from before the wheels were installed).", "",
             f"Machine: {device}, driver {h.get('driver')}, CUDA {h.get('cuda')}, torch {h.get('torch')}, triton "
             f"{h.get('triton')}, fla {h.get('fla')}, python {h.get('python')}; host {h.get('hostname')}, "
             f"{h.get('cpu_count')} CPUs, load {h.get('loadavg')}; {h.get('date')}; commit {h.get('commit')}"
             + {True: " (uncommitted changes)", False: "", None: " (uncommitted changes: unknown)"}[h.get("dirty")]
             + ".",
             ""]
    if state["dry"]:
        lines += ["DRY RUN: the campaign's code on a CPU with tiny shapes, the MHLA op on the torch path, the goals' "
                  f"T levels mapped to {s['t_levels']}; nothing here is a measurement of the kernels.", ""]
    lines += [goals_table(state), "## Stages", "", "| stage | status | allotted s | used s | ok | failed | skipped "
              "| not run / cut |", "|---|---|---|---|---|---|---|---|"]
    for st in state["stages"]:
        sts = [c["status"].split(":")[0].split(" ")[0] for c in st["cases"]]
        lines.append(f"| {st['name']} | {st['status']} | {st.get('allotted_s', '-')} | {st.get('seconds', '-')} | "
                     f"{sts.count('ok')} | {sts.count('failed')} | {sts.count('skipped')} | "
                     f"{sts.count('not') + sts.count('cut')} |")
    info = ops_info(state)
    recs = op_records(state)
    if info:
        lines += ["", "## Op benchmark", "",
                  f"B {o['batch']}, H {o['heads']}, {o['dtype']}, causal blocks of {o['block']}; non-causal M from "
                  "bench_ops.choose_num_blocks. Copy bandwidth "
                  f"{info.get('copy_bandwidth_GBps')} GB/s (measured, read + write), datasheet "
                  f"{info.get('datasheet_GBps')} GB/s, matrix product {info.get('matmul_tflops')} TFLOP/s "
                  "(measured). Floor: 4 tensors forward, 11 forward+backward, read or written once. "
                  "`mhla_window`: causal MHLA in the LM's setting (32 learned rows, uniform_far: far blocks folded); "
                  "`_half`: with the opt-in half block summaries (MHLA_SUMMARY_DTYPE=input).",
                  "", "| D | pass | causal | op | T | M | ms | % floor (datasheet) | % floor (copy) | "
                  "max rel diff to torch | modelled bytes / floor | modelled launches | peak MB |",
                  "|---" * 13 + "|"]
        for r in recs:
            mod = r.get("modelled") or {}
            ratio = mod.get("bytes") / r["floor_bytes"] if isinstance(mod.get("bytes"), (int, float)) else None
            lines.append(f"| {r['D']} | {r['pass']} | {r['causal']} | {r['op']} | {r['T']} | {r.get('M', '-')} | "
                         f"{r['ms']:.3f} | {fmt(r.get('pct_floor_datasheet'), '.1f')} | "
                         f"{fmt(r['pct_floor_copy'], '.1f')} | "
                         f"{fmt(r.get('max_rel_diff_to_torch'), '.1e')} | {fmt(ratio, '.2f')} | "
                         f"{mod.get('launches', '-')} | "
                         f"{fmt(r.get('peak_mem_mb'), '.0f')} |")
        dense = [r for r in recs if "mix_gflop" in r]
        if dense:
            lines += ["", "### Dense learned M x M (causal, M = T / 64): the O(M^2 D^2) mix", "",
                      "Quadratic in T by construction; the mix's FLOPs at the measured matrix-product rate, against "
                      "the case's time.", "", "| D | pass | T | M | ms | mix GFLOP | mix ms at the measured peak | "
                      "share of the time |", "|---|---|---|---|---|---|---|---|"]
            for r in dense:
                lines.append(f"| {r['D']} | {r['pass']} | {r['T']} | {r['M']} | {r['ms']:.3f} | {r['mix_gflop']:.3g} "
                             f"| {r['mix_ms_at_matmul_peak']:.3g} | {r['mix_ms_at_matmul_peak'] / r['ms']:.1%} |")
    for name, title, cols in (
            ("table14", "Table 14: DiT-S/2 latency across M, DeiT-S/16 throughput",
             ("model", "n_tokens", "attn", "M", "batch", "ms", "images_per_s", "peak_mem_mb")),
            ("train_throughput", "Training-step throughput",
             ("model", "attn", "context", "batch", "ms", "images_per_s", "tokens_per_s", "peak_mem_mb"))):
        st = next((x for x in state["stages"] if x["name"] == name), None)
        if st is None:
            continue
        lines += ["", f"## {title}", "", "| case | status | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
        for c in st["cases"]:
            vals = [fmt(c.get(k)) if isinstance(c.get(k), float) else str(c.get(k) if c.get(k) is not None else "-")
                    for k in cols]
            lines.append(f"| {c['case']} | {c['status']} | " + " | ".join(vals) + " |")
    train = next((x for x in state["stages"] if x["name"] == "train_bf16"), None)
    if train is not None:
        lines += ["", f"## {s['train_bf16']['steps']}-step training, bf16 against fp32", "",
                  f"Track rule: {TRACK_RULE}.", "",
                  "| run | status | losses (first, last) |", "|---|---|---|"]
        for c in train["cases"]:
            if c["case"].endswith("/track"):
                continue
            ls = c.get("losses") or []
            lines.append(f"| {c['case']} | {c['status']} | " + (f"{ls[0]:.4g}, {ls[-1]:.4g} ({len(ls)} steps)"
                                                               if ls else "-") + " |")
    tests = next((x for x in state["stages"] if x["name"] == "gpu_tests"), None)
    if tests is not None:
        lines += ["", "## GPU tests", "", "| test | status | s |", "|---|---|---|"]
        lines += [f"| `{c['case']}` | {c['status']} | {c.get('seconds', '-')} |" for c in tests["cases"]]
    lines += ["", "How to run it: docs/kernels.md#gpu-campaign."]
    return "\n".join(lines) + "\n"


# =========================================================================================== main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true", help="the same code on this CPU, tiny shapes and budget")
    p.add_argument("--out-dir", default=None, help="default $OUT, else outputs/gpu_campaign (--dry: a temp folder)")
    p.add_argument("--budget-s", type=float, default=None, help="the whole campaign's seconds (default 480; dry 60)")
    p.add_argument("--started-at", type=float, default=None,
                   help="epoch seconds the budget counts from (the wrapper's start, before the wheels)")
    p.add_argument("--stages", nargs="+", choices=STAGE_NAMES, default=list(STAGE_NAMES),
                   help="a subset, run in the campaign's order")
    p.add_argument("--worker", choices=STAGE_NAMES, help=argparse.SUPPRESS)  # internal: run one stage
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.worker:
        if not args.out_dir or args.deadline is None:
            p.error("--worker needs --out-dir and --deadline")
        return args
    if args.out_dir is None:
        args.out_dir = (tempfile.mkdtemp(prefix="gpu_campaign_dry_") if args.dry
                        else os.environ.get("OUT") or os.path.join(ROOT, "outputs", "gpu_campaign"))
    if args.budget_s is None:
        args.budget_s = DEFAULT_BUDGET_S[args.dry]
    if not args.dry:
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            p.error("no CUDA device here: run with --dry (the same code on this CPU, tiny shapes)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
