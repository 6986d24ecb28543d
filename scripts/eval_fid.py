#!/usr/bin/env python
"""FID, sFID, Inception Score, precision and recall of a sample batch against a reference (ADM semantics).

    python scripts/eval_fid.py samples.npz VIRTUAL_imagenet256_labeled.npz [--device cuda] [--inception-path P]

``samples.npz``: uint8 ``[N, H, W, 3]`` under ``arr_0`` (what ``tasks.image_gen.sample`` writes). The reference
is an ADM reference batch or a stats file (``tasks.image_gen.metrics.save_reference_stats``). Prints one JSON
object (the metrics and, per metric, the implementation that produced it) and writes it beside the samples as
``<samples>.metrics.json`` unless ``--no-write``.

The reference must be of the samples' resolution (Inception resizes everything to 299 px, so a 256 px reference
would score 512 px samples without any error): the image size of an ADM reference batch (``arr_0``, read from
its header, nothing loaded) or the ``image_size`` a stats file records must equal the samples'; a stats file
that records none is checked against ``--ref-size`` and against a resolution its name states
(``VIRTUAL_imagenet512.npz``, ``ref_256x256.npz``). A mismatch is refused (exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import zipfile

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np


class ReferenceMismatch(ValueError):
    """A FID reference that does not fit the samples (another image size)."""


def npz_array_shape(path: str, key: str = "arr_0") -> tuple[int, ...] | None:
    """Shape of array ``key`` of an ``.npz`` from its ``.npy`` header (nothing else is read); None if absent."""
    with zipfile.ZipFile(path) as zf:
        if f"{key}.npy" not in zf.namelist():
            return None
        with zf.open(f"{key}.npy") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, _ = read(f)
    return tuple(int(d) for d in shape)


def images_size(shape: tuple[int, ...] | None, what: str) -> int | None:
    """The side of square NHWC (or NCHW) images of ``shape``; :class:`ReferenceMismatch` for non-square ones."""
    if shape is None or len(shape) != 4:
        return None
    h, w = (shape[1], shape[2]) if shape[-1] in (1, 3, 4) else (shape[2], shape[3])
    if h != w:
        raise ReferenceMismatch(f"{what} holds {h}x{w} images; FID references and samples are square")
    return h


def name_resolution(path: str) -> int | None:
    """The resolution a reference's file name states (``VIRTUAL_imagenet512.npz``, ``ref_256x256.npz``), or None."""
    base = os.path.basename(path)
    m = (re.search(r"imagenet_?(\d{2,4})(?![\dA-Za-z])", base, re.IGNORECASE)
         or re.search(r"(?<!\d)(\d{2,4})x\1(?!\d)", base))
    return int(m.group(1)) if m else None


def reference_image_size(path: str) -> int | None:
    """The image size of a FID reference: its images' (ADM batch, ``arr_0``), else the ``image_size`` a stats
    file records; None when neither is there."""
    size = images_size(npz_array_shape(path), f"reference {path}")
    if size is not None:
        return size
    with np.load(path) as data:
        if "image_size" in data.files:
            return int(np.asarray(data["image_size"]).reshape(-1)[0])
    return None


def check_reference(reference: str, image_size: int) -> str:
    """Refuse (:class:`ReferenceMismatch`) a FID reference whose image size is not ``image_size`` (the
    samples'). Returns how the size was checked (for the log)."""
    size = reference_image_size(reference)
    if size is not None:
        if size != image_size:
            raise ReferenceMismatch(f"FID reference {reference} holds {size}x{size} images but the samples are "
                                    f"{image_size}x{image_size}: use the {image_size} px reference (e.g. ADM's "
                                    f"VIRTUAL_imagenet{image_size}{'_labeled' if image_size == 256 else ''}.npz)")
        return f"{size} px (recorded in the reference)"
    named = name_resolution(reference)
    if named is not None and named != image_size:
        raise ReferenceMismatch(f"FID reference {reference} records no image size and its name says {named} px, "
                                f"but the samples are {image_size}x{image_size}: use the {image_size} px reference")
    return (f"{image_size} px by its file name" if named else
            f"{image_size} px as declared (the stats file records no image size: make sure it is a "
            f"{image_size} px reference)")


def parse_fid_refs(items: list[str] | None) -> dict[int, str]:
    """``["256=/ref256.npz", "512=/ref512.npz"]`` -> ``{256: path, 512: path}``, each checked with
    :func:`check_reference`. A bare path is keyed by the size it records or its name states (else refused)."""
    refs: dict[int, str] = {}
    for item in items or []:
        key, sep, path = item.partition("=")
        if not (sep and key.strip().isdigit()):
            key, path = "", item
        if not os.path.isfile(path):
            raise ValueError(f"--fid-ref {item}: no such file")
        size = int(key) if key else (reference_image_size(path) or name_resolution(path))
        if size is None:
            raise ValueError(f"--fid-ref {path}: it records no image size and its name states none; give its "
                             f"resolution: --fid-ref 256={path}")
        if size in refs and refs[size] != path:
            raise ValueError(f"two FID references for {size} px: {refs[size]} and {path}")
        check_reference(path, size)
        refs[size] = path
    return refs


def evaluate(samples: str, reference: str, *, ref_size: int | None = None, **kwargs) -> dict:
    """:func:`tasks.image_gen.metrics.evaluate_samples` after :func:`check_reference` (samples' size from their
    header; ``ref_size``: the resolution the reference must have, e.g. the cell's, checked against the samples)."""
    size = images_size(npz_array_shape(samples), f"samples {samples}")
    if size is None:
        raise ReferenceMismatch(f"{samples}: no images under arr_0")
    if ref_size is not None and ref_size != size:
        raise ReferenceMismatch(f"the samples {samples} are {size}x{size} but the reference is declared "
                                f"{ref_size} px")
    check_reference(reference, size)
    # torch and scipy only when scoring: reproduce_table.py imports this module for parse_fid_refs
    from tasks.image_gen.metrics import evaluate_samples  # noqa: PLC0415

    return evaluate_samples(samples, reference, **kwargs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("samples", help="ADM-style .npz of generated images (arr_0, uint8 NHWC)")
    p.add_argument("reference", help="ADM reference batch .npz, or a stats .npz")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--inception-path", default=None,
                   help="local inception-2015-12-05.pt (needed for the Inception Score)")
    p.add_argument("--torchmetrics", action="store_true", help="also compute FID with torchmetrics (cross-check)")
    p.add_argument("--ref-size", type=int, default=None,
                   help="the reference's resolution when it records none (a stats file); must match the samples")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    for path in (args.samples, args.reference):
        if not os.path.isfile(path):
            p.error(f"{path} does not exist")
    try:
        res = evaluate(args.samples, args.reference, ref_size=args.ref_size, device=args.device,
                       inception_path=args.inception_path, batch_size=args.batch_size,
                       cross_check_torchmetrics=args.torchmetrics)
    except ReferenceMismatch as e:
        p.error(str(e))
    text = json.dumps(res, indent=2, default=float)
    print(text)
    if not args.no_write:
        with open(os.path.splitext(args.samples)[0] + ".metrics.json", "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
