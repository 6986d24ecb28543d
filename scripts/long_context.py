#!/usr/bin/env python
"""Recall at any length (issue 50): passkey retrieval and spread multi-query recall from the training length to
1M tokens by chunked prefill, for trained MHLA (every extension rule), linear and softmax models, with the time
and peak memory of every evaluation and a depth x length heatmap.

Runs are ``name=run_dir`` (``train.py`` runs of ``experiment=long_context/passkey`` or
``experiment=long_context/spread_mqar[_curriculum]``; ``name_s<seed>`` groups seeds, as
``scripts/mqar_extrapolation.py``).
The test follows the run's task: a passkey run (``PasskeyLMTask``) is scored on passkey examples in held-out
filler (the validation split of its corpus), an MQAR run on spread MQAR (``tasks/language/long_context.py``
says how both are built and scored). Lengths: the training length ``N`` times 1, 4, 16, ... up to
``--max-len`` (default 1,048,576; the last is ``--max-len`` itself). MHLA is evaluated under every rule of
``--rules`` on the same checkpoint (:func:`scripts.length_extrapolation.extension_rule`; without ``--rules``:
every rule of ``mhla.mixing.EXTENSION_RULES`` and the model's own, e.g. the ``uniform_far:120`` that
``uniform_far:auto`` resolves to in the recall preset: :func:`rules_for`); softmax stops at
``--softmax-max-len`` (its KV cache and its quadratic prefill grow with the context). Every evaluation records
its wall time, the process's resident memory before it and its own peak (``PeakRSS``), and the cache size.

    python scripts/long_context.py mhla_s0=outputs/long_context/passkey_mhla_s0 \\
        linear_s0=outputs/long_context/passkey_linear_s0 --out results/language/long_context
    python scripts/long_context.py --train outputs/long_context --seeds 0 --out results/language/long_context
    python scripts/long_context.py --plot-only --out results/language/long_context
    python scripts/long_context.py --merge outputs/a.json outputs/b.json --out results/language/long_context_ab

``--train DIR`` first trains what is missing of ``DIR/<test>_<attn>_s<seed>`` (``--tests``, ``--attns``,
``--seeds``; one thread per run, ``--jobs`` at a time), then evaluates all of them. Writes ``<out>.md``,
``.json``, ``.png`` through :func:`tasks.common.results.write_result` (the machine's load around the whole
evaluation: :class:`tasks.common.records.Measurement`; a busy machine is written marked BUSY with
``--allow-busy``). ``--merge`` joins records of other runs evaluated in parallel processes (the same settings,
each with its own ``--rules``; a model's seeds may come from several) into one, which lists every part's command
and keeps its measurement. ``--equal-weights`` also evaluates every MHLA model with its mixing coefficients made
equal (group ``<name>_equal``; the control for the learned shape of the mixing); ``--equal-only`` evaluates only
those copies of the MHLA models (when the trained models' side is recorded already).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from mhla.mixing import EXTENSION_RULES_TEXT, check_extension, mixing_matrices, with_equal_weights  # noqa: E402
from mhla.registry import benchmark_baseline, grows_with_context  # noqa: E402
from scripts.length_extrapolation import extension_rule, rules_for  # noqa: E402
from scripts.mqar_extrapolation import group  # noqa: E402
from tasks.common.checkpoint import find_checkpoint  # noqa: E402
from tasks.common.evaluation import load_run  # noqa: E402
from tasks.common.launch import metric_curve, read_notes, train_loss_curve  # noqa: E402
from tasks.common.records import RUN_RECORD_KEYS, Measurement, read_run_record  # noqa: E402
from tasks.common.results import BusyMachine, load_summary, read_parts, rewrite_result, write_result  # noqa: E402
from tasks.common.utils import system_info  # noqa: E402
from tasks.language.long_context import (PasskeyLMTask, evaluate_passkey, evaluate_spread_mqar,  # noqa: E402
                                         filler_tokens, spread_mqar_filler, without_numbers)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
TESTS = {"passkey": "long_context/passkey", "mqar": "long_context/spread_mqar_curriculum"}  # the MQAR recipe every run learns
ATTNS = ("mhla", "linear", "softmax")
GOALS = ("MHLA >= linear attention at every length on both tests; passkey >= 90% at 16x the training length; "
         "moonshot: passkey >= 50% at 1M tokens with peak RSS within 10% of the 64k evaluation's")


def lengths_for(train_len: int, max_len: int, factor: int = 4) -> list[int]:
    """``train_len x 1, factor, factor^2, ...`` below ``max_len``, then ``max_len``."""
    out, L = [], int(train_len)
    while L < max_len:
        out.append(L)
        L *= factor
    return out + [int(max_len)]


def test_of(cfg) -> str:
    """``passkey`` or ``mqar``: the benchmark a run is scored on, from its task class."""
    target = str(cfg.task.get("target", ""))
    if target.endswith("PasskeyLMTask"):
        return "passkey"
    if target.endswith("MQARTask"):
        return "mqar"
    raise SystemExit(f"no long-context test for task.target={target} (a passkey or MQAR run is needed)")


def evaluate_model(model, test: str, lengths: list[int], rules: list[str] | None, args, *, filler=None, fmt=None,
                   mqar: dict | None = None, log=print) -> dict:
    """``{rule or "-": {str(L): record}}`` for one model: MHLA under every rule of :func:`rules_for`, the others
    once; a context-growing attention (softmax) is skipped past ``args.softmax_max_len`` (``{"skipped": why}``)."""
    mhla = bool(mixing_matrices(model))
    grows = grows_with_context(model.config.attn_name)
    out = {}
    for rule in (rules_for(model, rules) if mhla else ["-"]):
        per_len = {}
        for L in lengths:
            if grows and L > args.softmax_max_len:
                per_len[str(L)] = {"length": L, "skipped": f"KV cache grows with the context: over "
                                   f"--softmax-max-len {args.softmax_max_len}"}
                continue
            ctx = extension_rule(model, rule) if mhla else _nullcontext()
            with ctx:
                if test == "passkey":
                    rec = evaluate_passkey(model, filler, fmt, L, args.depths, examples_per_depth=args.examples,
                                           batch_size=args.batch_size, prefill_chunk=args.prefill_chunk,
                                           seed=args.seed, distances=args.distances)
                else:
                    rec = evaluate_spread_mqar(model, L, vocab_size=mqar["vocab_size"],
                                               num_kv_pairs=mqar["num_kv_pairs"], num_examples=args.examples,
                                               batch_size=args.batch_size, prefill_chunk=args.prefill_chunk,
                                               seed=args.seed, filler=mqar["filler"])
            per_len[str(L)] = rec
            acc = "-" if rec["acc"] is None else f"{100 * rec['acc']:5.1f}%"
            log(f"  {test} {rule:>12} L={L:8d} acc={acc} {rec['seconds']:7.1f} s "
                f"peak RSS {rec['peak_rss_mib']:.0f} MiB cache {rec['cache_bytes'] / 2**20:.2f} MiB")
        out[rule] = per_len
    return out


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def joined_rules(*rule_lists) -> list[str]:
    """The rules of a model's seeds in one list, ``"-"`` (a model without rules) first, then by name."""
    return sorted({r for rules in rule_lists for r in rules}, key=lambda r: (r != "-", r))


def evaluate_runs(runs: dict, args) -> dict:
    """Load and evaluate every run: ``{"tests": {test: {"train_len", "lengths", "groups": {g: {seed: {rule:
    {L: rec}}}}, "rules_of": {g: [...]}}}, "runs": {...}}``."""
    record: dict = {"tests": {}, "runs": {}}
    for g, members in group(runs).items():
        for key, path in members.items():
            ckpt = find_checkpoint(path)
            print(f"{g} {key}: {ckpt}", flush=True)
            cfg, task, model, _ = load_run(str(ckpt), ["trainer.device=cpu"])
            test = test_of(cfg)
            train_len = int(cfg.data.seq_len)
            lengths = args.lengths or lengths_for(train_len, args.max_len)
            kw = {}
            if test == "passkey":
                assert isinstance(task, PasskeyLMTask)
                _, val, tok, _ = task.data()
                filler = filler_tokens(val.tokens, tok.eos_token_id)
                kw = {"filler": without_numbers(filler, tok) if args.filler_without_numbers else filler,
                      "fmt": task.fmt()}
            else:
                kw = {"mqar": {"vocab_size": int(cfg.data.vocab_size),
                               "num_kv_pairs": int(cfg.data.num_kv_pairs), "filler": spread_mqar_filler(cfg)}}
            t = record["tests"].setdefault(test, {"train_len": train_len, "lengths": [str(L) for L in lengths],
                                                  "groups": {}, "rules_of": {}})
            if t["train_len"] != train_len:
                raise SystemExit(f"{g}/{key} trained at {train_len} tokens, the other {test} runs at "
                                 f"{t['train_len']}")
            run = read_run_record(path) or {}  # the trainer's run.json: commit, dirty, machine, load, config
            curve = train_loss_curve(str(path))
            about = {"path": str(path), "checkpoint": str(ckpt), "test": test, "attn_name": model.config.attn_name,
                     "metrics": run.get("metrics"), "curve": curve, "eval_curve": metric_curve(str(path), "eval/acc"),
                     "left_plateau_at": plateau_exit(curve), **{k: run[k] for k in RUN_RECORD_KEYS if k in run}}
            mixed = bool(mixing_matrices(model))
            edits = {} if args.equal_only and mixed else {g: (model, {})}
            if (args.equal_weights or args.equal_only) and mixed:  # the same weights, the mixing made equal
                edits[g + EQUAL_SUFFIX] = (with_equal_weights(model), {"edit": EQUAL_EDIT})
            for name, (m, edit) in edits.items():
                res = evaluate_model(m, test, lengths, args.rules, args, **kw)
                t["groups"].setdefault(name, {})[str(key)] = res
                t["rules_of"][name] = joined_rules(t["rules_of"].get(name, []), res)
                record["runs"][f"{name}/{key}"] = {**about, **edit}
            del model, edits
    return record


EQUAL_SUFFIX = "_equal"  # --equal-weights: the group of a model's copy with its mixing made equal
EQUAL_EDIT = "every mixing coefficient made equal (mhla.mixing.with_equal_weights), no training"
PLATEAU_DROP = 0.5  # nats below the first logged training loss that count as leaving the starting plateau


def plateau_exit(curve: list, drop: float = PLATEAU_DROP) -> int | None:
    """The first logged step whose training loss is at least ``drop`` nats below the first logged one: when a run
    leaves the chance plateau that recall tasks start on (``curve``: ``(step, loss)`` pairs; None if never)."""
    if not curve:
        return None
    first = curve[0][1]
    return next((int(step) for step, loss in curve if loss <= first - drop), None)


# ------------------------------------------------------------------------------------------ tables
def stat(test: dict, g: str, rule: str, L: str, pick):
    """Mean, std and count over a group's seeds of ``pick(record)`` (records without it are skipped)."""
    xs = []
    for res in test["groups"][g].values():
        rec = res.get(rule, {}).get(L)
        if rec is not None and "skipped" not in rec:
            v = pick(rec)
            if v is not None:
                xs.append(v)
    if not xs:
        return None, None, 0
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0), len(xs)


def depth_acc(rec: dict, i: int):
    """Accuracy of depth row ``i`` of a record (passkey: its depths; MQAR: its depth bins)."""
    rows = rec.get("depths") or rec.get("by_depth") or []
    return rows[i]["acc"] if i < len(rows) and rows[i].get("acc") is not None else None


def _records(test: dict):
    """Every evaluation record of a test (all groups, seeds, rules and lengths), in order."""
    for res in (r for seeds in test["groups"].values() for r in seeds.values()):
        for per_len in res.values():
            yield from per_len.values()


def placement(test: dict) -> str:
    """What the rows of a test's heatmap are: ``"distance"`` (passkey run with ``--distances``) or ``"depth"``."""
    rows = next((rec["depths"] for rec in _records(test) if rec.get("depths")), None)
    return "distance" if rows and "target_distance" in rows[0] else "depth"


def depth_labels(test: dict) -> list[str]:
    for rec in _records(test):
        if rec.get("depths") and "target_distance" in rec["depths"][0]:
            return [f"{r['target_distance']:,}" for r in rec["depths"]]
        if "depths" in rec:
            return [f"{r['depth']:.2f}" for r in rec["depths"]]
        if "by_depth" in rec:
            return [f"{r['lo']:.1f}-{r['hi']:.1f}" for r in rec["by_depth"]]
    return []


def _fmt(m, s, scale=100.0, digits=1):
    return "-" if m is None else f"{scale * m:.{digits}f} ± {scale * s:.{digits}f}"


def markdown(record: dict) -> str:
    s = record["settings"]
    lines = ["# Recall at any length: passkey and spread MQAR by chunked prefill", "",
             f"Made by `{record['command']}`. {s['examples']} examples per depth or distance (passkey) or per "
             "length (MQAR), "
             f"batches of {s['batch_size']}, prefill chunks of {s['prefill_chunk']} tokens, evaluation seed "
             f"{s['seed']}; softmax up to {s['softmax_max_len']} tokens. Accuracy in %, mean ± std over the seeds "
             "of a row (n). Passkey: all 5 digits right (chance 0.001%); MQAR: per query (chance ~0.4%). "
             "Machine and load: the .json (`measurement`, `machine`)."
             + (" Passkey filler without numbers (`--filler-without-numbers`)." if s.get("filler_without_numbers")
                else ""), ""]
    lines += [f"- part: `{p['command']}` ({p['seconds'] or 0:.0f} s)" for p in record.get("parts", [])]
    lines += [""] * bool(record.get("parts")) + [f"Goals (issue 50): {GOALS}.", ""]
    m = record.get("measurement")
    if m:
        lines += [f"Load: {load_summary(m)}; commit {m.get('commit')} (dirty: {m.get('dirty')}).", ""]
    for test_name, test in record["tests"].items():
        Ls = test["lengths"]
        lines += [f"## {test_name} (trained at {test['train_len']} tokens)", "",
                  "| model | rule | n | " + " | ".join(f"{int(L):,}" for L in Ls) + " |",
                  "|---|---|---|" + "---|" * len(Ls)]
        for g in test["groups"]:
            for rule in test["rules_of"][g]:
                cells, n = [], 0
                for L in Ls:
                    mu, sd, k = stat(test, g, rule, L, lambda r: r["acc"])
                    n = max(n, k)
                    cells.append(_fmt(mu, sd))
                lines.append(f"| {g} | {rule} | {n} | " + " | ".join(cells) + " |")
        if test_name == "passkey":
            lines += ["", "Digit accuracy (%, chance 10):", "",
                      "| model | rule | " + " | ".join(f"{int(L):,}" for L in Ls) + " |", "|---|---|" + "---|" * len(Ls)]
            for g in test["groups"]:
                for rule in test["rules_of"][g]:
                    cells = [_fmt(*stat(test, g, rule, L, lambda r: r.get("digit_acc"))[:2]) for L in Ls]
                    lines.append(f"| {g} | {rule} | " + " | ".join(cells) + " |")
        lines += ["", "Time (s) / peak RSS (MiB) / cache (MiB) of each evaluation (mean over seeds):", "",
                  "| model | rule | " + " | ".join(f"{int(L):,}" for L in Ls) + " |", "|---|---|" + "---|" * len(Ls)]
        for g in test["groups"]:
            for rule in test["rules_of"][g]:
                cells = []
                for L in Ls:
                    t, _, k = stat(test, g, rule, L, lambda r: r["seconds"])
                    p, _, _ = stat(test, g, rule, L, lambda r: r["peak_rss_mib"])
                    c, _, _ = stat(test, g, rule, L, lambda r: r["cache_bytes"] / 2**20)
                    cells.append("-" if not k else f"{t:.1f} / {p:.0f} / {c:.2f}")
                lines.append(f"| {g} | {rule} | " + " | ".join(cells) + " |")
        labels = depth_labels(test)
        if labels:
            what = placement(test)
            rows_are = ("distance of the fact from the end in tokens (the same at every length; -: does not fit)"
                        if what == "distance" else "depth of the fact")
            lines += ["", f"Accuracy by {rows_are} (rows) and length (columns), per model and rule:", ""]
            for g in test["groups"]:
                for rule in test["rules_of"][g]:
                    lines += [f"**{g}** ({rule})", "", f"| {what} | " + " | ".join(f"{int(L):,}" for L in Ls) + " |",
                              "|---|" + "---|" * len(Ls)]
                    for i, lab in enumerate(labels):
                        cells = []
                        for L in Ls:
                            mu, _, _ = stat(test, g, rule, L, lambda r, i=i: depth_acc(r, i))
                            cells.append("-" if mu is None else f"{100 * mu:.0f}")
                        lines.append(f"| {lab} | " + " | ".join(cells) + " |")
                    lines.append("")
        lines.append("")
    lines += training_lines(record)
    lines += goal_lines(record)
    if record.get("notes"):
        lines += ["## Reading", "", record["notes"].strip(), ""]
    return "\n".join(lines)


def training_lines(record: dict) -> list[str]:
    """Per run: the step at which its training loss left the starting plateau (:func:`plateau_exit`) and its last
    evaluation accuracy during training (records made before these were stored: nothing)."""
    runs = {k: r for k, r in record["runs"].items() if "curve" in r and "edit" not in r}  # a run once, not per edit
    if not runs:
        return []
    out = ["## Training", "", f"Left the plateau: the first logged step with the training loss {PLATEAU_DROP} below "
           "its first logged value (-: never); last eval: the accuracy (%) of the last evaluation during training.", "",
           "| run | left the plateau at step | of | last eval |", "|---|---|---|---|"]
    for key, r in runs.items():
        last_step = r["curve"][-1][0] if r["curve"] else "-"
        ev = f"{100 * r['eval_curve'][-1][1]:.1f}" if r.get("eval_curve") else "-"
        at = "-" if r["left_plateau_at"] is None else r["left_plateau_at"]
        out.append(f"| {key} | {at} | {last_step} | {ev} |")
    return out + [""]


def goal_lines(record: dict) -> list[str]:
    """The issue's goals, met or not, from the record: per MHLA group and rule, >= linear at every length (per
    test); passkey >= 90% at 16x; passkey >= 50% at the longest length with peak RSS within 10% of the 65,536-token
    evaluation's (mean over seeds)."""
    out = []
    attn_of = {key.split("/", 1)[0]: run["attn_name"] for key, run in record["runs"].items()}
    for tn, t in record["tests"].items():
        Ls = t["lengths"]
        for g in t["groups"]:
            baseline = benchmark_baseline(attn_of.get(g, ""))  # MHLA's: linear attention
            lin = next((b for b in t["groups"] if baseline and attn_of.get(b) == baseline), None)
            for rule in t["rules_of"][g]:
                if rule == "-":
                    continue
                acc = {L: stat(t, g, rule, L, lambda r: r["acc"])[0] for L in Ls}
                parts = []
                if lin:
                    worse = [L for L in Ls if acc[L] is not None and stat(t, lin, "-", L, lambda r: r["acc"])[0]
                             is not None and acc[L] < stat(t, lin, "-", L, lambda r: r["acc"])[0]]
                    verdict = "met" if not worse else f"not met (below at {', '.join(worse)})"
                    parts.append(f">= {lin} at every length: {verdict}")
                if tn == "passkey":
                    L16 = str(16 * t["train_len"])
                    if acc.get(L16) is not None:
                        parts.append(f"{100 * acc[L16]:.0f}% at 16x ({'met' if acc[L16] >= 0.9 else 'not met'})")
                    last = Ls[-1]
                    p_last = stat(t, g, rule, last, lambda r: r["peak_rss_mib"])[0]
                    p_64k = stat(t, g, rule, "65536", lambda r: r["peak_rss_mib"])[0]
                    if acc.get(last) is not None and p_last and p_64k and last != "65536":
                        ok = acc[last] >= 0.5 and p_last <= 1.1 * p_64k
                        parts.append(f"{100 * acc[last]:.0f}% at {int(last):,} with peak RSS {p_last / p_64k:.2f}x the "
                                     f"64k evaluation's (moonshot {'met' if ok else 'not met'})")
                if parts:
                    out.append(f"- {tn} {g} ({rule}): " + "; ".join(parts) + ".")
    return (["## Goals", ""] + out + [""]) if out else []


def plot(record: dict, path: str) -> None:
    """One heatmap per test, model and rule: accuracy by depth (rows) and context length (columns)."""
    from tasks.common.plots import pyplot, save_figure  # noqa: PLC0415

    panels = [(tn, g, rule) for tn, t in record["tests"].items() for g in t["groups"] for rule in t["rules_of"][g]]
    if not panels:
        return
    plt = pyplot()
    cols = min(4, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.9 * rows), squeeze=False)
    for ax, (tn, g, rule) in zip(axes.flat, panels):
        t = record["tests"][tn]
        labels, Ls = depth_labels(t), t["lengths"]
        grid = [[stat(t, g, rule, L, lambda r, i=i: depth_acc(r, i))[0] for L in Ls] for i in range(len(labels))]
        data = [[float("nan") if v is None else 100 * v for v in row] for row in grid]
        ax.imshow(data, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(Ls)), [_short(int(L)) for L in Ls], fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_title(f"{tn}: {g}" + ("" if rule == "-" else f" ({rule})"), fontsize=8)
        ax.set_xlabel("context (tokens)", fontsize=7)
        ax.set_ylabel(f"{placement(t)} of the fact", fontsize=7)
        for i, row in enumerate(data):
            for j, v in enumerate(row):
                if v == v:  # not NaN
                    ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("Recall accuracy (%) by place and context (green 100, red 0; blank: not run or does not fit)",
                 fontsize=9)
    save_figure(fig, path)


def _short(n: int) -> str:
    return f"{n // 2**20}M" if n >= 2**20 and n % 2**20 == 0 else f"{n // 1024}k" if n >= 1024 else str(n)


# ------------------------------------------------------------------------------------------ training
def train_commands(train_dir: str, tests, attns, seeds, extra=()) -> dict[str, list[str]]:
    """``{run name: train.py command}`` for the runs of ``tests x attns x seeds`` without a checkpoint."""
    out = {}
    for test in tests:
        for attn in attns:
            for seed in seeds:
                name = f"{test}_{attn}_s{seed}"
                run_dir = os.path.join(train_dir, name)
                try:
                    find_checkpoint(run_dir)
                    continue
                except FileNotFoundError:
                    pass
                out[name] = [sys.executable, os.path.join(ROOT, "train.py"), f"experiment={TESTS[test]}",
                             f"attn={attn}", f"seed={seed}", f"hydra.run.dir={os.path.abspath(run_dir)}", *extra]
    return out


def train_missing(train_dir: str, tests, attns, seeds, jobs: int = 2, extra=()) -> dict[str, str]:
    """Train the missing runs (one thread each, ``jobs`` at a time, logs ``DIR/<name>.log``); returns
    ``{name: dir}`` for all of them, named ``<test>_<attn>_s<seed>`` (so the seeds of a row group together)."""
    from tasks.common.launch import run_parallel  # noqa: PLC0415

    os.makedirs(train_dir, exist_ok=True)
    commands = train_commands(train_dir, tests, attns, seeds, extra)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    failed = []

    def run(name):
        t0 = time.time()
        with open(os.path.join(train_dir, f"{name}.log"), "w") as log_file:
            rc = subprocess.run(commands[name], cwd=ROOT, env=env, stdout=log_file,
                                stderr=subprocess.STDOUT).returncode
        return {"rc": rc, "seconds": round(time.time() - t0, 1)}

    def done(name, rec):
        if rec["rc"]:
            failed.append(name)
        return f"trained {name}: exit {rec['rc']} ({rec['seconds']} s)"

    if commands:
        run_parallel(run, list(commands), jobs, "long context: training", done)
    if failed:
        raise SystemExit(f"training failed for {', '.join(failed)}: see {train_dir}/<name>.log")
    names = [f"{t}_{a}_s{s}" for t in tests for a in attns for s in seeds]
    return {name: os.path.join(train_dir, name) for name in names}


# ------------------------------------------------------------------------------------------ main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", help="name=run_dir (name_s<seed> groups seeds)")
    ap.add_argument("--lengths", type=int, nargs="+", default=None,
                    help="context lengths (default: the training length x 1, 4, 16, ... and --max-len)")
    ap.add_argument("--max-len", type=int, default=1 << 20)
    ap.add_argument("--depths", type=float, nargs="+", default=list(DEPTHS))
    ap.add_argument("--distances", type=int, nargs="+", default=None,
                    help="passkey: the needle this many tokens from the end at every length, instead of --depths")
    ap.add_argument("--examples", type=int, default=4,
                    help="passkey: per depth (or distance) and length; MQAR: per length")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--rules", nargs="+", default=None, type=check_extension, metavar="RULE",
                    help=f"extension rules: {EXTENSION_RULES_TEXT} (default: every named rule and the model's own)")
    ap.add_argument("--softmax-max-len", type=int, default=16384)
    ap.add_argument("--equal-weights", action="store_true",
                    help="also evaluate each MHLA model with every mixing coefficient made equal (group <name>_equal: "
                         "the same weights read as linear attention; mhla.mixing.with_equal_weights)")
    ap.add_argument("--equal-only", action="store_true",
                    help="as --equal-weights, without evaluating the MHLA models as trained (a control whose trained "
                         "side is recorded already); models without mixing are evaluated as usual")
    ap.add_argument("--filler-without-numbers", action="store_true",
                    help="passkey: filler without the tokens that hold a digit (the control for a write gate that "
                         "writes the filler's numbers; tasks.language.long_context.without_numbers)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the evaluation examples")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--train", default=None, metavar="DIR", help="train the missing runs into DIR first")
    ap.add_argument("--tests", nargs="+", default=["passkey"], choices=sorted(TESTS))
    ap.add_argument("--attns", nargs="+", default=["mhla", "linear"], choices=ATTNS)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "language", "long_context"))
    ap.add_argument("--notes", default="", help="reading paragraph (or @file)")
    ap.add_argument("--allow-busy", action="store_true", help="write a measurement of a busy machine, marked BUSY")
    ap.add_argument("--plot-only", action="store_true", help="rewrite <out>.md / .png from <out>.json")
    ap.add_argument("--merge", action="store_true",
                    help="the positional arguments are .json records of this script (evaluations run in parallel "
                         "processes, each of other runs): join them into <out>, evaluating nothing")
    return ap.parse_args(argv)


PART_SETTINGS = ("rules", "threads")  # may differ between the parts of a merge (each part's command keeps its own)
# settings added later: what a part recorded before them was made under
SETTING_DEFAULTS = {"equal_weights": False, "equal_only": False, "filler_without_numbers": False}


def seed_order(key: str) -> tuple:
    """Sort key of a group's member: seeds (``"0"``, ``"1"``, ..., ``"10"``) in numeric order, then runs named
    without a seed, by name."""
    return (0, int(key), "") if key.isdigit() else (1, 0, key)


def merge_records(records: list[dict]) -> dict:
    """One record of several of this script's records of other runs: their tests' groups (a model's seeds may come
    from several records) and their runs joined. A test's training length and lengths must agree across the records,
    and no seed of a model may appear twice."""
    merged: dict = {"tests": {}, "runs": {}}
    for rec in records:
        for name, test in rec["tests"].items():
            t = merged["tests"].setdefault(name, {**test, "groups": {}, "rules_of": {}})
            if (t["train_len"], t["lengths"]) != (test["train_len"], test["lengths"]):
                raise SystemExit(f"{name}: the records were evaluated at different training lengths or lengths "
                                 f"({t['train_len']} {t['lengths']} vs {test['train_len']} {test['lengths']})")
            for g, seeds in test["groups"].items():
                have = t["groups"].setdefault(g, {})
                if set(have) & set(seeds):
                    raise SystemExit(f"{name}: model {g} seed(s) {sorted(set(have) & set(seeds))} in more than one "
                                     "record")
                have.update(seeds)
                t["rules_of"][g] = joined_rules(t["rules_of"].get(g, []), test["rules_of"][g])
        merged["runs"].update(rec["runs"])
    for test in merged["tests"].values():  # seeds in order, whatever the parts' order: readings pair them by position
        for g, seeds in test["groups"].items():
            test["groups"][g] = dict(sorted(seeds.items(), key=lambda kv: seed_order(kv[0])))
    return merged


def write_merged(paths: list[str], out: str, notes: str, argv=None) -> int:
    """``--merge``: write ``<out>`` from the records at ``paths`` (:func:`merge_records`); the record keeps each
    part's command and measurement (:func:`tasks.common.results.read_parts`), the settings the parts share (all
    but :data:`PART_SETTINGS`: checked) and the first part's machine."""
    records, kept = read_parts(paths)
    shared = [{**SETTING_DEFAULTS, **{k: v for k, v in r["settings"].items() if k not in PART_SETTINGS}}
              for r in records]
    if any(s != shared[0] for s in shared):
        raise SystemExit("the records were evaluated with different settings (examples, seed, lengths, ...): "
                         + "; ".join(json.dumps(s, sort_keys=True) for s in shared))
    record = {**merge_records(records), "settings": {**shared[0], **{k: None for k in PART_SETTINGS}},
              "machine": records[0].get("machine"), "notes": notes, "parts": kept["parts"],
              "command": "python scripts/long_context.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    if kept["measurement"] is not None:
        record["measurement"] = kept["measurement"]
    write_result(out, markdown(record), record, lambda png: plot(record, png))
    print(f"wrote {out}.md / .json / .png from {len(paths)} records")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        rewrite_result(args.out, markdown, plot, read_notes(args.notes))
        print(f"rewrote {args.out}.md / .png")
        return 0
    if args.merge:
        return write_merged(args.runs, args.out, read_notes(args.notes), argv)
    runs = dict(r.split("=", 1) for r in args.runs)
    if args.train:
        runs.update(train_missing(args.train, args.tests, args.attns, args.seeds, args.jobs))
    if not runs:
        raise SystemExit("give name=run_dir runs or --train DIR")
    torch.set_num_threads(args.threads)
    command = "python scripts/long_context.py " + " ".join(argv if argv is not None else sys.argv[1:])
    with Measurement(threads=args.threads) as m:
        record = evaluate_runs(runs, args)
    record.update({"command": command, "machine": system_info("cpu"), "notes": read_notes(args.notes),
                   "settings": {k: getattr(args, k) for k in ("depths", "distances", "examples", "batch_size",
                                                              "prefill_chunk", "rules", "softmax_max_len", "seed",
                                                              "threads", "max_len", "equal_weights",
                                                              "equal_only", "filler_without_numbers")}})
    try:
        write_result(args.out, markdown(record), record, lambda png: plot(record, png), measurement=m.record,
                     allow_busy=args.allow_busy)
    except BusyMachine as e:
        with open(args.out + ".unwritten.json", "w") as f:  # keep what was measured
            json.dump({**record, "measurement": m.record}, f, indent=1)
        print(f"{e}\n(the record is kept in {args.out}.unwritten.json)", file=sys.stderr)
        return 2
    print(f"wrote {args.out}.md / .json / .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
