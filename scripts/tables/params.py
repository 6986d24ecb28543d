"""``results/params.md`` and ``.json`` (``make params``): every table cell's parameters and GMACs, counted on the
model its full-scale config builds (random weights; nothing is downloaded), at the paper's resolution, beside
the paper's number where the paper gives one.

Counting (one implementation each): parameters with :func:`tasks.common.utils.count_parameters`; FLOPs with
:func:`tasks.common.utils.count_flops_split` (``torch.utils.flop_counter``: matmuls, convolutions and softmax
attention, 2 FLOPs per multiply-add; elementwise ops, norms and feature maps not counted), reported as GMACs
(FLOPs / 2, what papers call "FLOPs"), twice: all matmuls, and without the attention matmuls (``Q K^T``, ``P V``,
the ``K^T V`` summaries, MHLA's mixing and query products, a recurrence's matmuls: the FLOPs inside an attention
module that are not in its projections or convolutions). The paper's GFLOPs leave the attention matmuls out:
its column is compared with the second. Where the model runs:

* ViT / VLT / DiT / DiG: on the CPU, one sample at the cell's resolution. DeiT cells zero-pad 224 px to 256 px
  for MHLA's blocks; the paper counts 224 px (196 tokens): the paper-resolution count is the task's own
  (:meth:`tasks.classification.task.ClassificationTask.paper_flop_counts`: the unpadded model, or, where MHLA's
  blocks cannot tile 14 x 14, the exact affine scaling in the token count), the padded one is given too.
* SANA (1024 px: 32 x 32 DC-AE latents, a 300-token caption) and Wan2.1 (81 x 480 x 800: 21 x 60 x 100
  latents, 512 text tokens): built on the CPU, counted on the ``meta`` device (shapes only, no arithmetic: a CPU
  forward of Wan2.1 at 31,500 tokens would take hours). Meta tensors hold no values, so MHLA's check that its
  mixing matrix is finite and nonnegative is skipped there (its shape checks stay).
* The 340M LMs (MHLA, Transformer++): on the CPU, one 2048-token sequence.
* The fla baselines (GLA, Mamba, Mamba2, Gated DeltaNet; fla needs a GPU): analytically
  (:func:`models.lm.baselines.fla_param_count`, equal to fla 0.6.0 on the meta device); their GMACs are the
  projections, MLPs, convs and head only (their recurrences are not counted).

The check: a paper number more than 3% away from ours (ours rounded to the paper's printed precision) must be
marked by an assumption of the cell (``assumptions.size`` for parameters, ``assumptions.flops`` for GFLOPs);
``tests/scripts/test_params_table.py`` fails otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import sys
import time
from datetime import datetime, timezone

import torch
from omegaconf import OmegaConf

from tasks.common.utils import count_flops_split, count_parameters, system_info

from . import config, registry
from .registry import ROOT, Cell
from tasks.common.results import write_result

TOLERANCE = 0.03
OUT = os.path.join(ROOT, "results", "params")
COMMAND = "make params"
DELEGATED = ("5", "6", "8")  # tables whose cells are experiment configs run by their own entry point


def all_cells(tables=None) -> list[tuple[str, Cell]]:
    """``(table, cell)`` of every table with cells: the runner's (derived and extra cells included) and the
    experiment configs of the delegated tables."""
    out = []
    for spec in registry.TABLES.values():
        if tables and spec.id not in tables:
            continue
        if spec.kind == "cells":
            out += [(spec.id, c) for c in registry.table_cells(spec.id)]
        elif spec.id in DELEGATED:
            for p in sorted(glob.glob(os.path.join(registry.EXPERIMENTS, f"table{spec.id}", "*.yaml"))):
                name = os.path.splitext(os.path.basename(p))[0]
                cfg, _ = config.compose([f"experiment=table{spec.id}/{name}"])
                paper = OmegaConf.to_container(cfg.paper, resolve=True)
                out.append((spec.id, Cell(name, [f"experiment=table{spec.id}/{name}"], paper,
                                          os.path.relpath(p, ROOT))))
    return out


@contextlib.contextmanager
def shape_only_mixing_checks():
    """On the meta device MHLA's op cannot check its mixing matrix's values (finite, nonnegative): meta tensors
    hold none. Its shape checks stay; restored on exit."""
    from mhla.ops.mhla import api  # noqa: PLC0415  (the non-causal entry point's check)

    check = api.check_mixing

    def shapes_only(mixing, *args, **kwargs):
        return check(mixing, *args, **{**kwargs, "check_values": False})

    api.check_mixing = shapes_only
    try:
        yield
    finally:
        api.check_mixing = check


def gmacs(counts: dict) -> dict:
    return {"all": counts["total"] / 2e9, "no_attention": (counts["total"] - counts["attention"]) / 2e9}


def _on_meta(model, *inputs, **kwargs) -> dict:
    model = model.to("meta")
    inputs = tuple(x.to("meta") if torch.is_tensor(x) else x for x in inputs)
    kwargs = {k: v.to("meta") if torch.is_tensor(v) else v for k, v in kwargs.items()}
    with shape_only_mixing_checks():
        return count_flops_split(model, *inputs, **kwargs)


def count_model(cfg) -> dict:
    """``{"params", "gmacs": {"all", "no_attention"}, "at", ...}`` of a composed full-scale config's model."""
    kind = cfg.model.get("kind")
    cpu = torch.device("cpu")
    if kind in ("vit", "vlt"):
        from tasks.classification.task import ClassificationTask  # noqa: PLC0415

        task = ClassificationTask(cfg)
        task.check_data = lambda: None  # no ImageNet here: only the model is built
        model = task.build_model()
        x = task.example_input(cpu)
        out = {"params": count_parameters(model), "gmacs": gmacs(count_flops_split(model, x)),
               "at": f"{x.shape[-1]} px"}
        paper = task.paper_flop_counts(model, cpu) if kind == "vit" else None
        if paper is not None:  # DeiT: counted padded; the paper counts the unpadded input
            out.update(gmacs_run=out["gmacs"], at_run=paper[2], gmacs=gmacs(paper[0]), at=paper[1])
        return out
    if kind in ("dit", "dig"):
        from tasks.image_gen.task import ImageGenTask  # noqa: PLC0415

        task = ImageGenTask(cfg)
        task._check_data_root = lambda: None  # no ImageNet here: only the model is built
        model = task.build_model()
        x = task.example_input(cpu)
        return {"params": count_parameters(model), "gmacs": gmacs(count_flops_split(model, *x)),
                "at": f"{cfg.data.image_size} px ({x[0].shape[-1]} x {x[0].shape[-1]} latents, one step)"}
    if kind == "sana":
        from tasks.image_gen.sana_task import SanaFinetuneTask  # noqa: PLC0415

        model = SanaFinetuneTask(cfg).build_model()
        side, text = 32, int(cfg.task.get("text_len", 300))
        n = count_parameters(model)
        counts = _on_meta(model, torch.zeros(1, 32, side, side), encoder_hidden_states=torch.zeros(1, text, 2304),
                          timestep=torch.zeros(1), encoder_attention_mask=torch.ones(1, text, dtype=torch.long),
                          return_dict=False)
        return {"params": n, "gmacs": gmacs(counts), "meta": True,
                "at": f"1024 px ({side} x {side} DC-AE latents, {text}-token caption, one step)"}
    if kind == "wan":
        from tasks.video_gen.task import VideoGenTask  # noqa: PLC0415

        task = VideoGenTask(cfg)
        model = task.build_model()
        n = count_parameters(model)
        shape = task.latent_shape(1)
        counts = _on_meta(model, torch.zeros(shape), torch.zeros(1), torch.zeros(1, 512, int(cfg.model.text_dim)))
        d = cfg.data
        return {"params": n, "gmacs": gmacs(counts), "meta": True,
                "at": f"{d.num_frames} x {d.height} x {d.width} ({'x'.join(map(str, shape[2:]))} latents, "
                      f"{'x'.join(map(str, task.grid))} = {int(torch.tensor(task.grid).prod())} tokens, 512 text "
                      "tokens, one step)"}
    if kind == "lm":
        arch = cfg.model.get("arch", "mhla_lm")
        vocab, ctx = int(cfg.data.get("vocab_size", 32000)), int(cfg.data.seq_len)
        if str(arch).startswith("fla_"):
            from models.lm.baselines import fla_param_count  # noqa: PLC0415

            count = fla_param_count(arch[len("fla_"):], vocab_size=vocab)
            macs = count["macs_per_token"] * ctx / 1e9
            return {"params": count["params"], "gmacs": {"all": None, "no_attention": macs}, "analytic": True,
                    "at": f"one {ctx}-token sequence (analytic: projections, MLPs, convs, head)"}
        from tasks.common.config import model_attention  # noqa: PLC0415
        from tasks.language.task import build_lm  # noqa: PLC0415

        model = build_lm(cfg.model, model_attention(cfg), vocab)  # on the CPU (~30 s): its forward reads tensor values
        counts = count_flops_split(model, input_ids=torch.zeros(1, ctx, dtype=torch.long), use_cache=False)
        return {"params": count_parameters(model), "gmacs": gmacs(counts), "at": f"one {ctx}-token sequence"}
    raise ValueError(f"no parameter / FLOP count for model.kind={kind!r}")


def paper_precision(value) -> float:
    """Half a unit of the last digit the paper prints (5.7 -> 0.05, 22 -> 0.5)."""
    text = str(value)
    return 0.5 * 10 ** -(len(text.split(".")[1]) if "." in text else 0)


def deviation(paper, ours) -> float | None:
    """How far ours is from the paper's number, relative, after rounding ours to the paper's precision (a paper
    that prints 1.1 cannot be told from 1.07); None without both."""
    if paper in (None, "") or ours is None:
        return None
    step = 2 * paper_precision(paper)
    rounded = round(ours / step) * step
    return abs(rounded - float(paper)) / float(paper)


def check(row: dict) -> str:
    """``ok`` / ``assumption (<topic>)`` / ``OFF`` for a row's parameter and GFLOP comparisons."""
    notes = []
    for key, topic in (("params", "size"), ("gmacs", "flops")):
        dev = row["deviation"].get(key)
        if dev is None or dev <= TOLERANCE:
            continue
        notes.append(f"{key} {dev:.1%}: " + ("assumption (" + topic + ")" if topic in row["assumptions"]
                                              else "OFF, not marked"))
    return "; ".join(notes) or ("ok" if any(v is not None for v in row["deviation"].values()) else "")


def build_rows(tables=None, log=print) -> list[dict]:
    """One row per cell (identical models counted once)."""
    rows, done = [], {}
    for table, cell in all_cells(tables):
        cfg, _ = config.compose(cell.overrides)
        key = json.dumps([OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "attn")]
                         + [OmegaConf.to_container(cfg.data, resolve=True)], sort_keys=True, default=str)
        t0 = time.time()
        if key not in done:
            try:
                done[key] = count_model(cfg)
            except Exception as e:  # noqa: BLE001  (one model that cannot be counted must not hide the others)
                done[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        res = done[key]
        paper = cell.paper or {}
        ours_m = res["params"] / 1e6 if res.get("params") else None
        ours_g = (res.get("gmacs") or {}).get("no_attention")
        row = {"table": table, "cell": cell.name, "row": paper.get("row", ""), "source": cell.source,
               "paper_params_M": paper.get("params_M"), "paper_gflops": paper.get("gflops"),
               "params_M": ours_m, **{k: v for k, v in res.items() if k != "params"},
               "assumptions": {k: v for k, v in config.cell_assumptions(cell).items() if k in ("size", "flops")},
               "deviation": {"params": deviation(paper.get("params_M"), ours_m),
                             "gmacs": deviation(paper.get("gflops"), ours_g)}}
        row["check"] = check(row)
        rows.append(row)
        log(f"{table} {cell.name}: {ours_m and round(ours_m, 3)}M params, "
            f"{ours_g and round(ours_g, 3)} GMACs without attention ({time.time() - t0:.1f}s) {row['check']}")
    return rows


def _f(v, digits=2) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def write(rows: list[dict], out: str, argv: list[str], seconds: float) -> str:
    machine = system_info()
    cmd = f"python scripts/count_params.py {' '.join(argv)}".rstrip()
    lines = ["# Parameters and GMACs of every table cell", "",
             f"Command: `{COMMAND}` (`{cmd}`, {seconds:.0f} s)",
             "", f"Machine: {json.dumps(machine)}", "",
             "Every cell's model as its full-scale config builds it (random weights), at the paper's resolution. "
             "**Counting convention**: parameters = every parameter of the model (embeddings and heads "
             "included). GMACs = multiply-adds of one forward pass of one sample (one denoising step for "
             "generation; one 2048-token sequence for the LMs), counted by `torch.utils.flop_counter` "
             "(`tasks.common.utils.count_flops_split`: matmuls, convolutions and softmax attention; elementwise "
             "ops, norms, feature maps and activations not counted), in two ways: **all** matmuls, and **without "
             "the attention matmuls** (QK^T and PV of softmax attention, K^T V summaries, MHLA's mixing and "
             "query products, a recurrence's matmuls: what is inside an attention module and not in its "
             "projections or convolutions). The paper's GFLOPs (fvcore-style MACs) leave the attention matmuls "
             "out: its column is compared with the second. DeiT cells run 224 px zero-padded to 256 px (MHLA's "
             "4 x 4 blocks); the paper counts 224 px unpadded, so that is the count here (the padded one is in "
             "the .json, `gmacs_run`). SANA and Wan2.1 are counted on the meta device (shapes only); the "
             "fla baselines (GLA, Mamba, Mamba2, GDN) analytically (`models/lm/baselines.py fla_param_count`, equal "
             "to fla 0.6.0; GMACs: their projections, MLPs, convs and head, the recurrences not counted).", "",
             f"**Check**: a paper number more than {TOLERANCE:.0%} from ours (ours rounded to the paper's printed "
             "precision) must be explained by an assumption of the cell (`assumptions.size` / `assumptions.flops` "
             "of its config), listed below the table; `tests/scripts/test_params_table.py` fails on an "
             "unexplained one. "
             "Paper numbers: the paper's columns where it prints them (Table 2), the sizes in its row labels and "
             "model names (Tables 4, 5, 6); blank where it gives none. Table 8 evaluates Table 6's checkpoints "
             "(its own row labels, 325-360M, are not compared).", "",
             "| table | cell | row | paper params (M) | ours params (M) | paper GFLOPs | ours GMACs without attention "
             "matmuls | ours GMACs, all | counted at | check |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r.get("gmacs") or {}
        ours = r.get("error") or _f(r["params_M"], 3)
        lines.append(f"| {r['table']} | {r['cell']} | {r['row']} | {r['paper_params_M'] or ''} | {ours} | "
                     f"{r['paper_gflops'] or ''} | {_f(g.get('no_attention'), 3)} | {_f(g.get('all'), 3)} | "
                     f"{r.get('at', '')} | {r['check']} |")
    marked = [r for r in rows if r["assumptions"]]
    if marked:
        lines += ["", "## Assumptions behind the size and FLOP differences", ""]
        lines += [f"- Table {r['table']} `{r['cell']}` ({k}): {v}" for r in marked for k, v in r["assumptions"].items()]
    off = [r for r in rows if "OFF" in r["check"]]
    lines += ["", f"Cells off by more than {TOLERANCE:.0%} without an assumption: "
              + (", ".join(f"{r['table']}/{r['cell']}" for r in off) if off else "none") + "."]
    write_result(out, "\n".join(lines) + "\n", {"command": COMMAND, "argv": argv, "machine": machine,
                                                "date": datetime.now(timezone.utc).isoformat(),
                                                "tolerance": TOLERANCE, "rows": rows}, indent=1, default=str)
    return out + ".md"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", nargs="*", default=None, help="only these tables (default: all)")
    p.add_argument("--out", default=OUT, help="output stem (default results/params)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    rows = build_rows(args.tables)
    print(f"wrote {write(rows, args.out, argv, time.time() - t0)}")
    return 1 if any("OFF" in r["check"] or r.get("error") for r in rows) else 0
