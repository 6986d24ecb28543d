#!/usr/bin/env python
"""Model throughput (images/s) of DiT with softmax (SDPA), linear and MHLA attention.

    python scripts/bench_models.py                         # CPU: DiT-S/2 and DiT-XL/2 at 256 / 512 / 1024 px
    python scripts/bench_models.py --device cuda           # GPU: bf16 autocast, CUDA-event timing, batch 32
    python scripts/bench_models.py --models DiT-S/2 --resolutions 256 --attns mhla softmax --quick

For each (model, resolution, attention): one denoising step (a forward ``model(x, t, y)`` under ``no_grad``)
and one training step (forward, MSE on the output, backward, AdamW step), on latents of side ``res / 8``
(SD-VAE), patch 2: N = 256 / 1024 / 4096 tokens at 256 / 512 / 1024 px. MHLA uses M = 16 blocks (M^2 <= N;
4x4 tiles of the patch grid), no CPE / gate (the bare operator; ``--mhla-cpe-gate`` adds them).
Timing: one warm-up call, then the median of ``--repeats`` calls (CPU wall clock; CUDA events on GPU).
A case whose estimated time (from the same model / attention at the previous resolution, scaled by the token
count, squared for softmax) exceeds ``--max-case-s`` is skipped and listed with the estimate.
Writes ``results/bench/models_<device>.json`` and ``.md`` with a machine header (and the CPU load, since on a
shared machine other processes inflate wall-clock times), and ``.png`` (time against N per attention, log-log;
``--plot-only`` redraws it from the ``.json``), through ``tasks.common.results.write_result``. The load before
and after (``measurement``: :class:`tasks.common.records.Measurement`) decides whether the machine was busy; a
busy run is not written unless ``--allow-busy`` (then it is marked BUSY).

The paper's claim (docs/paper_tables.md#speed-claims): at 512 px MHLA has about 2x the throughput of self-attention and is on par with
linear attention (Table 7b: DiT-S/2 512 px, 435 img/s for M = 16 on their GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch

import mhla  # noqa: F401  (registers the package's attentions)
from mhla.registry import Needs, bench_options, benchmarked, grows_with_context
from scripts.bench_ops import timer
from tasks.common.config import import_config_attentions
from tasks.common.results import BusyMachine, write_result
from tasks.common.plots import colors_for, loglog_lines, pyplot, save_figure
from tasks.common.records import Measurement, busy_cpu_s
from tasks.common.utils import system_info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the attentions that declare ``benchmark = True`` and run on DiT's 2-D grid (mhla/registry.py; softmax, linear, MHLA)
import_config_attentions()  # the attentions defined outside the package (configs/attn/*.yaml's module:)
ATTNS = tuple(benchmarked(Needs(grid_rank=2)))
TIME_METHOD = ("one warm-up call, then the median (p25-p75) of --repeats calls; CPU: time.perf_counter wall "
               "clock; GPU: CUDA events. fwd: model(x, t, y) under no_grad (one denoising step); train: forward, "
               "MSE to a fixed target, backward, AdamW step. images/s = batch / median seconds.")


def attn_config(name: str, n_tokens: int, cpe_gate: bool) -> dict:
    """The attention's options in this benchmark (its ``bench_options``: MHLA's M from the token count)."""
    return bench_options(name, n_tokens, cpe_gate=cpe_gate)


def build_case(model_name: str, res: int, attn: str, batch: int, device, cpe_gate: bool):
    from models.dit import DiT_models  # noqa: PLC0415  (models/ pulls in timm)

    latent = res // 8
    n_tokens = (latent // 2) ** 2
    cfg = attn_config(attn, n_tokens, cpe_gate)
    model = DiT_models[model_name](input_size=latent, num_classes=1000, attn=cfg).to(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 4, latent, latent, generator=g).to(device)
    t = torch.randint(0, 1000, (batch,), generator=g).to(device)
    y = torch.randint(0, 1000, (batch,), generator=g).to(device)
    return model, (x, t, y), n_tokens, cfg


def measure(model, inputs, mode: str, device: str, repeats: int, amp: bool) -> list[float]:
    """Seconds per call of one denoising step (``fwd``) or one training step (``train``)."""
    if mode == "fwd":
        model.eval()

        def step():
            with torch.no_grad(), (torch.autocast("cuda", dtype=torch.bfloat16) if amp else _null()):
                model(*inputs)
    else:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        target = torch.zeros_like(inputs[0]).repeat(1, 2, 1, 1)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16) if amp else _null():
                loss = torch.nn.functional.mse_loss(model(*inputs).float(), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    step()  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    return [ms / 1e3 for ms in timer(step, device, repeats)]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def model_weight(model_name: str) -> float:
    """Relative per-token cost of a DiT size: depth x width^2."""
    from models.dit import DIT_SIZES  # noqa: PLC0415  (models/ pulls in timm)

    depth, hidden, _ = DIT_SIZES[model_name.split("/")[0]]
    return depth * hidden * hidden


def estimate(prev: dict | None, n_tokens: int, attn: str, model_name: str) -> float | None:
    """Seconds for this case from an earlier one: the same model and attention at a lower resolution (time x N
    ratio, N ratio^2 for softmax), or a smaller model at the same resolution (time x depth x width^2 ratio)."""
    if not prev or prev.get("sec") is None:
        return None
    ratio = n_tokens / prev["n_tokens"]
    return prev["sec"] * (ratio ** 2 if grows_with_context(attn) else ratio) * model_weight(model_name) / prev["weight"]


def run(args) -> dict | None:
    """Every case of the grid, timed inside one :class:`Measurement` (None: refused, the machine was busy at start)."""
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    if args.threads:
        torch.set_num_threads(args.threads)
    amp = device == "cuda" and not args.fp32
    batch = args.batch or (32 if device == "cuda" else 1)
    header = system_info(device)
    with Measurement(threads=1 if device == "cuda" else torch.get_num_threads(),
                     watch_other_cpu=device != "cuda") as load:
        if load.refuses_to_start(args.allow_busy):
            return None
        header.update(batch=batch, precision="bf16 autocast" if amp else "fp32", repeats=args.repeats,
                      loadavg_start=load.record["load_before"])  # (the .md's line; the whole record: measurement)
        busy0, wall0 = busy_cpu_s(), time.time()
        rows = measure_grid(args, device, batch, amp)
        busy1 = busy_cpu_s()
    if busy0 is not None and busy1 is not None:
        header["cpu_busy_fraction"] = round((busy1 - busy0) / max(time.time() - wall0, 1e-9) / (os.cpu_count() or 1), 3)
    header["loadavg_end"] = load.record["load_after"]
    header["note"] = args.note
    return {"header": header, "time_method": TIME_METHOD, "results": rows, "measurement": load.record}


def measure_grid(args, device: str, batch: int, amp: bool) -> list[dict]:
    """Every (model, resolution, attention, mode) case: its time per call, or why it was skipped."""
    rows, prev = [], {}
    for model_name in args.models:
        for res in args.resolutions:
            for attn in args.attns:
                for mode in args.modes:
                    key = (model_name, attn, mode)
                    latent = res // 8
                    n_tokens = (latent // 2) ** 2
                    row = {"model": model_name, "res": res, "n_tokens": n_tokens, "attn": attn, "mode": mode,
                           "batch": batch}
                    weight = model_weight(model_name)
                    est = estimate(prev.get(key) or prev.get((res, attn, mode)), n_tokens, attn, model_name)
                    if est is not None and est * (args.repeats + 1) > args.max_case_s:
                        row.update(sec=None, images_per_s=None,
                                   skipped=f"estimated {est:.1f} s per call x {args.repeats + 1} calls > "
                                           f"--max-case-s {args.max_case_s}")
                        rows.append(row)
                        prev[key] = {"sec": est, "n_tokens": n_tokens, "weight": weight}
                        print(f"{model_name} {res}px {attn:8s} {mode:5s} skipped ({row['skipped']})", flush=True)
                        continue
                    torch.manual_seed(0)
                    model, inputs, n_tokens, cfg = build_case(model_name, res, attn, batch, device, args.mhla_cpe_gate)
                    secs = measure(model, inputs, mode, device, args.repeats, amp)
                    med = statistics.median(secs)
                    q = statistics.quantiles(secs, n=4) if len(secs) > 1 else [med, med, med]
                    row.update(sec=med, p25=q[0], p75=q[2], images_per_s=batch / med,
                               attn_config=cfg)
                    rows.append(row)
                    prev[key] = prev[(res, attn, mode)] = {"sec": med, "n_tokens": n_tokens, "weight": weight}
                    print(f"{model_name} {res}px N={n_tokens} {attn:8s} {mode:5s} {batch / med:9.2f} img/s "
                          f"({med * 1e3:.1f} ms/call)", flush=True)
                    del model, inputs
                    if device == "cuda":
                        torch.cuda.empty_cache()
    return rows


def to_markdown(data: dict) -> str:
    h = data["header"]
    lines = [f"# DiT throughput ({h['device']})", "",
             f"Machine: {h.get('gpu') or h['cpu']} ({h['cpu_count']} CPUs, torch {h['torch']}, "
             f"{h['torch_threads']} threads), {h['date']}; batch {h['batch']}, {h['precision']}, "
             f"median of {h['repeats']} calls.", ""]
    if h.get("loadavg_start") is not None:
        lines += [f"CPU load average at start {h['loadavg_start'][0]:.1f}, at end {h['loadavg_end'][0]:.1f}; "
                  f"machine-wide CPU busy fraction during the run {h.get('cpu_busy_fraction')}. "
                  f"{h.get('note') or ''}", ""]
    lines += [f"Timing: {data['time_method']}", "",
              "| model | px | N | mode | softmax img/s | linear img/s | MHLA img/s | MHLA / softmax | MHLA / linear |",
              "|---|---|---|---|---|---|---|---|---|"]
    table: dict = {}
    for r in data["results"]:
        table.setdefault((r["model"], r["res"], r["n_tokens"], r["mode"]), {})[r["attn"]] = r

    def cell(r):
        if r is None:
            return "-"
        return f"skipped ({r['skipped'].split(' per call')[0]} per call)" if r.get("skipped") else f"{r['images_per_s']:.3g}"

    def ratio(a, b):
        if a is None or b is None or a.get("images_per_s") is None or b.get("images_per_s") is None:
            return "-"
        return f"{a['images_per_s'] / b['images_per_s']:.2f}x"

    for (model, res, n, mode), d in table.items():
        s, lin, m = d.get("softmax"), d.get("linear"), d.get("mhla")
        lines.append(f"| {model} | {res} | {n} | {mode} | {cell(s)} | {cell(lin)} | {cell(m)} | {ratio(m, s)} | "
                     f"{ratio(m, lin)} |")
    lines += ["", "Paper (docs/paper_tables.md#speed-claims): MHLA about 2x the throughput of self-attention at 512 px and on par with linear "
              "attention (GPU). CPU numbers measure FLOP-bound behaviour on this machine only."]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="image", choices=["image", "video"],
                    help="image: DiT images/s; video: one Wan2.1 denoising step (the remaining arguments go to "
                         "scripts/bench_video.py, e.g. --preset wan1.3b --device cuda)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--models", nargs="+", default=["DiT-S/2", "DiT-XL/2"])
    ap.add_argument("--resolutions", nargs="+", type=int, default=[256, 512, 1024])
    ap.add_argument("--attns", nargs="+", default=list(ATTNS), choices=list(ATTNS))
    ap.add_argument("--modes", nargs="+", default=["fwd", "train"], choices=["fwd", "train"])
    ap.add_argument("--batch", type=int, default=None, help="default: 1 on CPU, 32 on GPU")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-case-s", type=float, default=120.0, help="skip cases estimated to take longer")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--fp32", action="store_true", help="GPU: no bf16 autocast")
    ap.add_argument("--mhla-cpe-gate", action="store_true", help="MHLA with CPE and output gate (Table 3 rows)")
    ap.add_argument("--quick", action="store_true", help="smoke run: DiT-S/2 at 64 px, 2 repeats")
    ap.add_argument("--note", default="", help="free text stored in the header (e.g. 'ran under load')")
    ap.add_argument("--allow-busy", action="store_true",
                    help="write a run made on a busy machine, marked BUSY (default: refused; the rule: "
                         "tasks.common.records.BUSY_RULE)")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "results", "bench"))
    ap.add_argument("--out-name", default=None, help="file stem (default models_<device>)")
    ap.add_argument("--plot-only", action="store_true",
                    help="redraw <out-dir>/<stem>.png from its .json; measure nothing")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.resolutions, args.repeats = ["DiT-S/2"], [64], 2
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--mode" in argv and argv[argv.index("--mode") + 1:argv.index("--mode") + 2] == ["video"]:
        i = argv.index("--mode")
        from scripts import bench_video  # noqa: PLC0415  (imports models.wan, so timm)

        bench_video.main(argv[:i] + argv[i + 2:])
        return 0
    args = parse_args(argv)
    stem = os.path.join(args.out_dir, args.out_name or f"models_{args.device}")
    if args.plot_only:
        with open(stem + ".json") as f:
            print(f"wrote {plot_models(json.load(f), stem + '.png')}")
        return 0
    data = run(args)
    if data is None:  # refused before measuring: the machine was busy
        return 2
    try:
        write_results(data, stem, allow_busy=args.allow_busy)
    except BusyMachine as e:
        print(e, file=sys.stderr)
        return 2
    print(f"wrote {stem}.json, .md and .png")
    return 0


def write_results(data: dict, stem: str, allow_busy: bool = False) -> str:
    """``<stem>.json`` (``data``), ``.md`` (:func:`to_markdown`) and ``.png`` (:func:`plot_models`), through
    :func:`tasks.common.results.write_result`: a run whose ``measurement`` says busy is refused
    (:class:`~tasks.common.results.BusyMachine`) unless ``allow_busy``."""
    md = to_markdown(data) + (f"\nPlot: `{os.path.basename(stem)}.png` (seconds per call against the token count N "
                              "per attention, one panel per model and mode, log-log; skipped cases left out; redraw "
                              "from the .json with `--plot-only`).\n")
    record = {k: v for k, v in data.items() if k != "measurement"}
    return write_result(stem, md, record, lambda png: plot_models(data, png), measurement=data.get("measurement"),
                        allow_busy=allow_busy)


def plot_models(data: dict, path: str) -> str:
    """Seconds per call against N, one line per attention, a panel per (model, mode); log-log."""
    rows = data["results"]
    every = list(dict.fromkeys((r["model"], r["mode"]) for r in rows))
    measured = {(r["model"], r["mode"]) for r in rows if r.get("sec") is not None}
    panels = [p for p in every if p in measured] or every[:1]  # a panel with nothing measured says so in the title
    unmeasured = [f"{m} {mode}" for m, mode in every if (m, mode) not in measured]
    colors = colors_for(r["attn"] for r in rows)
    plt = pyplot()
    cols = min(len(panels), 2) or 1
    nrows = max(1, -(-len(panels) // cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 4 * nrows), squeeze=False)
    ticks = {r["n_tokens"]: f"{r['n_tokens']}\n({r['res']} px)" for r in rows}
    for ax, (model, mode) in zip(axes.flat, panels):
        mine = [r for r in rows if (r["model"], r["mode"]) == (model, mode)]
        series: dict = {}
        for r in mine:
            series.setdefault(r["attn"], []).append((r["n_tokens"], r.get("sec")))
        skipped = sum(r.get("sec") is None for r in mine)
        loglog_lines(ax, series, "tokens N", f"seconds per {'denoising' if mode == 'fwd' else 'training'} step",
                     f"{model}, {mode}" + (f" ({skipped} of {len(mine)} cases skipped: estimated too slow)"
                                           if skipped else ""), colors, xticks=ticks)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    h = data["header"]
    fig.suptitle(f"DiT time per call on {h.get('gpu') or h.get('cpu', '')} ({h.get('device')}), batch "
                 f"{h.get('batch')}, {h.get('precision')}" + ("\nevery case skipped (estimated too slow): "
                                                             + ", ".join(unmeasured) if unmeasured else ""),
                 fontsize=11)
    return save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
