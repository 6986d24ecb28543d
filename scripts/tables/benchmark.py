"""The benchmark across M (Table 14, and Table 7b's throughput): DiT forward time with the timing of
``scripts/bench_models.py``, at the paper's size on the GPU (full) or smaller on this CPU (mini); what each
measures is ``registry.BENCH``."""

from __future__ import annotations

import os
import statistics

import torch

from mhla.layouts import factorize_blocks
from scripts import bench_models as bm
from tasks.common.utils import system_info

from .registry import BENCH, Table


def bench_across_m(table: str, scale: str, device: str, batch: int | None = None, repeats: int | None = None) -> dict:
    """DiT forward time (one denoising step, batch ``batch``) across M with ``scripts/bench_models.py``'s
    timing (one warm-up call, median of ``repeats``; CUDA events on the GPU, bf16 autocast)."""
    from models.dit import DiT_models  # noqa: PLC0415  (models/ pulls in timm)

    b = BENCH[table]
    res, ms = b[scale]
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: the full-scale benchmark runs on a GPU (SCALE=mini measures on the CPU)")
    batch = batch or (32 if device == "cuda" else 1)
    repeats = repeats or (5 if device == "cuda" else 3)
    latent = res // 8
    grid = latent // 2
    header = system_info(device)
    header.update(model=b["model"], res=res, n_tokens=grid * grid, batch=batch, repeats=repeats, mode="fwd",
                  precision="bf16 autocast" if device == "cuda" else "fp32", cpe_gate=b["cpe_gate"],
                  loadavg=os.getloadavg() if hasattr(os, "getloadavg") else None)
    rows = []
    for m in ms:
        torch.manual_seed(0)
        attn = {"name": "mhla", "num_blocks": m, "cpe": b["cpe_gate"], "gate": b["cpe_gate"]}
        model = DiT_models[b["model"]](input_size=latent, num_classes=1000, attn=attn).to(device)
        g = torch.Generator().manual_seed(0)
        inputs = (torch.randn(batch, 4, latent, latent, generator=g).to(device),
                  torch.randint(0, 1000, (batch,), generator=g).to(device),
                  torch.randint(0, 1000, (batch,), generator=g).to(device))
        secs = bm.measure(model, inputs, "fwd", device, repeats, device == "cuda")
        med = statistics.median(secs)
        q = statistics.quantiles(secs, n=4) if len(secs) > 1 else [med, med, med]
        blocks = factorize_blocks((grid, grid), m)
        rows.append({"M": m, "blocks": list(blocks), "tokens_per_block": grid * grid // m, "n_tokens": grid * grid,
                     "ms": med * 1e3, "p25_ms": q[0] * 1e3, "p75_ms": q[2] * 1e3, "images_per_s": batch / med})
        print(f"  {b['model']} {res}px N={grid * grid} M={m}: {med * 1e3:.1f} ms ({batch / med:.2f} img/s)", flush=True)
        del model, inputs
    return {"header": header, "time_method": bm.TIME_METHOD, "rows": rows}


def run_bench(spec: Table, args) -> dict:
    device = getattr(args, "device", None) or ("cuda" if args.scale == "full" else "cpu")
    try:
        return bench_across_m(spec.bench, args.scale, device, getattr(args, "bench_batch", None),
                              getattr(args, "bench_repeats", None))
    except Exception as e:  # noqa: BLE001
        print(f"  benchmark FAILED: {type(e).__name__}: {e}", flush=True)
        return {"error": f"{type(e).__name__}: {e}"}
