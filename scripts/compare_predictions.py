#!/usr/bin/env python
"""Do trained classifiers differ on the test set itself? Per-example predictions, compared in pairs.

    python scripts/compare_predictions.py softmax_s1=RUN_DIR linear_s1=RUN_DIR mhla_s1=RUN_DIR \\
        --out results/classification/table2_converged_predictions [--pairs mhla_s1:softmax_s1 ...]

Each ``NAME=RUN`` (a ``train.py`` run folder or checkpoint; ``last.pt`` by default, ``--which best``) is
loaded with its stored config (:func:`tasks.common.evaluation.load_run`) and run once over its eval split, in
order. For each run the record keeps the test examples it gets wrong (their indices), its top-1 recomputed
here next to the one its ``run.json`` holds, the binomial standard error of that top-1, and the run's resolved
config and commit. For each pair (all pairs in the order given, or ``--pairs a:b``) it counts the examples
both get wrong, and those only one gets right, and gives McNemar's exact test
(:func:`tasks.common.stats.mcnemar`).

What it separates: when two models are 0.1 point apart at 99% on 10k test images, that gap is about one
binomial standard error of either accuracy (0.09 points), and McNemar's test says whether the two trained
models disagree more one way than chance would. It does NOT test the recipes: two seeds of ONE recipe also
disagree on some examples, so put a same-recipe pair (``softmax_s1:softmax_s2``) beside the cross-recipe ones
as the reference. The error overlap (both wrong / either wrong) says whether the models fail on the same
images.

``--split train`` does the same on each run's training split, in order: with the eval split's record beside
it, the cross-entropy and top-1 on the examples a model trained on against those on held-out ones (does a
recipe that ends lower on the test set fit the training set worse, or as well and generalise worse?).
``--limit N`` reads only the split's first N examples (a 60k training split is six test sets' worth).

Writes ``<out>.json`` (the runs' error indices, the pairs, the command, machine and commit) and ``<out>.md``
(with ``--notes``, the reading under ``## Reading``, each of whose numbers and verdict words a sidecar
``<out>.reading.bind`` binds to a JSON path or a rule: ``scripts/tables/readings.py``, checked by
``tests/scripts/test_readings_numbers.py``).
Classification tasks only (batches of ``(x, y)`` with integer labels).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from tasks.common.checkpoint import find_checkpoint, run_folder
from tasks.common.evaluation import eval_loader, eval_precision, load_run
from tasks.common.launch import read_notes
from tasks.common.progress import ProgressLoader
from tasks.common.records import code_version, read_run_record
from tasks.common.results import write_result
from tasks.common.stats import accuracy_se, mcnemar
from tasks.common.utils import load_average, system_info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@torch.no_grad()
def predict(run: str, which: str = "last", use_ema: bool = True, split: str = "eval",
            limit: int | None = None) -> dict:
    """One run's predictions on its eval split (``split="train"``: its training split, in order; ``limit``:
    its first ``limit`` examples only):
    ``{"checkpoint", "n", "correct": [n] bools, "pred": [n] ints, "loss": mean cross-entropy, "config"}``
    (the stored config, resolved)."""
    ckpt = find_checkpoint(run, which)
    cfg, task, model, info = load_run(str(ckpt), use_ema=use_ema)
    preds, labels, loss_sum, seen = [], [], 0.0, 0
    with eval_precision(cfg, info):
        for batch in ProgressLoader(eval_loader(cfg, task, info, split), f"{split} split"):
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and batch[1].dim() == 1):
                raise ValueError(f"{run}: not a classification run (its eval batches are not (x, labels))")
            x, y = batch if limit is None else (batch[0][: limit - seen], batch[1][: limit - seen])
            logits = model(x.to(info.device)).float().cpu()
            loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
            preds.append(logits.argmax(-1))
            labels.append(y)
            seen += len(y)
            if limit is not None and seen >= limit:  # stop before the loader reads another batch
                break
    pred, label = torch.cat(preds), torch.cat(labels)
    return {"checkpoint": str(ckpt), "n": int(label.numel()), "correct": (pred == label).tolist(),
            "pred": pred.tolist(), "loss": loss_sum / label.numel(),
            "config": OmegaConf.to_container(cfg, resolve=True)}


def run_entry(name: str, run: str, p: dict, split: str = "eval") -> dict:
    """A run's part of the record: what it got wrong, its mean cross-entropy, and where it came from
    (``top1_recorded``, the top-1 its ``run.json`` holds, is for the eval split only; ``eval_loss_recorded``
    is the eval cross-entropy its ``run.json`` holds, and with ``split="train"`` ``generalization_gap`` is
    that minus the training split's cross-entropy measured here)."""
    rec = read_run_record(run_folder(p["checkpoint"])) or {}
    top1 = sum(p["correct"]) / p["n"]
    wrong = [i for i, ok in enumerate(p["correct"]) if not ok]
    metrics = rec.get("metrics") or {}
    recorded = metrics.get("top1") if split == "eval" else None
    eval_loss = metrics.get("loss")
    gap = eval_loss - p["loss"] if split == "train" and eval_loss is not None else None
    return {"name": name, "run": run, "checkpoint": p["checkpoint"], "n": p["n"], "top1": top1,
            "loss": p["loss"], "top1_recorded": recorded, "eval_loss_recorded": eval_loss,
            "generalization_gap": gap, "top1_se": accuracy_se(top1, p["n"]),
            "errors": wrong, "wrong_as": [p["pred"][i] for i in wrong],
            "run_commit": rec.get("commit"), "run_command": rec.get("command"), "config": p["config"]}


def compare(runs: dict, pairs: list[tuple[str, str]]) -> list[dict]:
    """McNemar's test and the error overlap of each pair of ``runs`` (``{name: run_entry}``)."""
    out = []
    for a, b in pairs:
        ra, rb = runs[a], runs[b]
        ea, eb = set(ra["errors"]), set(rb["errors"])
        m = mcnemar([i not in ea for i in range(ra["n"])], [i not in eb for i in range(rb["n"])])
        union = len(ea | eb)
        out.append({"a": a, "b": b, "top1_diff": ra["top1"] - rb["top1"], **m,
                    "overlap": len(ea & eb) / union if union else 1.0})
    return out


def markdown(record: dict) -> str:
    runs, pairs = record["runs"], record["pairs"]
    limit = f" (its first {record['limit']} examples)" if record.get("limit") else ""
    train = record.get("split") == "train"
    lines = [f"# {record['title']}", "", f"`{record['command']}`", "",
             f"Commit {record['commit']}, {record['machine']['cpu']} ({record['machine']['date']}). Each "
             f"run's {record['split']} split{limit}, in order, with the weights of the checkpoint named in the "
             "JSON; the JSON keeps the indices of the examples each run gets wrong.", "",
             "| run | top-1 (here) | top-1 (run.json) | errors | binomial s.e. | cross-entropy |"
             + (" eval cross-entropy (run.json) | eval - train |" if train else ""),
             "|---|---|---|---|---|---|" + ("---|---|" if train else "")]
    for r in runs.values():
        rec = "-" if r["top1_recorded"] is None else f"{100 * r['top1_recorded']:.2f}%"
        row = (f"| {r['name']} | {100 * r['top1']:.2f}% | {rec} | {len(r['errors'])} | "
               f"{100 * r['top1_se']:.3f} | {r['loss']:.4f} |")
        if train:
            ev, gap = r.get("eval_loss_recorded"), r.get("generalization_gap")
            row += f" {'-' if ev is None else f'{ev:.4f}'} | {'-' if gap is None else f'{gap:.4f}'} |"
        lines.append(row)
    lines += ["", f"Wrong in every run: {record['wrong_in_all']} of {record['n']} examples; wrong in at "
              f"least one: {record['wrong_in_any']}.", "",
              "| a - b | top-1 diff (points) | only a right | only b right | both wrong | overlap "
              "| McNemar p |",
              "|---|---|---|---|---|---|---|"]
    for p in pairs:
        lines.append(f"| {p['a']} - {p['b']} | {100 * p['top1_diff']:+.2f} | {p['only_a_right']} | "
                     f"{p['only_b_right']} | {p['both_wrong']} | {p['overlap']:.2f} | {p['p']:.3f} |")
    lines += ["", "only a right / only b right: the examples the two disagree on; overlap: both wrong / "
              "either wrong; McNemar p: two-sided exact test that either model is as likely to be the right "
              "one on an example they disagree on. It tests two trained models on this split, not two "
              "recipes: a pair of seeds of one recipe is the reference for how much models disagree by "
              "chance."]
    if record.get("notes"):
        lines += ["", "## Reading", "", record["notes"].strip()]
    return "\n".join(lines) + "\n"


def parse_runs(items: list[str]) -> dict:
    runs = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"error: expected NAME=RUN, got {item!r}")
        if name in runs:
            raise SystemExit(f"error: run name {name!r} given twice")
        runs[name] = path
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="NAME=RUN (a train.py run folder or checkpoint)")
    ap.add_argument("--pairs", nargs="*", default=None, help="a:b pairs of run names (default: all pairs)")
    ap.add_argument("--which", default="last", choices=["last", "best"], help="checkpoint of a run folder")
    ap.add_argument("--split", default="eval", choices=["eval", "train"],
                    help="the split to predict (train: how well each model fits the examples it trained on)")
    ap.add_argument("--limit", type=int, default=None, help="only the split's first LIMIT examples")
    ap.add_argument("--raw", action="store_true", help="the raw weights, not the EMA ones")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "classification", "predictions"),
                    help="output stem (.json, .md)")
    ap.add_argument("--title", default="Per-example comparison of trained classifiers")
    ap.add_argument("--notes", default="", help="the reading (text or @file), written under '## Reading'")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        raise SystemExit(f"error: --limit must be >= 1, got {args.limit}")

    paths = parse_runs(args.runs)
    names = list(paths)
    pairs = ([tuple(p.split(":", 1)) for p in args.pairs] if args.pairs
             else list(itertools.combinations(names, 2)))
    for a, b in pairs:
        if a not in paths or b not in paths:
            raise SystemExit(f"error: pair {a}:{b} names a run not given (runs: {', '.join(names)})")
    load_before = load_average()
    runs = {}
    for name, path in paths.items():
        print(f"{name}: {path}", flush=True)
        runs[name] = run_entry(name, path, predict(path, args.which, not args.raw, args.split, args.limit),
                               args.split)
        print(f"  top1 {100 * runs[name]['top1']:.2f}% ({len(runs[name]['errors'])} errors), cross-entropy "
              f"{runs[name]['loss']:.4f}", flush=True)
    ns = {r["n"] for r in runs.values()}
    if len(ns) != 1:
        raise SystemExit(f"error: the runs' {args.split} splits differ in size ({sorted(ns)}); compare runs "
                         "of one task")
    wrong = [set(r["errors"]) for r in runs.values()]
    record = {"title": args.title,
              "command": "python scripts/compare_predictions.py " + " ".join(argv if argv is not None
                                                                             else sys.argv[1:]),
              "split": args.split, "limit": args.limit, **code_version(), "machine": system_info(),
              "load_before": load_before,
              "load_after": load_average(), "n": ns.pop(), "wrong_in_all": len(set.intersection(*wrong)),
              "wrong_in_any": len(set.union(*wrong)), "runs": runs, "pairs": compare(runs, pairs),
              "notes": read_notes(args.notes)}
    md = markdown(record)
    write_result(args.out, md, record)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
