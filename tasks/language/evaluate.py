"""Evaluate trained language models: perplexity, LongBench, and the Table 6 row of one model (lm-evaluation-harness).

    python -m tasks.language.evaluate ppl --model PATH --wikitext /data/wikitext-103-raw/wiki.test.raw \\
        --lambada /data/lambada/lambada_test.jsonl
    python -m tasks.language.evaluate longbench --model PATH --data /data/LongBench/data [--tasks ...]

The Table 6 / Table 8 reproductions (every cell's model, ``results/table6.md`` / ``table8.md``) are
:mod:`scripts.tables.lm_tables` (``make reproduce-table6`` / ``reproduce-table8``, ``python
scripts/reproduce_table.py --table 6|8 -- --ckpt-dir ...``); they evaluate each model with this module.

``--model PATH`` is a ``save_pretrained`` folder (``config.json`` + weights; tokenizer files there or
``--tokenizer``) or a Trainer checkpoint ``.pt`` / run directory (``checkpoints/best.pt``; the model is rebuilt
from the config stored in the checkpoint, the tokenizer comes from ``--tokenizer`` or that config's
``data.tokenizer``). Baselines trained with flash-linear-attention (GLA, Mamba, Mamba2, GDN) load through
``AutoModelForCausalLM`` once ``fla`` is importable.

:func:`lm_eval_table6` runs lm-evaluation-harness (``lm_eval``, installed by ``make install``) through our adapter
(:mod:`tasks.language.lm_eval_adapter`, zero-shot, the harness's default metrics and conventions) on Table 6's
tasks; the datasets come from local copies of the dataset repositories (``DIR/cais/mmlu`` ...) or from a Hugging
Face cache (``HF_HOME`` with ``HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1``). The raw harness output is written to
``<out_dir>/lm_eval_results.json``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from importlib.metadata import version

import torch

from tasks.common.checkpoint import load_checkpoint, model_weights, run_config
from tasks.common.config import model_attention
from tasks.language.eval_ppl import EvalSettings, evaluate_lambada, evaluate_wikitext
from tasks.language.lm_eval_adapter import TABLE6_TASKS, MHLAEvalLM, run_lm_eval
from tasks.language.longbench import TABLE8_TASKS, run_longbench
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


# ------------------------------------------------------------------------------------------- Table 6 row

def lm_eval_table6(model_path: str, tokenizer: str | None, out_dir: str, batch_size: int, device: str,
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
                   "config": out.get("config"), "lm_eval": lm_eval_version(), "limit": limit}, f, indent=2,
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


def lm_eval_version() -> str | None:
    try:
        return version("lm_eval")
    except Exception:  # noqa: BLE001
        return None


# ---------------------------------------------------------------------------------------------- CLI

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("ppl", "longbench"):
        s = sub.add_parser(name)
        s.add_argument("--model", required=True, help="save_pretrained folder or Trainer checkpoint/run dir")
        s.add_argument("--tokenizer", default=None)
        s.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        s.add_argument("--batch-size", type=int, default=8)
        s.add_argument("--out", default=os.path.join(ROOT, "results", "lm_eval" if name == "ppl" else "longbench"))
        if name == "ppl":
            s.add_argument("--wikitext", default=None, help="wiki.test.raw / jsonl / saved HF dataset")
            s.add_argument("--lambada", default=None, help="lambada_test.jsonl")
            s.add_argument("--context-len", type=int, default=1, help="1: lm-eval's disjoint windows; >1: sliding")
            s.add_argument("--max-length", type=int, default=None)
            s.add_argument("--limit", type=int, default=None, help="documents / examples per task (smoke runs)")
        else:
            s.add_argument("--data", default=None, help="folder with the official LongBench <dataset>.jsonl files")
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
    else:
        if not args.data:
            p.error("give --data /path/to/LongBench/data")
        model, tok = load_model(args.model, args.tokenizer, args.device)
        print(json.dumps(run_longbench(model, tok, args.data, args.tasks, max_length=args.max_length,
                                       out_dir=args.out, limit=args.limit, batch_size=args.batch_size), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
