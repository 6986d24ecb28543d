#!/usr/bin/env python
"""Greedy decoding speed and memory: MHLA (recurrent state) vs softmax (KV cache) vs linear attention.

For each context L: prefill L prompt tokens in one call, then decode N tokens one at a time through the
model's cache (``MHLALMForCausalLM`` with ``attn_type`` mhla / softmax / linear, same size and code).
Reports prefill time, decode tokens/s, peak memory (CUDA: ``max_memory_allocated``; CPU: peak RSS growth
of a fresh child process per measurement) and the cache size after decoding.

    python scripts/bench_generation.py                      # CPU, small model, L = 1k, 4k, 16k
    python scripts/bench_generation.py --device cuda --preset 340m --contexts 2048 8192 32768
Writes results/bench/generation_<device>.json and .md with a machine header, and .png (each measure against L per
attention, log-log; ``--plot-only`` redraws it from the .json).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import time

import torch

from tasks.common.plots import colors_for, loglog_lines, pyplot, save_figure
from tasks.common.utils import system_info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRESETS = {
    "small": dict(hidden_size=256, num_hidden_layers=4, num_heads=4, vocab_size=4096, block_size=64,
                  max_position_embeddings=2048),
    "340m": dict(block_size=64, max_position_embeddings=2048),
}


def _cache_bytes(cache) -> int:
    from models.lm.modeling_mhla_lm import _map_tensors  # noqa: PLC0415  (imports transformers)

    total = 0

    def add(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t
    for layer in cache.layers:
        _map_tensors(layer.state.attn, add)
        if torch.is_tensor(layer.state.conv):
            total += layer.state.conv.numel() * layer.state.conv.element_size()
    return total


def measure(attn: str, context: int, new_tokens: int, preset: str, device: str, dtype: str, batch: int) -> dict:
    from models.lm import MHLALMCache, MHLALMConfig, MHLALMForCausalLM  # noqa: PLC0415  (transformers)

    torch.manual_seed(0)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    model = MHLALMForCausalLM(MHLALMConfig(attn_type=attn, **PRESETS[preset])).to(device, dt).eval()
    x = torch.randint(0, model.config.vocab_size, (batch, context), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with torch.no_grad():
        cache = MHLALMCache(model.config)
        sync()
        t0 = time.perf_counter()
        out = model(x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        sync()
        prefill = time.perf_counter() - t0
        tok = out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            out = model(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
        sync()
        decode = time.perf_counter() - t0
    if device == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024  # KiB -> MiB (Linux)
    return {"attn": attn, "context": context, "new_tokens": new_tokens, "batch": batch,
            "prefill_s": prefill, "prefill_tok_s": batch * context / prefill,
            "decode_tok_s": batch * new_tokens / decode, "decode_ms_per_token": 1e3 * decode / new_tokens,
            "peak_mem_mib": peak, "cache_mib": _cache_bytes(cache) / 2**20}


def _child(q, args):
    try:
        q.put(measure(*args))
    except Exception as e:  # noqa: BLE001 - report OOM etc. as a row
        q.put({"attn": args[0], "context": args[1], "error": repr(e)[:200]})


def write_results(rows, header, args, dtype, argv) -> str:
    """``results/bench/generation_<device>.json`` and ``.md`` for the rows measured so far."""
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"generation_{args.device}")
    cmd = "python scripts/bench_generation.py " + " ".join(argv if argv is not None else sys.argv[1:])
    data = {"machine": header, "preset": args.preset, "model": PRESETS[args.preset], "dtype": dtype,
            "command": cmd.strip(), "rows": rows}
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=2)
    lines = [f"# Greedy generation: prefill L tokens, decode {args.new_tokens} ({args.device}, {dtype})", "",
             f"Command: `{cmd.strip()}`", "",
             "Machine: " + ", ".join(f"{k}={v}" for k, v in header.items()), "",
             f"Model preset `{args.preset}`: {PRESETS[args.preset]} (the same MHLALM code for every attention).",
             "CPU peak memory = growth of the peak RSS of a fresh process (model, prefill activations, cache).", "",
             "| context L | attention | prefill s | decode tok/s | ms/token | peak MiB | cache MiB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['context']} | {r['attn']} | error: {r['error']} | | | | |")
            continue
        lines.append(f"| {r['context']} | {r['attn']} | {r['prefill_s']:.2f} | {r['decode_tok_s']:.1f} | "
                     f"{r['decode_ms_per_token']:.1f} | {r['peak_mem_mib']:.0f} | {r['cache_mib']:.2f} |")
    lines += ["", f"Plot: `{os.path.basename(stem)}.png` (prefill time, decode time per token, peak memory and "
                  "cache size against the context L per attention, log-log; redraw from the .json with "
                  "`--plot-only`)."]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    plot_generation(data, stem + ".png")
    return stem


def plot_generation(data: dict, path: str) -> str:
    """Prefill s, decode ms/token, peak MiB and cache MiB against the context L, one line per attention."""
    rows = [r for r in data["rows"] if "error" not in r]
    colors = colors_for(r["attn"] for r in data["rows"])
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4), squeeze=False)
    for ax, (key, label) in zip(axes[0], (("prefill_s", "prefill s"), ("decode_ms_per_token", "decode ms / token"),
                                          ("peak_mem_mib", "peak memory MiB"), ("cache_mib", "cache MiB"))):
        series: dict = {}
        for r in rows:
            series.setdefault(r["attn"], []).append((r["context"], r.get(key)))
        loglog_lines(ax, series, "context L (tokens)", label, label, colors)
    model = data.get("model", {})
    fig.suptitle(f"Greedy generation, preset {data.get('preset')} ({model.get('num_hidden_layers', '?')} layers x "
                 f"{model.get('hidden_size', '?')}), {data.get('machine', {}).get('device', '')} {data.get('dtype')}",
                 fontsize=11)
    return save_figure(fig, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--dtype", default=None, help="fp32 (CPU default) | bf16 (CUDA default) | fp16")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--attns", nargs="+", default=["mhla", "softmax", "linear"])
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "bench"))
    ap.add_argument("--plot-only", action="store_true",
                    help="redraw <out>/generation_<device>.png from its .json; measure nothing")
    args = ap.parse_args(argv)
    if args.plot_only:
        stem = os.path.join(args.out, f"generation_{args.device}")
        with open(stem + ".json") as f:
            print(f"wrote {plot_generation(json.load(f), stem + '.png')}")
        return
    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    header = {**system_info(args.device), "load_avg_at_start": os.getloadavg()}
    rows = []
    ctx = mp.get_context("spawn")
    for L in args.contexts:
        for attn in args.attns:
            q = ctx.Queue()
            p = ctx.Process(target=_child, args=(q, (attn, L, args.new_tokens, args.preset, args.device, dtype,
                                                     args.batch)))
            p.start()
            row = q.get()
            p.join()
            rows.append(row)
            print(json.dumps(row), flush=True)
            stem = write_results(rows, header, args, dtype, argv)  # after every row: partial runs leave a file
    print(f"wrote {stem}.json, .md and .png")


if __name__ == "__main__":
    main()
