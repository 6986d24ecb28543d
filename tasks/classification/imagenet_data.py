"""ImageNet-style data: a local folder (``train/`` and ``val/``, one subfolder per class) read with
torchvision's ``ImageFolder`` or Hugging Face ``datasets``' ``imagefolder`` builder, with the DeiT recipe's
augmentation from timm (RandAugment, random erasing; Mixup/CutMix are applied per batch by the task).

Nothing is downloaded: ``data.root`` must point at the extracted dataset. For ImageNet-1k, download the
ILSVRC2012 train/val archives from image-net.org, extract them, and sort ``val/`` into class folders
(e.g. with the widely used ``valprep.sh``).

Start-of-run checks (:func:`check_image_folder`, run by the task before it builds the model) read only
folder names: ``train/`` and ``val/`` exist, hold the same class folders, at least two of them, as many as
``model.num_classes``. Images are read with :func:`read_rgb`, whose errors name the file;
``data.skip_bad_images=true`` replaces unreadable images by the next readable one (:class:`SkipBadImages`).
"""

from __future__ import annotations

import io
import os
import warnings

from PIL import Image

from tasks.common.config import ConfigError
from tasks.common.data import SeededDataset

LAYOUT = ("expected layout: <data.root>/train/<class>/<image> and <data.root>/val/<class>/<image>, one folder per "
          "class with the same class folders in both splits (ImageNet-1k: root/train/n01440764/*.JPEG and "
          "root/val/n01440764/*.JPEG; download ILSVRC2012 from image-net.org, extract it under data.root and sort "
          "val/ into class folders)")


# ------------------------------------------------------------------------------------ layout checks
def list_classes(split_dir: str) -> list[str]:
    """The class names of an ImageFolder split: its subfolder names, sorted (as ``ImageFolder`` orders them)."""
    return sorted(entry.name for entry in os.scandir(split_dir) if entry.is_dir())


def check_split(root: str, split: str, layout: str = LAYOUT) -> list[str]:
    """Raise :class:`ConfigError` unless ``root/split`` exists with class subfolders; return their names."""
    if not root:
        raise ConfigError(f"data.root is not set: pass data.root=/path/to/dataset. {layout}")
    path = os.path.join(root, split)
    if not os.path.isdir(path):
        raise ConfigError(f"{path} does not exist: data.root={root} has no {split}/ folder. {layout}")
    classes = list_classes(path)
    if not classes:
        raise ConfigError(f"{path} has no class subfolders (images must sit in {split}/<class>/). {layout}")
    return classes


def _some(names, k: int = 10) -> str:
    """``names`` for a message: the first ``k``, then how many more."""
    names = sorted(names)
    more = f" and {len(names) - k} more" if len(names) > k else ""
    return ", ".join(names[:k]) + more


def check_same_classes(train_classes, val_classes) -> None:
    """Raise :class:`ConfigError` if train/ and val/ do not name the same classes (the labels would not match)."""
    only_train, only_val = set(train_classes) - set(val_classes), set(val_classes) - set(train_classes)
    if only_train or only_val:
        raise ConfigError(
            "train/ and val/ have different class folders, so val labels would not mean the train classes "
            f"(top-1 would be meaningless): only in train/: [{_some(only_train)}]; only in val/: "
            f"[{_some(only_val)}]. Rename or remove folders so both splits hold the same classes. {LAYOUT}")


def check_class_count(n_found: int, num_classes: int, where: str) -> None:
    """Raise :class:`ConfigError` unless ``where`` has >= 2 classes and ``model.num_classes`` equals their count."""
    if n_found < 2:
        raise ConfigError(f"{where} has {n_found} class folder(s); classification needs at least 2 (top-1 and "
                          f"the eval metrics are undefined for one class). {LAYOUT}")
    if n_found != num_classes:
        raise ConfigError(f"{where} has {n_found} classes but model.num_classes={num_classes}; "
                          f"set model.num_classes={n_found}")


def check_image_folder(data_cfg, num_classes: int) -> list[str]:
    """The start-of-run checks of an ImageNet-style ``data_cfg`` (folder names only, no image is read):
    ``root/train`` and ``root/val`` exist with the same class folders, at least 2, ``num_classes`` of them.
    Returns the class names."""
    root = data_cfg.get("root")
    train_classes = check_split(root, "train")
    val_classes = check_split(root, "val")
    check_same_classes(train_classes, val_classes)
    check_class_count(len(train_classes), num_classes, f"data.root={root}")
    return train_classes


# ------------------------------------------------------------------------------------ reading images
class BadImageError(OSError):
    """An image file that cannot be decoded (corrupt, truncated, not an image); the message names it and
    ``path`` holds it."""

    path: str | None = None


FIX_BAD_IMAGE = "Delete or replace the file, or set data.skip_bad_images=true to skip unreadable images"


def read_rgb(source, name: str | None = None, fix: str = FIX_BAD_IMAGE):
    """Decode ``source`` (a path or a binary file object) fully into an RGB PIL image.

    Any decoding error is raised as :class:`BadImageError` naming ``name`` (default: ``source``) and saying
    how to ``fix`` it, so a corrupt or truncated file is identified even when it fails in a DataLoader worker."""
    name = name or str(source)
    try:
        with Image.open(source) as img:
            return img.convert("RGB")  # forces the full decode: truncated files fail here, not later
    except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, ... depending on the format
        bad = BadImageError(f"cannot read image {name}: {type(err).__name__}: {err}. {fix}")
        bad.path = name
        raise bad from err


class SkipBadImages:
    """Wraps a dataset whose ``__getitem__`` may raise :class:`BadImageError`: such a sample is replaced by the
    next readable one (deterministically, so resumed runs see the same data).

    Counts are per process (DataLoader workers keep their own): ``bad_files`` lists the distinct unreadable
    files met, each warned about once; ``skips`` counts the replaced samples."""

    def __init__(self, ds, name: str = "", max_tries: int = 100):
        self.ds, self.name, self.max_tries = ds, name or "the dataset", max_tries
        self.classes = getattr(ds, "classes", None)
        self.bad_files: list[str] = []
        self.skips = 0

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        n = len(self.ds)
        tries = min(self.max_tries, n)
        for k in range(tries):
            try:
                return self.ds[(i + k) % n]
            except BadImageError as err:
                self._record(err)
        raise BadImageError(f"{self.name}: {tries} consecutive images from index {i} cannot be read "
                            f"(last: {self.bad_files[-1]}); is the dataset readable at all?")

    def _record(self, err: BadImageError) -> None:
        """Count a skip; warn the first time a file is met."""
        self.skips += 1
        path = err.path or str(err)
        if path not in self.bad_files:
            self.bad_files.append(path)
            warnings.warn(f"data.skip_bad_images: replacing an unreadable image by the next one "
                          f"({len(self.bad_files)} bad file(s) so far in {self.name}, this process): {err}")


# ------------------------------------------------------------------------------------ datasets
class _HFImageFolder:
    """A ``datasets`` imagefolder split as ``(PIL image, label)`` samples; images are decoded by :func:`read_rgb`
    (not by ``datasets``), so a bad file is named."""

    def __init__(self, root: str, split: str):
        import datasets  # noqa: PLC0415

        self.split_dir = os.path.join(root, split)
        ds = datasets.load_dataset("imagefolder", data_dir=self.split_dir, split="train")
        self.ds = ds.cast_column("image", datasets.Image(decode=False))  # rows hold {"path", "bytes"}
        self.classes = ds.features["label"].names

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        row = self.ds[i]
        image = row["image"]
        source = image["path"] if image.get("bytes") is None else io.BytesIO(image["bytes"])
        return read_rgb(source, name=image.get("path") or f"{self.split_dir} row {i}"), row["label"]


def build_transforms(data_cfg, input_size: int):
    """DeiT recipe (train) and resize + centre crop (eval) from ``timm.data.create_transform``."""
    from timm.data import create_transform  # noqa: PLC0415  (timm: ~2 s to import)

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


def _load_splits(root: str, fmt: str):
    """The raw ``(train, val)`` splits of ``root`` as ``(PIL image, label)`` datasets with ``classes``."""
    if fmt == "folder":
        from torchvision.datasets import ImageFolder  # noqa: PLC0415

        return tuple(ImageFolder(os.path.join(root, split), loader=read_rgb) for split in ("train", "val"))
    if fmt == "hf":
        return _HFImageFolder(root, "train"), _HFImageFolder(root, "val")
    raise ConfigError(f"data.format must be folder or hf, got {fmt!r}")


def _subset(raw, limit, skip_bad: bool, name: str):
    """The first ``limit`` samples of ``raw``, with unreadable images skipped if ``skip_bad``."""
    ds = _Limited(raw, limit)
    return SkipBadImages(ds, name) if skip_bad else ds


def build_imagenet(data_cfg, input_size: int, seed: int = 0):
    """``(train, val)`` datasets for ``data_cfg`` (``root``, ``format``: folder | hf, ``augment``,
    ``skip_bad_images``...)."""
    root = data_cfg.get("root")
    check_split(root, "train")
    check_split(root, "val")
    train_tf, eval_tf = build_transforms(data_cfg, input_size)
    train_raw, val_raw = _load_splits(root, data_cfg.get("format", "folder"))
    check_same_classes(train_raw.classes, val_raw.classes)  # again: hf labels only the folders holding images
    skip = bool(data_cfg.get("skip_bad_images", False))
    train = SeededDataset(_subset(train_raw, data_cfg.get("limit"), skip, "train/"), _Transformed(train_tf),
                          seed=seed)
    val = SeededDataset(_subset(val_raw, data_cfg.get("eval_limit"), skip, "val/"), _Transformed(eval_tf),
                        seed=seed)
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
