"""What each paper table is and runs: its spec (:class:`Table`, ``TABLES``), the entry points the delegated
tables hand over to, the benchmarks across M (``BENCH``), its cells (:func:`table_cells`), and everything that
lists the tables, rendered from ``TABLES``: the ``--list`` index, which is also the README's "Paper tables"
index (:func:`index_table`, :func:`update_readme`), and the ``make help`` lines (:func:`make_help`). The
Makefile has one pattern rule for every ``make reproduce-table<id>``, so a new table is its experiment configs
plus one ``Table`` here (docs/adding_a_table.md)."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")
EXPERIMENTS = os.path.join(CONFIGS, "experiment")


# ------------------------------------------------------------------------------------------------ the tables
MINI = "every cell composed with scale=mini/<model> (configs/scale/mini/), on the CPU"


@dataclass(frozen=True)
class Table:
    id: str
    title: str
    kind: str                            # cells: train.py per cell | delegate: another entry point | bench
    folder: str | None = None            # configs/experiment/<folder>/
    stem: str | None = None              # results/<stem>[_mini]; default table<id>
    seeds: tuple[int, ...] = ()          # default --seeds
    mini: str | None = MINI              # what SCALE=mini runs; None: no CPU proxy (the reason is in `needs`)
    derived: str | None = None           # the sweep the cells come from while the folder does not exist
    bench: str | None = None             # BENCH key measured with (or as) the table
    cfg_scales: tuple[float, ...] = (1.0,)  # image generation: guidance scales sampled for FID
    needs: str = ""                      # what the full scale needs, in short for --list (each cell's config
    #                                      declares its inputs: `inputs:`, checked by config.check_config)
    status: str = ""                     # what of it is committed in results/ (--list, README index)
    usage: str | None = None             # the make variables it takes, as `make help` shows them; None: the
    #                                      usual ones ([SCALE=mini] where it has a CPU proxy)

    def results_stem(self, scale: str) -> str:
        return (self.stem or f"table{self.id}") + ("_mini" if scale == "mini" else "")


TABLES = {t.id: t for t in (
    Table("2", "ImageNet-1K classification: DeiT-T/S and MHLA-VLT (top-1)", "cells", folder="table2",
          mini="the seeded proxy (its options in EXTRA, e.g. EXTRA='--resume'): MNIST at 256 tokens, every "
               "attention x 3 seeds (~80 min on 2 cores) + Fig. 3 -> results/analysis/",
          needs="ImageNet, GPUs", status="CPU proxy committed (`table2_mini.md`)"),
    Table("3a", "class-conditional ImageNet generation: DiT / DiG S-XL at 256 / 512 px (FID-50K)", "cells",
          folder="table3", stem="table3", needs="ImageNet, SD-VAE, ADM FID references (256 and 512 px), GPUs",
          usage="[SCALE=mini] [REF=...]", status="CPU proxy committed (`table3_mini.md`, `.png`)"),
    Table("3b", "DiT-XL/2 fast adaptation from the released weights (FID-50K, IS, sFID; cfg 1.5)", "cells",
          folder="table3b", mini=None, cfg_scales=(1.0, 1.5),
          needs="DiT-XL-2-256x256.pt, ImageNet, SD-VAE, ADM 256 px reference, GPUs",
          usage="EXTRA='model.pretrained=DiT-XL-2-256x256.pt data.root=... data.vae_path=...' REF=256=...",
          status="no CPU proxy; the self-attention baseline is the released weights, evaluated only"),
    Table("4", "SANA-0.6B fine-tuned with MHLA (FID, CLIP, GenEval)", "cells", folder="table4",
          needs="SANA-0.6B diffusers weights, caption latents, MJHQ-30K, CLIP, GenEval, GPUs",
          usage="[SCALE=mini] EXTRA='model.pretrained=... task.data_root=...'",
          status="CPU proxy runs, not committed"),
    Table("5", "Wan2.1-1.3B video generation (VBench, latency)", "delegate",
          mini="the video_mini model: softmax / linear / MHLA / hybrid",
          needs="Wan2.1-T2V-1.3B-Diffusers weights, a video dataset, VBench, GPUs",
          usage="WAN_PATH=... VIDEO_DATA=... [RUN=--run], or SCALE=mini",
          status="CPU proxy committed (`table5_mini.md`: eval loss, prompt following, latency, frames); `table5.md`: "
                 "the paper's numbers, the commands, CPU latency; `table5.png`: latency ratios"),
    Table("6", "340M language models (commonsense, MMLU, Wiki / LAMBADA ppl)", "delegate", mini=None,
          needs="trained 340M models (CKPT_DIR), lm-eval, WikiText / LAMBADA",
          usage="CKPT_DIR=... [LM_EVAL_DATA=...] [WIKITEXT=...] [LAMBADA=...]",
          status="the committed file has no numbers of ours"),
    Table("7a", "ablation: mixing init x learnability on DeiT-T (top-1)", "cells", folder="table7a",
          derived="configs/sweep/mhla_init.yaml", needs="ImageNet, GPUs",
          status="CPU proxy in the Table 2 convergence grid (3 seeds per row)"),
    Table("7b", "ablation: DiT-S/2 512 px, M = 4 / 16 / 64 (FID, throughput)", "cells", folder="table7b",
          derived="configs/sweep/dit_blocks.yaml", bench="7b",
          needs="ImageNet, SD-VAE, ADM 512 px reference, GPUs", usage="[SCALE=mini] [REF=512=...]",
          status="CPU proxy runs, not committed"),
    Table("8", "LongBench, 14 tasks (average)", "delegate", mini=None,
          needs="trained 340M models (CKPT_DIR), LongBench data", usage="CKPT_DIR=... LONGBENCH=...",
          status="the committed file has no numbers of ours"),
    Table("11", "DiT-S/B/L/XL-2 256 px MHLA against LiT (quoted), three seeds (FID-50K mean ± std)", "cells",
          folder="table11", seeds=(0, 1, 2), needs="ImageNet, SD-VAE, ADM 256 px reference, GPUs",
          usage="[SCALE=mini] [SEEDS='0 1 2'] [REF=256=...]",
          status="CPU proxy committed (`table11_mini.md`: 3 seeds per cell)"),
    Table("12", "DiT-S/2 256 px module ablation: CPE / gate (FID-50K)", "cells", folder="table12",
          needs="ImageNet, SD-VAE, ADM 256 px reference, GPUs", usage="[SCALE=mini] [REF=256=...]",
          status="CPU proxy runs, not committed"),
    Table("13", "high-resolution DeiT-T: 384 / 512 px (top-1)", "cells", folder="table13",
          needs="ImageNet, GPUs", status="CPU proxy runs, not committed"),
    Table("14", "profiling: DiT-S/2 latency across M", "bench", bench="14", needs="a GPU",
          mini="the latency at 512 px on this CPU", usage="[SCALE=mini] [EXTRA='--bench-batch 8']",
          status="the CPU run (512 px) is not committed"),
    Table("mqar", "MQAR: softmax vs linear vs MHLA (not a paper table)", "delegate",
          mini="the CI-size grid (N = 32, K = 2; about 10 min); SCALE=large: more cells, widths and seeds",
          needs="nothing: runs on the CPU (SCALE=mini|full|large)",
          usage="[SCALE=mini|full|large]", status="runs at full scale on the CPU, committed (`mqar.md`)"),
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
           # the paper's Table 14 (left half, DiT-S/2, column N = 4096): latency in ms and memory in GB per M
           "paper": {4: 147, 16: 145, 64: 148, 256: 157, 1024: 219},
           "paper_memory_gb": {4: 20.8, 16: 21.0, 64: 21.7, 256: 25.4, 1024: 40.0}},
    "7b": {"model": "DiT-S/2", "cpe_gate": True, "full": (512, (4, 16, 64)), "mini": (512, (4, 16, 64)),
           "paper_key": "throughput (img/s)", "paper": {4: 435, 16: 435, 64: 408}},
}


# What the tables report: a metric's label in the results files and plots; PERCENT: stored as fractions, shown in %.
LABELS = {"top1": "top-1", "ema_top1": "top-1 of the EMA", "top5": "top-5", "fid": "FID", "fid_cfg": "FID (cfg 1.5)", "is": "IS",
          "inception_score": "IS", "inception_score_cfg": "IS (cfg 1.5)", "sfid": "sFID", "sfid_cfg": "sFID (cfg 1.5)",
          "precision": "precision", "recall": "recall", "clip": "CLIP", "geneval": "GenEval",
          "is_cfg": "IS (cfg 1.5)", "precision_cfg": "precision (cfg 1.5)", "recall_cfg": "recall (cfg 1.5)",
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
                  # the paper's Tables 3b and 9, row "Self Attention" of DiT-XL/2 and of DiT-XL/2(G) (guided: *_cfg)
                  "fid": 9.62, "fid_cfg": 2.27, "is": 121.50, "sfid": 6.85, "is_cfg": 278.24, "sfid_cfg": 4.60,
                  "precision": 0.67, "recall": 0.67, "precision_cfg": 0.83, "recall_cfg": 0.57},
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


# ------------------------------------------------------------------- --list, the README index, make help
README = os.path.join(ROOT, "README.md")
README_BEGIN = "<!-- paper tables: begin (written by scripts/reproduce_table.py --update-readme) -->"
README_END = "<!-- paper tables: end -->"


def make_target(spec: Table) -> str:
    """``make reproduce-table<id>`` (MQAR: ``make reproduce-mqar``); the Makefile's ``reproduce-%`` rule runs every
    one of them."""
    return "make reproduce-" + ("mqar" if spec.id == "mqar" else f"table{spec.id}")


def make_command(spec: Table) -> str:
    """The make target with the variables the table takes (``usage``; by default ``[SCALE=mini]`` where it has a
    CPU proxy)."""
    usage = spec.usage if spec.usage is not None else ("[SCALE=mini]" if spec.mini else "")
    return f"{make_target(spec)} {usage}".rstrip()


def results_files(spec: Table) -> str:
    if spec.id == "mqar":
        return "results/mqar[_mini|_large].md"
    return f"results/{spec.results_stem('full')}" + ("" if spec.mini is None else "[_mini]") + ".md"


def entry_point(spec: Table) -> str:
    """Where a table's runs come from: its cell configs (or the sweep they are derived from), its own driver, or
    the benchmark."""
    if spec.kind == "delegate":
        module, lead = DELEGATES[spec.id]
        return f"`{' '.join([delegate_path(module), *lead])}`" + (
            f" (mini: `{delegate_path(DELEGATES_MINI[spec.id][0])}`)" if spec.id in DELEGATES_MINI else "")
    if spec.kind == "bench":
        return "`scripts/bench_models.py` timing"
    if glob.glob(os.path.join(EXPERIMENTS, spec.folder, "*.yaml")):
        return f"`configs/experiment/{spec.folder}/`"
    if spec.derived:
        return f"`{spec.derived}` (derived)"
    return f"`configs/experiment/{spec.folder}/` (no cells yet)"


def index_table() -> str:
    """The index of the tables as a markdown table: ``--list`` prints it, the README holds it (between
    ``README_BEGIN`` and ``README_END``; ``tests/scripts/test_table_index.py`` checks that they agree)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| table | what | cells or driver | command | results | status | full scale needs |",
             "|---|---|---|---|---|---|---|"]
    for spec in TABLES.values():
        lines.append("| " + " | ".join(cell(x) for x in (
            spec.id, spec.title, entry_point(spec), f"`{make_command(spec)}`", f"`{results_files(spec)}`",
            spec.status, spec.needs)) + " |")
    return "\n".join(lines)


def make_help() -> str:
    """The ``make help`` lines of the tables, one per table (and its CPU proxy when it is not the usual one)."""
    width = max(len(make_target(spec)) for spec in TABLES.values()) + 1
    lines = []
    for spec in TABLES.values():
        usage = make_command(spec)[len(make_target(spec)):].strip()
        alias = [f"reproduce-table{a}" for a, t in ALIASES.items() if t == spec.id]
        what = spec.title if spec.id == "mqar" else f"Table {spec.id}: {spec.title}"
        alias += ["make mqar"] if spec.id == "mqar" else []  # the Makefile's short name for it
        lines.append(f"{make_target(spec):<{width}} {usage + ' - ' if usage else '- '}{what}"
                     + "".join(f" (= {a})" for a in alias) + f" -> {results_files(spec)}")
        if spec.mini not in (None, MINI):
            lines.append(f"    SCALE=mini: {spec.mini}")
    return "\n".join(lines)


def readme_with_index(text: str) -> str:
    """``text`` (the README) with the index between its markers replaced by :func:`index_table`."""
    if README_BEGIN not in text or README_END not in text:
        raise ValueError(f"README.md has no {README_BEGIN!r} ... {README_END!r} block")
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    return f"{head}{README_BEGIN}\n{index_table()}\n{README_END}{tail}"


def update_readme(path: str = README) -> bool:
    """Write the index into the README (``--update-readme``); True when it changed."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    new = readme_with_index(text)
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return new != text
