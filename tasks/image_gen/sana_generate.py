"""Sampling a prompt set into a run folder: jobs (prompt, image, seed), batches sharded over ranks, the GenEval
folder layout, and the part files joined into ``samples.npz`` / ``latents.npy`` + ``samples.jsonl``.

    run = SampleRun(out_dir, make_jobs(len(prompts), images_per_prompt, seed), batch_size)
    generate(model, prompts, run, settings, decode=decode, rank=rank, world=world)   # every rank
    finalize(run, prompts, settings)                                                  # rank 0, after all ranks
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from PIL import Image
from tqdm.auto import tqdm

from mhla.layouts import ceil_div
from tasks.image_gen.npz import center_crop_resize, save_npz
from tasks.image_gen.sampling import to_uint8
from tasks.image_gen.sana_sampling import sample_latents, sample_seed


@dataclass
class Job:
    """Image ``k`` of prompt ``prompt`` (``index``: its row in ``samples.npz``)."""

    index: int
    prompt: int
    k: int
    seed: int = 0


@dataclass
class SampleRun:
    out_dir: str
    jobs: list = field(default_factory=list)
    batch_size: int = 8

    @property
    def num_batches(self) -> int:
        return ceil_div(len(self.jobs), self.batch_size)

    def batch(self, j: int) -> list:
        return self.jobs[j * self.batch_size:(j + 1) * self.batch_size]


def make_jobs(num_prompts: int, images_per_prompt: int, seed: int) -> list:
    """Jobs in (prompt, k) order: row ``i * images_per_prompt + k`` is image ``k`` of prompt ``i``."""
    return [Job(i * images_per_prompt + k, i, k, sample_seed(seed, i, k))
            for i in range(num_prompts) for k in range(images_per_prompt)]


def run_name(cfg, step: int, s: dict) -> str:
    return (f"{cfg.model.name}-{cfg.attn.name}-{step:07d}-{s['solver']}{s['steps']}-cfg{s['cfg_scale']:g}"
            f"-shift{s['shift']:g}-seed{s['seed']}")


def write_metadata(out_dir: str, prompts) -> None:
    """GenEval's per-prompt folders: ``<i:05d>/metadata.jsonl`` (one JSON object) and ``<i:05d>/samples/``."""
    for i, r in enumerate(prompts.records):
        folder = os.path.join(out_dir, f"{i:05d}")
        os.makedirs(os.path.join(folder, "samples"), exist_ok=True)
        with open(os.path.join(folder, "metadata.jsonl"), "w") as f:
            f.write(json.dumps(r["metadata"]) + "\n")


def generate(model, prompts, run: SampleRun, s: dict, *, decode: Callable | None = None, rank: int = 0,
             world: int = 1, device="cpu", write_png: bool = True, npz_size: int | None = None,
             progress: bool = True) -> None:
    """Sample this rank's global batches (``j % world == rank``) of ``run.jobs``.

    Each batch writes its PNGs (``<prompt:05d>/samples/<k:04d>.png``) and a part file in ``run.out_dir``:
    uint8 images ``[b, S, S, 3]`` (centre crop + resize to ``npz_size`` when smaller than the decoded size) or,
    without ``decode``, the latents ``[b, C, h, w]``. :func:`finalize` (rank 0, after all ranks) joins the parts.
    """
    mine = list(range(rank, run.num_batches, world))
    it = mine
    if progress and rank == 0:
        it = tqdm(mine, desc=f"sampling {len(run.jobs)} images", unit="batch")
    for j in it:
        jobs = run.batch(j)
        cond, uncond = prompts.encode([jb.prompt for jb in jobs], device)
        z = sample_latents(model, cond[0], mask=cond[1], neg_text=None if uncond is None else uncond[0],
                           neg_mask=None if uncond is None else uncond[1], seeds=[jb.seed for jb in jobs],
                           steps=s["steps"], shift=s["shift"], guidance_scale=s["cfg_scale"], solver=s["solver"],
                           precision=s["precision"])
        part = os.path.join(run.out_dir, f".part_{j:06d}.npy")
        if decode is None:
            np.save(part, z.cpu().numpy().astype(np.float32))
            continue
        imgs = to_uint8(decode(z)).cpu().numpy()  # [b, H, W, 3] uint8
        if write_png:
            for jb, im in zip(jobs, imgs):
                Image.fromarray(im).save(os.path.join(run.out_dir, f"{jb.prompt:05d}", "samples", f"{jb.k:04d}.png"))
        if npz_size and npz_size < imgs.shape[1]:  # downscale only
            imgs = np.stack([center_crop_resize(Image.fromarray(im), npz_size) for im in imgs])
        np.save(part, imgs)


def finalize(run: SampleRun, prompts, s: dict) -> dict:
    """Join the part files (rank 0): ``samples.npz`` (uint8 ``arr_0``) or ``latents.npy``, and ``samples.jsonl``
    (row ``n``: prompt index, image index, seed, prompt, id). Returns ``{"npz" or "latents": path, "rows": N}``."""
    arrays = []
    for j in range(run.num_batches):
        part = os.path.join(run.out_dir, f".part_{j:06d}.npy")
        arrays.append(np.load(part))
        os.unlink(part)
    arr = np.concatenate(arrays)
    with open(os.path.join(run.out_dir, "samples.jsonl"), "w") as f:
        for jb in run.jobs:
            r = prompts.records[jb.prompt]
            f.write(json.dumps({"index": jb.index, "prompt_index": jb.prompt, "k": jb.k, "seed": jb.seed,
                                "prompt": r["prompt"], "id": r["id"]}) + "\n")
    with open(os.path.join(run.out_dir, "settings.json"), "w") as f:
        json.dump(s, f, indent=2)
    if arr.dtype == np.uint8:
        return {"npz": save_npz(arr, os.path.join(run.out_dir, "samples.npz")), "rows": int(arr.shape[0])}
    path = os.path.join(run.out_dir, "latents.npy")
    np.save(path, arr)
    return {"latents": path, "rows": int(arr.shape[0])}
