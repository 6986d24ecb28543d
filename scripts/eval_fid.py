#!/usr/bin/env python
"""FID, sFID, Inception Score, precision and recall of a sample batch against a reference (ADM semantics).

    python scripts/eval_fid.py samples.npz VIRTUAL_imagenet256_labeled.npz [--device cuda] [--inception-path P]

``samples.npz``: uint8 ``[N, H, W, 3]`` under ``arr_0`` (what ``tasks.image_gen.sample`` writes). The reference
is an ADM reference batch or a stats file (``tasks.image_gen.metrics.save_reference_stats``). Prints one JSON
object (the metrics and, per metric, the implementation that produced it) and writes it beside the samples as
``<samples>.metrics.json`` unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("samples", help="ADM-style .npz of generated images (arr_0, uint8 NHWC)")
    p.add_argument("reference", help="ADM reference batch .npz, or a stats .npz")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--inception-path", default=None,
                   help="local inception-2015-12-05.pt (needed for the Inception Score)")
    p.add_argument("--torchmetrics", action="store_true", help="also compute FID with torchmetrics (cross-check)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    for path in (args.samples, args.reference):
        if not os.path.isfile(path):
            p.error(f"{path} does not exist")
    from tasks.image_gen.metrics import evaluate_samples  # noqa: PLC0415

    res = evaluate_samples(args.samples, args.reference, device=args.device, inception_path=args.inception_path,
                           batch_size=args.batch_size, cross_check_torchmetrics=args.torchmetrics)
    text = json.dumps(res, indent=2, default=float)
    print(text)
    if not args.no_write:
        with open(os.path.splitext(args.samples)[0] + ".metrics.json", "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
