#!/usr/bin/env python
"""Check the ``num_blocks=auto`` rule (:func:`mhla.layouts.auto_blocks`) against an M sweep and a latency
curve; writes ``results/auto_m.{md,json,png}`` (:func:`tasks.common.results.write_result`).

    python scripts/auto_m.py                  # the sweep, the benchmark, then the results files
    python scripts/auto_m.py --stage sweep    # only the training runs (resumable: finished runs are kept)
    python scripts/auto_m.py --stage bench    # only the benchmark
    python scripts/auto_m.py --stage write --allow-busy   # the files, from the saved runs and benchmark

(a) Accuracy: MNIST ``vit_mini`` (its 8 x 8 token grid, N = 64) with MHLA at the M values of ``--ms`` (any
M that tiles the grid), seeds x ``--steps`` steps each; top-1 mean ± std, and the paired per-seed difference
of every M against the rule's M (:mod:`tasks.common.stats`; "level" where the gap is within 2 pooled std).
(b) Latency: Table 14's shapes (DiT-S/2 forward, batch 1, no CPE / gate; 1024 px = a 64 x 64 grid, N = 4096)
for its M values on this CPU, timed in this one process by ``scripts.tables.benchmark.time_m`` (one warm-up
call, median of ``--bench-repeats``; ``--bench-rounds`` rounds in alternating order, the lowest median per M),
inside a :class:`tasks.common.records.Measurement` (commit, load before and after). A busy machine is refused
unless ``--allow-busy`` (then the files say BUSY).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from datetime import datetime, timezone

if __name__ == "__main__" and not __package__:  # python scripts/x.py: import from this checkout's root
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from mhla.layouts import AUTO_RULE, auto_blocks, factorize_blocks
from scripts.tables.registry import BENCH, ROOT
from tasks.common.results import write_json, write_result
from tasks.common.launch import read_notes, run_parallel, run_training, train_loss_curve
from tasks.common.records import read_run_record
from tasks.common.stats import mean_std, ordering_winner, paired_difference
from tasks.common.utils import system_info

SWEEP_GRID = (8, 8)  # vit_mini: 32 px inputs, 4 px patches
# Below the rule's M, the rule's, the largest M with M^2 <= N (4 x 2 tiles), past the bound, one token per
# block (M = 2 and 32 also tile the 8 x 8 grid: --ms 1 2 4 8 16 32 64; left out to fit a busy 2-core CPU)
SWEEP_MS = [1, 4, 8, 16, 64]
SWEEP_BASE = [
    "task=mnist",
    "model=vit_mini",
    "attn=mhla",
    "trainer.device=cpu",
    "logger=none",
    "trainer.progress_bar=false",
    "trainer.count_flops=false",
]


def divisor_ms(grid) -> list[int]:
    """Every M whose block grid tiles ``grid`` (products of one divisor per axis), ascending."""
    ms = {1}
    for g in grid:
        ms = {m * d for m in ms for d in range(1, g + 1) if g % d == 0}
    return sorted(ms)


def sweep_overrides(m: int, seed: int, args) -> list[str]:
    return [
        *SWEEP_BASE,
        f"attn.num_blocks={m}",
        f"trainer.max_steps={args.steps}",
        f"seed={seed}",
        f"hydra.run.dir={os.path.join(args.runs_dir, f'M{m}_s{seed}')}",
        *args.extra,
    ]


def run_sweep(args) -> list[dict]:
    path = os.path.join(args.runs_dir, "sweep.json")
    records = []
    if os.path.exists(path):
        with open(path) as f:
            records = [r for r in json.load(f) if "error" not in r]
    done = {(r["M"], r["seed"]) for r in records}
    for m, seed in [(m, s) for s in args.seeds for m in args.ms if (m, s) not in done]:
        rec = finished_run(m, seed, args)  # finished, but not saved here (the sweep was stopped)
        if rec is not None:
            records.append(rec)
            done.add((m, seed))
    todo = [(m, s) for s in args.seeds for m in args.ms if (m, s) not in done]

    def one(item):
        m, seed = item
        rec = run_training(sweep_overrides(m, seed, args), threads=args.threads)
        rec.pop("error_tail", None)
        rec.update(M=m, seed=seed, steps=args.steps)
        if "metrics" in rec:
            rec["curve"] = train_loss_curve(os.path.join(args.runs_dir, f"M{m}_s{seed}"))
        return rec

    def on_done(item, rec):
        records.append(rec)
        os.makedirs(args.runs_dir, exist_ok=True)
        write_json(path, records)
        return (
            f"M={rec['M']} seed {rec['seed']}: "
            + (f"FAILED {rec['error']}" if "error" in rec else f"top-1 {100 * rec['metrics']['top1']:.2f}%")
            + f" ({rec['seconds']:.0f}s)"
        )

    run_parallel(one, todo, args.jobs, "auto_m sweep", on_done)
    return records


def finished_run(m: int, seed: int, args) -> dict | None:
    """The record of a finished run of this sweep from its folder's ``run.json`` (the run's own record:
    command, metrics, time, commit, machine, load), or None when it did not finish with these settings."""
    run_dir = os.path.join(args.runs_dir, f"M{m}_s{seed}")
    run = read_run_record(run_dir)
    if not run or "top1" not in run.get("metrics", {}):
        return None
    cfg = run.get("config") or {}
    if (cfg.get("trainer", {}).get("max_steps") != args.steps or cfg.get("attn", {}).get("num_blocks") != m
            or cfg.get("seed") != seed):
        return None
    return {"command": run["command"].replace(ROOT + os.sep, ""), "seconds": run["seconds"],
            "metrics": run["metrics"], "M": m, "seed": seed, "steps": args.steps,
            "curve": train_loss_curve(run_dir), "from_run_record": True,
            "run": {k: run.get(k) for k in ("commit", "dirty", "machine", "load_before", "load_after")}}


def run_bench(args) -> dict:
    import torch

    from scripts.tables.benchmark import time_m
    from tasks.common.records import Measurement

    torch.set_num_threads(args.bench_threads)
    b = BENCH["14"]
    latent = args.bench_res // 8
    rounds = []  # every round times each M once; the order alternates (a load change hits both ends alike)
    with Measurement(threads=args.bench_threads) as load:
        for i in range(args.bench_rounds):
            order = args.bench_ms if i % 2 == 0 else list(reversed(args.bench_ms))
            rounds.append([time_m(b, m, latent, 1, "cpu", args.bench_repeats) for m in order])
    # per M: the round with the lowest median (the one least disturbed by the other jobs on the machine)
    rows = [min((r for rnd in rounds for r in rnd if r["M"] == m), key=lambda r: r["ms"])
            for m in args.bench_ms]
    bench = {
        "rounds": rounds,
        "model": b["model"],
        "res": args.bench_res,
        "grid": [latent // 2] * 2,
        "batch": 1,
        "repeats": args.bench_repeats,
        "threads": args.bench_threads,
        "cpe_gate": b["cpe_gate"],
        "rows": rows,
        "measurement": load.record,
    }
    write_json(os.path.join(args.runs_dir, "bench.json"), bench)
    return bench


# ------------------------------------------------------------------------------------------------- tables
def sweep_stats(records: list[dict], rule_m: int) -> list[dict]:
    by_m: dict[int, dict[int, float]] = {}
    for r in records:
        if "metrics" in r:
            by_m.setdefault(r["M"], {})[r["seed"]] = 100 * r["metrics"]["top1"]
    rows = []
    ref = by_m.get(rule_m, {})
    for m in sorted(by_m):
        accs = by_m[m]
        mean, std = mean_std(list(accs.values()))
        row = {
            "M": m,
            "blocks": list(factorize_blocks(SWEEP_GRID, m)),
            "mean": mean,
            "std": std,
            "n": len(accs),
            "per_seed": {str(s): a for s, a in sorted(accs.items())},
        }
        if m != rule_m and ref:
            d = paired_difference(accs, ref)
            winner = ordering_winner(list(accs.values()), list(ref.values()))
            verdict = {"a": "higher", "b": "lower", None: "level"}[winner]
            row.update(diff=d, verdict=verdict)
        rows.append(row)
    return rows


def block_text(grid, blocks) -> str:
    return "x".join(str(g // b) for g, b in zip(grid, blocks))


def to_markdown(data: dict) -> str:
    sw, bench, rule_m = data["sweep"], data.get("bench"), data["rule_m_sweep"]
    where = (f" On the sweep's {block_text(SWEEP_GRID, (1, 1))} grid it picks **M = {rule_m}** (blocks of "
             f"{block_text(SWEEP_GRID, auto_blocks(SWEEP_GRID))} tokens)")
    if bench:
        where += f"; on Table 14's {block_text(bench['grid'], (1, 1))} grid **M = {data['rule_m_bench']}**"
    commands = "; ".join(f"`{c}`" for c in dict.fromkeys(data["commands"].values()))
    lines = ["# num_blocks=auto: where the rule's M lands", "",
             f"**The rule** (`mhla.layouts.auto_blocks`): {AUTO_RULE}.{where}.", "",
             f"Commands: {commands}", "",
             "## (a) M sweep: MNIST vit_mini (8 x 8 grid, N = 64)", "",
             (f"{data['steps']} steps at the MNIST task's batch and schedule, fp32, {data['threads']} "
              f"thread(s) per run, {data['jobs']} run(s) at a time; top-1 on the full 10k test set; seeds "
              f"{data['seeds']}. Paired difference: each M minus the rule's M = {rule_m}, per seed, with its "
              "95% t interval; verdict `higher` / `lower` where the gap clears 2 pooled std, else `level` "
              "(tasks/common/stats.py)."), "",
             ("| M | block (tokens) | M^2 <= N | top-1 % (mean ± std) | per seed | n | minus rule's M (pp) "
              "| 95% CI | verdict |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sw:
        d = r.get("diff")
        ci = d["ci95"] if d else None
        diff = (f"{d['mean']:+.2f} ± {d['std']:.2f} | " + (f"[{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "-")
                + f" | {r['verdict']}") if d else "- | - | -"
        seeds = ", ".join(f"{v:.2f}" for v in r["per_seed"].values())
        lines.append(f"| {r['M']}{' **(rule)**' if r['M'] == rule_m else ''} | "
                     f"{block_text(SWEEP_GRID, r['blocks'])} | {'yes' if r['M'] ** 2 <= 64 else 'no'} | "
                     f"{r['mean']:.2f} ± {r['std']:.2f} | {seeds} | {r['n']} | {diff} |")
    if bench:
        n = math.prod(bench["grid"])
        lines += ["", (f"## (b) CPU latency: Table 14's shapes ({bench['model']} forward, {bench['res']} px, "
                       f"{block_text(bench['grid'], (1, 1))} grid, N = {n})"), "",
                  (f"Batch {bench['batch']}, no CPE / gate, fp32, {bench['threads']} thread(s), one process "
                   "(`scripts.tables.benchmark.time_m`): per M one warm-up call then the median of "
                   f"{bench['repeats']} calls (p25-p75 beside it); {len(bench.get('rounds', [1]))} round(s) "
                   "over the M values in alternating order, and per M the round with the lowest median. "
                   "Load: "
                   f"{load_text(bench['measurement'])}."), "",
                  "| M | block (tokens) | M^2 <= N | ms (median) | p25-p75 ms | vs rule's M |",
                  "|---|---|---|---|---|---|"]
        ref = next((r["ms"] for r in bench["rows"] if r["M"] == data["rule_m_bench"]), None)
        for r in bench["rows"]:
            rel = f"{r['ms'] / ref:.2f}x" if ref else "-"
            lines.append(f"| {r['M']}{' **(rule)**' if r['M'] == data['rule_m_bench'] else ''} | "
                         f"{block_text(bench['grid'], r['blocks'])} | "
                         f"{'yes' if r['M'] ** 2 <= n else 'no'} | "
                         f"{r['ms']:.0f} | {r['p25_ms']:.0f}-{r['p75_ms']:.0f} | {rel} |")
    lines += ["", "## Reading", "", *reading(data)]
    if data.get("notes"):
        lines += ["", data["notes"].strip()]
    lines += ["", (f"Machine: {json.dumps(data['machine'])}. Plot: `auto_m.png` (top-1 across M; latency "
                   "across M). Raw records (commands, per-seed metrics, loss curves, times, load): "
                   "`auto_m.json`.")]
    return "\n".join(lines) + "\n"


def load_text(m: dict) -> str:
    def first(x):
        return f"{x[0]:.2f}" if isinstance(x, (list, tuple)) and x else "?"

    busy = "BUSY" if m.get("busy") else "not busy"
    return (f"1-minute load {first(m.get('load_before'))} before, {first(m.get('load_after'))} after, on "
            f"{m.get('cpu_count')} CPUs ({busy} by `tasks.common.records`)")


def latency_ratios(bench: dict, rule_m: int) -> dict:
    """The ratios the reading quotes, kept in the record: each M's time over the rule's M's
    (``ratio_to_rule``, by M) and the rule's M's over the fastest M's (``rule_over_fastest``)."""
    rows = {r["M"]: r["ms"] for r in bench["rows"]}
    if rule_m not in rows:
        return {}
    fastest = min(rows.values())
    return {"ratio_to_rule": {str(m): round(ms / rows[rule_m], 2) for m, ms in rows.items()},
            "rule_over_fastest": round(rows[rule_m] / fastest, 2)}


def reading(data: dict) -> list[str]:
    """The reading, made from the numbers (none is written by hand)."""
    sw, rule_m, out = data["sweep"], data["rule_m_sweep"], []
    rule = next((r for r in sw if r["M"] == rule_m), None)
    if rule:
        best = max(sw, key=lambda r: r["mean"])
        rank = sorted(sw, key=lambda r: -r["mean"]).index(rule) + 1
        groups = {v: [str(r["M"]) for r in sw if r.get("verdict") == v] for v in ("higher", "lower", "level")}
        parts = [f"M = {', '.join(ms)} {what[len(ms) == 1]}" for ms, what in (
            (groups["higher"], ("clear the noise above it", "clears the noise above it")),
            (groups["lower"], ("clear the noise below it", "clears the noise below it")),
            (groups["level"], ("are level with it (gap within 2 pooled std)", "is level with it (gap within 2 "
                                                                              "pooled std)"))) if ms]
        out.append(f"- Accuracy: the rule's M = {rule_m} scores {rule['mean']:.2f} ± {rule['std']:.2f} "
                   f"(rank {rank} of {len(sw)} by mean; best mean: M = {best['M']}, {best['mean']:.2f}). "
                   f"Against it, {'; '.join(parts)}. {data['steps']} steps is a short proxy: it can show a "
                   "poor choice, not which M is best after full training.")
    bench = data.get("bench")
    if bench and data["rule_m_bench"] in {r["M"] for r in bench["rows"]}:
        rows = {r["M"]: r["ms"] for r in bench["rows"]}
        n, rm = math.prod(bench["grid"]), data["rule_m_bench"]
        inside = [m for m in rows if m * m <= n]
        lo, hi = min(rows[m] for m in inside), max(rows[m] for m in inside)
        fastest = min(rows, key=rows.get)
        text = (f"- Latency (Table 14's shapes, N = {n}): the rule picks M = {rm} ({rows[rm]:.0f} ms), the "
                f"largest M here with M^2 <= N; the M within the bound ({', '.join(map(str, inside))}) take "
                f"{lo:.0f}-{hi:.0f} ms (a spread of {100 * (hi / lo - 1):.0f}%)")
        past = [f"M = {m}: {rows[m]:.0f} ms ({rows[m] / rows[rm]:.2f}x the rule's)"
                for m in rows if m * m > n]
        if past:
            text += "; past the bound " + ", ".join(past)
        text += f". The rule's M takes {rows[rm] / rows[fastest]:.2f}x the time of the fastest M ({fastest})"
        per_m = {m: [r["ms"] for rnd in bench.get("rounds", []) for r in rnd if r["M"] == m] for m in rows}
        moved = [max(v) / min(v) - 1 for v in per_m.values() if len(v) > 1]
        if moved:
            noise = max(moved)
            gap = {m: rows[m] / rows[rm] - 1 for m in rows if m != rm}
            verdict = {m: "slower" if g > noise else "faster" if -g > noise else "level"
                       for m, g in gap.items()}
            groups = {v: [str(m) for m in verdict if verdict[m] == v] for v in ("slower", "faster", "level")}
            text += (f". Round to round the same M moved by up to {100 * noise:.0f}% under the load, so "
                     "only a gap larger than that is read: " + "; ".join(
                         f"M = {', '.join(ms)} {what}" for ms, what in (
                             (groups["slower"], "slower than the rule's M"),
                             (groups["faster"], "faster than the rule's M"),
                             (groups["level"], "level with it")) if ms))
        out.append(text + ".")
    if bench and bench["measurement"].get("busy"):
        out.append("- The benchmark ran on a busy CPU (other jobs running; written with `--allow-busy`): the "
                   "times are a shape across M under that load, not latencies of an idle machine.")
    return out


def plot(data: dict, path: str) -> None:
    from tasks.common.plots import pyplot, save_figure

    plt = pyplot()
    bench = data.get("bench")
    fig, axes = plt.subplots(1, 2 if bench else 1, figsize=(10 if bench else 5, 3.6), squeeze=False)
    ax = axes[0][0]
    sw, rule_m = data["sweep"], data["rule_m_sweep"]
    xs = [r["M"] for r in sw]
    for r in sw:
        ax.scatter([r["M"]] * r["n"], list(r["per_seed"].values()), s=12, color="0.6")
    ax.errorbar(
        xs, [r["mean"] for r in sw], yerr=[r["std"] for r in sw], marker="o", capsize=3, label="mean ± std"
    )
    ax.axvline(rule_m, color="C3", ls="--", label=f"rule: M = {rule_m}")
    ax.axvline(math.isqrt(64), color="0.4", ls=":", label="M = sqrt(N)")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="M (blocks)", ylabel="top-1 %", title=f"MNIST vit_mini 8x8, {data['steps']} steps")
    ax.legend(fontsize=8)
    if bench:
        ax = axes[0][1]
        rows = bench["rows"]
        n = bench["grid"][0] * bench["grid"][1]
        ax.errorbar(
            [r["M"] for r in rows],
            [r["ms"] for r in rows],
            yerr=[[r["ms"] - r["p25_ms"] for r in rows], [r["p75_ms"] - r["ms"] for r in rows]],
            marker="o",
            capsize=3,
        )
        ax.axvline(data["rule_m_bench"], color="C3", ls="--", label=f"rule: M = {data['rule_m_bench']}")
        ax.axvline(math.isqrt(n), color="0.4", ls=":", label="M = sqrt(N)")
        ax.set_xscale("log", base=2)
        busy = ", BUSY" if bench["measurement"].get("busy") else ""
        ax.set(
            xlabel="M (blocks)",
            ylabel="ms per forward",
            title=f"{bench['model']} {bench['res']} px, N = {n}, CPU{busy}",
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", choices=("all", "sweep", "bench", "write"), default="all")
    p.add_argument(
        "--ms",
        nargs="*",
        type=int,
        default=SWEEP_MS,
        help=f"M values of the sweep (every M that tiles the grid: {divisor_ms(SWEEP_GRID)})",
    )
    p.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--bench-res", type=int, default=BENCH["14"]["full"][0], help="Table 14: 1024 px")
    p.add_argument("--bench-ms", nargs="*", type=int, default=list(BENCH["14"]["full"][1]))
    p.add_argument("--bench-repeats", type=int, default=5)
    p.add_argument("--bench-threads", type=int, default=2)
    p.add_argument("--bench-rounds", type=int, default=2, help="rounds over the M values, alternating order")
    p.add_argument(
        "--allow-busy", action="store_true", help="write a benchmark measured on a busy machine (BUSY)"
    )
    p.add_argument("--notes", default="", help="a paragraph (or @file) written under the generated reading")
    p.add_argument("--runs-dir", default=os.path.join(ROOT, "outputs", "auto_m"))
    p.add_argument("--out", default=os.path.join(ROOT, "results", "auto_m"), help="output stem")
    p.add_argument("extra", nargs="*", help="extra Hydra overrides for every training run")
    args = p.parse_args(argv)
    command = "python scripts/auto_m.py " + " ".join(sys.argv[1:] if argv is None else argv)
    commands_path = os.path.join(args.runs_dir, "commands.json")
    commands = {}
    if os.path.exists(commands_path):
        with open(commands_path) as f:
            commands = json.load(f)
    if args.stage != "write":  # the commands that made the runs and the benchmark, for the results file
        os.makedirs(args.runs_dir, exist_ok=True)
        commands[args.stage] = command
        write_json(commands_path, commands)
    records = run_sweep(args) if args.stage in ("all", "sweep") else []
    if args.stage == "sweep":
        return
    bench = run_bench(args) if args.stage in ("all", "bench") else None
    if args.stage == "bench":
        return
    with open(os.path.join(args.runs_dir, "sweep.json")) as f:
        records = [r for r in json.load(f) if "error" not in r]
    bench_path = os.path.join(args.runs_dir, "bench.json")
    if bench is None and os.path.exists(bench_path):
        with open(bench_path) as f:
            bench = json.load(f)
    steps = sorted({r["steps"] for r in records})
    data = {
        "command": command,
        "commands": {**commands, args.stage: command},
        "rule": AUTO_RULE,
        "rule_m_sweep": math.prod(auto_blocks(SWEEP_GRID)),
        "steps": steps[0] if steps else None,
        "seeds": sorted({r["seed"] for r in records}),
        "threads": args.threads,
        "jobs": args.jobs,
        "machine": system_info(),
        "date": datetime.now(timezone.utc).isoformat(),
        "sweep": sweep_stats(records, math.prod(auto_blocks(SWEEP_GRID))),
        "records": records,
        "notes": read_notes(args.notes),
    }
    if bench:
        data["bench"] = bench
        data["rule_m_bench"] = math.prod(auto_blocks(tuple(bench["grid"])))
        bench.update(latency_ratios(bench, data["rule_m_bench"]))
    measurement = bench.pop("measurement") if bench else None
    if bench:
        bench["measurement"] = measurement  # (the table reads it; write_result stores it at the top too)
    write_result(
        args.out,
        to_markdown(data),
        data,
        lambda png: plot(data, png),
        measurement=measurement,
        allow_busy=args.allow_busy,
        default=str,
    )
    print(f"wrote {args.out}.md, .json, .png")


if __name__ == "__main__":
    main()
