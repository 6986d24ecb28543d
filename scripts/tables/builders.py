"""One table end to end, per family: cells (:func:`run_cells_table`: every cell, or once per seed with mean ±
std; ``--only`` keeps the others' saved rows; Table 7b's benchmark with it), bench (:func:`run_bench_table`)
and delegate (:func:`run_delegate`: the tables with their own entry point)."""

from __future__ import annotations

import sys

from tasks.common.launch import mean_std, run_parallel

from tasks.common import results

from . import benchmark, config, registry, runner, writers
from .registry import Cell, NoCells, Table


def run_delegate(spec: Table, args) -> int:
    """Hand over to the table's own driver (``registry.DELEGATES``; at mini scale ``DELEGATES_MINI``) in this
    process: its ``main`` gets the table's leading arguments, then ``--scale`` / ``--seeds`` where it takes them,
    ``--plot-only`` / ``--rewrite`` as its redraw option, then the arguments after ``--``."""
    if args.scale == "mini" and spec.mini is None:
        print(f"Table {spec.id} has no CPU proxy: its entry point needs {spec.needs}. Run it with --scale full "
              f"(without them it prints the commands and the paper's numbers).", file=sys.stderr)
        return 2
    mini = registry.DELEGATES_MINI.get(spec.id) if args.scale == "mini" else None
    module, lead = mini or registry.DELEGATES[spec.id]
    argv = list(lead)
    if spec.id == "mqar":
        argv += ["--scale", args.scale] + (["--seeds", *map(str, args.seeds)] if args.seeds else [])
    elif mini and args.seeds:
        argv += ["--seeds", *map(str, args.seeds)]
    elif args.seeds:
        print(f"--seeds does not apply to Table {spec.id} (it evaluates given models)", file=sys.stderr)
        return 2
    if getattr(args, "plot_only", False) or getattr(args, "rewrite", False):
        redraw = "--plot-only" if mini else registry.DELEGATE_REDRAW.get(spec.id)
        if redraw is None:
            print(f"Table {spec.id} has no --plot-only / --rewrite: run it again (it measures nothing without its "
                  "models)", file=sys.stderr)
            return 2
        argv.append(redraw)
    return runner.delegate(module, argv + list(args.extra))


def run_cells_table(spec: Table, args) -> int:
    try:
        todo_cells = registry.table_cells(spec.id)
    except NoCells as e:
        print(str(e), file=sys.stderr)
        return 2
    unknown = sorted(set(args.only or []) - {c.name for c in todo_cells})
    if unknown:
        print(f"unknown cells {unknown}; Table {spec.id}: {', '.join(c.name for c in todo_cells)}", file=sys.stderr)
        return 2
    if args.scale == "mini" and spec.mini is None:
        print(f"Table {spec.id} has no CPU proxy (its cells need {spec.needs}).", file=sys.stderr)
        return 2
    if args.scale == "full" and not args.bench_only:
        missing = preflight(spec, [c for c in todo_cells if not args.only or c.name in args.only], args)
        if missing:
            print(f"Table {spec.id}: nothing started; these cells need inputs that are not here (each cell's "
                  f"config declares them under `inputs:`):\n" + "\n".join(missing), file=sys.stderr)
            return 2
        if not (args.gpus or runner.gpu_count()):
            print("the full scale needs CUDA GPUs; use --scale mini on a CPU", file=sys.stderr)
            return 2
    seeds = args.seeds if args.seeds is not None else (list(spec.seeds) or None)
    args.seeds = seeds
    previous = writers.previous_rows(spec, args) if (args.only or args.bench_only) else {}
    run = [c for c in todo_cells if not args.bench_only and (not args.only or c.name in args.only)]
    items = [(c, s) for c in run for s in (seeds or [None])]
    records: dict[str, list] = {c.name: [] for c in run}
    rows: list[tuple[Cell, dict]] = []
    bench = None

    def collect() -> list[tuple[Cell, dict]]:
        out = []
        for c in todo_cells:
            if c.name in records and records[c.name]:
                recs = sorted(records[c.name], key=lambda r: (r.get("seed") is None, r.get("seed") or 0))
                res = aggregate(recs) if seeds else {k: v for k, v in recs[0].items() if k != "cell"}
                if not seeds:
                    res.pop("seed", None)
                out.append((c, {**{k: recs[0].get(k) for k in ("kind", "num_blocks", "image_size")}, **res}))
            elif c.name in previous:
                out.append((c, previous[c.name]))
        return out

    def on_done(item, rec):
        cell, seed = item
        records[cell.name].append(rec)
        writers.write_table(spec.id, args, collect(), bench)
        return f"{cell.name}" + (f" seed {seed}" if seed is not None else "") + ": " + (
            f"FAILED {rec['error']}" if "error" in rec else f"{rec['metrics']}") + f" ({rec.get('seconds', 0):.0f}s)"

    run_parallel(lambda item: runner.run_cell(spec.id, item[0], args, seed=item[1]), items, args.jobs,
                 f"Table {spec.id} runs", on_done)
    if spec.bench and not args.no_bench:
        print(f"Table {spec.id}: benchmark across M", flush=True)
        bench = benchmark.run_bench(spec, args)
    rows = collect()
    md = writers.write_table(spec.id, args, rows, bench)
    print(f"wrote {md}")
    return 0 if all("error" not in r for _, r in rows) and not (bench or {}).get("error") else 1


def run_bench_table(spec: Table, args) -> int:
    bench = benchmark.run_bench(spec, args)
    try:
        md = writers.write_bench_table(spec, args, bench)
    except results.BusyMachine as e:
        print(e, file=sys.stderr)
        return 2
    print(f"wrote {md}")
    return 0 if "rows" in bench else 1


def preflight(spec: Table, cells: list[Cell], args) -> list[str]:
    """Before anything starts at full scale: one line per problem (a config that does not compose, a declared
    input that is not here: what to download and where to put it) with the cells it stops."""
    extra = list(getattr(args, "extra", []) or [])
    stopped: dict[str, list[str]] = {}
    for cell in cells:
        for problem in config.config_problems(spec, [*cell.overrides, *extra], "full", args):
            stopped.setdefault(problem, []).append(cell.name)
    return [f"- {problem}\n  (cells: {', '.join(names)})" for problem, names in stopped.items()]


def aggregate(recs: list[dict]) -> dict:
    """One cell's runs (one per seed) -> its row: mean metrics, their std, n, the runs."""
    ok = [r for r in recs if "metrics" in r]
    out = {"seconds": round(sum(r.get("seconds", 0.0) for r in recs), 1), "runs": recs}
    if not ok:
        out["error"] = recs[0].get("error", "failed") if recs else "not run"
        return out
    keys = [k for k, v in ok[0]["metrics"].items() if isinstance(v, (int, float))
            and all(isinstance(r["metrics"].get(k), (int, float)) for r in ok)]
    stats = {k: mean_std([r["metrics"][k] for r in ok]) for k in keys}
    out.update(metrics={k: s[0] for k, s in stats.items()}, metrics_std={k: s[1] for k, s in stats.items()},
               n=len(ok), params_M=ok[0].get("params_M"), command=ok[0].get("command"))
    if len(ok) < len(recs):
        out["failed_runs"] = [f"seed {r.get('seed')}: {r.get('error')}" for r in recs if "metrics" not in r]
    return out
