"""Tables 6 and 8: every cell's trained 340M model evaluated (lm-evaluation-harness / LongBench, with
:mod:`tasks.language.evaluate`), the paper's numbers beside ours -> ``results/table6.md`` / ``table8.md`` (and
``.json``; a cell's ``run.json``, when its model folder has one, goes with its row: resolved config, commit,
machine, load).

    python scripts/reproduce_table.py --table 6 -- --ckpt-dir /ckpt [--lm-eval-data /data/lm_eval]  # make reproduce-table6
    python scripts/reproduce_table.py --table 8 -- --ckpt-dir /ckpt --longbench /data/LongBench/data  # make reproduce-table8

The model of cell ``<cell>`` (``configs/experiment/table6/<cell>.yaml``) is looked up at ``<ckpt-dir>/<cell>`` (a
``save_pretrained`` folder, a Trainer checkpoint or run directory: :func:`tasks.language.evaluate.load_model`); a
cell without a model, or without the data, is written as such, never with an invented number. Table 6 runs the
harness for every cell whose model exists (``--lm-eval-data DIR``: local copies of the tasks' dataset
repositories; else a Hugging Face cache, offline); the raw harness output of each cell goes to
``<out>/<cell>/lm_eval_results.json``. Without ``lm_eval`` it falls back to our own scorer for the two
perplexities (``--wikitext`` / ``--lambada`` files).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from datetime import datetime, timezone

import torch
import yaml

from tasks.common.records import read_run_record
from tasks.common.utils import system_info
from tasks.language import evaluate
from tasks.language.eval_ppl import EvalSettings, evaluate_lambada, evaluate_wikitext
from tasks.language.evaluate import COMMONSENSE, TABLE6_COLUMNS, TABLE6_METRIC, load_model
from tasks.language.lm_eval_adapter import HAVE_LM_EVAL, INSTALL_HELP
from tasks.language.longbench import TABLE8_GROUPS, TABLE8_TASKS, run_longbench

from .registry import ROOT
from tasks.common.results import write_result


# ------------------------------------------------------------------------------------------- tables

def table_cells(table: str) -> list[tuple[str, dict]]:
    out = []
    for p in sorted(glob.glob(os.path.join(ROOT, "configs", "experiment", f"table{table}", "*.yaml"))):
        with open(p) as f:
            out.append((os.path.splitext(os.path.basename(p))[0], (yaml.safe_load(f) or {}).get("paper", {})))
    if not out:
        raise SystemExit(f"no experiment configs under configs/experiment/table{table}/")
    return out


def cell_assumptions(cell: str) -> dict:
    """``{topic: text}``: the ``assumptions:`` of ``configs/experiment/table6/<cell>.yaml`` as ``train.py`` composes
    it (its task's, e.g. the token budget, and its own); the file's own block when it does not compose."""
    from .config import compose  # noqa: PLC0415  (hydra only where a config is composed)

    try:
        cfg, _ = compose([f"experiment=table6/{cell}"])
        return {str(k): str(v) for k, v in (cfg.get("assumptions") or {}).items() if v}
    except Exception:  # noqa: BLE001  (a config being written: read the file as it is)
        with open(os.path.join(ROOT, "configs", "experiment", "table6", cell + ".yaml")) as f:
            return {str(k): str(v) for k, v in ((yaml.safe_load(f) or {}).get("assumptions") or {}).items() if v}


def assumption_notes(table: str = "6") -> list[str]:
    """The ``assumptions:`` of the Table 6 cells' configs (the models Tables 6 and 8 evaluate), as markdown: those
    every cell shares (the recipe's: ``task=lm_fineweb``) once, then each cell's own."""
    cells = [os.path.splitext(os.path.basename(p))[0]
             for p in sorted(glob.glob(os.path.join(ROOT, "configs", "experiment", "table6", "*.yaml")))]
    notes = {cell: cell_assumptions(cell) for cell in cells}
    shared = {k: v for k, v in (notes[cells[0]] if cells else {}).items()
              if all(notes[c].get(k) == v for c in cells)}
    one = lambda v: " ".join(str(v).split())  # noqa: E731
    lines = [f"- every cell ({k}): ASSUMPTION {one(v)}" for k, v in shared.items()]
    lines += [f"- `{cell}` ({k}): ASSUMPTION {one(v)}" for cell in cells for k, v in notes[cell].items()
              if k not in shared]
    if not lines:
        return []
    return ["", f"Settings and assumptions (where the paper is silent or disagrees with itself; Table {table} evaluates "
                "the models of configs/experiment/table6/, each config's `assumptions:`; parameters and GMACs of every "
                "cell: results/params.md):", "", *lines]


def _write(table: str, header: list[str], rows: list[list[str]], notes: list[str], records: list[dict],
           results_dir: str) -> str:
    """``<results_dir>/table<table>.md`` and ``.json`` (the rows; each cell's ``run.json`` where its model has one)."""
    lines = [f"# Table {table}", "", *notes, "", f"Machine: {json.dumps(system_info())}", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    stem = os.path.join(results_dir, f"table{table}")
    write_result(stem, "\n".join(lines) + "\n",
                 {"table": table, "date": datetime.now(timezone.utc).isoformat(), "rows": records}, indent=2)
    return stem + ".md"


def model_run(path: str | None) -> dict:
    """``{"run": <run.json>}`` of a cell's model folder (a ``train.py`` run directory), else ``{}``."""
    record = read_run_record(path) if path and os.path.isdir(path) else None
    return {"run": record} if record else {}


def _fmt(v, digits=2) -> str:
    return "" if v is None else (f"{v:.{digits}f}" if isinstance(v, (int, float)) else str(v))


def reproduce_table6(args) -> str:
    cols = ["mmlu", "wino", "piqa", "arc_c", "obqa", "arc_e", "boolq", "avg", "wiki_ppl", "lambada_ppl"]
    header = ["cell", "model", "source"] + [f"{c} ({TABLE6_METRIC[c].replace('acc_norm', 'acc_n')})"
                                            if c in TABLE6_METRIC else c for c in cols]
    rows, records = [], []
    for cell, paper in table_cells("6"):
        rows.append([cell, paper.get("row", ""), "paper"] + [_fmt(paper.get(c)) for c in cols])
        path = os.path.join(args.ckpt_dir, cell) if args.ckpt_dir else None
        ours: dict = {}
        if not path or not os.path.exists(path):
            status = f"not trained: no model at {path or '<--ckpt-dir>/' + cell}"
        else:
            status = "ok"
            try:
                if HAVE_LM_EVAL:
                    ours = evaluate.lm_eval_table6(path, args.tokenizer, os.path.join(args.out, cell),
                                                   args.batch_size, args.device, data_root=args.lm_eval_data, limit=args.limit,
                                           max_length=args.max_length)
                    avg = [ours[c] for c in COMMONSENSE if c in ours]
                    ours["avg"] = sum(avg) / len(avg) if len(avg) == len(COMMONSENSE) else None
                else:
                    status = "lm_eval not installed: only wiki/lambada ppl (our scorer)"
                    model, tok = load_model(path, args.tokenizer, args.device)
                    settings = EvalSettings(batch_size=args.batch_size)
                    if args.wikitext:
                        ours["wiki_ppl"] = evaluate_wikitext(model, tok, args.wikitext, settings)["word_perplexity"]
                    if args.lambada:
                        ours["lambada_ppl"] = evaluate_lambada(model, tok, args.lambada, settings)["ppl"]
                    if not (args.wikitext or args.lambada):
                        status += " (no --wikitext / --lambada given: nothing measured)"
            except Exception as e:  # noqa: BLE001 - one broken cell must not hide the others
                status = f"failed: {type(e).__name__}: {str(e)[:120]}"
        rows.append([cell, paper.get("row", ""), "ours" if ours else status] + [_fmt(ours.get(c)) for c in cols])
        records.append({"cell": cell, "paper": paper, "ours": ours, "status": status, **model_run(path)})
    notes = ["340M language models (docs/paper_tables.md#table-6). Accuracies in %, `avg` = mean of the six commonsense columns "
             "(Wino, PIQA, ARC-c, OBQA, ARC-e, BoolQ); Wiki ppl = lm-eval `wikitext` word perplexity; LAMBADA ppl "
             "= `lambada_openai` perplexity. Paper numbers: the paper's Table 6, every column of every row "
             "(docs/paper_tables.md; the baselines' commonsense averages are also on the authors' project page).",
             "", f"Command: `make reproduce-table6 CKPT_DIR={args.ckpt_dir}"
             + (f" LM_EVAL_DATA={args.lm_eval_data}" if args.lm_eval_data else "") + "`"
             + (f" (lm-evaluation-harness {evaluate.lm_eval_version()}, zero-shot"
                + (f", limit {args.limit} examples per task" if args.limit else "") + ")"
                if HAVE_LM_EVAL else " (lm_eval not installed: see below)")]
    notes += ["", "Metrics: each accuracy column is the lm-eval metric of the paper's header, in brackets "
                  "(`acc_n` = lm-eval's length-normalised `acc_norm`): " + ", ".join(
                      f"{col} {task} `{metric}`" for col, task, metric in TABLE6_COLUMNS) + "."]
    notes += assumption_notes("6")
    if not HAVE_LM_EVAL:
        notes += ["", "To fill the accuracy columns:", "", "```", INSTALL_HELP, "```"]
    return _write("6", header, rows, notes, records, args.results_dir)


def reproduce_table8(args) -> str:
    header = ["cell", "model", "source", "avg (14 tasks)"] + list(TABLE8_TASKS)
    rows, records = [], []
    for cell, paper in table_cells("8"):  # the paper's per-task keys: the task names with '-' as '_'
        rows.append([cell, paper.get("row", ""), "paper", _fmt(paper.get("longbench_avg"))]
                    + [_fmt(paper.get(t.replace("-", "_"))) for t in TABLE8_TASKS])
        path = os.path.join(args.ckpt_dir, cell) if args.ckpt_dir else None
        scores, status = {}, "ok"
        if not path or not os.path.exists(path):
            status = f"not trained: no model at {path or '<--ckpt-dir>/' + cell}"
        elif not args.longbench or not os.path.isdir(args.longbench):
            status = f"no LongBench data at {args.longbench!r} (--longbench / LONGBENCH=)"
        else:
            try:
                model, tok = load_model(path, args.tokenizer, args.device)
                scores = run_longbench(model, tok, args.longbench, TABLE8_TASKS, max_length=args.max_length,
                                       out_dir=os.path.join(args.out, cell), limit=args.limit,
                                       batch_size=args.batch_size)
            except Exception as e:  # noqa: BLE001
                status = f"failed: {type(e).__name__}: {str(e)[:120]}"
        rows.append([cell, paper.get("row", ""), "ours" if scores else status, _fmt(scores.get("average"))]
                    + [_fmt(scores.get(t)) for t in TABLE8_TASKS])
        records.append({"cell": cell, "paper": paper, "ours": scores, "status": status, **model_run(path)})
    groups = "; ".join(f"{g}: " + ", ".join(f"{abbr} = {name}" for abbr, name in tasks)
                       for g, tasks in TABLE8_GROUPS.items())
    notes = [f"LongBench (docs/paper_tables.md#table-8), the paper's 14 tasks in its column order ({groups}), "
             "official prompts, greedy decoding, middle truncation to "
             f"{args.max_length} tokens (prompt + generation), official metrics (LongBench's packages: rouge, fuzzywuzzy, jieba). Paper numbers: the paper's Table 8, its 14 per-task "
             "scores and its average of every row (docs/paper_tables.md).", "",
             f"Command: `make reproduce-table8 CKPT_DIR={args.ckpt_dir}"
             + (f" LONGBENCH={args.longbench}`" if args.longbench else "` (no LONGBENCH data given)")
             + (f" (limit {args.limit} examples per task)" if args.limit else "")]
    notes += assumption_notes("8")
    return _write("8", header, rows, notes, records, args.results_dir)


# ---------------------------------------------------------------------------------------------- CLI

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("table6", "table8"):
        s = sub.add_parser(name)
        s.add_argument("--ckpt-dir", default="", help="folder with one model per cell: <ckpt-dir>/<cell>")
        s.add_argument("--tokenizer", default=None)
        s.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        s.add_argument("--batch-size", type=int, default=8)
        s.add_argument("--out", default=os.path.join(ROOT, "results", "lm_eval" if name == "table6" else "longbench"),
                       help="raw outputs per cell (<out>/<cell>/)")
        s.add_argument("--results-dir", default=os.path.join(ROOT, "results"), help="where table6|8.md go")
        if name == "table6":
            s.add_argument("--wikitext", default=None, help="wiki.test.raw / jsonl / saved HF dataset")
            s.add_argument("--lambada", default=None, help="lambada_test.jsonl")
            s.add_argument("--max-length", type=int, default=None)
            s.add_argument("--limit", type=int, default=None, help="documents / examples per task (smoke runs)")
            s.add_argument("--lm-eval-data", default=os.environ.get("LM_EVAL_DATA") or None,
                           help="folder with local copies of the tasks' dataset repositories, DIR/<org>/<name> "
                                "(default: $LM_EVAL_DATA; else the Hugging Face cache, offline)")
        else:
            s.add_argument("--longbench", default=None, help="folder with the official LongBench <dataset>.jsonl files")
            s.add_argument("--max-length", type=int, default=2048, help="prompt + generation budget (tokens)")
            s.add_argument("--limit", type=int, default=None, help="examples per task (smoke runs)")
    args = p.parse_args(argv)
    if args.cmd == "table6":
        print("wrote", reproduce_table6(args))
        if not HAVE_LM_EVAL:
            print(INSTALL_HELP, file=sys.stderr)
    else:
        print("wrote", reproduce_table8(args))
    return 0
