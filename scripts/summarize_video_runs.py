#!/usr/bin/env python
"""Table of video_mini runs: their overrides, eval loss and prompt following, from their run folders.

    python scripts/summarize_video_runs.py outputs/video/* --out results/video/levers

Reads each run's ``.hydra/overrides.yaml`` (the command), ``metrics.jsonl`` (the last ``eval/loss``),
``samples_follow.json`` (its sample prompts, written at the end of every ``task=video_mini`` run) and the
``follow_all[_cfg<G>].json`` files of ``python -m tasks.video_gen.follow --all-prompts [--cfg G]`` (all 32
captions). Writes ``<out>.md`` and ``<out>.json``. Measures nothing itself.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import yaml

from tasks.common.results import write_result
from tasks.common.launch import metric_curve

HIDDEN = ("logger=", "trainer.progress_bar=", "hydra.run.dir=")


def run_summary(run_dir: str) -> dict | None:
    """One run folder -> ``{"run", "command", "eval_loss", "sample": (followed, n), "all": {cfg: (followed, n)}}``,
    or None when the folder is not a finished video_mini run."""
    overrides_file = os.path.join(run_dir, ".hydra", "overrides.yaml")
    follow_file = os.path.join(run_dir, "samples_follow.json")
    if not os.path.isfile(follow_file):  # runs from before samples_follow.json: the follow CLI's report
        follow_file = os.path.join(run_dir, "follow.json")
    if not (os.path.isfile(overrides_file) and os.path.isfile(follow_file)):
        return None
    overrides = [o for o in yaml.safe_load(open(overrides_file)) if not o.startswith(HIDDEN)]
    sample = json.load(open(follow_file))
    curve = metric_curve(run_dir, "eval/loss")
    config = yaml.safe_load(open(os.path.join(run_dir, ".hydra", "config.yaml")))
    default_cfg = float(config["sample"]["guidance_scale"])
    everything = {}
    for path in glob.glob(os.path.join(run_dir, "follow_all*.json")):
        rep = json.load(open(path))
        m = re.search(r"_cfg([\d.]+)\.json$", path)
        g = float(m.group(1)) if m else float(rep.get("guidance_scale", default_cfg))
        everything[g] = [round(rep["followed"] * len(rep["per_prompt"])), len(rep["per_prompt"])]
    return {"run": os.path.basename(run_dir.rstrip("/")), "command": "python train.py " + " ".join(overrides),
            "eval_loss": curve[-1][1] if curve else None, "cfg": default_cfg,
            "sample": [round(sample["followed"] * len(sample["per_prompt"])), len(sample["per_prompt"])],
            "sample_failed": [p["prompt"] for p in sample["per_prompt"] if not p["ok"]],
            "all": dict(sorted(everything.items()))}


def to_markdown(rows: list[dict], argv: list[str], note: str = "") -> str:
    lines = ["# video_mini runs: eval loss and prompt following", "",
             f"Command: `python scripts/summarize_video_runs.py {' '.join(argv)}`", "", *([note, ""] if note else []),
             "Eval loss: held-out velocity MSE at t = 0.1 ... 0.9 (fixed noise). Sample prompts: the run's 4 "
             "(`sample.prompts`, seed 0, the run's CFG). All captions: 32 (4 colours x 2 shapes x 4 directions), "
             "seed 0, per guidance scale. Check: `tasks/video_gen/follow.py`.", "",
             "| run | command | eval loss | CFG | sample prompts followed | failed | all 32 captions followed (CFG: n) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        loss = f"{r['eval_loss']:.4f}" if r["eval_loss"] is not None else "-"
        allc = ", ".join(f"{g:g}: {a}/{n}" for g, (a, n) in r["all"].items()) or "-"
        lines.append(f"| {r['run']} | `{r['command']}` | {loss} | {r['cfg']:g} | {r['sample'][0]}/{r['sample'][1]} | "
                     f"{'; '.join(r['sample_failed']) or '-'} | {allc} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run folders")
    ap.add_argument("--out", required=True, help="output stem (.md, .json)")
    ap.add_argument("--note", default="", help="a line under the command (e.g. which defaults the overrides sit on)")
    args = ap.parse_args(argv)
    rows = [r for r in (run_summary(d) for d in args.runs) if r is not None]
    given = list(argv) if argv is not None else sys.argv[1:]
    write_result(args.out, to_markdown(rows, given, args.note), rows, indent=1)
    print(f"wrote {args.out}.md, .json ({len(rows)} runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
