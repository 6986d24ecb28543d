#!/usr/bin/env python
"""Latency of one denoising step of a Wan2.1-shaped transformer: softmax (SDPA) vs linear vs MHLA (full, hybrid).

One step = one forward of ``WanTransformer3DModel`` on a batch of 1 (no CFG; a CFG step is two of these),
random weights (latency does not depend on them), text context 512 tokens.

    python scripts/bench_video.py --preset wan1.3b --device cuda     # 21 x 30 x 50 = 31,500 tokens, bf16
    python scripts/bench_video.py --preset cpu                       # scaled down, fp32, a few minutes
    python scripts/bench_video.py --preset wan1.3b_3layers --device cpu --warmup 1 --iters 3
                                     # 31,500 tokens, 3 of the 30 layers (one hybrid period), fp32: ~30 min
    python scripts/bench_video.py --preset mini_31k --device cpu     # the video_mini model at 31,500 tokens

Writes ``results/bench/video_<preset>_<device>.json``, ``.md`` and ``.png`` (``video_cpu.*`` for the ``cpu``
preset on the CPU; ``--plot-only`` redraws the ``.png`` from the ``.json``) through
``tasks.common.results.write_result``, with the load before and after (``measurement``); a run made on a busy
machine is not written unless ``--allow-busy`` (then it is marked BUSY). The paper (Table 5) reports end-to-end
sampling latency of 166 s (FlashAttention) vs 81 s (MHLA) vs 103 s (hybrid) for 50 steps with CFG; the
per-step ratio measured here is the comparable number (VAE and text encoder excluded).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch

from mhla.registry import takes_blocks
from models.wan import WAN_1_3B, apply_attention
from tasks.common.results import BusyMachine, load_summary, write_result
from tasks.common.plots import colors_for, grouped_bars, pyplot, save_figure
from tasks.common.records import Measurement
from tasks.common.utils import system_info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRESETS = {
    # the paper's setting: 81 frames at 480 x 800 -> latents 21 x 60 x 100 -> 21 x 30 x 50 tokens
    "wan1.3b": dict(arch=WAN_1_3B, latent=(21, 60, 100), blocks=(7, 3, 5), text_len=512),
    # CPU: Wan's head size (128) and block structure, 4 layers of width 512, 6 x 24 x 32 = 4,608 tokens
    "cpu": dict(arch={**WAN_1_3B, "num_attention_heads": 4, "num_layers": 4, "ffn_dim": 2048},
                latent=(6, 48, 64), blocks=(3, 4, 4), text_len=64),
    # the paper's 31,500 tokens and Wan2.1-1.3B's layers, 3 of its 30 (a CPU cannot run all 30 in minutes): one
    # period of the hybrid (layers 0, 1 MHLA, layer 2 softmax), so the 30-layer step is 10 of these plus the patch
    # embedding and head, and the speed-ups carry over to the full model
    "wan1.3b_3layers": dict(arch={**WAN_1_3B, "num_layers": 3}, latent=(21, 60, 100), blocks=(7, 3, 5),
                            text_len=512,
                            note="3 of Wan2.1-1.3B's 30 layers: one period of the hybrid pattern (layers 0 and 1 "
                                 "MHLA, layer 2 softmax), so the 30-layer step is 10 of these plus the patch "
                                 "embedding and head, and the speed-ups carry over"),
    # the CPU mini model of task=video_mini (models: wan_mini, 4 layers of width 64) at the paper's 31,500 tokens
    "mini_31k": dict(arch={**WAN_1_3B, "num_attention_heads": 4, "attention_head_dim": 16, "in_channels": 3,
                           "out_channels": 3, "text_dim": 32, "freq_dim": 32, "ffn_dim": 256, "num_layers": 4,
                           "rope_max_seq_len": 64},
                     latent=(21, 60, 100), blocks=(7, 3, 5), text_len=3,
                     note="the video_mini model (configs/model/wan_mini.yaml: 4 layers of width 64, 3 text tokens) "
                          "at the paper's token grid; at width 64 attention is nearly all of the cost, so its "
                          "speed-ups are far above the full-width model's"),
}
VARIANTS = {
    "softmax": {"name": "softmax"},
    "linear": {"name": "linear"},
    "mhla": {"name": "mhla", "layers": "all"},
    "mhla_hybrid": {"name": "mhla", "layers": "hybrid"},
}


def bench_variant(preset: dict, variant: str, device: torch.device, dtype, warmup: int, iters: int) -> dict:
    from diffusers import WanTransformer3DModel  # noqa: PLC0415

    torch.manual_seed(0)
    with torch.device(device):
        model = WanTransformer3DModel(**preset["arch"])
    attn = {**VARIANTS[variant], "normalize": False, "out_norm": True, "rope": "after"}
    if takes_blocks(attn["name"]):  # the block grid is MHLA's own option (linear attention refuses it)
        attn["blocks"] = list(preset["blocks"])
    apply_attention(model, attn)
    model = model.to(device, dtype).eval()
    x = torch.randn(1, preset["arch"]["in_channels"], *preset["latent"], device=device, dtype=dtype)
    text = torch.randn(1, preset["text_len"], preset["arch"]["text_dim"], device=device, dtype=dtype)
    t = torch.tensor([500.0], device=device)
    times = []
    with torch.inference_mode():
        for i in range(warmup + iters):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(x, t, text, return_dict=False)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return {"median_s": statistics.median(times), "min_s": min(times), "iters": len(times), "peak_mem_gib": mem}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "bench"))
    ap.add_argument("--plot-only", action="store_true",
                    help="redraw the .png of --preset / --device from its .json in --out; measure nothing")
    ap.add_argument("--allow-busy", action="store_true",
                    help="write a run made on a busy machine, marked BUSY (default: refused; the rule: "
                         "tasks.common.records.BUSY_RULE)")
    args = ap.parse_args(argv)
    if args.plot_only:
        stem = os.path.join(args.out, out_name(args.preset, torch.device(args.device).type))
        with open(stem + ".json") as f:
            print(f"wrote {plot_video(json.load(f), stem + '.png')}")
        return
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    warmup = args.warmup if args.warmup is not None else (3 if device.type == "cuda" else 1)
    iters = args.iters if args.iters is not None else (10 if device.type == "cuda" else 3)
    preset = PRESETS[args.preset]
    arch = preset["arch"]
    p = arch["patch_size"]
    grid = tuple(g // q for g, q in zip(preset["latent"], p))
    tokens = math.prod(grid)
    print(f"preset {args.preset}: {arch['num_layers']} layers, width {arch['num_attention_heads'] * arch['attention_head_dim']}, "
          f"token grid {grid} = {tokens} tokens, MHLA blocks {preset['blocks']} (M = {math.prod(preset['blocks'])}), "
          f"{device} {dtype}", flush=True)
    results = {}
    with Measurement(threads=1 if device.type == "cuda" else torch.get_num_threads(),
                     watch_other_cpu=device.type != "cuda") as load:
        if load.refuses_to_start(args.allow_busy):
            raise SystemExit(2)
        for v in args.variants:
            r = bench_variant(preset, v, device, dtype, warmup, iters)
            results[v] = r
            print(f"  {v:12s} {r['median_s'] * 1e3:10.1f} ms / step (min {r['min_s'] * 1e3:.1f})", flush=True)
    machine = system_info(str(device))
    # device_name / threads / torch: flat keys scripts/tables/table5.py reads; "machine": the full header
    info = {"preset": args.preset, "device": str(device), "device_name": machine.get("gpu", "cpu"),
            "threads": machine["torch_threads"], "dtype": str(dtype), "tokens": tokens, "grid": grid,
            "blocks": preset["blocks"], "layers": arch["num_layers"], "torch": machine["torch"],
            "warmup": warmup, "iters": iters, "machine": machine, "note": preset.get("note"), "results": results}
    try:
        stem = write_results(info, os.path.join(args.out, out_name(args.preset, device.type)), load.record,
                             args.allow_busy)
    except BusyMachine as e:
        raise SystemExit(str(e)) from None
    print(f"wrote {stem}.json, .md and .png")


def out_name(preset: str, device: str) -> str:
    """``video_<preset>_<device>``, or ``video_<preset>`` where the preset already names the device (``cpu``)."""
    return f"video_{preset}" if preset == device else f"video_{preset}_{device}"


def write_results(info: dict, stem: str, measurement: dict | None = None, allow_busy: bool = False) -> str:
    """``<stem>.json`` (``info``), ``.md`` (ms per step and speed-up per attention), ``.png`` (:func:`plot_video`),
    through :func:`tasks.common.results.write_result` (``measurement``: the load around the timing; a busy one
    is refused unless ``allow_busy``)."""
    results = info["results"]
    base = results.get("softmax", {}).get("median_s")
    lines = [f"# One denoising step, Wan2.1-shaped transformer ({info['preset']})", "",
             f"{info['device_name']}, {info['dtype']}, {info['tokens']} tokens (grid {tuple(info['grid'])}), "
             f"{info['layers']} layers, MHLA blocks {tuple(info['blocks'])}, batch 1, median of "
             f"{info.get('iters', '?')} after {info.get('warmup', '?')} warm-up." + (
                 f" {info['note']}." if info.get("note") else ""), "",
             "| attention | ms / step | speed-up vs softmax |", "|---|---|---|"]
    for v, r in results.items():
        sp = f"{base / r['median_s']:.2f}x" if base else "-"
        lines.append(f"| {v} | {r['median_s'] * 1e3:.1f} | {sp} |")
    lines += ["", f"Plot: `{os.path.basename(stem)}.png` (ms per step per attention, speed-up over softmax above "
                  "each bar; peak memory where measured; redraw from the .json with `--plot-only`)."]
    m = measurement or info.get("measurement")
    if m:
        lines += ["", f"Load: {load_summary(m)}."]
    return write_result(stem, "\n".join(lines) + "\n", info, lambda png: plot_video(info, png), measurement=measurement,
                        allow_busy=allow_busy, indent=2)


def plot_video(info: dict, path: str) -> str:
    """Bars of ms per step per attention (the speed-up over softmax above each), and peak GiB where recorded."""
    results = info["results"]
    base = results.get("softmax", {}).get("median_s")
    mem = {v: r["peak_mem_gib"] for v, r in results.items() if r.get("peak_mem_gib")}
    colors = colors_for(results)
    plt = pyplot()
    fig, axes = plt.subplots(1, 2 if mem else 1, figsize=(11 if mem else 6, 4), squeeze=False)
    ax = axes[0][0]
    group = [f"{info['tokens']} tokens"]
    grouped_bars(ax, group, {v: {group[0]: r["median_s"] * 1e3} for v, r in results.items()}, "ms / step",
                 "one denoising step (median)", colors)
    ax.margins(y=0.1)
    if base:
        for patch, r in zip(ax.patches, results.values()):
            ax.annotate(f"{base / r['median_s']:.2f}x", (patch.get_x() + patch.get_width() / 2, patch.get_height()),
                        ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    if mem:
        grouped_bars(axes[0][1], group, {v: {group[0]: g} for v, g in mem.items()}, "peak GiB", "peak memory",
                     colors)
    fig.suptitle(f"Wan2.1-shaped transformer ({info['preset']}): {info['layers']} layers, {info['device_name']}, "
                 f"{info['dtype']}", fontsize=10)
    return save_figure(fig, path)


if __name__ == "__main__":
    main()
