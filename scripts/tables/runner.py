"""Launching runs: one cell of a table (:func:`run_cell`: ``train.py`` under torchrun on the GPUs, then FID
for image generation; or its CPU proxy), an evaluation-only cell's export of released weights
(:func:`export_pretrained`), the FID sampling (:func:`sample_fid`) and the delegated entry points
(:func:`delegate`)."""

from __future__ import annotations

import importlib
import os
import subprocess
import time

import torch
from omegaconf import OmegaConf

from scripts import eval_fid
from tasks.common.checkpoint import atomic_save
from tasks.common.config import model_attention, run_settings, settings_tag
from tasks.common.launch import run_training

from . import config, registry
from .registry import ROOT, Cell, Table


def gpu_count() -> int:
    try:
        return torch.cuda.device_count()
    except Exception:
        return 0


def run_dir_for(spec: Table, cell: Cell, args, tag: str) -> str:
    """``outputs/<table>[_mini]/<cell>/<settings tag>``: the tag (:func:`tasks.common.config.settings_tag` of the
    run's composed config: model, resolution, attention, M, seed, schedule) keeps two seeds, or a run with other
    overrides, out of each other's folder; the same command finds its folder again (``trainer.resume=auto``)."""
    return os.path.join(ROOT, "outputs", spec.results_stem(args.scale), cell.name, tag)


def run_cell(table: str, cell, args, seed: int | None = None) -> dict:
    """Train one cell (full: torchrun on the GPUs, then FID for image generation; mini: its CPU proxy) and
    return its record (``metrics`` or ``error``)."""
    spec = registry.table_spec(table)
    if isinstance(cell, str):
        cell = next((c for c in registry.table_cells(spec.id) if c.name == cell), None) or Cell(
            cell, [f"experiment={spec.folder}/{cell}"], {}, "")
    scale, extra = args.scale, list(getattr(args, "extra", []) or [])
    base = {"cell": cell.name, **({"seed": seed} if seed is not None else {})}
    try:
        info = config.cell_info(cell)
    except Exception as e:  # noqa: BLE001
        return {**base, "seconds": 0.0, "error": f"the config does not compose: {str(e).splitlines()[0]}"}
    base.update(kind=info["kind"], num_blocks=info["num_blocks"], image_size=info["image_size"])
    overrides = list(cell.overrides)
    if scale == "mini":
        if spec.mini is None or cell.eval_only:
            return {**base, "seconds": 0.0, "error": f"no CPU proxy for this cell ({spec.needs or 'see --list'})"}
        try:
            overrides.append(f"scale={config.mini_option(info)}")
        except ValueError as e:
            return {**base, "seconds": 0.0, "error": str(e)}
    if seed is not None:
        overrides.append(f"seed={seed}")
    try:
        settings = run_settings(config.compose([*overrides, *extra])[0])
    except Exception as e:  # noqa: BLE001
        return {**base, "seconds": 0.0, "error": f"the config does not compose: {str(e).splitlines()[0]}"}
    run_dir = run_dir_for(spec, cell, args, settings_tag(settings))
    base.update(settings=settings, run_dir=os.path.relpath(run_dir, ROOT))
    overrides += [f"hydra.run.dir={run_dir}", *extra]
    problem = config.check_config(spec, overrides, scale, args)
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
    if scale == "full" and info["kind"] == "generation" and not getattr(args, "no_fid", False):
        for cfg_scale in spec.cfg_scales:
            suffix = "" if cfg_scale == 1.0 else "_cfg"
            fid = sample_fid(spec, cell, run_dir, n, info["image_size"], cfg_scale, args)
            if fid.get("samples"):
                rec.setdefault("samples", []).append(fid.pop("samples"))
            rec["metrics"].update({k + suffix: v for k, v in fid.items()})
    if scale == "full" and info["kind"] == "sana":
        rec["todo"] = (f"FID / CLIP / GenEval: torchrun --nproc_per_node={n} -m tasks.image_gen.sana_sample --ckpt "
                       f"{run_dir} --pipeline <Sana_600M_1024px_diffusers> --prompts <MJHQ-30K meta_data.json> "
                       f"--clip <clip-vit-large-patch14> --reference <MJHQ-30K/images> (docs/tasks/image_generation.md#sana)")
        print("  " + rec["todo"], flush=True)
    return rec


def export_pretrained(overrides: list[str], run_dir: str) -> dict:
    """An evaluation-only cell: build the cell's model with ``model.pretrained`` loaded and save it as a
    ``train.py`` checkpoint (step 0, no EMA) at ``<run_dir>/checkpoints/last.pt`` for the sampler."""
    t0 = time.time()
    rec = {"command": "python scripts/reproduce_table.py (export) " + " ".join(overrides)}
    try:
        from models.dit import build_dit  # noqa: PLC0415  (models/ pulls in timm)

        cfg, _ = config.compose(overrides)
        model = build_dit(cfg.model, model_attention(cfg))
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
    reference of another image size). The samples go to ``samples/<table>/<cell>/<run name>`` (the sampler's run
    name: the run's settings, its step and the sampling settings); ``"samples"`` in the result is that folder."""
    refs = getattr(args, "fid_refs", None) or {}
    ref = refs.get(int(image_size or 0))
    if not ref:
        print(f"  no --fid-ref for {image_size} px (e.g. --fid-ref {image_size}=/data/VIRTUAL_imagenet{image_size}"
              f"{'_labeled' if image_size == 256 else ''}.npz): FID skipped", flush=True)
        return {}
    cmd = ["torchrun", f"--nproc_per_node={n}", "-m", "tasks.image_gen.sample", "--ckpt",
           os.path.join(run_dir, "checkpoints", "last.pt"), "--num-samples", "50000", "--steps", "250",
           "--cfg-scale", f"{cfg_scale:g}", "--out", os.path.join(ROOT, "samples", spec.results_stem(args.scale),
                                                                   cell.name)]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wrote = [line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("wrote ")]
    if proc.returncode != 0 or not wrote:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        print(f"  sampling FAILED: {tail[0]}", flush=True)
        return {"sampling_error": tail[0]}
    folder = os.path.relpath(os.path.dirname(wrote[-1]), ROOT)
    try:
        res = eval_fid.evaluate(wrote[-1], ref, ref_size=int(image_size), device="cuda")
    except eval_fid.ReferenceMismatch as e:
        print(f"  FID refused: {e}", flush=True)
        return {"fid_error": str(e), "samples": folder}
    return {**{k: v for k, v in res.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
            "samples": folder}


def delegate(module: str, argv: list[str]) -> int:
    """Run a table's own driver (``registry.DELEGATES``): ``<module>.main(argv)`` in this process; its exit status."""
    print(f"$ {registry.delegate_path(module)} {' '.join(argv)}".rstrip(), flush=True)
    return int(importlib.import_module(module).main(argv) or 0)
