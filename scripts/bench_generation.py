#!/usr/bin/env python
"""Language-model decoding against the context: per-token time and cache size, MHLA / linear / softmax.

For each preset (``small``: 4 layers x 256; ``340m``: the paper's 24 x 1024), attention (the same
``MHLALMForCausalLM`` code with ``attn`` mhla / linear / softmax) and context ``L`` (default 1k, 2k, ...,
64k), in ONE process:

1. the model's cache is brought to ``L`` tokens (``--fill``, below);
2. ``--warmup`` tokens are decoded untimed, then ``--repeats`` times ``--new-tokens`` tokens one at a time
   (greedy, batch ``--batch``, ``torch.no_grad``), each repeat timed as a whole (CPU ``time.perf_counter``;
   CUDA synchronised around it); per-token time = the median over the repeats of (repeat time / new tokens),
   with p25-p75;
3. the cache size is what the cache itself reports (``MHLALMCache.nbytes()``: every tensor of every
   layer's state).

``--fill synthetic`` (default) writes into the cache the tensors a prefill of ``L`` tokens leaves, with their
real shapes and dtypes and random values (:func:`fill_cache`: MHLA the kept block summaries of its window, the
folded far sum and the open block; linear attention ``(S, z)``; softmax ``L`` keys and values), because a
decode step's cost depends on those shapes only and a real 64k-token prefill of softmax attention takes hours
on a CPU. ``--fill prefill`` runs the real chunked prefill instead (``--prefill-chunk`` tokens per call) and
records its time. The tests check that a synthetic cache has the layout and the size of a real prefill's.

Load: :class:`tasks.common.records.Measurement` around the run (commit, the 1-minute load average before and
after, the share of the CPUs other processes used during it; the busy rule:
``tasks.common.records.BUSY_RULE``).
On a CPU a busy machine refuses the run before it starts (load average) or nothing is written at the end (exit
status 2), unless ``--allow-busy``, which writes it marked BUSY (``tasks.common.results.write_result``).

    python scripts/bench_generation.py                                   # CPU: small and 340m, 1k .. 64k
    python scripts/bench_generation.py --presets small --contexts 1024 4096
    python scripts/bench_generation.py --device cuda --dtype bf16        # the GPU run (GPU_COMMAND)
    python scripts/bench_generation.py --plot-only                       # redraw the .png from the .json

Writes ``results/bench/generation_<device>.json``, ``.md`` and ``.png`` (per-token time and cache size against
L, one line per preset and attention, log-log).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import mhla  # noqa: F401, E402  (registers the package's attentions)
from mhla.registry import Needs, bench_options, benchmark_baseline, benchmarked, grows_with_context  # noqa: E402
from tasks.common.config import import_config_attentions  # noqa: E402
from tasks.common.results import BusyMachine, load_summary, write_result
from tasks.common.plots import colors_for, loglog_lines, pyplot, save_figure
from tasks.common.records import Measurement
from tasks.common.utils import system_info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRESETS = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_heads=2, vocab_size=64, block_size=4,
                 max_position_embeddings=16),  # tests only
    "small": dict(hidden_size=256, num_hidden_layers=4, num_heads=4, vocab_size=4096, block_size=64,
                  max_position_embeddings=2048),
    "340m": dict(block_size=64, max_position_embeddings=2048),
}
CONTEXTS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
# the attentions that declare ``benchmark = True`` and decode causally (mhla/registry.py), MHLA first
import_config_attentions()  # the attentions defined outside the package (configs/attn/*.yaml's module:)
ATTNS = benchmarked(Needs(causal=True, decoding=True))[::-1]
GPU_COMMAND = ("python scripts/bench_generation.py --device cuda --dtype bf16 --presets small 340m "
               "--contexts " + " ".join(map(str, CONTEXTS)))
TIME_METHOD = ("one process; per preset and attention one model, per context a fresh cache filled to "
               "L tokens, {warmup} decode steps untimed, then {repeats} repeats of {new_tokens} steps each "
               "timed as a whole (CPU time.perf_counter, CUDA synchronised); ms/token = median over the "
               "repeats of repeat time / {new_tokens} (p25-p75 in brackets).")
FILL_METHOD = {
    "synthetic": ("the cache holds the tensors a prefill of L tokens leaves (real shapes and dtypes, "
                  "random values: MHLA its kept block summaries, the folded far sum and the open block; "
                  "linear (S, z); softmax L keys and values); a decode step's cost depends on the shapes "
                  "only."),
    "prefill": "a real chunked prefill of L random tokens ({chunk} per call), timed (prefill s).",
}


def build_model(preset: str, attn: str, device: str, dtype: torch.dtype):
    from models.lm import MHLALMConfig, MHLALMForCausalLM  # noqa: PLC0415  (imports transformers)

    torch.manual_seed(0)
    cfg = dict(PRESETS[preset])
    block = cfg.pop("block_size")
    spec = bench_options(attn, block_size=block)  # (MHLA: chunks of the preset's block_size)
    return MHLALMForCausalLM(MHLALMConfig(attn=spec, **cfg)).to(device, dtype).eval()


def synthetic_state(layer, L: int, batch: int, dtype: torch.dtype, device, gen: torch.Generator):
    """The attention state of ``layer`` after a prefill of ``L`` tokens: real shapes, random values."""
    from mhla.layers import LinearAttention, MultiHeadLinearAttention, SoftmaxAttention  # noqa: PLC0415
    from mhla.mixing import extension_window  # noqa: PLC0415
    from mhla.ops import MHLAState  # noqa: PLC0415
    from mhla.ops.mhla.state import kept_blocks  # noqa: PLC0415
    from mhla.ops.utils import accumulation_dtype  # noqa: PLC0415

    H, D, Dv = layer.num_heads, layer.head_dim, layer.value_dim
    acc = accumulation_dtype(dtype)

    def rand(*shape, dt=acc, scale=1.0):
        return (torch.rand(*shape, generator=gen) * scale).to(device=device, dtype=dt)

    if isinstance(layer, MultiHeadLinearAttention):
        C = layer.block_size
        window = extension_window(layer.mixing.num_blocks, layer.mixing.extension)
        kept = sum(kept_blocks(L // C, window))
        open_tokens = L % C
        return MHLAState(
            block_summaries=rand(batch, H, kept, D, Dv, scale=C),
            block_key_sums=rand(batch, H, kept, D, scale=C),
            current_summary=rand(batch, H, D, Dv, scale=open_tokens),
            current_key_sum=rand(batch, H, D, scale=open_tokens), num_tokens=L, block_size=C, window=window,
            far_summary=rand(batch, H, D, Dv, scale=L), far_key_sum=rand(batch, H, D, scale=L))
    if isinstance(layer, LinearAttention):
        return rand(batch, H, D, Dv, scale=L), rand(batch, H, D, scale=L)
    if isinstance(layer, SoftmaxAttention):
        return rand(batch, L, H, D, dt=dtype), rand(batch, L, H, Dv, dt=dtype)
    raise TypeError(f"no synthetic decode state for {type(layer).__name__}")


def fill_cache(model, cache, L: int, batch: int) -> None:
    """Bring ``cache`` to ``L`` tokens without a prefill (:func:`synthetic_state` per layer; the causal CPE's
    and the short convolution's last inputs as random values too)."""
    p = next(model.parameters())
    gen = torch.Generator().manual_seed(L)
    for i, block in enumerate(model.model.layers):
        attn, state = block.attn, cache.layer_state(i)
        state.attn = synthetic_state(attn, L, batch, p.dtype, p.device, gen)
        if attn.cpe is not None and attn.causal:
            state.conv = torch.rand(batch, attn.cpe_kernel - 1, attn.num_heads * attn.value_dim,
                                    generator=gen).to(p.device, p.dtype)
        if attn.short_conv is not None:
            shape = (batch, attn.short_conv.kernel_size[0] - 1, attn.short_conv.in_channels)
            state.short_conv = torch.rand(*shape, generator=gen).to(p.device, p.dtype)
    cache.advance(L)


def prefill(model, cache, L: int, batch: int, chunk: int) -> None:
    """A real chunked prefill of ``L`` random tokens."""
    x = torch.randint(0, model.config.vocab_size, (batch, L), generator=torch.Generator().manual_seed(L))
    x = x.to(next(model.parameters()).device)
    for a in range(0, L, chunk):
        model(x[:, a:a + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)


def cache_bytes_estimate(preset: str, attn: str, L: int, batch: int, dtype: torch.dtype) -> int:
    """Bytes of a softmax KV cache at ``L`` tokens (others: 0), to skip what cannot fit
    (``--max-cache-gib``)."""
    if not grows_with_context(attn):
        return 0
    from models.lm import MHLALMConfig  # noqa: PLC0415

    cfg = dict(PRESETS[preset])
    cfg.pop("block_size")
    c = MHLALMConfig(attn="softmax", **cfg)
    per_token = c.num_heads * (c.head_dim + c.head_value_dim) * torch.tensor([], dtype=dtype).element_size()
    return c.num_hidden_layers * batch * L * per_token


def measure(model, preset: str, attn: str, L: int, args, dtype: torch.dtype) -> dict:
    """One row: fill the cache to ``L`` tokens, warm up, time the decode steps, read the cache size."""
    from models.lm import MHLALMCache  # noqa: PLC0415

    device = args.device
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    row = {"preset": preset, "attn": attn, "context": L, "batch": args.batch, "new_tokens": args.new_tokens,
           "repeats": args.repeats, "warmup": args.warmup, "fill": args.fill}
    with torch.no_grad():
        cache = MHLALMCache(model.config)
        if args.fill == "prefill":
            sync()
            t0 = time.perf_counter()
            prefill(model, cache, L, args.batch, args.prefill_chunk)
            sync()
            row["prefill_s"] = time.perf_counter() - t0
        else:
            fill_cache(model, cache, L, args.batch)
        gen = torch.Generator().manual_seed(1)
        tok = torch.randint(0, model.config.vocab_size, (args.batch, 1), generator=gen).to(device)

        def step(tok):
            return model(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)

        for _ in range(args.warmup):
            tok = step(tok)
        times = []
        for _ in range(args.repeats):
            sync()
            t0 = time.perf_counter()
            for _ in range(args.new_tokens):
                tok = step(tok)
            sync()
            times.append((time.perf_counter() - t0) / args.new_tokens * 1e3)
    row["ms_per_token"] = statistics.median(times)
    row["ms_per_token_iqr"] = quartiles(times)
    row["cache_bytes"] = cache.nbytes()
    row["cache_mib"] = row["cache_bytes"] / 2**20
    row["seen_after"] = cache.get_seq_length()
    return row


def quartiles(xs: list[float]) -> list[float]:
    if len(xs) < 2:
        return [xs[0], xs[0]]
    q = statistics.quantiles(xs, n=4)
    return [q[0], q[2]]


# ------------------------------------------------------------------------------------------------ output
def write_results(data: dict, out_dir: str, allow_busy: bool = False) -> str:
    """``<out_dir>/generation_<device>.json``, ``.md`` and ``.png`` for ``data`` through
    :func:`tasks.common.results.write_result` (its ``measurement``: refused when busy unless ``allow_busy``,
    then marked BUSY); returns the stem."""
    stem = os.path.join(out_dir, f"generation_{data['settings']['device']}")
    return write_result(stem, markdown(data, os.path.basename(stem)), data,
                        lambda png: plot_generation(data, png), measurement=data.get("measurement"),
                        allow_busy=allow_busy, indent=2)


def markdown(data: dict, name: str) -> str:
    h, s, rows = data["machine"], data["settings"], data["rows"]
    lines = [f"# Decoding against the context: per-token time and cache size ({s['device']}, {s['dtype']})",
             "",
             f"Command: `{data['command']}`", "", f"GPU: `{GPU_COMMAND}`", ""]
    m = data.get("measurement")
    lines += [f"Machine: {h.get('gpu') or h.get('cpu', '?')}, {h.get('cpu_count')} CPUs, torch "
              f"{h.get('torch')} ({h.get('torch_threads')} threads), {h.get('date')}. "
              + (f"Load: {load_summary(m)}; commit {m.get('commit')}." if m else "Load: not recorded."), ""]
    presets = sorted({r["preset"] for r in rows}, key=list(PRESETS).index)
    fill = FILL_METHOD[s["fill"]].format(chunk=s.get("prefill_chunk"))
    lines += ["Presets: " + "; ".join(f"`{p}` {PRESETS[p]}" for p in presets) + " (the same MHLALM code for "
              "every attention; MHLA with the LM defaults: 32 learned mixing rows, `uniform_far`).", "",
              "Time: " + TIME_METHOD.format(**s), "",
              f"Cache: {fill} Size: `MHLALMCache.nbytes()`, every tensor of every layer's state (MHLA: at "
              "most 31 block summaries, the folded far sum, the open block and its cached prefix).", "",
              "| preset | attention | context L | ms / token [p25-p75] | / linear | cache MiB |"
              + (" prefill s |" if s["fill"] == "prefill" else ""),
              "|---|---|---|---|---|---|" + ("---|" if s["fill"] == "prefill" else "")]
    by = {(r["preset"], r["attn"], r["context"]): r for r in rows}
    for r in rows:
        head = f"| {r['preset']} | {r['attn']} | {r['context']} |"
        if "error" in r or "skipped" in r:
            extra = " |" if s["fill"] == "prefill" else ""
            lines.append(f"{head} {r.get('error') or r.get('skipped')} | | |{extra}")
            continue
        lin = by.get((r["preset"], "linear", r["context"]))
        ratio = f"{r['ms_per_token'] / lin['ms_per_token']:.2f}x" if lin and "ms_per_token" in lin else "n/a"
        q = r["ms_per_token_iqr"]
        extra = f" {r['prefill_s']:.1f} |" if s["fill"] == "prefill" else ""
        lines.append(f"{head} {r['ms_per_token']:.2f} [{q[0]:.2f}-{q[1]:.2f}] | {ratio} | "
                     f"{r['cache_mib']:.3f} |{extra}")
    lines += ["", "Summary (MHLA's goal: per-token time flat in the context and within 1.2x of linear "
              "attention's; cache flat):", ""]
    for p in presets:
        for a in dict.fromkeys(r["attn"] for r in rows):
            ok = sorted((r for r in rows if r["preset"] == p and r["attn"] == a and "ms_per_token" in r),
                        key=lambda r: r["context"])
            if len(ok) < 1:
                continue
            lo, hi = ok[0], ok[-1]
            text = (f"- `{p}` {a}: {hi['ms_per_token'] / lo['ms_per_token']:.2f}x the per-token time and "
                    f"{hi['cache_bytes'] / lo['cache_bytes']:.2f}x the cache from L = {lo['context']} to "
                    f"{hi['context']}")
            base = benchmark_baseline(a)  # MHLA: linear attention
            if base:
                ratios = [by[(p, a, L)]["ms_per_token"] / by[(p, base, L)]["ms_per_token"]
                          for L in sorted({r["context"] for r in ok})
                          if "ms_per_token" in by.get((p, base, L), {})]
                if ratios:
                    text += f"; against {base} attention {min(ratios):.2f}x-{max(ratios):.2f}x per token"
            lines.append(text + ".")
    lines += ["", f"Plot: `{name}.png` (ms / token and cache MiB against the context L, one line per preset "
                  "and attention, log-log; redraw from the .json with `--plot-only`)."]
    return "\n".join(lines) + "\n"


def plot_generation(data: dict, path: str) -> str:
    """ms / token and cache MiB against the context L, one line per preset and attention (a .json written
    before the presets were rows, one preset and ``decode_ms_per_token``, draws too)."""
    rows = [{"preset": data.get("preset"), **r,
             "ms_per_token": r.get("ms_per_token", r.get("decode_ms_per_token"))}
            for r in data["rows"] if "error" not in r and "skipped" not in r]
    label = lambda r: f"{r['preset']} {r['attn']}"  # noqa: E731
    colors = colors_for(label(r) for r in rows)
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
    for ax, (key, name) in zip(axes[0], (("ms_per_token", "decode ms / token"), ("cache_mib", "cache MiB"))):
        series: dict = {}
        for r in rows:
            series.setdefault(label(r), []).append((r["context"], r.get(key)))
        loglog_lines(ax, series, "context L (tokens)", name, name, colors)
    s = data.get("settings", {})
    busy = " (BUSY machine)" if (data.get("measurement") or {}).get("busy") or data.get("busy") else ""
    device = data.get("machine", {}).get("device", "")
    fig.suptitle(f"Decoding against the context, {device} {s.get('dtype', '')}, batch "
                 f"{s.get('batch', '?')}{busy}", fontsize=11)
    return save_figure(fig, path)


# -------------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--presets", nargs="+", default=["small", "340m"], choices=sorted(PRESETS))
    ap.add_argument("--attns", nargs="+", default=ATTNS, choices=ATTNS)
    ap.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
    ap.add_argument("--dtype", default=None, help="fp32 (CPU default) | bf16 (CUDA default) | fp16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=64,
                    help="decode steps per timed repeat (64: one MHLA block)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=8, help="untimed decode steps before the repeats")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--fill", default="synthetic", choices=["synthetic", "prefill"])
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--max-cache-gib", type=float, default=8.0,
                    help="skip a softmax context whose KV cache is larger")
    ap.add_argument("--allow-busy", action="store_true",
                    help="measure and write on a busy machine, marked BUSY")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "bench"))
    ap.add_argument("--plot-only", action="store_true",
                    help="redraw <out>/generation_<device>.png from its .json; measure nothing")
    return ap.parse_args(argv)


def measure_preset(preset: str, attn: str, args, dtype) -> list[dict]:
    """One model, every context of ``args.contexts``: its rows (skipped where the cache would not fit, an
    error row where it ran out of memory)."""
    model, rows = build_model(preset, attn, args.device, dtype), []
    for L in sorted(args.contexts):
        need = cache_bytes_estimate(preset, attn, L, args.batch, dtype)
        if need > args.max_cache_gib * 2**30:
            row = {"preset": preset, "attn": attn, "context": L,
                   "skipped": f"skipped: a {need / 2**30:.1f} GiB KV cache > --max-cache-gib"}
        else:
            try:
                row = measure(model, preset, attn, L, args, dtype)
            except (RuntimeError, MemoryError) as e:  # out of memory: a row that says so
                row = {"preset": preset, "attn": attn, "context": L, "error": repr(e)[:160]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        gc.collect()
    del model
    gc.collect()
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    stem = os.path.join(args.out, f"generation_{args.device}")
    if args.plot_only:
        with open(stem + ".json") as f:
            print(f"wrote {plot_generation(json.load(f), stem + '.png')}")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype_name = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    header = system_info(args.device)
    cmd = "python scripts/bench_generation.py " + " ".join(argv if argv is not None else sys.argv[1:])
    settings = {k: getattr(args, k) for k in ("device", "presets", "attns", "contexts", "batch", "new_tokens",
                                              "repeats", "warmup", "threads", "fill", "prefill_chunk")}
    settings["dtype"] = dtype_name
    with Measurement(threads=1 if args.device == "cuda" else torch.get_num_threads(),
                     watch_other_cpu=args.device == "cpu") as load:
        if load.refuses_to_start(args.allow_busy):
            return 2
        rows = [row for preset in args.presets for attn in args.attns
                for row in measure_preset(preset, attn, args, dtype)]
    data = {"machine": header, "command": cmd.strip(), "settings": settings, "measurement": load.record,
            "rows": rows}
    try:
        stem = write_results(data, args.out, allow_busy=args.allow_busy)
    except BusyMachine as e:
        print(e, file=sys.stderr)
        return 2
    print(f"wrote {stem}.json, .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
