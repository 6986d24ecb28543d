"""Evaluate trained language models: perplexity, LongBench, and the Table 6 / Table 8 reproductions.

    python -m tasks.language.evaluate ppl --model PATH --wikitext /data/wikitext-103-raw/wiki.test.raw \\
        --lambada /data/lambada/lambada_test.jsonl
    python -m tasks.language.evaluate longbench --model PATH --data /data/LongBench/data [--tasks ...]
    python -m tasks.language.evaluate table6 --ckpt-dir /ckpt [--lm-eval-data /data/lm_eval]     # results/table6.md
    python -m tasks.language.evaluate table8 --ckpt-dir /ckpt --longbench /data/LongBench/data   # results/table8.md

``--model PATH`` is a ``save_pretrained`` folder (``config.json`` + weights; tokenizer files there or
``--tokenizer``) or a Trainer checkpoint ``.pt`` / run directory (``checkpoints/best.pt``; the model is rebuilt
from the config stored in the checkpoint, the tokenizer comes from ``--tokenizer`` or that config's
``data.tokenizer``). For the tables, the model of cell ``<cell>`` (``configs/experiment/table6/<cell>.yaml``) is
looked up at ``<ckpt-dir>/<cell>``; a cell without a model, or without the data, is written as such, never with
an invented number. Baselines trained with flash-linear-attention (GLA, Mamba, Mamba2, GDN) load through
``AutoModelForCausalLM`` once ``fla`` is importable.

Table 6 runs lm-evaluation-harness (``lm_eval``, installed by ``make install``) through our adapter
(:mod:`tasks.language.lm_eval_adapter`, zero-shot, the harness's default metrics and conventions) for every cell
whose model exists; its datasets come from local copies of the dataset repositories (``--lm-eval-data DIR``,
``DIR/cais/mmlu`` ...) or from a Hugging Face cache (``HF_HOME`` with ``HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1``).
The raw harness output of each cell is written to ``<out>/<cell>/lm_eval_results.json``. Without ``lm_eval`` it
falls back to our own scorer for the two perplexities (``--wikitext`` / ``--lambada`` files).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from datetime import datetime, timezone
from importlib.metadata import version

import torch
import yaml
from omegaconf import OmegaConf

from tasks.common.checkpoint import load_checkpoint, model_weights, run_config
from tasks.common.config import model_attention
from tasks.common.utils import system_info
from tasks.language.eval_ppl import EvalSettings, evaluate_lambada, evaluate_wikitext
from tasks.language.lm_eval_adapter import HAVE_LM_EVAL, INSTALL_HELP, TABLE6_TASKS, MHLAEvalLM, run_lm_eval
from tasks.language.longbench import TABLE8_GROUPS, TABLE8_TASKS, run_longbench
from tasks.language.task import build_lm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# lm-eval metric of each Table 6 column: the paper's header (Wino acc, PIQA acc, ARC-c acc_n, OBQA acc_n,
# ARC-e acc_n, BoolQ acc; acc_n = lm-eval's length-normalised ``acc_norm``). MMLU: acc.
TABLE6_COLUMNS = (("mmlu", "mmlu", "acc"), ("wino", "winogrande", "acc"), ("piqa", "piqa", "acc"),
                  ("arc_c", "arc_challenge", "acc_norm"), ("obqa", "openbookqa", "acc_norm"),
                  ("arc_e", "arc_easy", "acc_norm"), ("boolq", "boolq", "acc"))
TABLE6_METRIC = {col: metric for col, _, metric in TABLE6_COLUMNS}
COMMONSENSE = ("wino", "piqa", "arc_c", "obqa", "arc_e", "boolq")


# ------------------------------------------------------------------------------------------ loading

def _import_fla() -> None:
    try:
        import fla  # noqa: F401, PLC0415  (registers GLA / Mamba / ... with the Auto classes)
    except Exception:  # noqa: BLE001
        pass


def _tokenizer_from(path: str | None, stored_cfg: dict | None):
    from transformers import AutoTokenizer  # noqa: PLC0415

    if path:
        return AutoTokenizer.from_pretrained(path)
    spec = ((stored_cfg or {}).get("data") or {}).get("tokenizer")
    if spec and spec != "bpe" and os.path.exists(os.path.expanduser(spec)):
        return AutoTokenizer.from_pretrained(os.path.expanduser(spec))
    raise FileNotFoundError("no tokenizer: pass --tokenizer PATH (the folder of the tokenizer the model was "
                            "trained with, e.g. the Llama 32k tokenizer)")


def load_model(path: str, tokenizer: str | None = None, device: str = "cpu", dtype: str = "float32"):
    """``(model, tokenizer)`` from a ``save_pretrained`` folder or a Trainer checkpoint (file or run dir)."""
    import models.lm  # noqa: F401, PLC0415  (imports transformers; registers MHLALMForCausalLM)

    if not os.path.exists(path):
        raise FileNotFoundError(f"no model at {path}")
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json")):
        from transformers import AutoModelForCausalLM  # noqa: PLC0415

        _import_fla()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        tok = _tokenizer_from(tokenizer or (path if glob.glob(os.path.join(path, "tokenizer*")) else None), None)
        return model.to(device).eval(), tok
    ckpt = path
    if os.path.isdir(path):
        ckpt = next((c for c in (os.path.join(path, "checkpoints", n) for n in ("best.pt", "last.pt"))
                     if os.path.exists(c)), None)
        if ckpt is None:
            raise FileNotFoundError(f"{path} holds neither config.json nor checkpoints/best.pt|last.pt")
    state = load_checkpoint(ckpt, map_location="cpu")
    cfg = run_config(state)
    weights = model_weights(state)  # the EMA weights when the run kept them
    vocab = next(v.shape[0] for k, v in weights.items() if k.endswith("embed_tokens.weight"))
    model = build_lm(cfg.model, model_attention(cfg), vocab)
    model.load_state_dict(weights)
    return model.to(device).eval(), _tokenizer_from(tokenizer, cfg)


# ------------------------------------------------------------------------------------------- tables

def table_cells(table: str) -> list[tuple[str, dict]]:
    out = []
    for p in sorted(glob.glob(os.path.join(ROOT, "configs", "experiment", f"table{table}", "*.yaml"))):
        with open(p) as f:
            out.append((os.path.splitext(os.path.basename(p))[0], (yaml.safe_load(f) or {}).get("paper", {})))
    if not out:
        raise SystemExit(f"no experiment configs under configs/experiment/table{table}/")
    return out


def assumption_notes(table: str = "6") -> list[str]:
    """The ``assumptions:`` of the Table 6 cells' configs (the models Tables 6 and 8 evaluate), as markdown."""
    lines = []
    for p in sorted(glob.glob(os.path.join(ROOT, "configs", "experiment", "table6", "*.yaml"))):
        with open(p) as f:
            notes = (yaml.safe_load(f) or {}).get("assumptions") or {}
        cell = os.path.splitext(os.path.basename(p))[0]
        lines += [f"- `{cell}` ({k}): ASSUMPTION {' '.join(str(v).split())}" for k, v in notes.items() if v]
    if not lines:
        return []
    return ["", f"Model sizes (Table {table} evaluates the models of configs/experiment/table6/; parameters and GMACs "
                "of every cell: results/params.md):", "", *lines]


def _lm_eval_table6(model_path: str, tokenizer: str | None, out_dir: str, batch_size: int, device: str,
                    data_root: str | None = None, limit: int | None = None, max_length: int | None = None) -> dict:
    """Run the harness on Table 6's tasks (:data:`TABLE6_TASKS`); returns ``{column: value}`` for the tasks it
    ran. ``data_root``: local copies of the tasks' dataset repositories (``lm_eval_adapter.local_datasets``)."""
    model, tok = load_model(model_path, tokenizer, device)
    lm = MHLAEvalLM(model=model, tokenizer=tok, batch_size=batch_size, device=device, max_length=max_length)
    out = run_lm_eval(lm, list(TABLE6_TASKS), data_root=data_root, limit=limit)
    res = out["results"]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "lm_eval_results.json"), "w") as f:
        json.dump({"results": res, "versions": out.get("versions"), "n-shot": out.get("n-shot"),
                   "config": out.get("config"), "lm_eval": _lm_eval_version(), "limit": limit}, f, indent=2,
                  default=str)
    return table6_row(res)


def table6_row(res: dict) -> dict:
    """The Table 6 columns from lm-eval's ``results`` (``{task: {"<metric>,none": value}}``): each accuracy with the
    metric of the paper's header (:data:`TABLE6_COLUMNS`), in %; the two perplexities; LAMBADA accuracy."""
    row = {col: 100 * res[task][f"{metric},none"] for col, task, metric in TABLE6_COLUMNS if task in res}
    if "wikitext" in res:
        row["wiki_ppl"] = res["wikitext"]["word_perplexity,none"]
    if "lambada_openai" in res:
        row["lambada_ppl"] = res["lambada_openai"]["perplexity,none"]
        row["lambada_acc"] = 100 * res["lambada_openai"]["acc,none"]
    return row


def _lm_eval_version() -> str | None:
    try:
        return version("lm_eval")
    except Exception:  # noqa: BLE001
        return None


def _write(table: str, header: list[str], rows: list[list[str]], notes: list[str], records: list[dict]) -> str:
    os.makedirs(os.path.join(ROOT, "results"), exist_ok=True)
    lines = [f"# Table {table}", "", *notes, "", f"Machine: {json.dumps(system_info())}", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    md = os.path.join(ROOT, "results", f"table{table}.md")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(ROOT, "results", f"table{table}.json"), "w") as f:
        json.dump({"table": table, "date": datetime.now(timezone.utc).isoformat(), "rows": records}, f, indent=2)
    return md


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
                    ours = _lm_eval_table6(path, args.tokenizer, os.path.join(args.out, cell), args.batch_size,
                                           args.device, data_root=args.lm_eval_data, limit=args.limit,
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
        records.append({"cell": cell, "paper": paper, "ours": ours, "status": status})
    notes = ["340M language models (docs/paper_tables.md#table-6). Accuracies in %, `avg` = mean of the six commonsense columns "
             "(Wino, PIQA, ARC-c, OBQA, ARC-e, BoolQ); Wiki ppl = lm-eval `wikitext` word perplexity; LAMBADA ppl "
             "= `lambada_openai` perplexity. Paper numbers: docs/paper_tables.md; the baselines' commonsense averages come from the authors' "
             "project page (the `paper:` block of each config says so). A `paper` value is blank where neither gives it.",
             "", f"Command: `make reproduce-table6 CKPT_DIR={args.ckpt_dir}"
             + (f" LM_EVAL_DATA={args.lm_eval_data}" if args.lm_eval_data else "") + "`"
             + (f" (lm-evaluation-harness {_lm_eval_version()}, zero-shot"
                + (f", limit {args.limit} examples per task" if args.limit else "") + ")"
                if HAVE_LM_EVAL else " (lm_eval not installed: see below)")]
    notes += ["", "Metrics: each accuracy column is the lm-eval metric of the paper's header, in brackets "
                  "(`acc_n` = lm-eval's length-normalised `acc_norm`): " + ", ".join(
                      f"{col} {task} `{metric}`" for col, task, metric in TABLE6_COLUMNS) + "."]
    notes += assumption_notes("6")
    if not HAVE_LM_EVAL:
        notes += ["", "To fill the accuracy columns:", "", "```", INSTALL_HELP, "```"]
    return _write("6", header, rows, notes, records)


def reproduce_table8(args) -> str:
    header = ["cell", "model", "paper avg (14 tasks)", "ours avg", "status"] + list(TABLE8_TASKS)
    rows, records = [], []
    for cell, paper in table_cells("8"):
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
        rows.append([cell, paper.get("row", ""), _fmt(paper.get("longbench_avg")), _fmt(scores.get("average")),
                     status] + [_fmt(scores.get(t)) for t in TABLE8_TASKS])
        records.append({"cell": cell, "paper": paper, "ours": scores, "status": status})
    groups = "; ".join(f"{g}: " + ", ".join(f"{abbr} = {name}" for abbr, name in tasks)
                       for g, tasks in TABLE8_GROUPS.items())
    notes = [f"LongBench (docs/paper_tables.md#table-8), the paper's 14 tasks in its column order ({groups}), "
             "official prompts, greedy decoding, middle truncation to "
             f"{args.max_length} tokens (prompt + generation), official metrics (LongBench's packages: rouge, fuzzywuzzy, jieba). Paper averages: the paper (docs/paper_tables.md), "
             "and for GLA / Mamba2 the authors' project page. A blank paper value: neither gives it.", "",
             f"Command: `make reproduce-table8 CKPT_DIR={args.ckpt_dir}"
             + (f" LONGBENCH={args.longbench}`" if args.longbench else "` (no LONGBENCH data given)")
             + (f" (limit {args.limit} examples per task)" if args.limit else "")]
    notes += assumption_notes("8")
    return _write("8", header, rows, notes, records)


# ---------------------------------------------------------------------------------------------- CLI

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("ppl", "longbench", "table6", "table8"):
        s = sub.add_parser(name)
        if name in ("ppl", "longbench"):
            s.add_argument("--model", required=True, help="save_pretrained folder or Trainer checkpoint/run dir")
        else:
            s.add_argument("--ckpt-dir", default="", help="folder with one model per cell: <ckpt-dir>/<cell>")
        s.add_argument("--tokenizer", default=None)
        s.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        s.add_argument("--batch-size", type=int, default=8)
        s.add_argument("--out", default=os.path.join(ROOT, "results", "lm_eval" if name != "table8" else "longbench"))
        if name in ("ppl", "table6"):
            s.add_argument("--wikitext", default=None, help="wiki.test.raw / jsonl / saved HF dataset")
            s.add_argument("--lambada", default=None, help="lambada_test.jsonl")
            s.add_argument("--context-len", type=int, default=1, help="1: lm-eval's disjoint windows; >1: sliding")
            s.add_argument("--max-length", type=int, default=None)
            s.add_argument("--limit", type=int, default=None, help="documents / examples per task (smoke runs)")
        if name == "table6":
            s.add_argument("--lm-eval-data", default=os.environ.get("LM_EVAL_DATA") or None,
                           help="folder with local copies of the tasks' dataset repositories, DIR/<org>/<name> "
                                "(default: $LM_EVAL_DATA; else the Hugging Face cache, offline)")
        if name in ("longbench", "table8"):
            s.add_argument("--data" if name == "longbench" else "--longbench", default=None,
                           help="folder with the official LongBench <dataset>.jsonl files")
            s.add_argument("--tasks", nargs="*", default=list(TABLE8_TASKS))
            s.add_argument("--max-length", type=int, default=2048, help="prompt + generation budget (tokens)")
            s.add_argument("--limit", type=int, default=None, help="examples per task (smoke runs)")
    args = p.parse_args(argv)
    if args.cmd == "ppl":
        model, tok = load_model(args.model, args.tokenizer, args.device)
        settings = EvalSettings(max_len=args.max_length, context_len=args.context_len, batch_size=args.batch_size,
                                limit=args.limit)
        out = {}
        if args.wikitext:
            out["wikitext"] = evaluate_wikitext(model, tok, args.wikitext, settings)
        if args.lambada:
            out["lambada"] = evaluate_lambada(model, tok, args.lambada, settings)
        if not out:
            p.error("give --wikitext and/or --lambada")
        print(json.dumps(out, indent=2))
    elif args.cmd == "longbench":
        if not args.data:
            p.error("give --data /path/to/LongBench/data")
        model, tok = load_model(args.model, args.tokenizer, args.device)
        print(json.dumps(run_longbench(model, tok, args.data, args.tasks, max_length=args.max_length,
                                       out_dir=args.out, limit=args.limit, batch_size=args.batch_size), indent=2))
    elif args.cmd == "table6":
        print("wrote", reproduce_table6(args))
        if not HAVE_LM_EVAL:
            print(INSTALL_HELP, file=sys.stderr)
    else:
        print("wrote", reproduce_table8(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
