"""What each paper table is and runs: its spec (:class:`Table`, ``TABLES``), the entry points the delegated
tables hand over to, the benchmarks across M (``BENCH``), its cells (:func:`table_cells`) and the ``--list``
index."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")
EXPERIMENTS = os.path.join(CONFIGS, "experiment")


# ------------------------------------------------------------------------------------------------ the tables
@dataclass(frozen=True)
class Table:
    id: str
    title: str
    kind: str                            # cells: train.py per cell | delegate: another entry point | bench
    folder: str | None = None            # configs/experiment/<folder>/
    stem: str | None = None              # results/<stem>[_mini]; default table<id>
    seeds: tuple[int, ...] = ()          # default --seeds
    mini: str | None = "proxy"           # None: no CPU proxy (the reason is in `needs`)
    derived: str | None = None           # the sweep the cells come from while the folder does not exist
    bench: str | None = None             # BENCH key measured with (or as) the table
    cfg_scales: tuple[float, ...] = (1.0,)  # image generation: guidance scales sampled for FID
    needs: str = ""                      # what the full scale needs, in short for --list (each cell's config
    #                                      declares its inputs: `inputs:`, checked by config.check_config)

    def results_stem(self, scale: str) -> str:
        return (self.stem or f"table{self.id}") + ("_mini" if scale == "mini" else "")


TABLES = {t.id: t for t in (
    Table("2", "ImageNet-1K classification: DeiT-T/S and MHLA-VLT (top-1)", "cells", folder="table2",
          needs="ImageNet, GPUs"),
    Table("3a", "class-conditional ImageNet generation: DiT / DiG S-XL at 256 / 512 px (FID-50K)", "cells",
          folder="table3", stem="table3", needs="ImageNet, SD-VAE, ADM FID references (256 and 512 px), GPUs"),
    Table("3b", "DiT-XL/2 fast adaptation from the released weights (FID-50K, IS, sFID; cfg 1.5)", "cells",
          folder="table3b", mini=None, cfg_scales=(1.0, 1.5),
          needs="DiT-XL-2-256x256.pt, ImageNet, SD-VAE, ADM 256 px reference, GPUs"),
    Table("4", "SANA-0.6B fine-tuned with MHLA (FID, CLIP, GenEval)", "cells", folder="table4",
          needs="SANA-0.6B diffusers weights, caption latents, MJHQ-30K, CLIP, GenEval, GPUs"),
    Table("5", "Wan2.1-1.3B video generation (VBench, latency)", "delegate", mini="video_mini",
          needs="Wan2.1-T2V-1.3B-Diffusers weights, a video dataset, VBench, GPUs"),
    Table("6", "340M language models (commonsense, MMLU, Wiki / LAMBADA ppl)", "delegate", mini=None,
          needs="trained 340M models (CKPT_DIR), lm-eval, WikiText / LAMBADA"),
    Table("7a", "ablation: mixing init x learnability on DeiT-T (top-1)", "cells", folder="table7a",
          derived="configs/sweep/mhla_init.yaml", needs="ImageNet, GPUs"),
    Table("7b", "ablation: DiT-S/2 512 px, M = 4 / 16 / 64 (FID, throughput)", "cells", folder="table7b",
          derived="configs/sweep/dit_blocks.yaml", bench="7b",
          needs="ImageNet, SD-VAE, ADM 512 px reference, GPUs"),
    Table("8", "LongBench, 14 tasks (average)", "delegate", mini=None,
          needs="trained 340M models (CKPT_DIR), LongBench data"),
    Table("11", "DiT-S/B/L/XL-2 256 px MHLA against LiT (quoted), three seeds (FID-50K mean ± std)", "cells",
          folder="table11", seeds=(0, 1, 2), needs="ImageNet, SD-VAE, ADM 256 px reference, GPUs"),
    Table("12", "DiT-S/2 256 px module ablation: CPE / gate (FID-50K)", "cells", folder="table12",
          needs="ImageNet, SD-VAE, ADM 256 px reference, GPUs"),
    Table("13", "high-resolution DeiT-T: 384 / 512 px (top-1)", "cells", folder="table13",
          needs="ImageNet, GPUs"),
    Table("14", "profiling: DiT-S/2 latency across M", "bench", bench="14", needs="a GPU"),
    Table("mqar", "MQAR: softmax vs linear vs MHLA (not a paper table)", "delegate",
          needs="nothing: runs on the CPU (SCALE=mini|full|large)"),
)}
ALIASES = {"3": "3a"}
# Tables with a driver of their own (in this package: their runs, or the evaluation of given models, and their
# results files): table -> (module, leading arguments); its main(argv) gets them, then the arguments after --.
DELEGATES = {
    "5": ("scripts.tables.table5", []),           # Wan2.1 fine-tunes (commands, or --run) and the latency table
    "6": ("scripts.tables.lm_tables", ["table6"]),  # lm-evaluation-harness on the trained 340M models
    "8": ("scripts.tables.lm_tables", ["table8"]),  # LongBench on the same models
    "mqar": ("scripts.tables.mqar", []),          # the MQAR grid (also scripts/run_mqar.py)
}
DELEGATES_MINI = {  # the CPU proxy's own driver where it differs from the full table's
    "5": ("scripts.tables.table5_mini", []),      # the video_mini model: softmax / linear / MHLA / hybrid
}
# What a delegate's --plot-only / --rewrite become (forwarded to its driver; others take neither).
DELEGATE_REDRAW = {"5": "--plot-only", "mqar": "--plot-only"}


def delegate_path(module: str) -> str:
    """``scripts/tables/table5.py`` for ``scripts.tables.table5``."""
    return module.replace(".", "/") + ".py"


# Benchmarks across M (Table 14, Table 7b's throughput): DiT forward time with scripts/bench_models.py's timing.
# Full scale on the GPU at the paper's size; mini on this CPU (Table 14 at 512 px instead of 1024 px).
BENCH = {
    "14": {"model": "DiT-S/2", "cpe_gate": False, "full": (1024, (4, 16, 64, 256, 1024)),
           "mini": (512, (4, 16, 64, 256)), "paper_key": "latency (ms)",
           "paper": {4: "145-157 (range, M <= 256)", 16: "145-157 (range, M <= 256)",
                     64: "145-157 (range, M <= 256)", 256: "145-157 (range, M <= 256)", 1024: "219"}},
    "7b": {"model": "DiT-S/2", "cpe_gate": True, "full": (512, (4, 16, 64)), "mini": (512, (4, 16, 64)),
           "paper_key": "throughput (img/s)", "paper": {4: 435, 16: 435, 64: 408}},
}


# What the tables report: a metric's label in the results files and plots; PERCENT: stored as fractions, shown in %.
LABELS = {"top1": "top-1", "ema_top1": "top-1 of the EMA", "top5": "top-5", "fid": "FID", "fid_cfg": "FID (cfg 1.5)", "is": "IS",
          "inception_score": "IS", "inception_score_cfg": "IS (cfg 1.5)", "sfid": "sFID", "sfid_cfg": "sFID (cfg 1.5)",
          "precision": "precision", "recall": "recall", "clip": "CLIP", "geneval": "GenEval",
          "throughput": "throughput (img/s)", "loss": "held-out loss (proxy)", "mse": "eps-MSE",
          "latency_s": "latency (s)", "lit_fid": "LiT FID (quoted)", "params_M": "params (M)",
          "gflops": "GFLOPs (MACs)"}
PERCENT = ("top1", "ema_top1", "top5")


def table_spec(table: str) -> Table:
    key = ALIASES.get(str(table), str(table))
    if key not in TABLES:
        raise SystemExit(f"unknown table {table!r}; tables: {', '.join(TABLES)} (3 = 3a)")
    return TABLES[key]


@dataclass
class Cell:
    name: str
    overrides: list[str]                 # what selects the cell (before scale, seed and the extra overrides)
    paper: dict
    source: str                          # the config it comes from
    eval_only: bool = False              # no training: evaluate released weights
    notes: list[str] = field(default_factory=list)


class NoCells(Exception):
    """A table whose cells do not exist (yet)."""


def derived_cells(table: str) -> list[Cell]:
    """Table 7a / 7b cells while ``configs/experiment/table7a|7b/`` do not exist: the grids of the sweeps
    ``configs/sweep/mhla_init.yaml`` / ``dit_blocks.yaml`` applied to the Table 2 / Table 3 cell they vary."""
    if table == "7a":  # the 75.8 cell is Table 2's DeiT-T MHLA cell (CPE kept, as the sweep does)
        rows = (("uniform_learnable", "uniform", "true", "uniform init, learnable", 75.4),
                ("locality_frozen", "locality", "false", "locality init, frozen", 75.1),
                ("locality_learnable", "locality", "true", "locality init, learnable (= Table 2 DeiT-T MHLA)", 75.8))
        return [Cell(f"deit_t_mhla_{name}", ["experiment=table2/deit_t_mhla", f"attn.mixing_init={init}",
                                             f"attn.mixing_learnable={learn}"],
                     {"table": "7a", "row": row, "top1": top1}, "configs/sweep/mhla_init.yaml on table2/deit_t_mhla")
                for name, init, learn, row, top1 in rows]
    if table == "7b":  # DiT-S/2 512 px with CPE + gate (the Table 3a cell), M = 4 / 16 / 64
        return [Cell(f"dit_s2_512_mhla_m{m}", ["experiment=table3/dit_s2_512_mhla", f"attn.num_blocks={m}"],
                     {"table": "7b", "row": f"DiT-S/2 512 MHLA M = {m}", "fid": fid, "throughput": thr},
                     "configs/sweep/dit_blocks.yaml on table3/dit_s2_512_mhla")
                for m, fid, thr in ((4, 79.56, 435), (16, 78.63, 435), (64, 79.50, 408))]
    return []


def extra_cells(table: str) -> list[Cell]:
    """Cells a table has besides its experiment files: Table 3b's self-attention DiT-XL/2, the released weights
    evaluated as they are (the paper's 9.62 / 2.27 are DiT's own numbers for them)."""
    if table != "3b":
        return []
    return [Cell("dit_xl2_256_softmax_pretrained",
                 ["experiment=table3b/dit_xl2_256_mhla_finetune", "attn=softmax"],
                 {"table": "3b", "row": "DiT-XL/2 256 self-attention (released weights, not fine-tuned)",
                  "fid": 9.62, "fid_cfg": 2.27},
                 "table3b/dit_xl2_256_mhla_finetune with attn=softmax, evaluated without training", eval_only=True,
                 notes=["`dit_xl2_256_softmax_pretrained` trains nothing: the `model.pretrained` weights are loaded "
                        "into the softmax DiT-XL/2, saved as a checkpoint and sampled like the other cells."])]


def table_cells(table: str) -> list[Cell]:
    """The table's cells: its experiment files (else the derived cells), plus its extra cells."""
    spec = table_spec(table)
    out: list[Cell] = []
    if spec.folder:
        for p in sorted(glob.glob(os.path.join(EXPERIMENTS, spec.folder, "*.yaml"))):
            try:
                with open(p) as f:
                    paper = (yaml.safe_load(f) or {}).get("paper") or {}
            except (OSError, yaml.YAMLError):
                paper = {}  # a file being written: composing it reports the error
            name = os.path.splitext(os.path.basename(p))[0]
            out.append(Cell(name, [f"experiment={spec.folder}/{name}"], paper, os.path.relpath(p, ROOT)))
    if not out:
        out = derived_cells(spec.id)
    names = {c.name for c in out}
    out += [c for c in extra_cells(spec.id) if c.name not in names]
    if not out:
        raise NoCells(f"Table {spec.id} ({spec.title}): no cells yet. configs/experiment/{spec.folder}/ has no "
                      f"experiment files; each cell is configs/experiment/{spec.folder}/<cell>.yaml with a `paper:` "
                      f"block (being added). Nothing was run.")
    return out


def stem_path(spec: Table, args) -> str:
    """``<results dir>/<table>[_mini]`` (``--results-dir``, default ``results/``): the .md and .json without
    their extension."""
    out_dir = getattr(args, "results_dir", None) or os.path.join(ROOT, "results")
    return os.path.join(out_dir, spec.results_stem(args.scale))


def cells(table: str) -> list[tuple[str, dict]]:
    """``[(cell, paper block)]`` of a table."""
    try:
        return [(c.name, c.paper) for c in table_cells(table)]
    except NoCells as e:
        raise SystemExit(str(e)) from None


# ---------------------------------------------------------------------------------------------- --list
def make_target(spec: Table) -> str:
    return "make reproduce-" + ("mqar" if spec.id == "mqar" else f"table{spec.id}")


def results_files(spec: Table) -> str:
    if spec.id == "mqar":
        return "results/mqar[_mini|_large].md"
    return f"results/{spec.results_stem('full')}" + ("" if spec.mini is None else "[_mini]") + ".md"


def list_tables() -> str:
    lines = ["| table | what | kind | config / entry point | command | results | full scale needs |",
             "|---|---|---|---|---|---|---|"]
    for spec in TABLES.values():
        if spec.kind == "delegate":
            module, lead = DELEGATES[spec.id]
            where = " ".join([delegate_path(module), *lead]) + (
                f" (mini: {delegate_path(DELEGATES_MINI[spec.id][0])})" if spec.id in DELEGATES_MINI else "")
        elif spec.kind == "bench":
            where = "scripts/bench_models.py timing"
        else:
            try:
                n = len(table_cells(spec.id))
                derived = not glob.glob(os.path.join(EXPERIMENTS, spec.folder, "*.yaml"))
                where = (f"{spec.derived} (derived)" if derived and spec.derived
                     else f"configs/experiment/{spec.folder}/") + f", {n} cells"
            except NoCells:
                where = f"configs/experiment/{spec.folder}/ (no cells yet)"
        lines.append(f"| {spec.id} | {spec.title} | {spec.kind} | {where} | {make_target(spec)}"
                     f"{'' if spec.mini is None else ' [SCALE=mini]'} | {results_files(spec)} | {spec.needs} |")
    return "\n".join(lines)

