#!/usr/bin/env python
"""Where training took MHLA's mixing matrices: every layer's learned matrix against its init and uniform.

    python scripts/mixing_profile.py --ckpt RUN [RUN ...] --out results/classification/table2_converged_mixing

``--ckpt``: run folders (their ``checkpoints/last.pt``) or ``.pt`` files written by ``train.py``; models
without an MHLA layer are refused. For each MHLA layer, :func:`mhla.mixing.mixing_profile` compares the
row-normalised learned matrix with the one it started from (its init through the parameterization) and with
uniform mixing (plain linear attention over the blocks): the weight a block keeps on itself, the mass-weighted
block distance (how local the mixing is), the row entropy, the total-variation distance to the init and to
uniform, and the fraction of entries clamped to 0. A frozen matrix reads back its init exactly.

Between every two runs with the same layers, the total-variation distance between their learned rows: two seeds
of one recipe give the scale of seed-to-seed differences, against which two inits can be compared.

Writes ``<out>.json`` (each run's resolved config, its run commit, every layer's profile and row-normalised
matrix; the pairwise distances; this command's commit, machine and load) and ``<out>.md`` (per run, over runs
of the same variant as mean ± std, between runs, per layer; with ``--notes``, the reading under ``## Reading``,
each of whose numbers and verdict words a sidecar ``<out>.reading.bind`` binds to a JSON path or a rule:
``scripts/tables/readings.py``, checked by ``tests/scripts/test_readings_numbers.py``).
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from omegaconf import OmegaConf

from mhla.mixing import mixing_matrices, mixing_profile, normalized_rows
from scripts.tables.seed_grid import attention_of
from tasks.common.checkpoint import find_checkpoint, run_folder
from tasks.common.evaluation import load_run
from tasks.common.launch import read_notes
from tasks.common.records import code_version, read_run_record
from tasks.common.results import write_result
from tasks.common.stats import mean_std
from tasks.common.utils import load_average, system_info

#: the columns of the table: (profile key, header, digits)
COLUMNS = (("self_share", "self share", 3), ("mean_distance", "mean distance", 2), ("entropy", "entropy", 3),
           ("tv_from_init", "TV from init", 3), ("tv_from_uniform", "TV from uniform", 3),
           ("zero_fraction", "zeros", 3))

#: the profile keys averaged over a run's layers: the table's, and the init's and uniform mixing's for reference
MEAN_KEYS = tuple(key for key, _, _ in COLUMNS) + tuple(
    f"{key}_{ref}" for ref in ("init", "uniform") for key in ("self_share", "mean_distance", "entropy"))


def profile_run(path: str) -> dict:
    """The run at ``path`` (a run folder or a checkpoint): its config, effective attention, run commit and each MHLA
    layer's profile."""
    ckpt = str(find_checkpoint(path))
    cfg, _, model, _ = load_run(ckpt, ["trainer.device=cpu"])
    layers = [{"layer": name, **mixing_profile(m), "rows": _rows(m)} for name, m in mixing_matrices(model).items()]
    if not layers:
        raise SystemExit(f"{ckpt}: the model has no MHLA mixing matrix (attn={cfg.attn.name})")
    folder = run_folder(ckpt)
    record = read_run_record(folder) or {}
    mean = {key: _mean([lay[key] for lay in layers]) for key in MEAN_KEYS}
    config = OmegaConf.to_container(cfg, resolve=True)
    return {"run": folder.name, "checkpoint": ckpt, "seed": cfg.get("seed"), "run_commit": record.get("commit"),
            "metrics": record.get("metrics"), "init": layers[0]["init"], "learnable": layers[0]["learnable"],
            "config": config, "attention": attention_of({"config": config, **record}),  # every option it ran with
            "layers": layers, "mean": mean}


def _rows(m) -> list:
    """The learned matrix with rows normalised to sum 1 (heads averaged), rounded to 5 decimals: [M][M]."""
    w = normalized_rows(m.learned())
    w = w.mean(0) if w.dim() == 3 else w
    return [[round(x, 5) for x in row] for row in w.tolist()]


def pairwise_tv(runs: list[dict]) -> dict:
    """``{"a|b": TV}`` for every two runs whose layers match: the total-variation distance between their learned
    rows, averaged over rows and layers. Two seeds of one recipe give the scale of seed-to-seed differences; two
    inits closer than that have forgotten where they started."""
    out = {}
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            la, lb = a["layers"], b["layers"]
            if [x["layer"] for x in la] != [x["layer"] for x in lb] or any(
                    len(x["rows"]) != len(y["rows"]) for x, y in zip(la, lb)):
                continue
            tvs = [0.5 * sum(abs(p - q) for p, q in zip(ra, rb)) for x, y in zip(la, lb)
                   for ra, rb in zip(x["rows"], y["rows"])]
            out[f"{a['run']}|{b['run']}"] = sum(tvs) / len(tvs)
    return out


def _mean(xs: list) -> float | None:
    return None if any(x is None for x in xs) else sum(xs) / len(xs)


def variant_of(run: dict) -> str:
    """The run's name without its seed suffix (``mhla_unif_s0`` -> ``mhla_unif``)."""
    name, _, seed = run["run"].rpartition("_s")
    return name if name and seed.isdigit() else run["run"]


def _fmt(x, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table_md(out: dict) -> str:
    runs = out["runs"]
    first = runs[0]["mean"]
    lines = ["# MHLA's learned mixing matrices against their init", "",
             f"Command: `{out['command']}`", "",
             f"Commit {out['commit']}; machine {out['machine'].get('cpu', '')}; load average before / after: "
             f"{out['load_before']} / {out['load_after']}. Each run's resolved config and run commit are in the JSON.",
             "",
             "Rows are normalised to sum 1 (with MHLA's normaliser a row's scale cancels). Means over layers and "
             "rows: self share = the weight a block keeps on itself; mean distance = the mass-weighted distance "
             "between block centres; entropy in nats; TV = total-variation distance of a row to its init's row and "
             "to uniform mixing (plain linear attention); zeros = entries clamped to 0.", "",
             f"For reference (the first run's layout): uniform mixing has self share "
             f"{_fmt(first['self_share_uniform'], 3)}, mean distance {_fmt(first['mean_distance_uniform'], 2)}, "
             f"entropy {_fmt(first['entropy_uniform'], 3)}.", "",
             "| run | init | learnable | " + " | ".join(h for _, h, _ in COLUMNS)
             + " | self share at init | mean distance at init | entropy at init |",
             "|---|---|---|" + "---|" * (len(COLUMNS) + 3)]
    for r in runs:
        m = r["mean"]
        lines.append(f"| {r['run']} | {r['init']} | {'yes' if r['learnable'] else 'no'} | "
                     + " | ".join(_fmt(m[k], d) for k, _, d in COLUMNS)
                     + f" | {_fmt(m['self_share_init'], 3)} | {_fmt(m['mean_distance_init'], 2)} | "
                     f"{_fmt(m['entropy_init'], 3)} |")
    by = {}
    for r in runs:
        by.setdefault(variant_of(r), []).append(r)
    if any(len(v) > 1 for v in by.values()):
        lines += ["", "Over runs (mean ± std):", "", "| variant | runs | " + " | ".join(h for _, h, _ in COLUMNS)
                  + " |", "|---|---|" + "---|" * len(COLUMNS)]
        for v, rs in by.items():
            cells = []
            for k, _, d in COLUMNS:
                xs = [r["mean"][k] for r in rs]
                if None in xs:
                    cells.append("-")
                else:
                    mu, sd = mean_std(xs)
                    cells.append(f"{mu:.{d}f}" + (f" ± {sd:.{d}f}" if len(xs) > 1 else ""))
            lines.append(f"| {v} | {len(rs)} | " + " | ".join(cells) + " |")
    if out.get("pairwise_tv"):
        names = [r["run"] for r in runs]
        lines += ["", "Between runs: the total-variation distance between two runs' learned rows (mean over rows "
                  "and layers; 0 = the same mixing, 1 = disjoint). Two seeds of one recipe set the scale of "
                  "seed-to-seed differences.", "", "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for a in names:
            cells = []
            for b in names:
                tv = out["pairwise_tv"].get(f"{a}|{b}", out["pairwise_tv"].get(f"{b}|{a}"))
                cells.append("0" if a == b else _fmt(tv, 3))
            lines.append(f"| {a} | " + " | ".join(cells) + " |")
    lines += ["", "Per layer:", "", "| run | layer | " + " | ".join(h for _, h, _ in COLUMNS) + " |",
              "|---|---|" + "---|" * len(COLUMNS)]
    for r in runs:
        for lay in r["layers"]:
            lines.append(f"| {r['run']} | {lay['layer']} | " + " | ".join(_fmt(lay[k], d) for k, _, d in COLUMNS)
                         + " |")
    if out.get("notes"):
        lines += ["", "## Reading", "", out["notes"].strip()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", nargs="+", required=True, help="trained MHLA runs (run folders or .pt files)")
    ap.add_argument("--out", required=True, help="output stem: writes <out>.json and <out>.md")
    ap.add_argument("--notes", default="", help="the reading (text or @file), written under '## Reading'")
    args = ap.parse_args(argv)
    load_before = load_average()
    runs = []
    for path in args.ckpt:
        r = profile_run(path)
        runs.append(r)
        m = r["mean"]
        print(f"{r['run']:>16} ({r['init']}, {'learnable' if r['learnable'] else 'frozen'}): self share "
              f"{_fmt(m['self_share'], 3)}, mean distance {_fmt(m['mean_distance'], 2)}, entropy "
              f"{_fmt(m['entropy'], 3)}, TV from init {_fmt(m['tv_from_init'], 3)}", flush=True)
    out = {"command": "python scripts/mixing_profile.py " + " ".join(argv), "runs": runs,
           "pairwise_tv": pairwise_tv(runs), "notes": read_notes(args.notes), **code_version(),
           "machine": system_info(), "load_before": load_before, "load_after": load_average()}
    write_result(args.out, table_md(out), out, indent=1)
    print(f"wrote {args.out}.json, .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
