#!/usr/bin/env python
"""Seeds of ``train.py`` runs, grouped: mean ± std of one metric per model, from the run folders.

    python scripts/summarize_runs.py outputs/lmlr/* --metric final/val_ppl --out results/language/mixing_lr

Each run folder gives its command (``.hydra/overrides.yaml``, without ``seed=`` and the logging overrides),
its resolved config (``run.json``'s ``config``, else ``.hydra/config.yaml``; mapped to today's schema by
``tasks.common.config.upgrade_config``) and the last value of ``--metric`` in ``metrics.jsonl``. Runs form one
row when their resolved settings are the same (:func:`settings_of`: the attention as the model builds it, with
every option, and the rest of the config, less the seed and what only logs or places the run): so a row is one
model and training, whatever overrides spelled it (two commands that resolve alike share a row; one command
that resolved differently, e.g. before and after a default changed, gives two). A run without a saved config
is grouped by its command, and the table says so. Per row: per-seed values, mean ± std (sample std,
``tasks.common.launch.mean_std``), n, and the settings that tell it from the other rows. Folders without the
metric (not finished) are listed as such. Writes ``<out>.md`` and ``<out>.json``
(``tasks.common.results.write_result``); measures nothing itself. (The video runs have their own table with
prompt following: ``scripts/summarize_video_runs.py``.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import yaml
from omegaconf import OmegaConf

from tasks.common.results import write_result
from tasks.common.config import model_attention, register_resolvers, upgrade_config
from tasks.common.launch import mean_std, metric_curve, read_notes
from tasks.common.records import read_run_record

HIDDEN = ("logger=", "trainer.progress_bar=", "hydra.run.dir=", "seed=")
# config keys that neither build nor train the model (dropped before runs are compared)
NOT_THE_MODEL = ("seed", "logger", "hydra", "print_config", "resume", "trainer.progress_bar",
                 "trainer.log_every", "trainer.device", "trainer.save_every", "trainer.out_dir", "data.root",
                 "data.num_workers")


def saved_config(run_dir: str):
    """The run's resolved config in today's schema (``run.json``, else ``.hydra/config.yaml``), or None."""
    record = read_run_record(run_dir)
    if record and record.get("config"):
        cfg = OmegaConf.create(record["config"])
    elif os.path.isfile(os.path.join(run_dir, ".hydra", "config.yaml")):
        cfg = OmegaConf.load(os.path.join(run_dir, ".hydra", "config.yaml"))
    else:
        return None
    return upgrade_config(cfg)


def _flat(d, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def settings_of(cfg) -> dict:
    """What a run trains, flat (``{"attn.name": "mhla", "attn.mixing_param": "clamp", "optim.lr": 3e-3, ...}``):
    the attention as the model builds it (:func:`tasks.common.config.model_attention`: every option resolved),
    then the rest of the resolved config less :data:`NOT_THE_MODEL`."""
    register_resolvers()
    try:
        attn = model_attention(cfg)
    except Exception:  # noqa: BLE001  (ConfigError, or a config train.py no longer builds: as it stands)
        attn = OmegaConf.to_container(cfg.get("attn") or {}, resolve=False)
    try:
        rest = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001  (an interpolation only Hydra's runtime resolves)
        rest = OmegaConf.to_container(cfg, resolve=False)
    rest.pop("attn", None)
    flat = {**{f"attn.{k}": v for k, v in attn.items()}, **_flat(rest)}
    return {k: v for k, v in flat.items() if not any(k == n or k.startswith(n + ".") for n in NOT_THE_MODEL)}


def run_record(run_dir: str, metric: str) -> dict | None:
    """``{"run", "command", "seed", "value"}`` of one run folder (``value`` None when unfinished), or None when the
    folder is not a ``train.py`` run."""
    overrides_file = os.path.join(run_dir, ".hydra", "overrides.yaml")
    if not os.path.isfile(overrides_file):
        return None
    overrides = yaml.safe_load(open(overrides_file)) or []
    seeds = [o.split("=", 1)[1] for o in overrides if o.startswith("seed=")]
    curve = metric_curve(run_dir, metric)
    cfg = saved_config(run_dir)
    return {"run": os.path.basename(run_dir.rstrip("/")), "seed": int(seeds[-1]) if seeds else 0,
            "command": "python train.py " + " ".join(o for o in overrides if not o.startswith(HIDDEN)),
            "value": curve[-1][1] if curve else None, "settings": None if cfg is None else settings_of(cfg)}


def group_runs(records: list[dict]) -> list[dict]:
    """One row per model (in first-seen order): the runs whose resolved settings are equal (by command where a
    run saved none), sorted by seed, mean ± std of the finished ones; ``commands`` (each spelling once),
    ``settings`` (the row's resolved settings, or None) and ``differs`` (those that not every row shares)."""
    rows: dict[str, dict] = {}
    for r in records:
        key = (json.dumps(r["settings"], sort_keys=True, default=str) if r.get("settings") is not None
               else "command: " + r["command"])
        row = rows.setdefault(key, {"command": r["command"], "commands": [], "settings": r.get("settings"),
                                    "runs": []})
        row["runs"].append({k: v for k, v in r.items() if k != "settings"})
        if r["command"] not in row["commands"]:
            row["commands"].append(r["command"])
    def pairs(settings: dict) -> set:
        return {(k, json.dumps(v, sort_keys=True, default=str)) for k, v in settings.items()}

    with_settings = [row for row in rows.values() if row["settings"] is not None]
    common = set.intersection(*(pairs(row["settings"]) for row in with_settings)) if with_settings else set()
    for row in rows.values():
        row["differs"] = (None if row["settings"] is None else
                          {k: row["settings"][k] for k, _ in sorted(pairs(row["settings"]) - common)})
    for row in rows.values():
        row["runs"].sort(key=lambda r: r["seed"])
        values = [r["value"] for r in row["runs"] if r["value"] is not None]
        row["n"] = len(values)
        row["mean"], row["std"] = mean_std(values) if values else (None, None)
    return list(rows.values())


def to_markdown(rows: list[dict], metric: str, argv: list[str], note: str = "") -> str:
    lines = [f"# Runs grouped by model: `{metric}`", "",
             f"Command: `python scripts/summarize_runs.py {' '.join(argv)}`", "",
             "A row is one model and training: the runs whose saved resolved configs agree (the attention as "
             "built, every option; the rest less the seed and logging), whatever overrides spelled them. "
             "Settings: those "
             "that tell the row from the others.", "",
             "| command (+ `seed=S`) | settings | per seed | mean ± std | n |", "|---|---|---|---|---|"]
    for row in rows:
        per_seed = ", ".join(f"{r['seed']}: " + (f"{r['value']:.4g}" if r["value"] is not None else "unfinished")
                             for r in row["runs"])
        mean = "-" if row["mean"] is None else f"{row['mean']:.4g} ± {row['std']:.2g}"
        settings = ("no saved config: grouped by command" if row.get("differs") is None else
                    " ".join(f"`{k}={v}`" for k, v in sorted(row["differs"].items())) or "-")
        commands = " / ".join(f"`{c}`" for c in row.get("commands") or [row["command"]])
        lines.append(f"| {commands} | {settings} | {per_seed} | {mean} | {row['n']} |")
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
    md = to_markdown(rows, args.metric, list(argv) if argv is not None else sys.argv[1:], note)
    write_result(args.out, md, {"metric": args.metric, "rows": rows}, indent=1, default=str)
    print(f"wrote {args.out}.md, .json ({len(records)} runs, {len(rows)} models)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
