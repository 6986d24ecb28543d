#!/usr/bin/env python
"""One cell over seeds: finished ``train.py`` runs named ``<variant>_s<seed>`` under one folder -> a table of
each variant's final metric (mean ± std, every seed), the paired per-seed differences with their 95% interval,
the "holds" / "reversed" / "level" verdict, the learning curves, and every run's record (its resolved config,
command, commit, machine and load: the ``run.json`` the trainer writes).

    python -m scripts.tables.seed_grid RUNS/mqar256 --metric acc --baseline linear \\
        --pairs mhla_lm:frozen_unif mhla_lm:frozen_loc --title "MQAR N = 256, K = 8" --out results/mqar/seeds_n256

A run counts when its ``run.json`` exists (the trainer writes it at the end); unfinished runs are listed as
such. Differences are paired by seed (the same data order and init seed on both sides) and the interval is the
t interval of the per-seed differences (:func:`tasks.common.stats.paired_difference`); the ordering a > b
"holds" only when both sides have 3 seeds or more and the gap of the means exceeds two pooled standard
deviations, it is "reversed" when b is ahead of a by the same rule
(:func:`tasks.common.stats.ordering_word`: a baseline that beats MHLA is said so, not hidden as "level"),
otherwise it is "level" (higher metrics are better; ``--lower-is-better`` for a loss or a perplexity). The last
column, the change between a run's last two evaluations, is the evidence of convergence: a variant still gaining at
the end was stopped while learning.
Final metrics whose names start with ``mix`` (MHLA's mixing profile per layer, e.g. MQAR's ``mix1_first``: the
share of the first block in layer 1's causal rows) get their own table, at the start (the first evaluation)
and at the end.

A ``run_info.json`` beside ``run.json`` (a job queue's record: niceness, load while it ran) is kept when present.
Writes ``<out>.md``, ``.json`` and ``.png`` through :func:`tasks.common.results.write_result`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys

from omegaconf import OmegaConf

from mhla.layers import write_gate_kind
from mhla.layouts import num_blocks_for
from mhla.registry import takes_blocks
from tasks.common.results import write_result
from tasks.common.launch import metric_curve, read_notes
from tasks.common.records import effective_attention, read_run_record
from tasks.common.stats import (
    CONVERGENCE_RULE,
    convergence_word,
    mean_std,
    ordering_word,
    paired_difference,
    pooled_std,
)

RUN_NAME = re.compile(r"^(?P<variant>.+)_s(?P<seed>\d+)$")


def collect(root: str, metric: str) -> dict:
    """``{variant: {"runs": {seed: run}, "unfinished": [seed, ...]}}`` for the ``<variant>_s<seed>`` folders of
    ``root``. A run: ``{"dir", "value" (final ``metric``), "metrics" (all final ones), "curve" ([(step, eval
    value)]), "record" (run.json), "queue" (run_info.json or None)}``."""
    out: dict = {}
    for name in sorted(os.listdir(root)):
        m = RUN_NAME.match(name)
        path = os.path.join(root, name)
        if not m or not os.path.isdir(path):
            continue
        variant, seed = m["variant"], int(m["seed"])
        entry = out.setdefault(variant, {"runs": {}, "unfinished": []})
        record = read_run_record(path)
        if record is None or metric not in record.get("metrics", {}):
            entry["unfinished"].append(seed)
            continue
        queue = os.path.join(path, "run_info.json")
        entry["runs"][seed] = {
            "dir": path, "value": float(record["metrics"][metric]), "metrics": record["metrics"],
            "curve": metric_curve(path, f"eval/{metric}"), "record": record,
            "queue": json.load(open(queue)) if os.path.exists(queue) else None,
            "first_eval": first_eval(path)}
    return out


def first_eval(run_dir: str) -> dict:
    """The metrics of a run's first evaluation (``eval/*`` keys of the first row that has any), without prefix."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                found = {k[5:]: v for k, v in row.items() if k.startswith("eval/")}
                if found:
                    return {"step": row["step"], **found}
    return {}


def steps_of(run: dict) -> int | None:
    """The optimiser steps a run took (``steps`` in its final metrics, else the step of its last evaluation)."""
    steps = run["metrics"].get("steps")
    if steps is not None:
        return int(steps)
    return int(run["curve"][-1][0]) if run["curve"] else None


def last_gain(run: dict) -> tuple[float, int] | None:
    """How much the last evaluation improved on the one before: ``(value change, steps between them)``, the
    evidence of whether a run was still learning when it stopped (None with fewer than two evaluations)."""
    if len(run["curve"]) < 2:
        return None
    (s0, v0), (s1, v1) = run["curve"][-2:]
    return v1 - v0, s1 - s0


def best_step(run: dict, higher_is_better: bool = True) -> int | None:
    """The step of the best evaluation (the highest value, or the lowest with ``higher_is_better=False``) of a
    run's curve."""
    if not run["curve"]:
        return None
    return (max if higher_is_better else min)(run["curve"], key=lambda p: p[1])[0]


def summarize(grid: dict, baseline: str | None, pairs: list[tuple[str, str]], scale: float,
              higher_is_better: bool = True) -> dict:
    """Per variant: n, mean, std, per-seed values (x ``scale``), steps; per pair: the paired difference and the
    verdict of "a is better than b" (``a > b``, or ``a < b`` with ``higher_is_better=False``)."""
    variants = {}
    for name, entry in grid.items():
        vals = {s: r["value"] * scale for s, r in sorted(entry["runs"].items())}
        m, sd = mean_std(list(vals.values())) if vals else (None, None)
        variants[name] = {"n": len(vals), "mean": m, "std": sd, "by_seed": vals,
                          "unfinished": sorted(entry["unfinished"]),
                          "steps": sorted({steps_of(r) for r in entry["runs"].values()} - {None}),
                          "best_step": {s: best_step(r, higher_is_better) for s, r in sorted(entry["runs"].items())}}
        gains = {s: g for s, g in ((s, last_gain(r)) for s, r in sorted(entry["runs"].items())) if g}
        variants[name]["last_gain"] = {
            "by_seed": {s: g[0] * scale for s, g in gains.items()},
            "mean": mean_std([g[0] * scale for g in gains.values()])[0] if gains else None,
            "over_steps": sorted({g[1] for g in gains.values()})}
        variants[name]["convergence"] = convergence_word([g[0] * scale for g in gains.values()], list(vals.values()),
                                                         higher_is_better)
    all_pairs = [(v, baseline) for v in grid if baseline and v != baseline and baseline in grid] + list(pairs)
    compared = []
    for a, b in dict.fromkeys(all_pairs):
        if a not in variants or b not in variants:
            continue
        d = paired_difference(variants[a]["by_seed"], variants[b]["by_seed"])
        va, vb = list(variants[a]["by_seed"].values()), list(variants[b]["by_seed"].values())
        gap = variants[a]["mean"] - variants[b]["mean"] if va and vb else None
        compared.append({"a": a, "b": b, **d, "gap_of_means": gap,
                         "pooled_std": pooled_std(va, vb) if va and vb else None,
                         "verdict": ordering_word(va, vb, higher_is_better)})
    lower = {} if higher_is_better else {"lower_is_better": True}  # (absent: higher is better, the usual case)
    return {"variants": variants, "pairs": compared, **lower}


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(summary: dict, grid: dict, args, command: str) -> str:
    """The cell's table, its paired differences and its mixing profile (numbers only; a reading goes beside)."""
    v, lines = summary["variants"], []
    lines += [f"# {args.title}", "", f"Made by `{command}`" + (f", on the runs of `{args.runs_command}`" if
                                                               args.runs_command else "") + ".", "",
              f"Final `{args.metric}`{' (%)' if args.scale == 100 else ''} per variant over seeds "
              "(mean ± sample std); every run's resolved config, command, commit, machine and load are in the "
              f".json{'; lower is better' if summary.get('lower_is_better') else ''}. Convergence (last column), "
              f"the written rule: {CONVERGENCE_RULE}.", "",
              "| variant | attention | n | steps | mean ± std | per seed | best eval at step | last eval's gain "
              "| converged (rule) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, s in v.items():
        desc = describe(next(iter(grid[name]["runs"].values()))["record"]) if s["n"] else "-"
        per = ", ".join(f"s{k}: {fmt(x, args.digits)}" for k, x in s["by_seed"].items())
        steps = "/".join(str(x) for x in s["steps"]) or "-"
        best = ", ".join(f"s{k}: {x}" for k, x in s["best_step"].items())
        unf = f" (unfinished: {', '.join(f's{u}' for u in s['unfinished'])})" if s["unfinished"] else ""
        g = s["last_gain"]
        gain = (f"{fmt(g['mean'], args.digits + 1)} over {'/'.join(map(str, g['over_steps']))} steps ("
                + ", ".join(f"s{k}: {fmt(x, args.digits + 1)}" for k, x in g["by_seed"].items()) + ")"
                if g["mean"] is not None else "-")
        spread = f" ± {fmt(s['std'], args.digits)}" if s["n"] > 1 else " (one seed)"  # no spread from one value
        lines.append(f"| {name}{unf} | {desc} | {s['n']} | {steps} | {fmt(s['mean'], args.digits)}{spread} | {per} | "
                     f"{best} | {gain} | {s.get('convergence', '-')} |")
    if summary["pairs"]:
        ahead, behind = ("a < b", "b < a") if summary.get("lower_is_better") else ("a > b", "b > a")
        lines += ["", "Paired per-seed differences a - b (95% t interval over the seeds both have; the ordering "
                  f"{ahead} *holds* only when both have 3 seeds or more and the gap of the means exceeds two pooled "
                  f"standard deviations, is *reversed* when {behind} by the same rule, else *level*):", "",
                  "| a - b | seeds | mean diff | 95% interval | per seed | verdict |", "|---|---|---|---|---|---|"]
        for p in summary["pairs"]:
            ci = "-" if p["ci95"] is None else f"[{fmt(p['ci95'][0], args.digits)}, {fmt(p['ci95'][1], args.digits)}]"
            per = ", ".join(fmt(x, args.digits) for x in p["diffs"])
            lines.append(f"| {p['a']} - {p['b']} | {p['n']} | {fmt(p['mean'], args.digits)} | {ci} | {per} | "
                         f"{p['verdict']} |")
    mix = mixing_rows(grid)
    if mix:
        keys = sorted({k for row in mix for k in row["end"]})
        lines += ["", "Mixing profile (MHLA's causal rows, mean over seeds): `mix<l>_first` is the share of the "
                  "first block (where the key-value pairs are) in layer l's rows, `mix<l>_diag` the share of the "
                  "query's own block; uniform rows give the mean of 1/(i+1) over rows i = 1 .. M-1 for both ("
                  + uniform_shares(mix) + ").", "",
                  "| variant | " + " | ".join(f"{k} start -> end" for k in keys) + " |",
                  "|---|" + "---|" * len(keys)]
        for row in mix:
            cells = [f"{row['start'].get(k, float('nan')):.3f} -> {row['end'].get(k, float('nan')):.3f}"
                     for k in keys]
            lines.append(f"| {row['variant']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def attention_of(record: dict) -> dict:
    """A run's attention with every option set: ``record["attention"]``, or for an older record its config resolved
    now (:func:`tasks.common.records.effective_attention`)."""
    config = record["config"]
    return record.get("attention") or effective_attention(OmegaConf.create(config)) or config.get("attn", {})


def describe(record: dict) -> str:
    """The attention settings that tell the variants apart, from a run's record (:func:`attention_of`)."""
    config = record["config"]
    attn = attention_of(record)
    bits = [str(attn.get("name"))]
    if takes_blocks(str(attn.get("name"))):  # MHLA's chunk or block count
        if attn.get("block_size") is not None:
            bits.append(f"block {attn.get('block_size')}")
        elif attn.get("num_blocks") is not None:
            bits.append(f"M={attn.get('num_blocks')}")
        bits += [f"init={attn.get('mixing_init')}", "learnable" if attn.get("mixing_learnable") else "frozen"]
        if attn.get("mixing_max") not in (None, 1, 1.0):  # the clamp's bound, when not the paper's 1
            bits.append(f"max {attn.get('mixing_max')}")
        if attn.get("mixing_learnable"):
            bits.append(f"mixing lr x {config.get('optim', {}).get('mixing_lr_scale')}")
        if attn.get("mixing_extension") not in (None, "uniform_far"):  # the far rule it trained under, if not default
            bits.append(f"rule {attn.get('mixing_extension')}")
    if attn.get("short_conv") is not None:
        bits.append(f"short_conv={attn.get('short_conv')}")
    if write_gate_kind(attn.get("write_gate")) is not None:  # a learned gate on each token's write
        budget = attn.get("write_gate_penalty")
        reads = " on the short conv" if attn.get("write_gate_input") == "short_conv" else ""
        bits.append(f"write gate {attn.get('write_gate')}{reads}" + (f" (budget {budget:g})" if budget else ""))
    return ", ".join(bits)


def uniform_share(num_blocks: int) -> float:
    """What ``mix<l>_first`` and ``mix<l>_diag`` read for causal uniform rows ``1/(i+1)`` over ``M`` blocks."""
    return sum(1 / (i + 1) for i in range(1, num_blocks)) / max(num_blocks - 1, 1)


def uniform_shares(mix: list[dict]) -> str:
    """``"0.159 at M = 16, 0.245 at M = 8"``: the uniform reference for each block count in the mixing table."""
    ms = sorted({row["num_blocks"] for row in mix if row["num_blocks"]})
    return ", ".join(f"{uniform_share(m):.3f} at M = {m}" for m in ms) or "M unknown"


def num_blocks_of(record: dict) -> int | None:
    """``M`` of an MHLA run from its record: ``num_blocks``, or the blocks of ``block_size`` covering the sequence
    (:func:`mhla.layouts.num_blocks_for`)."""
    attn = attention_of(record)
    num_blocks, block_size = attn.get("num_blocks"), attn.get("block_size")
    seq_len = record.get("config", {}).get("data", {}).get("seq_len")
    if isinstance(num_blocks, int):
        return num_blocks
    if isinstance(block_size, int) and isinstance(seq_len, int):
        return num_blocks_for(seq_len, block_size)
    return None                                                    # "auto" or no sequence length: not known here


def mixing_rows(grid: dict) -> list[dict]:
    """Per variant with mixing metrics: ``{"variant", "num_blocks", "start": {key: mean}, "end": {key: mean}}``."""
    rows = []
    for name, entry in grid.items():
        runs = list(entry["runs"].values())
        keys = sorted({k for r in runs for k in r["metrics"] if k.startswith("mix")})
        if not keys:
            continue

        def mean(key, where):
            xs = [r[where][key] for r in runs if key in r[where]]
            return sum(xs) / len(xs) if xs else float("nan")

        blocks = {num_blocks_of(r["record"]) for r in runs}
        rows.append({"variant": name, "num_blocks": blocks.pop() if len(blocks) == 1 else None,
                     "start": {k: mean(k, "first_eval") for k in keys},
                     "end": {k: mean(k, "metrics") for k in keys}})
    return rows


def plot(grid: dict, summary: dict, args, path: str) -> None:
    """Left: every seed's final value per variant (dots) and the mean ± std (bar), on an axis fitted to the values
    (not from zero: converged rows can differ by tenths); right: the eval curves."""
    from tasks.common.plots import colors_for, pyplot, save_figure

    plt = pyplot()
    names = list(summary["variants"])
    colors = colors_for(names)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, name in enumerate(names):
        s = summary["variants"][name]
        if s["n"]:
            ax1.errorbar([i], [s["mean"]], yerr=[s["std"]], fmt="_", markersize=18, capsize=6,
                         color=colors[name], zorder=2)
            ax1.scatter([i] * s["n"], list(s["by_seed"].values()), color=colors[name], zorder=3, s=14, alpha=0.7)
        for run in grid[name]["runs"].values():
            if run["curve"]:
                xs, ys = zip(*run["curve"])
                ax2.plot(xs, [y * args.scale for y in ys], color=colors[name], alpha=0.7, lw=1)
        ax2.plot([], [], color=colors[name], label=name)
    ax1.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax1.set_ylabel(args.metric)
    ax1.set_title("final value per seed (mean ± std)")
    ax2.set_xlabel("step")
    ax2.set_ylabel(f"eval {args.metric}")
    ax2.set_title("evaluation curves (one line per seed)")
    ax2.legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="folder holding <variant>_s<seed> run folders")
    ap.add_argument("--metric", default="acc", help="final metric (run.json metrics key)")
    ap.add_argument("--scale", type=float, default=100.0, help="multiply the metric (100: fractions -> %%)")
    ap.add_argument("--digits", type=int, default=1)
    ap.add_argument("--baseline", default=None, help="every variant is compared with it")
    ap.add_argument("--pairs", nargs="*", default=[], help="more comparisons a:b (a - b)")
    ap.add_argument("--title", default="Seeds")
    ap.add_argument("--out", required=True, help="stem of the .md / .json / .png")
    ap.add_argument("--notes", default="", help="reading paragraph (or @file) under the tables")
    ap.add_argument("--runs-command", default="", help="the command that trains the runs (named in the table)")
    ap.add_argument("--lower-is-better", action="store_true", help="the metric is a loss or a perplexity: the "
                    "verdicts, the best step and the convergence rule take lower values as better")
    args = ap.parse_args(argv)
    notes = read_notes(args.notes)
    pairs = [tuple(p.split(":", 1)) for p in args.pairs]
    grid = collect(args.root, args.metric)
    if not any(e["runs"] for e in grid.values()):
        raise SystemExit(f"{args.root}: no finished <variant>_s<seed> run (run.json with '{args.metric}')")
    summary = summarize(grid, args.baseline, pairs, args.scale, not args.lower_is_better)
    command = "python -m scripts.tables.seed_grid " + shlex.join(argv if argv is not None else sys.argv[1:])
    runs = {f"{v}_s{s}": {k: r[k] for k in ("dir", "value", "metrics", "curve", "record", "queue", "first_eval")}
            for v, e in grid.items() for s, r in e["runs"].items()}
    record = {"command": command, "title": args.title, "metric": args.metric, "scale": args.scale, **summary,
              "runs": runs, "notes": notes}
    md = markdown(summary, grid, args, command) + (f"\n## Reading\n\n{notes.strip()}\n" if notes else "")
    write_result(args.out, md, record,
                 lambda png: plot(grid, summary, args, png))
    print(f"wrote {args.out}.md / .json / .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
