#!/usr/bin/env python
"""Recall past the training length: MQAR models trained at N tokens, evaluated at 2x .. 8x N, by the query's
distance from the key-value pair it must recall, with every extension rule of MHLA's causal mixing matrix.

The language-model version (``scripts/length_extrapolation.py``) measures perplexity on validation text joined
without document resets, where the far past is mostly other documents: there the rules ``window`` and
``uniform_far`` read the same. Here the far past is the one thing that matters: an MQAR example of ``L`` tokens
puts its K key-value pairs first and its queries anywhere after them (``power_a = 1``: uniform gaps), so a
query ``D`` tokens past its pair can only be answered if the attention still reads block 0 at distance ``D``.
Every example is a single document (the model's state starts empty), so nothing else fills the far past.

With block size ``c`` and ``M`` learned rows (``M = N / c``), a query further than ``(M - 1) c`` tokens from
its pair sees the pair's block through the extension rule only (:func:`mhla.mixing.extend_causal_mixing`):
``window`` gives it 0 (a sliding window of M blocks: the pair is unreadable), ``uniform_far`` gives the far
blocks one shared coefficient (readable, diluted by their count), ``relative`` gives every far block the full
coefficient, ``last_row`` and ``mass_matched`` as documented there. Linear and softmax attention have no rule.

    python scripts/mqar_extrapolation.py mhla=RUNS/mqar256/mhla_lm_s0 linear=RUNS/mqar256/linear_s0 \\
        --lengths 256 512 1024 2048 --out results/language/mqar_extrapolation

Runs are ``name=run_dir`` (or ``name=.../checkpoints/last.pt``); several runs may share a name's prefix
``<name>_s<seed>`` and are then averaged per seed. Writes ``<out>.md``, ``.json``, ``.png`` through
:func:`tasks.common.results.write_result`. ``--add`` evaluates more runs (new seeds, new rows) into an existing
``<out>.json`` under its own lengths, rules, examples and evaluation seed, so seeds trained at different times
share one table; the record lists every command that contributed, with its machine and load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from mhla.mixing import EXTENSION_RULES, EXTENSION_RULES_TEXT, check_extension, mixing_matrices  # noqa: E402
from scripts.length_extrapolation import extension_rule  # noqa: E402
from tasks.common.results import rewrite_result, write_result  # noqa: E402
from tasks.common.checkpoint import find_checkpoint  # noqa: E402
from tasks.common.evaluation import load_run  # noqa: E402
from tasks.common.launch import read_notes  # noqa: E402
from tasks.common.records import Measurement  # noqa: E402
from tasks.language.mqar import recall_by_distance  # noqa: E402

SEED_SUFFIX = re.compile(r"^(?P<name>.+)_s(?P<seed>\d+)$")


def edges_for(train_len: int, max_len: int) -> tuple[int, ...]:
    """Distance buckets: quarters of the training length, then doublings up to ``max_len``."""
    q = train_len // 4
    edges = [0, q, 2 * q, 3 * q, train_len]
    while edges[-1] < max_len:
        edges.append(edges[-1] * 2)
    return tuple(edges)


def evaluate(model, cfg, lengths: list[int], rules: list[str], num_examples: int, seed: int) -> dict:
    """``{rule or "-": {L: recall_by_distance(...)}}`` for one model (MHLA: every rule; others: "-")."""
    d = cfg.data
    edges = edges_for(int(d.seq_len), max(lengths))
    mhla = bool(mixing_matrices(model))
    out = {}
    for rule in (rules if mhla else ["-"]):
        per_len = {}
        for L in lengths:
            if mhla:
                with extension_rule(model, rule):
                    r = recall_by_distance(model, L, vocab_size=int(d.vocab_size), num_kv_pairs=int(d.num_kv_pairs),
                                           num_examples=num_examples, edges=edges, seed=seed)
            else:
                r = recall_by_distance(model, L, vocab_size=int(d.vocab_size), num_kv_pairs=int(d.num_kv_pairs),
                                       num_examples=num_examples, edges=edges, seed=seed)
            per_len[str(L)] = r
            print(f"  {rule:>12} L={L:5d} acc={100 * r['acc']:.1f}", flush=True)
        out[rule] = per_len
    return out


def group(runs: dict) -> dict:
    """``{group: {seed or name: path}}``: ``mhla_s0=..``, ``mhla_s1=..`` form the group ``mhla``."""
    out: dict = {}
    for name, path in runs.items():
        m = SEED_SUFFIX.match(name)
        g, key = (m["name"], int(m["seed"])) if m else (name, name)
        out.setdefault(g, {})[key] = path
    return out


def mean_over(results: dict, rule: str, L: str, pick) -> tuple[float | None, float | None, int]:
    """Mean and std over a group's runs of ``pick(recall record)`` (skipping runs where it is None)."""
    xs = [pick(r[rule][L]) for r in results.values() if rule in r and L in r[rule]]
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None, 0
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0), len(xs)


def bucket(rec: dict, lo: int):
    return next((100 * b["acc"] for b in rec["buckets"] if b["lo"] == lo), None)


def markdown(record: dict, command: str) -> str:
    added = "".join(f"; runs {', '.join(a['runs'])} added by `{a['command']}`" for a in record.get("added", []))
    lines = [f"# MQAR recall past the training length ({record['train_len']} tokens, K = {record['num_kv_pairs']})",
             "", f"Made by `{command}`{added} ({record['num_examples']} examples per length, evaluation seed "
             f"{record['seed']}). Accuracy (%) over the {record['num_kv_pairs']} queries of every example, mean "
             "± std over the runs of a row (n); the right-hand columns split it by the query's distance in tokens "
             "from the pair it recalls. Machine and load: the .json.", ""]
    edges = record["edges"]
    for L in record["lengths"]:
        heads = [f"{lo}-{hi}" for lo, hi in zip(edges[:-1], edges[1:]) if lo < int(L)]
        lines += [f"## L = {L}", "", "| model | rule | n | all | " + " | ".join(heads) + " |",
                  "|---|---|---|---|" + "---|" * len(heads)]
        for g, res in record["groups"].items():
            for rule in record["rules_of"][g]:
                m, s, n = mean_over(res, rule, L, lambda r: 100 * r["acc"])
                cells = []
                for lo in edges[:-1]:
                    if lo >= int(L):
                        continue
                    bm, _, _ = mean_over(res, rule, L, lambda r, lo=lo: bucket(r, lo))
                    cells.append("-" if bm is None else f"{bm:.1f}")
                lines.append(f"| {g} | {rule} | {n} | {m:.1f} ± {s:.1f} | " + " | ".join(cells) + " |")
        lines.append("")
    if record.get("notes"):
        lines += ["## Reading", "", record["notes"].strip(), ""]
    return "\n".join(lines)


def plot(record: dict, path: str) -> None:
    """Accuracy against the query's distance at the longest length, one line per model and rule."""
    from tasks.common.plots import pyplot, save_figure

    plt = pyplot()
    L = record["lengths"][-1]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for g, res in record["groups"].items():
        for rule in record["rules_of"][g]:
            xs, ys = [], []
            for lo, hi in zip(record["edges"][:-1], record["edges"][1:]):
                m, _, _ = mean_over(res, rule, L, lambda r, lo=lo: bucket(r, lo))
                if m is not None:
                    xs.append((lo + hi) / 2)
                    ys.append(m)
            ax.plot(xs, ys, marker="o", label=g if rule == "-" else f"{g} ({rule})")
    ax.axvline(record["train_len"], color="grey", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"query distance from its pair (tokens), L = {L}")
    ax.set_ylabel("recall accuracy (%)")
    ax.set_title("MQAR recall past the training length (dotted: the training length)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def merge_into(previous: dict, groups: dict, rules_of: dict, meta: dict, train_len: int, kv: int, command: str,
               machine_load: dict) -> dict:
    """``previous`` (a record of this script) with the new runs' evaluations added; a run already there, or runs
    trained at another length or K, are refused."""
    if (train_len, kv) != (previous["train_len"], previous["num_kv_pairs"]):
        raise SystemExit(f"the new runs trained at N = {train_len}, K = {kv}; the record is N = "
                         f"{previous['train_len']}, K = {previous['num_kv_pairs']}")
    record = json.loads(json.dumps(previous))
    for g, members in groups.items():
        have = record["groups"].setdefault(g, {})
        clash = sorted(set(have) & set(members))
        if clash:
            raise SystemExit(f"{g}: runs {clash} are already in the record; give --out a new stem to redo them")
        have.update(members)
        record["rules_of"][g] = sorted(set(record["rules_of"].get(g, [])) | set(rules_of[g]),
                                       key=lambda r: (r != "-", r))
    record["runs"].update(meta)
    record.setdefault("added", []).append({"command": command, "runs": sorted(meta), "machine_load": machine_load})
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", help="name=run_dir (name_s<seed> groups seeds); none with --plot-only")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--rules", nargs="+", default=list(EXTENSION_RULES), type=check_extension,
                   metavar="RULE", help=f"extension rules: {EXTENSION_RULES_TEXT}")
    ap.add_argument("--num-examples", type=int, default=256)
    ap.add_argument("--seed", type=int, default=12345, help="seed of the evaluation examples")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True, help="stem of the .md / .json / .png")
    ap.add_argument("--notes", default="", help="reading paragraph (or @file) under the tables")
    ap.add_argument("--plot-only", action="store_true",
                    help="no evaluation: rewrite <out>.md / .png from <out>.json (with --notes)")
    ap.add_argument("--add", action="store_true",
                    help="evaluate the runs into the existing <out>.json (its lengths, rules, examples and seed)")
    args = ap.parse_args(argv)
    previous = None
    if args.add:
        with open(args.out + ".json") as f:
            previous = json.load(f)
        args.lengths = [int(x) for x in previous["lengths"]]
        args.num_examples, args.seed = previous["num_examples"], previous["seed"]
        args.rules = sorted({r for rules in previous["rules_of"].values() for r in rules if r != "-"}) or args.rules
    if args.plot_only:
        rewrite_result(args.out, lambda record: markdown(record, record["command"]), plot,
                       read_notes(args.notes))
        print(f"rewrote {args.out}.md / .json / .png")
        return 0
    if not args.runs:
        ap.error("name=run_dir runs are required (except with --plot-only)")
    torch.set_num_threads(args.threads)
    runs = dict(r.split("=", 1) for r in args.runs)
    groups, rules_of, meta = {}, {}, {}
    train_len = kv = None
    with Measurement(threads=args.threads) as m:
        for g, members in group(runs).items():
            groups[g] = {}
            for key, path in members.items():
                print(f"{g} {key}: {path}", flush=True)
                cfg, _, model, _ = load_run(find_checkpoint(path), ["trainer.device=cpu"])
                train_len, kv = int(cfg.data.seq_len), int(cfg.data.num_kv_pairs)
                groups[g][str(key)] = evaluate(model, cfg, args.lengths, args.rules, args.num_examples, args.seed)
                meta[f"{g}/{key}"] = {"path": path, "checkpoint": str(find_checkpoint(path))}
            rules_of[g] = sorted({rule for r in groups[g].values() for rule in r}, key=lambda r: (r != "-", r))
    command = "python scripts/mqar_extrapolation.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if previous is not None:  # keeps the record's reading unless --notes gives a new one
        record = merge_into(previous, groups, rules_of, meta, train_len, kv, command, m.record)
        record["notes"] = read_notes(args.notes) if args.notes else record.get("notes", "")
    else:
        record = {"command": command, "train_len": train_len, "num_kv_pairs": kv,
                  "lengths": [str(x) for x in args.lengths], "edges": list(edges_for(train_len, max(args.lengths))), "num_examples": args.num_examples,
                  "seed": args.seed, "groups": groups, "rules_of": rules_of, "runs": meta, "machine_load": m.record,
                  "notes": read_notes(args.notes)}
    write_result(args.out, markdown(record, record["command"]), record, lambda png: plot(record, png))
    print(f"wrote {args.out}.md / .json / .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
