#!/usr/bin/env python
"""MQAR grid: softmax vs linear vs MHLA at several sequence lengths and key-value counts -> results/mqar.md + PNG.

    python scripts/run_mqar.py                                   # the default grid (CPU; see --help)
    python scripts/run_mqar.py --cells 64x4 128x8 --steps 1000   # chosen cells, longer training
    python scripts/run_mqar.py --plot-only                       # redraw table and plot from results/mqar.json

Each run is ``python train.py task=mqar attn=<attn> data.seq_len=N data.num_kv_pairs=K trainer.max_steps=S ...``
(the same 2-layer model of ``configs/task/mqar.yaml`` for every attention; MHLA with chunks of C = the smallest
power of two >= sqrt(N), so M = N / C blocks and M^2 <= N). Results are saved after every run
(``results/mqar.json``), so an interrupted grid keeps what it finished and ``--resume`` skips those runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

ATTNS = ("softmax", "linear", "mhla")
DEFAULT_CELLS = ("64x4", "128x8", "256x16", "64x8", "128x16", "64x16", "128x4", "256x8", "256x4")


def run_one(attn: str, n: int, k: int, args) -> dict:
    overrides = [f"task=mqar", f"attn={attn}", f"data.seq_len={n}", f"data.num_kv_pairs={k}",
                 f"trainer.max_steps={args.steps}", f"data.batch_size={args.batch_size}",
                 f"data.num_train={args.steps * args.batch_size}", f"data.num_test={args.num_test}",
                 f"optim.lr={args.lr}", f"model.hidden_size={args.width}", f"seed={args.seed}",
                 "logger=none", "trainer.progress_bar=false", "trainer.device=cpu",
                 f"hydra.run.dir={os.path.join(args.out_dir, f'{n}x{k}', attn)}", *args.extra]
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *overrides]
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    rec = {"attn": attn, "seq_len": n, "num_kv_pairs": k, "seconds": round(time.time() - t0, 1),
           "command": "python train.py " + " ".join(overrides)}
    finals = [line for line in proc.stdout.splitlines() if line.startswith("final:")]
    if proc.returncode != 0 or not finals:
        rec["error"] = ((proc.stderr or proc.stdout).strip().splitlines() or ["failed"])[-1]
        print(f"  FAILED: {rec['error']}", flush=True)
        return rec
    rec.update({k_: float(v) for k_, v in re.findall(r"(\w+)=([-\d.eE+naninf]+)", finals[-1])})
    params = re.search(r"([\d.]+)M params", proc.stdout)
    rec["params_M"] = float(params.group(1)) if params else None
    print(f"  {finals[-1]} ({rec['seconds']:.0f}s)", flush=True)
    return rec


def write_outputs(results: list[dict], args, stem: str) -> None:
    from tasks.common.utils import system_info  # noqa: PLC0415

    cells = sorted({(r["seq_len"], r["num_kv_pairs"]) for r in results})
    by = {(r["seq_len"], r["num_kv_pairs"], r["attn"]): r for r in results}

    def fmt(r):
        if r is None:
            return "not run"
        return f"failed: {r['error'][:40]}" if "error" in r else f"{100 * r['acc']:.1f}"

    init = next((e.split("=", 1)[1] for e in args.extra if "mixing_init=" in e), "locality (the paper's)")
    lines = [
        "# MQAR: softmax vs linear vs MHLA",
        "",
        "Multi-query associative recall (Zoology's `multiquery_ar`, re-implemented in `tasks/language/mqar.py`): "
        "K key-value pairs (keys from the lower half of the vocabulary, values from the upper half), then the K "
        "keys again as queries at power-law gaps (a = 0.01) among random tokens; accuracy = exact prediction of "
        "the value at the query positions of a held-out set.",
        "",
        f"Command: `python scripts/run_mqar.py {' '.join(args.argv)}`".rstrip() + "",
        "",
        f"Conditions: every run trains the same 2-layer causal LM (`models.lm.MHLALMForCausalLM`, width {args.width}, "
        f"2 heads, SwiGLU, RoPE, no normalizer + output RMSNorm, tied embeddings) with only the attention changed; "
        f"vocabulary 512; {args.steps} steps of batch {args.batch_size} (fresh examples, "
        f"{args.steps * args.batch_size} in all), AdamW lr {args.lr}, cosine schedule, seed {args.seed}; test set "
        f"{args.num_test} examples. MHLA: chunks of C = smallest power of two >= sqrt(N) (M = N / C blocks, "
        f"M^2 <= N: N = 64 -> M = 8, 128 -> 8, 256 -> 16), mixing init {init}, learnable mixing. Extra overrides: "
        f"{' '.join(args.extra) or 'none'}. CPU run, shared machine (2 cores, several other jobs): times are "
        f"wall-clock under load.",
        "",
        f"Machine: {json.dumps(system_info())}",
        "",
        "| N (seq len) | K (kv pairs) | softmax acc % | linear acc % | MHLA acc % | time s (sm / lin / mhla) |",
        "|---|---|---|---|---|---|",
    ]
    for n, k in cells:
        rs = [by.get((n, k, a)) for a in ATTNS]
        times = " / ".join(f"{r['seconds']:.0f}" if r else "-" for r in rs)
        lines.append(f"| {n} | {k} | " + " | ".join(fmt(r) for r in rs) + f" | {times} |")
    lines += ["", f"Plot: `{os.path.basename(stem)}.png`. Raw records (commands, losses, times): "
              f"`{os.path.basename(stem)}.json`.", ""]
    if args.notes:
        lines += ["## Reading", "", args.notes, ""]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines))
    with open(stem + ".json", "w") as f:
        json.dump({"date": datetime.now(timezone.utc).isoformat(), "args": vars(args) | {"extra": args.extra},
                   "results": results}, f, indent=2)
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415

        fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(cells) + 2), 3.6))
        width = 0.8 / len(ATTNS)
        for j, a in enumerate(ATTNS):
            ys = [100 * by[(n, k, a)]["acc"] if (n, k, a) in by and "acc" in by[(n, k, a)] else 0 for n, k in cells]
            ax.bar([i + (j - 1) * width for i in range(len(cells))], ys, width, label=a)
        ax.set_xticks(range(len(cells)), [f"N={n}\nK={k}" for n, k in cells])
        ax.set_ylabel("MQAR accuracy (%)")
        ax.set_ylim(0, 100)
        ax.set_title(f"MQAR, 2 layers, width {args.width}, {args.steps} steps (CPU)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=120)
        plt.close(fig)
    except ImportError:  # pragma: no cover
        print("matplotlib missing: no plot", flush=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", nargs="*", default=list(DEFAULT_CELLS), help="NxK cells (sequence length x pairs)")
    p.add_argument("--attns", nargs="*", default=list(ATTNS))
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--num-test", type=int, default=500)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(ROOT, "results", "mqar"), help="output stem (.md/.json/.png)")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "outputs", "mqar_grid"), help="run directories")
    p.add_argument("--resume", action="store_true", help="skip runs already in <out>.json")
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--notes", default="", help="a paragraph written under the table")
    p.add_argument("extra", nargs="*", help="extra Hydra overrides for every run")
    args = p.parse_args(argv)
    args.argv = argv
    results = []
    if (args.resume or args.plot_only) and os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            results = json.load(f)["results"]
    if not args.plot_only:
        done = {(r["seq_len"], r["num_kv_pairs"], r["attn"]) for r in results if "error" not in r}
        for cell in args.cells:
            n, k = (int(v) for v in cell.lower().split("x"))
            for attn in args.attns:
                if (n, k, attn) in done:
                    continue
                results.append(run_one(attn, n, k, args))
                write_outputs(results, args, args.out)
    write_outputs(results, args, args.out)
    print(f"wrote {args.out}.md, .json, .png")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
