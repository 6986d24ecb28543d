#!/usr/bin/env python
"""Run a seed grid (variants x seeds of ``train.py`` on one shared set of overrides) and write its table.

    python scripts/run_seed_grid.py configs/grid/mqar_n256.yaml --jobs 2          # train what is missing, tabulate
    python scripts/run_seed_grid.py configs/grid/mqar_n256.yaml --dry-run         # print the commands
    python scripts/run_seed_grid.py configs/grid/table2_converged.yaml --table-only --notes @reading.md

A grid file (``configs/grid/*.yaml``) names the table (``title``, ``out``), where the runs train (``runs_dir``),
the overrides every run shares (``common``), each variant's own (``variants``; ``{seed}`` in an override is the
run's seed), the seeds (``seeds``; per variant ``seeds_of``) and the comparisons (``table``: ``metric``,
``baseline``, ``pairs``, optional ``digits``, ``scale`` (100: fractions as %) and ``lower_is_better`` (a loss
or a perplexity)). Run ``<variant>_s<seed>`` is

    python train.py <common> <variant's overrides> seed=<seed> trainer.resume=auto \\
        trainer.checkpoint_every_steps=500 hydra.run.dir=<runs_dir>/<variant>_s<seed>

so an interrupted grid continues from the last checkpoint of every unfinished run when started again. A run whose
record is already in ``<out>_runs`` counts as done: to reproduce a committed grid from scratch, give another
``--out`` (and ``--runs-dir``). A finished run's record (``metrics.jsonl``, ``run.json``: resolved config, commit,
machine, load) is copied to ``<out>_runs/<variant>_s<seed>/``, and the table is :mod:`scripts.tables.seed_grid`
over that folder: mean ± std, the paired per-seed differences with their 95% interval, the two-pooled-std verdict,
the curves and the convergence column. Its reading, when given, lives beside it as ``<out>_reading.md``.

Unlike ``scripts/run_mqar.py`` (the MQAR table's own (N, K) cells and variants, defined in code), a grid here is
any set of ``train.py`` overrides, written in a file, and its table is about seeds: paired differences and
verdicts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from omegaconf import OmegaConf  # noqa: E402

from scripts.tables import seed_grid  # noqa: E402
from tasks.common.launch import run_parallel, run_training  # noqa: E402
from tasks.common.records import RECORD, read_run_record  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_TAIL = ("trainer.resume=auto", "trainer.checkpoint_every_steps=500")  # every run resumes; the queue's cadence
COPIED = ("metrics.jsonl", RECORD, "run_info.json")  # what a run leaves for the table (run_info.json: a job queue's)


def load_grid(path: str) -> dict:
    """The grid file as a dict, checked: every variant has overrides and ``seeds_of`` names only variants."""
    grid = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    missing = [k for k in ("title", "out", "runs_dir", "common", "variants", "seeds", "table") if k not in grid]
    if missing:
        raise SystemExit(f"{path}: the grid file lacks {missing}")
    empty = [v for v, overrides in grid["variants"].items() if not isinstance(overrides, list) or not overrides]
    if empty:
        raise SystemExit(f"{path}: variants {empty} need a list of overrides")
    unknown = set(grid.get("seeds_of", {})) - set(grid["variants"])
    if unknown:
        raise SystemExit(f"{path}: seeds_of names {sorted(unknown)}, which are not variants")
    return grid


def runs_of(grid: dict, variants: list[str] | None = None, seeds: list[int] | None = None) -> list[tuple[str, int]]:
    """``[(variant, seed)]`` in the grid's order: seed-major, so that the first seed of every variant comes first."""
    chosen = variants or list(grid["variants"])
    unknown = [v for v in chosen if v not in grid["variants"]]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; the grid has {list(grid['variants'])}")
    seeds_of = {v: grid.get("seeds_of", {}).get(v, grid["seeds"]) for v in chosen}
    outside = sorted({s for s in seeds or () if not any(s in seeds_of[v] for v in chosen)})
    if outside:  # a seed no chosen variant has would train nothing, silently
        raise SystemExit(f"seeds {outside} are in no chosen variant's seed list ({seeds_of}); "
                         "add them to the grid's seeds (or seeds_of) first")
    return [(v, s) for s in sorted({s for v in chosen for s in seeds_of[v]}) for v in chosen
            if s in seeds_of[v] and (seeds is None or s in seeds)]


def run_overrides(grid: dict, variant: str, seed: int, runs_dir: str, extra: list[str] = ()) -> list[str]:
    """The ``train.py`` overrides of run ``<variant>_s<seed>`` (``extra`` last: e.g. ``trainer.device=cuda``).
    ``{seed}`` in a grid override is the run's seed (e.g. ``trainer.init_from=<runs>/passkey_mhla_s{seed}``: each
    seed continues the same seed of another grid)."""
    own = [o.replace("{seed}", str(seed)) for o in (*grid["common"], *grid["variants"][variant])]
    return [*own, f"seed={seed}", *RUN_TAIL, *extra, f"hydra.run.dir={os.path.join(runs_dir, f'{variant}_s{seed}')}"]


def copy_record(run_dir: str, dest: str) -> None:
    """Copy a finished run's record files into ``dest`` (the table's ``<out>_runs/<name>/``)."""
    os.makedirs(dest, exist_ok=True)
    for name in COPIED:
        if os.path.exists(os.path.join(run_dir, name)):
            shutil.copy2(os.path.join(run_dir, name), os.path.join(dest, name))


def table_argv(grid: dict, path: str, notes: str) -> list[str]:
    """:mod:`scripts.tables.seed_grid`'s command line for the grid's ``<out>_runs`` folder."""
    t, out = grid["table"], grid["out"]
    argv = [f"{out}_runs", "--metric", t["metric"], "--title", grid["title"], "--out", out,
            "--runs-command", f"python scripts/run_seed_grid.py {os.path.relpath(path, ROOT)}"]
    if t.get("baseline"):
        argv += ["--baseline", t["baseline"]]
    if t.get("pairs"):
        argv += ["--pairs", *t["pairs"]]
    if "digits" in t:
        argv += ["--digits", str(t["digits"])]
    if "scale" in t:
        argv += ["--scale", str(t["scale"])]
    if t.get("lower_is_better"):
        argv += ["--lower-is-better"]
    return argv + (["--notes", notes] if notes else [])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("grid", help="a grid file, e.g. configs/grid/mqar_n256.yaml")
    ap.add_argument("--variants", nargs="*", default=None, help="only these variants (default: all)")
    ap.add_argument("--seeds", nargs="*", type=int, default=None, help="only these seeds (default: the grid's)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--runs-dir", default=None, help="where the runs train (default: the grid's runs_dir)")
    ap.add_argument("--out", default=None, help="the table's stem (default: the grid's out, whose committed "
                    "<out>_runs count as done; give another to reproduce the grid from scratch)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands of the missing runs and stop")
    ap.add_argument("--table-only", action="store_true", help="write the table from <out>_runs; train nothing")
    ap.add_argument("--notes", default="", help="the table's reading (text or @file; default @<out>_reading.md)")
    ap.add_argument("extra", nargs="*", help="Hydra overrides added to every run (they change its command)")
    args = ap.parse_args(argv)
    args.grid = os.path.abspath(args.grid)
    os.chdir(ROOT)  # the grid's paths (out, runs_dir) are relative to the checkout
    grid = load_grid(args.grid)
    grid["out"] = args.out or grid["out"]
    runs_dir = os.path.abspath(args.runs_dir or grid["runs_dir"])
    table_runs = f"{grid['out']}_runs"
    todo = []
    for v, s in runs_of(grid, args.variants, args.seeds):
        name = f"{v}_s{s}"
        if os.path.exists(os.path.join(table_runs, name, RECORD)):
            continue
        if read_run_record(os.path.join(runs_dir, name)) is not None:  # finished but not yet beside the table
            copy_record(os.path.join(runs_dir, name), os.path.join(table_runs, name))
            continue
        todo.append((v, s))
    if args.dry_run:
        for v, s in todo:
            print("python train.py " + " ".join(run_overrides(grid, v, s, runs_dir, args.extra)))
        return 0
    failed = []
    if not args.table_only and todo:
        def on_done(item, rec):
            name = f"{item[0]}_s{item[1]}"
            if "error" in rec:
                failed.append(name)
                return f"{name}: FAILED {rec['error']}"
            copy_record(os.path.join(runs_dir, name), os.path.join(table_runs, name))
            metric = grid["table"]["metric"]
            return f"{name}: {metric} {rec['metrics'].get(metric)} ({rec['seconds']:.0f}s)"

        run_parallel(lambda item: run_training(run_overrides(grid, *item, runs_dir, args.extra), args.threads),
                     todo, args.jobs, os.path.basename(args.grid), on_done)
    reading = f"{grid['out']}_reading.md"  # the table's committed reading, when it has one
    rc = seed_grid.main(table_argv(grid, args.grid, args.notes or (f"@{reading}" if os.path.exists(reading) else "")))
    if failed:
        print(f"failed runs (see their folders under {runs_dir}): {', '.join(failed)}", file=sys.stderr)
    return rc or int(bool(failed))


if __name__ == "__main__":
    raise SystemExit(main())
