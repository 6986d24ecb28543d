#!/usr/bin/env python
"""Seeds of ``train.py`` runs, grouped: mean ± std of one metric per command, from the run folders.

    python scripts/summarize_runs.py outputs/lmlr/* --metric final/val_ppl --out results/language/mixing_lr

Each run folder gives its command (``.hydra/overrides.yaml``, without ``seed=`` and the logging overrides) and
the last value of ``--metric`` in ``metrics.jsonl``. Runs whose commands differ only in ``seed=`` form one row:
per-seed values, mean ± std (sample std, ``tasks.common.launch.mean_std``), n. Folders without the metric (not
finished) are listed as such. Writes ``<out>.md`` and ``<out>.json``; measures nothing itself.
(The video runs have their own table with prompt following: ``scripts/summarize_video_runs.py``.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __name__ == "__main__" and not __package__:  # python scripts/x.py: import from this checkout's root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import yaml

from tasks.common.launch import mean_std, metric_curve, read_notes

HIDDEN = ("logger=", "trainer.progress_bar=", "hydra.run.dir=", "seed=")


def run_record(run_dir: str, metric: str) -> dict | None:
    """``{"run", "command", "seed", "value"}`` of one run folder (``value`` None when unfinished), or None when the
    folder is not a ``train.py`` run."""
    overrides_file = os.path.join(run_dir, ".hydra", "overrides.yaml")
    if not os.path.isfile(overrides_file):
        return None
    overrides = yaml.safe_load(open(overrides_file)) or []
    seeds = [o.split("=", 1)[1] for o in overrides if o.startswith("seed=")]
    curve = metric_curve(run_dir, metric)
    return {"run": os.path.basename(run_dir.rstrip("/")), "seed": int(seeds[-1]) if seeds else 0,
            "command": "python train.py " + " ".join(o for o in overrides if not o.startswith(HIDDEN)),
            "value": curve[-1][1] if curve else None}


def group_runs(records: list[dict]) -> list[dict]:
    """One row per command (in first-seen order): its runs sorted by seed, mean ± std of the finished ones."""
    rows: dict[str, dict] = {}
    for r in records:
        rows.setdefault(r["command"], {"command": r["command"], "runs": []})["runs"].append(r)
    for row in rows.values():
        row["runs"].sort(key=lambda r: r["seed"])
        values = [r["value"] for r in row["runs"] if r["value"] is not None]
        row["n"] = len(values)
        row["mean"], row["std"] = mean_std(values) if values else (None, None)
    return list(rows.values())


def to_markdown(rows: list[dict], metric: str, argv: list[str], note: str = "") -> str:
    lines = [f"# Runs grouped by command: `{metric}`", "",
             f"Command: `python scripts/summarize_runs.py {' '.join(argv)}`", "",
             "| command (+ `seed=S`) | per seed | mean ± std | n |", "|---|---|---|---|"]
    for row in rows:
        per_seed = ", ".join(f"{r['seed']}: " + (f"{r['value']:.4g}" if r["value"] is not None else "unfinished")
                             for r in row["runs"])
        mean = "-" if row["mean"] is None else f"{row['mean']:.4g} ± {row['std']:.2g}"
        lines.append(f"| `{row['command']}` | {per_seed} | {mean} | {row['n']} |")
    return "\n".join(lines + (["", note] if note else [])) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run folders of train.py")
    ap.add_argument("--metric", default="final/val_ppl", help="a key of metrics.jsonl (its last value is used)")
    ap.add_argument("--out", required=True, help="output stem (.md, .json)")
    ap.add_argument("--notes", default="", help="text appended to the markdown (the reading), or @file")
    args = ap.parse_args(argv)
    records = [r for r in (run_record(d, args.metric) for d in args.runs) if r is not None]
    if not records:
        raise SystemExit(f"no train.py run folders among {args.runs}")
    rows = group_runs(records)
    note = read_notes(args.notes).strip()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(to_markdown(rows, args.metric, list(argv) if argv is not None else sys.argv[1:], note))
    with open(args.out + ".json", "w") as f:
        json.dump({"metric": args.metric, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}.md, .json ({len(records)} runs, {len(rows)} commands)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
