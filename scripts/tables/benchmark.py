"""The benchmark across M (Table 14, and Table 7b's throughput): DiT forward time with the timing of
``scripts/bench_models.py``, at the paper's size on the GPU (full) or smaller on this CPU (mini); what each
measures is ``registry.BENCH``."""

from __future__ import annotations

import statistics

import torch

from mhla.layouts import factorize_blocks
from scripts import bench_models as bm
from tasks.common.records import Measurement
from tasks.common.utils import system_info

from tasks.common import results
from .registry import BENCH, Table


def bench_across_m(table: str, scale: str, device: str, batch: int | None = None, repeats: int | None = None) -> dict:
    """DiT forward time (one denoising step, batch ``batch``) across M with ``scripts/bench_models.py``'s
    timing (one warm-up call, median of ``repeats``; CUDA events on the GPU, bf16 autocast), and the
    :class:`~tasks.common.records.Measurement` around it (commit, load before and after, busy or not)."""
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
                  precision="bf16 autocast" if device == "cuda" else "fp32", cpe_gate=b["cpe_gate"])
    with Measurement(threads=1 if device == "cuda" else torch.get_num_threads(),
                     watch_other_cpu=device != "cuda") as load:
        rows = [time_m(b, m, latent, batch, device, repeats) for m in ms]
    header["loadavg"] = load.record["load_before"]  # the table's line; the whole record: "measurement"
    return {"header": header, "time_method": bm.TIME_METHOD, "rows": rows, "measurement": load.record}


def time_m(b: dict, m: int, latent: int, batch: int, device: str, repeats: int) -> dict:
    """One row of :func:`bench_across_m`: the DiT of ``b`` with MHLA at M = ``m``."""
    from models.dit import DiT_models  # noqa: PLC0415  (models/ pulls in timm)

    grid = latent // 2
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
    print(f"  {b['model']} {latent * 8}px N={grid * grid} M={m}: {med * 1e3:.1f} ms ({batch / med:.2f} img/s)",
          flush=True)
    return {"M": m, "blocks": list(blocks), "tokens_per_block": grid * grid // m, "n_tokens": grid * grid,
            "ms": med * 1e3, "p25_ms": q[0] * 1e3, "p75_ms": q[2] * 1e3, "images_per_s": batch / med}


def run_bench(spec: Table, args) -> dict:
    """The table's benchmark (``{"error"}`` when it fails). A benchmark measured on a busy machine
    (:func:`tasks.common.records.is_busy`) is kept only with ``--allow-busy`` (marked BUSY); otherwise its rows
    are dropped and the error says why (a benchmark-only table then writes nothing: ``results.write_result``)."""
    device = getattr(args, "device", None) or ("cuda" if args.scale == "full" else "cpu")
    try:
        bench = bench_across_m(spec.bench, args.scale, device, getattr(args, "bench_batch", None),
                               getattr(args, "bench_repeats", None))
    except Exception as e:  # noqa: BLE001
        print(f"  benchmark FAILED: {type(e).__name__}: {e}", flush=True)
        return {"error": f"{type(e).__name__}: {e}"}
    if (bench.get("measurement") or {}).get("busy") and not getattr(args, "allow_busy", False) and spec.kind != "bench":
        print("  " + results.busy_refusal(f"Table {spec.id}'s benchmark", bench["measurement"]), flush=True)
        return {"error": "refused: the machine was busy (" + results.load_summary(bench["measurement"])
                         + "); rerun idle or with --allow-busy", "measurement": bench["measurement"]}
    return bench
