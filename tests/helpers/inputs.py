"""Stand-ins for the inputs a full-scale cell declares (``inputs:`` of its config, :mod:`tasks.common.config`):
an empty folder holding the declared markers, or an empty file, per ``key`` entry; an ADM-shaped reference batch
per resolution for the runner's ``--fid-ref``."""

from __future__ import annotations

import os

import numpy as np

from tasks.common.config import declared_inputs


def fake_inputs(cfg, root) -> list[str]:
    """Create every ``key`` input ``cfg`` declares under ``root``; return the overrides that point at them."""
    out = []
    for name, entry in declared_inputs(cfg).items():
        if not entry.get("key"):
            continue
        path = os.path.join(str(root), name + (".pt" if entry.get("file") else ""))
        if entry.get("file"):
            open(path, "wb").close()
        else:
            markers = entry.get("marker") or []
            for m in [markers] if isinstance(markers, str) else markers:
                target = os.path.join(path, m)
                if "." in os.path.basename(m):  # a file marker (config.json, metadata.jsonl)
                    os.makedirs(path, exist_ok=True)
                    open(target, "w").close()
                else:
                    os.makedirs(target, exist_ok=True)
            os.makedirs(path, exist_ok=True)
        out.append(f"{entry['key']}={path}")
    return out


def fake_fid_refs(root, sizes=(256, 512)) -> dict[int, str]:
    """``{resolution: path}`` of one-image ADM-style reference batches (``arr_0`` uint8 NHWC)."""
    refs = {}
    for size in sizes:
        path = os.path.join(str(root), f"VIRTUAL_imagenet{size}.npz")
        np.savez(path, arr_0=np.zeros((1, size, size, 3), np.uint8))
        refs[size] = path
    return refs
