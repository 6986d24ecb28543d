#!/usr/bin/env python
"""Sample a trained DiT to an ADM-compatible ``.npz`` (uint8 NHWC under ``arr_0``), then (optionally) FID.

    python -m tasks.image_gen.sample --ckpt outputs/.../checkpoints/last.pt --num-samples 50000 \\
        --steps 250 --cfg-scale 1.0 --out samples [--ref VIRTUAL_imagenet256_labeled.npz]
    torchrun --nproc_per_node=8 -m tasks.image_gen.sample --ckpt ... (each rank samples its share)

Writes ``<out>/<settings>-step<step>-cfg<scale>-<method><steps>-sampleseed<seed>/samples.npz`` (+ ``metrics.json``
with ``--ref``), ``<settings>`` naming the run's model, resolution, attention, M, training seed and schedule
(:func:`tasks.common.config.settings_tag`): two table cells never share a folder. Determinism: global batch ``j`` (``--batch-size`` images) draws its labels and all its noise
from a generator seeded with ``(seed, j)`` and is sampled by rank ``j % world_size``, so the same seed gives
the same images whatever the number of processes. Weights: the EMA copy when the checkpoint has one
(``--weights model`` for the raw ones). Latent models decode with ``data.vae_path`` from the checkpoint's
config (or ``--vae-path``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from mhla.layouts import ceil_div
from models.dit import build_dit
from tasks.common.checkpoint import load_checkpoint, model_weights, run_config
from tasks.common.config import model_attention, settings_tag
from tasks.common.distributed import cleanup, setup_distributed
from tasks.image_gen.npz import save_npz
from tasks.image_gen.sampling import generate
from tasks.image_gen.vae import load_vae


def load_model(ckpt_path: str, weights: str = "ema", device="cpu"):
    """Rebuild the DiT of a ``train.py`` checkpoint and load its (EMA) weights. Returns ``(model, cfg, step)``."""
    state = load_checkpoint(ckpt_path, map_location="cpu")
    cfg = run_config(state)
    model = build_dit(OmegaConf.merge(cfg.model, {"pretrained": None}), model_attention(cfg))  # weights: the run's
    model.load_state_dict(model_weights(state, weights))
    return model.to(device).eval(), cfg, int(state.get("step", 0))


def run_name(cfg, step: int, args) -> str:
    """The sample folder's name: the run's settings (:func:`~tasks.common.config.settings_tag`: model, resolution,
    attention, M, training seed, schedule), the checkpoint's step and the sampling settings."""
    return (f"{settings_tag(cfg)}-step{step:07d}-cfg{args.cfg_scale:g}-{args.method}{args.steps}"
            f"-sampleseed{args.seed}")


def batch_labels_and_generator(seed: int, j: int, n: int, num_classes: int, device):
    """Labels ``[n]`` and the generator for global batch ``j`` (labels drawn on the CPU, noise on ``device``)."""
    g_cpu = torch.Generator().manual_seed(seed * 1_000_003 + j)
    labels = torch.randint(0, num_classes, (n,), generator=g_cpu)
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + j + 500_000_000)
    return labels, g


def sample_to_npz(model, cfg, out_dir: str, *, num_samples: int, batch_size: int, steps: int, method: str,
                  cfg_scale: float, seed: int, guidance_channels=None, vae=None, rank: int = 0, world: int = 1,
                  device="cpu", progress: bool = True) -> str | None:
    """Sample ``num_samples`` images split over ranks; rank 0 writes ``out_dir/samples.npz`` (returns its path)."""
    os.makedirs(out_dir, exist_ok=True)
    n_batches = ceil_div(num_samples, batch_size)
    mine = list(range(rank, n_batches, world))
    it = mine
    if progress and rank == 0:
        it = tqdm(mine, desc="sampling batches")
    for j in it:
        n = min(batch_size, num_samples - j * batch_size)
        labels, g = batch_labels_and_generator(seed, j, n, int(cfg.model.num_classes), device)
        imgs = generate(model, labels.to(device), steps=steps, method=method, cfg_scale=cfg_scale,
                        guidance_channels=guidance_channels, generator=g, vae=vae,
                        prediction=str(cfg.task.get("prediction", "eps")))
        np.savez(os.path.join(out_dir, f".part_{j:06d}.npz"), images=imgs.cpu().numpy(), labels=labels.numpy())
    if world > 1 and dist.is_initialized():
        dist.barrier()
    if rank != 0:
        return None
    images, labels = [], []
    for j in range(n_batches):
        part = os.path.join(out_dir, f".part_{j:06d}.npz")
        with np.load(part) as f:
            images.append(f["images"])
            labels.append(f["labels"])
        os.unlink(part)
    images = np.concatenate(images)
    path = os.path.join(out_dir, "samples.npz")
    save_npz(images, path)
    np.save(os.path.join(out_dir, "labels.npy"), np.concatenate(labels))
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="a last.pt / best.pt written by train.py")
    p.add_argument("--num-samples", type=int, default=50_000)
    p.add_argument("--batch-size", type=int, default=64, help="images per global batch (per rank per step)")
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--method", default="ddpm", choices=["ddpm", "ddim"])
    p.add_argument("--cfg-scale", type=float, default=1.0, help="1.0: no guidance (Table 3a)")
    p.add_argument("--guidance-channels", type=int, default=None,
                   help="guide only the first k channels (DiT: 3 of 4); default: the task config's, else all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights", default="ema", choices=["ema", "model"])
    p.add_argument("--out", default="samples")
    p.add_argument("--vae-path", default=None)
    p.add_argument("--ref", default=None, help="ADM reference batch .npz (images or stats) -> FID/sFID/IS/P/R")
    p.add_argument("--inception-path", default=None)
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)

    info = setup_distributed(args.device)
    model, cfg, step = load_model(args.ckpt, args.weights, info.device)
    guidance = args.guidance_channels
    if guidance is None:
        guidance = (cfg.task.get("sample") or {}).get("guidance_channels")
    vae = None
    if cfg.data.get("latents", "none") != "none":
        vae = load_vae(args.vae_path or cfg.data.get("vae_path"), info.device)
    out_dir = os.path.join(args.out, run_name(cfg, step, args))
    path = sample_to_npz(model, cfg, out_dir, num_samples=args.num_samples, batch_size=args.batch_size,
                         steps=args.steps, method=args.method, cfg_scale=args.cfg_scale, seed=args.seed,
                         guidance_channels=guidance, vae=vae, rank=info.rank, world=info.world_size,
                         device=info.device, progress=True)
    if path is not None:
        print(f"wrote {path}", flush=True)
        if args.ref:
            from tasks.image_gen.metrics import evaluate_samples  # noqa: PLC0415  (scipy; only with --ref)

            metrics = evaluate_samples(path, args.ref, device=str(info.device), inception_path=args.inception_path)
            with open(os.path.join(out_dir, "metrics.json"), "w") as f:
                json.dump(metrics, f, indent=2)
            print("final: " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items() if isinstance(v, float)),
                  flush=True)
    cleanup(info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
