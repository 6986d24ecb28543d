"""ImageNet-style data: a local folder (``train/`` and ``val/``, one subfolder per class) read with
torchvision's ``ImageFolder`` or Hugging Face ``datasets``' ``imagefolder`` builder, with the DeiT recipe's
augmentation from timm (RandAugment, random erasing; Mixup/CutMix are applied per batch by the task).

Nothing is downloaded: ``data.root`` must point at the extracted dataset. For ImageNet-1k, download the
ILSVRC2012 train/val archives from image-net.org, extract them, and sort ``val/`` into class folders
(e.g. with the widely used ``valprep.sh``).
"""

from __future__ import annotations

import os

from tasks.common.data import SeededDataset


def _check_root(root: str) -> None:
    if not root:
        raise FileNotFoundError(
            "data.root is not set: pass data.root=/path/to/imagenet (a folder with train/ and val/, one "
            "subfolder per class). Download ImageNet-1k (ILSVRC2012) from image-net.org and extract it there")
    for split in ("train", "val"):
        if not os.path.isdir(os.path.join(root, split)):
            raise FileNotFoundError(
                f"{os.path.join(root, split)} does not exist: data.root must contain train/ and val/ with one "
                f"subfolder per class (ImageNet-1k from image-net.org, val sorted into class folders)")


class _HFImageFolder:
    """A ``datasets`` imagefolder split as ``(PIL image, label)`` samples."""

    def __init__(self, root: str, split: str):
        import datasets  # noqa: PLC0415

        ds = datasets.load_dataset("imagefolder", data_dir=os.path.join(root, split), split="train")
        self.ds = ds
        self.classes = ds.features["label"].names

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        row = self.ds[i]
        return row["image"].convert("RGB"), row["label"]


def build_transforms(data_cfg, input_size: int):
    """DeiT recipe (train) and resize + centre crop (eval) from ``timm.data.create_transform``."""
    from timm.data import create_transform  # noqa: PLC0415

    aug = data_cfg.get("augment", {}) or {}
    train = create_transform(
        input_size=input_size,
        is_training=True,
        auto_augment=aug.get("auto_augment", "rand-m9-mstd0.5-inc1"),
        color_jitter=aug.get("color_jitter", 0.3),
        re_prob=aug.get("reprob", 0.25),
        re_mode=aug.get("remode", "pixel"),
        re_count=aug.get("recount", 1),
        interpolation=aug.get("interpolation", "bicubic"),
    )
    evaluate = create_transform(input_size=input_size, is_training=False,
                                crop_pct=aug.get("crop_pct", 0.875), interpolation="bicubic")
    return train, evaluate


class _Transformed:
    """Applies ``transform`` to the image of ``(image, label)`` samples."""

    def __init__(self, transform):
        self.transform = transform

    def __call__(self, sample):
        img, label = sample
        return self.transform(img), label


def build_imagenet(data_cfg, input_size: int, seed: int = 0):
    """``(train, val)`` datasets for ``data_cfg`` (``root``, ``format``: folder | hf, ``augment``...)."""
    root = data_cfg.get("root")
    _check_root(root)
    train_tf, eval_tf = build_transforms(data_cfg, input_size)
    fmt = data_cfg.get("format", "folder")
    if fmt == "folder":
        from torchvision.datasets import ImageFolder  # noqa: PLC0415

        train_raw = ImageFolder(os.path.join(root, "train"))
        val_raw = ImageFolder(os.path.join(root, "val"))
    elif fmt == "hf":
        train_raw, val_raw = _HFImageFolder(root, "train"), _HFImageFolder(root, "val")
    else:
        raise ValueError(f"data.format must be folder or hf, got {fmt!r}")
    if len(train_raw.classes) != len(val_raw.classes):
        raise ValueError(f"train/ has {len(train_raw.classes)} classes but val/ has {len(val_raw.classes)}")
    limit = data_cfg.get("limit")
    train = SeededDataset(_Limited(train_raw, limit), _Transformed(train_tf), seed=seed)
    val = SeededDataset(_Limited(val_raw, data_cfg.get("eval_limit")), _Transformed(eval_tf), seed=seed)
    train.num_classes = len(train_raw.classes)
    return train, val


class _Limited:
    """The first ``limit`` samples (spread over classes by taking every k-th) of a dataset, or all."""

    def __init__(self, ds, limit):
        self.ds = ds
        n = len(ds)
        self.idx = list(range(n)) if not limit or limit >= n else list(range(0, n, n // limit))[:limit]
        self.classes = getattr(ds, "classes", None)

    def __len__(self) -> int:
        return len(self.idx)

    def __getitem__(self, i: int):
        return self.ds[self.idx[i]]
