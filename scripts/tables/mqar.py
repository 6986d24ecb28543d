"""MQAR grid: attention variants x sequence lengths x key-value counts x seeds -> table, plots and raw records
(the driver behind ``scripts/run_mqar.py`` and ``scripts/reproduce_table.py --table mqar``).

    python scripts/run_mqar.py --scale mini                      # CI-size check (N = 32, K = 2; about 10 min)
    python scripts/run_mqar.py                                   # the committed grid -> results/mqar.md
    python scripts/run_mqar.py --scale large --jobs 8            # more cells, widths and seeds (bigger machine)
    python scripts/run_mqar.py --cells 64x8 --variants mhla mhla_log --epochs 20 --seeds 0 1 \\
        --out results/mqar/lr_scale                              # one hypothesis -> results/mqar/lr_scale.md
    python scripts/run_mqar.py --plot-only                       # redraw from <out>.json

Each run is ``python train.py task=mqar <variant overrides> data.seq_len=N data.num_kv_pairs=K seed=S
trainer.max_epochs=E ...`` (the 2-layer model of ``configs/task/mqar.yaml``, only the attention changes), run
``--jobs`` at a time with one thread each. A variant is a name for a list of overrides (:data:`VARIANTS`):
``mhla`` is whatever ``configs/task/mqar.yaml`` sets (the language-model default rule), the others name
what they change. Records are saved after every run (``<out>.json``, through ``tasks.common.results``; each
record keeps its run's ``run.json`` as ``run``: the resolved config, commit, machine and load); ``--resume`` skips
finished runs.

A cell counts only when softmax attention solves it (>= 99% on average over seeds): otherwise the training
is too short to compare anything, and the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from datetime import datetime, timezone

from tasks.common.launch import mean_std, metric_curve, read_notes, run_parallel, run_training, train_loss_curve
from tasks.common.plots import pyplot, save_figure
from tasks.common.utils import system_info

from .registry import ROOT
from tasks.common.results import saved_machine, write_result

# name -> Hydra overrides. "softmax", "linear" and "mhla" are the task's defaults (configs/task/mqar.yaml: a short
# conv of kernel 4, lr 3e-3, and for MHLA the MQAR rule: uniform init, clamp, optim.mixing_lr_scale=0.01);
# the others each change one thing of them, and the *_conv / *_noconv names pin the conv either way.
VARIANTS = {
    "softmax": ["attn=softmax"],
    "linear": ["attn=linear"],
    "mhla": ["attn=mhla"],
    # the mixing hypotheses (results/mqar/): each changes one thing of the task's default rule
    "mhla_log": ["attn=mhla", "attn.mixing_param=log", "optim.mixing_lr_scale=1.0"],
    "mhla_softplus": ["attn=mhla", "attn.mixing_param=softplus", "optim.mixing_lr_scale=1.0"],
    "mhla_clamp": ["attn=mhla", "attn.mixing_param=clamp", "optim.mixing_lr_scale=1.0"],
    "mhla_clamp_lr0.1": ["attn=mhla", "attn.mixing_param=clamp", "optim.mixing_lr_scale=0.1"],
    "mhla_frozen": ["attn=mhla", "attn.mixing_learnable=false"],
    # the paper's clamp at the full lr, but the matrix waits half of the default 20-epoch run (3,120 steps)
    "mhla_clamp_freeze": ["attn=mhla", "attn.mixing_param=clamp", "optim.mixing_lr_scale=1.0",
                          "optim.mixing_freeze_steps=3120"],
    # ... the same after 1,000 frozen steps (past the early phase in which the full-lr matrix takes the shortcut)
    "mhla_clamp_freeze1k": ["attn=mhla", "attn.mixing_param=clamp", "optim.mixing_lr_scale=1.0",
                            "optim.mixing_freeze_steps=1000"],
    "mhla_locality": ["attn=mhla", "attn.mixing_init=locality"],
    "mhla_locality_visible": ["attn=mhla", "attn.mixing_init=locality_visible"],
    "mhla_identity": ["attn=mhla", "attn.mixing_init=identity"],
    # a short causal conv (kernel 4, fla's ShortConvolution) on q, k, v: the token shift that the recall circuit
    # needs and that linear attention cannot do sharply by itself (GLA / Gated DeltaNet have it by default)
    "softmax_conv": ["attn=softmax", "attn.short_conv=4"],
    "linear_conv": ["attn=linear", "attn.short_conv=4"],
    "mhla_conv": ["attn=mhla", "attn.short_conv=4"],
    # ... with the paper's full-lr mixing (the 0.01 x rule protects the matrix only before the circuit exists)
    "mhla_conv_lr1": ["attn=mhla", "attn.short_conv=4", "optim.mixing_lr_scale=1.0"],
    # ... and without it (the paper's LM has none): the recall circuit must then come from attention alone
    "softmax_noconv": ["attn=softmax", "attn.short_conv=0"],
    "linear_noconv": ["attn=linear", "attn.short_conv=0"],
    "mhla_noconv": ["attn=mhla", "attn.short_conv=0"],
}

# Grids by scale: cells (NxK), variants, seeds, epochs of the task's 20k training examples (312 steps each);
# "epochs_by_len": fewer epochs for long sequences (a step at N = 256 costs about 3x one at N = 64 on a CPU).
SCALES = {
    "mini": {"cells": ["32x2"], "variants": ["softmax", "linear", "mhla"], "seeds": [0], "epochs": 8},
    # N grows with K fixed (where per-block summaries should help); explicit variant names, so that the records
    # stay true if the task's defaults change. About 2 h on 2 cores (two single-thread runs at a time).
    "full": {"cells": ["64x8", "256x8"], "variants": ["softmax_conv", "linear_conv", "mhla_conv"],
             "seeds": [0, 1], "epochs": 20, "epochs_by_len": {256: 10}},
    "large": {"cells": ["64x4", "64x8", "128x8", "256x8", "256x16", "512x16", "512x32"],
              "variants": ["softmax", "linear", "mhla", "mhla_clamp"], "seeds": [0, 1, 2], "epochs": 40,
              "extra": ["model.hidden_size=128", "data.long_context=true"]},  # N = 512 with the vocabulary of 512
}
CONVERGED = 0.99  # softmax accuracy a cell needs before its comparison counts


def epochs_for(n: int, args) -> int:
    """Training epochs of a run at sequence length ``n``: ``--epochs`` when given, else the preset's."""
    return args.epochs if args.epochs_given else int(args.epochs_by_len.get(n, args.epochs))


def overrides_for(variant: str, n: int, k: int, seed: int, args) -> list[str]:
    return ["task=mqar", *VARIANTS[variant], f"data.seq_len={n}", f"data.num_kv_pairs={k}", f"seed={seed}",
            f"trainer.max_epochs={epochs_for(n, args)}", "logger=none", "trainer.progress_bar=false", "trainer.device=cpu",
            f"hydra.run.dir={run_dir(args, variant, n, k, seed)}", *args.extra]


def run_dir(args, variant: str, n: int, k: int, seed: int) -> str:
    return os.path.join(args.out_dir, f"{n}x{k}", f"{variant}_s{seed}")


def run_one(variant: str, n: int, k: int, seed: int, args) -> dict:
    rec = run_training(overrides_for(variant, n, k, seed, args), threads=args.threads)
    tail = rec.pop("error_tail", None) or ""
    rec = {"variant": variant, "seq_len": n, "num_kv_pairs": k, "seed": seed, "epochs": epochs_for(n, args), **rec}
    directory = run_dir(args, variant, n, k, seed)
    return finish_record(rec, directory, interrupted=STOPPED in tail or was_stopped(directory))


STOPPED = "received: stopped at step"  # train.py's line when a stop signal ended the run early (last.pt saved)


def stopped_step(directory: str) -> int | None:
    """The step at which a stop signal (SIGTERM / SIGINT) ended the run in ``directory`` (its ``train.log``), or
    None when it ended with its schedule or did not run."""
    path = os.path.join(directory, "train.log")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        m = re.search(STOPPED + r" (\d+)", f.read()[-4000:])
    return int(m.group(1)) if m else None


def was_stopped(directory: str) -> bool:
    """Whether a stop signal, not the end of its schedule, ended the run in ``directory``."""
    return stopped_step(directory) is not None


def finish_record(rec: dict, directory: str, interrupted: bool = False) -> dict:
    """Add the loss and eval-accuracy curves of the run in ``directory``; a run stopped by a signal becomes an
    ``interrupted`` record (no final accuracy: its eval curve up to ``stopped_at`` is what it measured)."""
    if "metrics" in rec:
        rec.update(rec.pop("metrics"))
    rec["curve"] = train_loss_curve(directory)
    rec["eval_curve"] = metric_curve(directory, "eval/acc")
    if interrupted and "acc" not in rec:
        rec.pop("error", None)
        rec.update(interrupted=True, stopped_at=stopped_step(directory) or (rec["curve"][-1][0] if rec["curve"] else 0))
    return rec


def matched_steps_table(results: list[dict], variants: list[str], n: int, k: int) -> list[str]:
    """Eval accuracy (mean over seeds) of every variant of cell (n, k) at the eval steps all its runs reached:
    how stopped runs compare at equal steps of the same schedule."""
    runs = [r for r in results if (r["seq_len"], r["num_kv_pairs"]) == (n, k) and r.get("eval_curve")
            and r["variant"] in variants]
    if not runs:
        return []
    common = sorted(set.intersection(*(set(s for s, _ in r["eval_curve"]) for r in runs)))
    shown = [v for v in variants if any(r["variant"] == v for r in runs)]
    head = "| step | " + " | ".join(f"{v} acc %" for v in shown) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for step in common:
        row = []
        for v in shown:
            accs = [dict(r["eval_curve"])[step] for r in runs if r["variant"] == v]
            row.append(f"{100 * statistics.fmean(accs):.1f}" + (f" (n={len(accs)})" if len(accs) > 1 else ""))
        lines.append(f"| {step} | " + " | ".join(row) + " |")
    return lines


def record_epochs(r: dict) -> int | None:
    """The epochs a record trained for (older records: read from its command)."""
    if r.get("epochs"):
        return int(r["epochs"])
    m = re.search(r"trainer\.max_epochs=(\d+)", r.get("command", ""))
    return int(m.group(1)) if m else None


def softmax_status(stats: dict, n: int, k: int, variants: list[str], results: list[dict] = ()) -> str:
    """Whether a softmax variant of the table solves cell (n, k) (>= :data:`CONVERGED` on average). A stopped
    softmax run counts by the accuracy of its last evaluation, and the column says so."""
    found = []
    for v in variants:
        if "attn=softmax" not in VARIANTS[v]:
            continue
        if (n, k, v) in stats:
            found.append((v, stats[(n, k, v)][0], ""))
            continue
        last = [r["eval_curve"][-1] for r in results if (r["seq_len"], r["num_kv_pairs"], r["variant"]) == (n, k, v)
                and r.get("interrupted") and r.get("eval_curve")]
        if last:
            found.append((v, statistics.fmean(a for _, a in last),
                          f" (stopped; last eval at step {max(s for s, _ in last)})"))
    if not found:
        return "?"
    return "; ".join(f"{v}: " + ("yes" if acc >= CONVERGED else "**no: too short, does not count**") + note
                     for v, acc, note in found)


def summarize(results: list[dict], variants: list[str]) -> tuple[list, dict]:
    """Cells in order and ``{(n, k, variant): (mean acc, std, number of seeds)}`` over finished runs."""
    cells = sorted({(r["seq_len"], r["num_kv_pairs"]) for r in results})
    stats = {}
    for n, k in cells:
        for v in variants:
            accs = [r["acc"] for r in results if (r["seq_len"], r["num_kv_pairs"], r["variant"]) == (n, k, v)
                    and "acc" in r]
            if accs:
                stats[(n, k, v)] = (*mean_std(accs), len(accs))
    return cells, stats


def run_key(rec: dict) -> tuple:
    """(variant, N, K, seed): what identifies one run of the grid."""
    return rec["variant"], rec["seq_len"], rec["num_kv_pairs"], rec["seed"]


def write_outputs(results: list[dict], args, stem: str) -> None:
    """``<stem>.md`` (the table, the conditions, the reading), ``.json`` (every run's record) and ``.png`` /
    ``_curves.png``, through :func:`tasks.common.results.write_result`. ``args.machine`` / ``args.date``: those of
    the runs (kept by ``--plot-only``; default this machine, now)."""
    args.machine = getattr(args, "machine", None) or system_info()
    args.date = getattr(args, "date", None) or datetime.now(timezone.utc).isoformat()
    args.record_notes = getattr(args, "record_notes", None) or {}
    variants = [v for v in args.variants if any(r["variant"] == v for r in results)] or args.variants
    cells, stats = summarize(results, variants)
    head = ("| N | K | epochs | " + " | ".join(f"{v} acc %" for v in variants)
            + " | softmax solved | mean time s |")
    lines = [
        f"# {args.title}",
        "",
        "Multi-query associative recall (Zoology's `multiquery_ar`, `tasks/language/mqar.py`): K key-value pairs, "
        "then the K keys again at power-law gaps among random tokens; accuracy = exact value predicted at the query "
        "positions of 1,000 held-out examples. Mean ± std over seeds (n = number of seeds).",
        "",
        f"Command: `python scripts/run_mqar.py {' '.join(args.argv)}`".rstrip(),
        "",
        f"Conditions: the 2-layer causal LM of `configs/task/mqar.yaml` (width 64 unless an override says "
        f"otherwise, 2 heads, SwiGLU, RoPE, no normalizer + output RMSNorm), AdamW at the task's lr unless an "
        f"override says otherwise, cosine, batch 64, the epochs of the table (312 steps each: 20k examples); "
        f"MHLA chunks of C = smallest power of two >= sqrt(N). Variants (each one's overrides): "
        + "; ".join(f"`{v}`: {' '.join(VARIANTS[v])}" for v in variants)
        + f". Extra overrides: {' '.join(args.extra) or 'none'}. {args.jobs} run(s) at a time, "
        f"{args.threads} thread(s) each.",
        "",
        f"Machine: {json.dumps(args.machine)}",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for n, k in cells:
        row = []
        for v in variants:
            s = stats.get((n, k, v))
            stopped = [r["stopped_at"] for r in results if (r["seq_len"], r["num_kv_pairs"], r["variant"]) == (n, k, v)
                       and r.get("interrupted")]
            if s is None:
                row.append(f"stopped at step {', '.join(map(str, stopped))}" if stopped else "not run")
            else:
                row.append(f"{100 * s[0]:.1f} ± {100 * s[1]:.1f} (n={s[2]})")
        solved = softmax_status(stats, n, k, variants, results)
        eps = sorted({record_epochs(r) for r in results if (r["seq_len"], r["num_kv_pairs"]) == (n, k)} - {None})
        ep = "/".join(map(str, eps)) or "?"
        secs = [r["seconds"] for r in results if (r["seq_len"], r["num_kv_pairs"]) == (n, k) and "acc" in r
                and r.get("seconds")]
        lines.append(f"| {n} | {k} | {ep} | " + " | ".join(row) + f" | {solved} | "
                     + (f"{statistics.fmean(secs):.0f} |" if secs else "- |"))
    for n, k in cells:
        if any(r.get("interrupted") for r in results if (r["seq_len"], r["num_kv_pairs"]) == (n, k)):
            lines += ["", f"N = {n}, K = {k}: some runs were stopped before the end of their schedule, so the cell "
                      "has no final accuracy for them. Eval accuracy at the steps every run of the cell reached "
                      "(the same lr schedule, so equal steps are equal training):", "",
                      *matched_steps_table(results, variants, n, k)]
    failed = [r for r in results if "error" in r]
    if failed:
        lines += ["", "Failed runs: " + "; ".join(f"{r['variant']} {r['seq_len']}x{r['num_kv_pairs']} seed "
                                                  f"{r['seed']}: {r['error'][:80]}" for r in failed)]
    base = os.path.basename(stem)
    lines += ["", f"Plots: `{base}.png` (accuracy, mean and spread over seeds), `{base}_curves.png` (training "
              f"loss, every seed). Raw records (commands, metrics, loss curves, times): `{base}.json`.", ""]
    if args.notes:
        lines += ["## Reading", "", args.notes.strip(), ""]
    # whole files only (the grid rewrites them after every run)
    # the table's numbers (mean / std / n of the final accuracy over seeds, per cell and variant)
    summary = {f"{n}x{k}": {v: dict(zip(("mean", "std", "n"), stats[(n, k, v)])) for v in variants
                            if (n, k, v) in stats} for n, k in cells}
    record = {"date": args.date, "argv": args.argv, "machine": args.machine, **args.record_notes,
              "summary": summary, "results": results}
    write_result(stem, "\n".join(lines), record, lambda png: plot(results, variants, cells, stats, png[:-4], args))


def accuracy_panel(ax, xs: list[int], stat_of, variants: list[str], xlabel: str, title: str = "") -> None:
    """Mean accuracy with its spread over seeds against ``xs`` (log2 axis), one line per variant;
    ``stat_of(x, v)`` is the ``(mean, std, n)`` of variant ``v`` at ``x`` or None."""
    for j, v in enumerate(variants):
        pts = [(x, *stat_of(x, v)[:2]) for x in xs if stat_of(x, v) is not None]
        if pts:
            x, y, e = zip(*pts)
            ax.errorbar(x, [100 * a for a in y], yerr=[100 * s for s in e], marker="o", capsize=3, label=v,
                        color=f"C{j}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_ylim(0, 102)
    ax.set_xlabel(xlabel)
    if title:
        ax.set_title(title)


def plot(results, variants, cells, stats, stem, args) -> None:
    """``<stem>.png``: accuracy against N when every N has one K (N grows with K fixed), else against K, one
    panel per N; ``<stem>_curves.png``: the training loss of every run."""
    plt = pyplot()
    lengths = sorted({n for n, _ in cells})
    ks_all = sorted({k for _, k in cells})
    if len(lengths) > 1 and len(ks_all) == 1:
        k = ks_all[0]
        fig, ax = plt.subplots(figsize=(5.2, 3.6))
        panels = [(ax, lengths, lambda n, v: stats.get((n, k, v)), f"sequence length N (K = {k} key-value pairs)", "")]
    else:
        fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.4), squeeze=False)
        panels = [(ax, sorted(k for m, k in cells if m == n), lambda k, v, n=n: stats.get((n, k, v)),
                   "key-value pairs K", f"N = {n}") for ax, n in zip(axes[0], lengths)]
    for ax, xs, stat_of, xlabel, title in panels:
        accuracy_panel(ax, xs, stat_of, variants, xlabel, title)
    panels[0][0].set_ylabel("MQAR accuracy (%)")
    panels[-1][0].legend(fontsize=8)
    fig.suptitle(f"{args.title} (CPU)", fontsize=10)
    save_figure(fig, stem + ".png", dpi=110)

    fig, axes = plt.subplots(1, len(cells), figsize=(4.2 * len(cells), 3.2), squeeze=False)
    for ax, (n, k) in zip(axes[0], cells):
        for j, v in enumerate(variants):
            for r in results:
                if (r["seq_len"], r["num_kv_pairs"], r["variant"]) == (n, k, v) and r.get("curve"):
                    s, loss = zip(*r["curve"])
                    ax.plot(s, loss, color=f"C{j}", alpha=0.8, lw=1, label=v if r["seed"] == min(
                        q["seed"] for q in results if q["variant"] == v and "curve" in q) else None)
        ax.set_title(f"N = {n}, K = {k}")
        ax.set_xlabel("step")
        ax.set_yscale("log")
    axes[0][0].set_ylabel("training loss (query positions)")
    axes[0][-1].legend(fontsize=8)
    save_figure(fig, stem + "_curves.png", dpi=110)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=sorted(SCALES), default="full", help="preset grid (the options below override)")
    p.add_argument("--cells", nargs="*", help="NxK cells (sequence length x key-value pairs)")
    p.add_argument("--variants", nargs="*", help=f"attention variants: {', '.join(VARIANTS)}")
    p.add_argument("--seeds", nargs="*", type=int)
    p.add_argument("--epochs", type=int, help="epochs of the task's 20k training examples (312 steps each)")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--out", default=None, help="output stem (.md/.json/.png); default results/mqar[_<scale>]")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "outputs", "mqar_grid"), help="run directories")
    p.add_argument("--title", default="MQAR: softmax vs linear vs MHLA")
    p.add_argument("--resume", action="store_true", help="skip runs already in <out>.json")
    p.add_argument("--order", nargs="*", default=[], help="VARIANT:SEED pairs to run first, in this order")
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--notes", default="", help="a paragraph (or @file) written under the table as its reading")
    p.add_argument("extra", nargs="*", help="extra Hydra overrides for every run")
    args = p.parse_args(argv)
    args.argv = argv
    preset = SCALES[args.scale]
    args.cells = args.cells or preset["cells"]
    args.variants = args.variants or preset["variants"]
    args.seeds = args.seeds if args.seeds is not None else preset["seeds"]
    args.epochs_given = args.epochs is not None
    args.epochs = args.epochs or preset["epochs"]
    args.epochs_by_len = {int(n): int(e) for n, e in preset.get("epochs_by_len", {}).items()}
    args.extra = [*preset.get("extra", []), *args.extra]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    args.notes = read_notes(args.notes)
    stem = args.out or os.path.join(ROOT, "results", "mqar" if args.scale == "full" else f"mqar_{args.scale}")
    results = []
    args.machine, args.date, args.record_notes = system_info(), datetime.now(timezone.utc).isoformat(), {}
    if (args.resume or args.plot_only) and os.path.exists(stem + ".json"):
        with open(stem + ".json") as f:
            saved = json.load(f)
        results = saved["results"]
        # notes on the records themselves (e.g. commands rewritten to today's schema) stay with them
        args.record_notes = {k: v for k, v in saved.items() if k.startswith("note")}
        if args.plot_only:  # the table keeps the machine and date it was measured on
            args.machine = saved.get("machine") or saved_machine(stem + ".md") or args.machine
            args.date = saved.get("date", args.date)
    if not args.plot_only:
        planned = [(v, *(int(x) for x in c.lower().split("x")), s) for c in args.cells for s in args.seeds
                   for v in args.variants]
        # failed or stopped runs of this grid are run again; records outside it are kept as they are
        results = [r for r in results if run_key(r) not in planned or ("error" not in r and not r.get("interrupted"))]
        done = {run_key(r) for r in results}
        todo = [t for t in planned if t not in done]
        if args.order:  # "variant:seed" pairs to run first, in this order
            rank = {tuple(o.rsplit(":", 1)): i for i, o in enumerate(args.order)}
            todo.sort(key=lambda t: rank.get((t[0], str(t[3])), len(rank)))

        def on_done(item, rec):
            results.append(rec)
            write_outputs(results, args, stem)
            return (f"{rec['variant']} N={rec['seq_len']} K={rec['num_kv_pairs']} seed={rec['seed']}: "
                    + (f"FAILED {rec['error']}" if "error" in rec else f"acc={100 * rec['acc']:.1f}%")
                    + f" ({rec['seconds']:.0f}s)")

        run_parallel(lambda t: run_one(*t, args), todo, args.jobs, "MQAR runs", on_done)
    write_outputs(results, args, stem)
    print(f"wrote {stem}.md, .json, .png, _curves.png")
    return 0 if all("error" not in r for r in results) else 1
