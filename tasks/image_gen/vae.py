"""The SD-VAE latent space DiT trains in: diffusers' ``AutoencoderKL`` from a local folder, scale 0.18215.

Nothing is downloaded: ``data.vae_path`` must hold the weights (``config.json`` +
``diffusion_pytorch_model.safetensors``). :func:`precompute_latents` encodes a dataset once (each image
unflipped and flipped, as DiT's feature-extraction script) into a cache that :class:`LatentDataset` reads.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from tqdm.auto import tqdm

from models.weights import require_local_weights
from tasks.common.fileio import atomic_write

SD_VAE_SCALE = 0.18215


def load_vae(path: str | None, device="cpu"):
    """``AutoencoderKL.from_pretrained(path)`` in eval mode; a clear error when the weights are missing."""
    require_local_weights(path, what="VAE weights", repo="stabilityai/sd-vae-ft-ema (or sd-vae-ft-mse)",
                          option="data.vae_path={dir}", example_dir="/models/sd-vae-ft-ema",
                          contents="config.json and diffusion_pytorch_model.*")
    from diffusers import AutoencoderKL  # noqa: PLC0415

    vae = AutoencoderKL.from_pretrained(path).to(device).eval()
    for p in vae.parameters():
        p.requires_grad_(False)
    return vae


def downsample_factor(vae) -> int:
    return 2 ** (len(vae.config.block_out_channels) - 1)


@torch.no_grad()
def encode(vae, x: torch.Tensor, scale: float = SD_VAE_SCALE, generator=None) -> torch.Tensor:
    """Images ``[B, 3, S, S]`` in [-1, 1] -> scaled latents ``[B, C, S/f, S/f]`` (a sample of the posterior)."""
    return vae.encode(x).latent_dist.sample(generator) * scale


@torch.no_grad()
def decode(vae, z: torch.Tensor, scale: float = SD_VAE_SCALE) -> torch.Tensor:
    """Scaled latents -> images in [-1, 1] (clamped)."""
    return vae.decode(z / scale).sample.clamp(-1, 1)


@torch.no_grad()
def precompute_latents(dataset, vae, cache_dir: str, *, batch_size: int = 64, rank: int = 0, world_size: int = 1,
                       device="cpu", scale: float = SD_VAE_SCALE, progress: bool = True) -> str:
    """Encode ``dataset`` (unflipped ``([3, S, S] in [-1, 1], label)`` samples) into ``cache_dir``.

    Rank ``r`` of ``W`` encodes samples ``r, r + W, ...`` into ``shard_<r>-of-<W>.npy`` (``[n_r, 2, C, h, w]``
    float16, unflipped and flipped); rank 0 also writes ``labels.npy`` and ``meta.json`` (written last: its
    presence marks a finished cache). Returns ``cache_dir``.
    """
    os.makedirs(cache_dir, exist_ok=True)
    idx = list(range(rank, len(dataset), world_size))
    f = downsample_factor(vae)
    x0, _ = dataset[0]
    shape = (len(idx), 2, int(vae.config.latent_channels), x0.shape[-2] // f, x0.shape[-1] // f)
    path = os.path.join(cache_dir, f"shard_{rank:03d}-of-{world_size:03d}.npy")

    def write_shard(tmp: str) -> None:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=shape)
        g = torch.Generator(device=device).manual_seed(rank)
        it = range(0, len(idx), batch_size)
        if progress:
            it = tqdm(it, desc=f"encoding latents (rank {rank})")
        for s in it:
            x = torch.stack([dataset[i][0] for i in idx[s: s + batch_size]]).to(device)
            z = encode(vae, torch.cat([x, x.flip(-1)]), scale, g).float().cpu()
            n = x.shape[0]
            out[s: s + n] = torch.stack([z[:n], z[n:]], dim=1).numpy().astype(np.float16)
        out.flush()
        del out

    atomic_write(path, write_shard, suffix=".tmp.npy")
    if rank == 0:
        labels = np.array([_label(dataset, i) for i in range(len(dataset))], dtype=np.int64)
        np.save(os.path.join(cache_dir, "labels.npy"), labels)
        meta = {"num_samples": len(dataset), "world_size": world_size, "latent_shape": list(shape[2:]),
                "scale": scale, "num_classes": int(getattr(dataset, "num_classes", int(labels.max()) + 1)),
                "vae": str(getattr(vae.config, "_name_or_path", ""))}

        def write_meta(tmp: str) -> None:
            with open(tmp, "w") as fh:
                json.dump(meta, fh)

        atomic_write(os.path.join(cache_dir, "meta.json"), write_meta)
    return cache_dir


def _label(dataset, i: int) -> int:
    """The label of sample ``i`` without decoding the image when the dataset exposes ``targets``."""
    base = getattr(dataset, "dataset", dataset)
    targets = getattr(base, "targets", None)
    return int(targets[i]) if targets is not None else int(dataset[i][1])
