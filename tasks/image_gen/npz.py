"""Sample / reference batches as ``.npz`` files in the format of ADM's evaluator (guided-diffusion).

ADM (and DiT, and MHLA's Table 3) evaluate a single ``.npz`` of generated images against a reference batch
(e.g. ``VIRTUAL_imagenet256_labeled.npz``): key ``arr_0`` holds uint8 images ``[N, H, W, 3]``.

    save_npz(images, "samples.npz")                  # uint8 [N, H, W, 3] -> arr_0, written atomically
    images = load_npz("samples.npz")                  # -> np.ndarray uint8 [N, H, W, 3]
    build_reference_npz("/data/imagenet/val", "ref_256.npz", size=256, limit=10000)
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from tasks.common.fileio import atomic_write

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff", ".JPEG")


def to_uint8_nhwc(images) -> np.ndarray:
    """Images as uint8 ``[N, H, W, 3]``.

    Accepts uint8 ``[N, H, W, 3]`` / ``[N, 3, H, W]`` arrays or tensors, or floats: in ``[-1, 1]`` when any
    value is negative (a model's output), else in ``[0, 1]``; floats are clipped and rounded.
    Channel-first input is recognised by a leading axis of size 3 (with a last axis not of size 3).
    """
    if torch.is_tensor(images):
        images = images.detach().cpu().numpy()
    x = np.asarray(images)
    if x.ndim != 4:
        raise ValueError(f"expected a batch of images [N, H, W, 3] or [N, 3, H, W], got shape {x.shape}")
    if x.shape[1] in (1, 3) and x.shape[-1] not in (1, 3):
        x = x.transpose(0, 2, 3, 1)
    if x.shape[-1] == 1:
        x = np.repeat(x, 3, axis=-1)
    if x.shape[-1] != 3:
        raise ValueError(f"expected 3 (or 1) colour channels, got shape {x.shape}")
    if x.dtype == np.uint8:
        return np.ascontiguousarray(x)
    x = x.astype(np.float64)
    if x.min() < 0:
        x = (x + 1.0) / 2.0
    return np.clip(np.rint(x * 255.0), 0, 255).astype(np.uint8)


def save_npz(images, path: str | os.PathLike) -> str:
    """Write ``images`` (see :func:`to_uint8_nhwc`) to ``path`` as ``arr_0``; atomic (temp file + rename)."""
    arr = to_uint8_nhwc(images)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, arr_0=arr)

    return str(atomic_write(path, write, suffix=".tmp.npz"))


def load_npz(path: str | os.PathLike) -> np.ndarray:
    """The uint8 images ``[N, H, W, 3]`` stored under ``arr_0`` in an ADM-style ``.npz``."""
    with np.load(path) as data:
        if "arr_0" not in data.files:
            raise ValueError(f"{path} has no 'arr_0' (keys: {data.files}); it is not an ADM-style image batch")
        arr = data["arr_0"]
    if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[-1] != 3:
        raise ValueError(f"{path}: arr_0 must be uint8 [N, H, W, 3], got {arr.dtype} {arr.shape}")
    return arr


def center_crop_resize(img, size: int) -> np.ndarray:
    """ADM's reference preprocessing: downsample by halving (box) while large, bicubic resize so the short
    side is ``size``, then a centre crop. ``img``: a PIL image -> uint8 ``[size, size, 3]``."""
    img = img.convert("RGB")
    while min(img.size) >= 2 * size:
        img = img.resize(tuple(s // 2 for s in img.size), resample=Image.BOX)
    scale = size / min(img.size)
    img = img.resize(tuple(round(s * scale) for s in img.size), resample=Image.BICUBIC)
    arr = np.asarray(img)
    top, left = (arr.shape[0] - size) // 2, (arr.shape[1] - size) // 2
    return arr[top:top + size, left:left + size]


def build_reference_npz(source, path: str | os.PathLike, *, size: int = 256, limit: int | None = None,
                        seed: int = 0) -> str:
    """Build a reference batch ``.npz`` from a folder of images (searched recursively) or an image tensor/array.

    Folders: images are centre-cropped and resized to ``size`` (ADM's preprocessing); with ``limit``, a random
    subset of that many files (seeded) is used. Arrays / tensors are stored as given (see :func:`to_uint8_nhwc`).
    """
    if isinstance(source, (str, os.PathLike)):
        root = Path(source)
        if not root.is_dir():
            raise FileNotFoundError(f"reference folder {root} does not exist")
        files = sorted(p for p in root.rglob("*") if p.suffix in IMAGE_EXTS or p.suffix.lower() in IMAGE_EXTS)
        if not files:
            raise FileNotFoundError(f"no images ({', '.join(IMAGE_EXTS)}) under {root}")
        if limit is not None and limit < len(files):
            idx = np.random.default_rng(seed).choice(len(files), size=limit, replace=False)
            files = [files[i] for i in sorted(idx)]
        arrs = []
        for f in tqdm(files, desc=f"reference {root.name}", unit="img"):
            with Image.open(f) as im:
                arrs.append(center_crop_resize(im, size))
        images = np.stack(arrs)
    else:
        images = to_uint8_nhwc(source)
        if limit is not None:
            images = images[:limit]
    return save_npz(images, path)
