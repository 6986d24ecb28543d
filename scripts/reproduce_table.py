#!/usr/bin/env python
"""One entry point for every paper table: run its cells (or hand over to its own entry point) and write our
numbers beside the paper's.

    python scripts/reproduce_table.py --list                    # every table: cells or driver, command, results
    python scripts/reproduce_table.py --update-readme           # write that index into README.md
    python scripts/reproduce_table.py --table 2                 # full recipe on this machine's GPUs (torchrun)
    python scripts/reproduce_table.py --table 2 --scale mini    # CPU proxy: every attention x 3 seeds (about 80 min)
    python scripts/reproduce_table.py --table 3a --scale mini   # CPU proxy of another table: every cell, one seed
    python scripts/reproduce_table.py --table 3a --fid-ref 256=/data/VIRTUAL_imagenet256_labeled.npz \\
        512=/data/VIRTUAL_imagenet512.npz -- data.root=/data/imagenet data.vae_path=/models/sd-vae-ft-ema
    python scripts/reproduce_table.py --table 11 --seeds 0 1 2  # every cell x seeds -> mean ± std
    python scripts/reproduce_table.py --table 14 --scale mini   # DiT-S/2 latency across M, on this CPU
    python scripts/reproduce_table.py --table 6 -- --ckpt-dir /ckpt --wikitext wiki.test.raw   # -> evaluate.py

Tables (``make reproduce-table<id>`` takes the same ids; ``--table 3`` is Table 3a). Each is one ``Table`` of
:mod:`scripts.tables.registry`, which ``--list``, the README's index, ``make help`` (``--make-help``) and the
Makefile's one ``reproduce-%`` rule all read (docs/adding_a_table.md):

* cells - 2, 3a, 3b, 4, 7a, 11, 12, 13: one ``train.py`` run per cell. A cell is an experiment config
  ``configs/experiment/table<N>/<cell>.yaml`` with a ``paper:`` block; Table 7a's and 7b's cells, until their
  folders exist, are the sweeps ``configs/sweep/mhla_init.yaml`` / ``dit_blocks.yaml`` on the Table 2 / 3 cell
  they vary (:func:`scripts.tables.registry.derived_cells`); Table 3b adds the self-attention DiT-XL/2 baseline, an
  evaluation of the released weights (no training). Full scale: ``torchrun --nproc_per_node=<GPUs> train.py
  experiment=... <extra>``, then, for image generation, 50k samples (250 DDPM steps) scored by
  ``scripts/eval_fid.py`` against the ``--fid-ref`` of the cell's resolution. Mini scale (CPU proxy): the
  same cell with ``scale=mini/<model>`` (``configs/scale/mini/``, chosen by the cell's model and resolution);
  Table 2's mini scale is the seeded proxy :func:`scripts.tables.proxy2.main_proxy2` with its own options (``--attns
  --seeds --steps --batch --jobs --resume --plot-only``). ``--seeds`` runs every cell once per seed and
  reports mean ± std (Table 11's default: seeds 0 1 2).
* 7b also measures throughput across M, 14 is a benchmark only: DiT-S/2 forward time across M with the timing
  of ``scripts/bench_models.py`` (:func:`scripts.tables.benchmark.bench_across_m`).
* delegates - tables with a driver of their own in :mod:`scripts.tables`, run in this process: 5:
  :mod:`scripts.tables.table5` (the Wan2.1 fine-tunes; mini scale: :mod:`scripts.tables.table5_mini`, the
  video_mini model); 6 / 8: :mod:`scripts.tables.lm_tables` ``table6|table8`` (evaluates the trained models with
  ``tasks.language.evaluate``); mqar: :mod:`scripts.tables.mqar` ``--scale <scale>`` (= ``scripts/run_mqar.py``).
  Arguments after ``--`` go to them unchanged; ``--plot-only`` reaches the drivers of 5 and mqar. A benchmark
  table (14) takes no Hydra overrides: its arguments after ``--`` are options of this command
  (``make reproduce-table14 EXTRA='--bench-batch 8'``).

Inputs: every full-scale cell declares what it reads from disk (``inputs:`` of its config: ImageNet, the
SD-VAE, released weights, the FID reference of its resolution, ...). If one is missing nothing starts: the
message lists each missing input, where to download it and the option that points to it (``--no-fid`` trains the
generation cells without FID, and then needs no reference). ``train.py`` refuses the same way.

Each table goes to ``results/table<id>[_mini].md`` (and ``.json``) with the paper's numbers beside ours, the
command and the machine. A table whose cells do not exist yet is reported as such (exit 2); nothing is run.
``--only CELL ...`` reruns some cells and keeps the others' saved results; ``--jobs N`` runs N at a time; an
interrupted full-scale cell continues from its run folder (``outputs/table<id>/<cell>/<settings>``, the settings
that tell runs apart: model, resolution, attention, M, seed, schedule) with
``-- trainer.resume=auto``. ``--plot-only`` redraws a cell table's plot (``results/<table>[_mini].png``: the
paper's number and ours per cell) from its ``.json`` without running anything.
"""

# This file is the command line only; the package scripts/tables/ does the work (its __init__ lists the modules).
from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the index (--list, --make-help) needs nothing else, so `make help` stays fast; the rest is imported in main()
from scripts.tables import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--table" in argv and "--scale" in argv and argv[argv.index("--table") + 1] == "2" \
            and argv[argv.index("--scale") + 1] == "mini":  # the seeded proxy has its own options
        rest = argv[:]
        for flag in ("--table", "--scale"):
            i = rest.index(flag)
            del rest[i:i + 2]
        from scripts.tables import proxy2  # noqa: PLC0415

        return proxy2.main_proxy2([a for a in rest if a != "--"])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", help=f"one of {', '.join(registry.TABLES)} (3 = 3a)")
    p.add_argument("--list", action="store_true", help="list the tables (markdown, as in the README) and exit")
    p.add_argument("--make-help", action="store_true", help="print the tables' lines of `make help` and exit")
    p.add_argument("--update-readme", action="store_true",
                   help="write the --list index into README.md (between its paper-tables markers) and exit")
    p.add_argument("--scale", default="full", choices=["full", "mini", "large"],
                   help="full: the paper's recipe; mini: the CPU proxy (configs/scale/mini/); large: MQAR only")
    p.add_argument("--gpus", type=int, default=0, help="GPUs per run (default: all visible)")
    p.add_argument("--only", nargs="*", help="run only these cells (the others keep their saved results)")
    p.add_argument("--seeds", nargs="+", type=int, default=None,
                   help="run every cell once per seed (seed=S) and report mean ± std (Table 11 default: 0 1 2)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time")
    p.add_argument("--threads", type=int, default=None, help="torch threads per run (OMP_NUM_THREADS)")
    p.add_argument("--fid-ref", nargs="+", default=None, metavar="RES=PATH",
                   help="ADM reference batch (or stats .npz) per resolution for FID, e.g. "
                        "256=VIRTUAL_imagenet256_labeled.npz 512=VIRTUAL_imagenet512.npz; a reference of another "
                        "image size than its key or the samples is refused")
    p.add_argument("--no-fid", action="store_true",
                   help="generation cells: train only, no FID (then no --fid-ref is needed; score later with "
                        "tasks.image_gen.sample --ref)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="benchmarks (Tables 7b, 14): default cuda (full), cpu (mini)")
    p.add_argument("--bench-batch", type=int, default=None, help="benchmark batch (default 32 on GPU, 1 on CPU)")
    p.add_argument("--bench-repeats", type=int, default=None, help="timed calls per benchmark case")
    p.add_argument("--bench-only", action="store_true", help="Table 7b: measure throughput only, no training")
    p.add_argument("--allow-busy", action="store_true",
                   help="benchmarks (Tables 7b, 14): keep a timing made on a busy machine, marked BUSY (default: "
                        "refused; the rule: tasks.common.records.BUSY_RULE)")
    p.add_argument("--no-bench", action="store_true", help="Table 7b: skip the throughput benchmark")
    p.add_argument("--results-dir", default=os.path.join(ROOT, "results"), help="where results/<table>.md go")
    p.add_argument("--plot-only", action="store_true",
                   help="cell tables: redraw results/<table>[_mini].png from its .json, run nothing; Table 5 (and "
                        "its mini scale) and mqar: their driver's --plot-only (redraw from the saved results)")
    p.add_argument("--rewrite", action="store_true",
                   help="cell tables: write results/<table>[_mini].md again from its .json (the cells' current "
                        "paper numbers and assumptions beside the saved rows, their machine and date); runs nothing "
                        "(Table 5, its mini scale and mqar: as --plot-only)")
    p.add_argument("extra", nargs="*", help="extra Hydra overrides for every cell (e.g. data.root=...); for "
                                            "Tables 5 / 6 / 8 / mqar, the arguments of their entry point")
    args = p.parse_args(argv)
    args.argv = argv
    if args.list:
        print(registry.index_table())
        return 0
    if args.make_help:
        print(registry.make_help())
        return 0
    if args.update_readme:
        print("README.md " + ("updated" if registry.update_readme() else "already up to date"))
        return 0
    if not args.table:
        p.error("--table is required (--list shows the tables)")
    spec = registry.table_spec(args.table)
    if spec.kind == "bench" and args.extra:  # no Hydra overrides: what follows -- is this command's options
        args = p.parse_args([a for a in argv if a != "--"])
        args.argv = argv
    if args.scale == "large" and spec.id != "mqar":
        p.error("--scale large is MQAR's (scripts/run_mqar.py); tables take full or mini")
    from scripts.eval_fid import parse_fid_refs  # noqa: PLC0415  (torch and the table builders: only to run one)
    from scripts.tables import builders, figures, writers  # noqa: PLC0415

    try:
        args.fid_refs = parse_fid_refs(args.fid_ref)
    except ValueError as e:
        print(f"--fid-ref refused: {e}", file=sys.stderr)
        return 2
    if args.plot_only and spec.kind == "cells":
        return figures.redraw(spec, args)
    if args.rewrite and spec.kind == "cells":
        return writers.rewrite(spec, args)
    if spec.kind == "delegate":
        return builders.run_delegate(spec, args)
    if spec.kind == "bench":
        return builders.run_bench_table(spec, args)
    return builders.run_cells_table(spec, args)


if __name__ == "__main__":
    sys.exit(main())
