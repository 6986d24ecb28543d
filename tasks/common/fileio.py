"""Atomic file writes: the one implementation every writer of checkpoints, caches and results uses.

    def write(tmp):                                   # write_fn gets the temp file's path
        with open(tmp, "w") as f:
            json.dump(result, f)
    atomic_write("results/run.json", write)
    atomic_write(path, lambda tmp: np.save(tmp, arr), suffix=".tmp.npy")   # np.save appends .npy otherwise

Standard library only, so light modules can import it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Callable


def atomic_write(path: str | os.PathLike, write_fn: Callable[[str], object], *, suffix: str = ".tmp",
                 fsync: bool = False) -> Path:
    """Write ``path`` so that it only ever appears complete: ``write_fn(tmp)`` writes a temp file in the same
    folder, which is then renamed into place with ``os.replace`` (atomic on POSIX; the old file, if any, stays
    untouched until then).

    Args:
        path: the final file. Its folder is created if missing.
        write_fn: called with the temp file's path (a str, not yet existing; ``.{name}.<random><suffix>`` next
            to ``path``); it creates and writes that file. Its return value is ignored.
        suffix: end of the temp file's name, for writers that look at the extension (``np.savez`` appends
            ``.npz`` to a path without it; ``np.save`` appends ``.npy``).
        fsync: flush the temp file to disk before the rename (a power loss then leaves the old or the new
            file, never an empty one); checkpoints use it.
    Raises:
        whatever ``write_fn`` raises (or the rename); the temp file is removed first, ``path`` is unchanged.
    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(path.parent / f".{path.name}.{secrets.token_hex(6)}{suffix}")
    try:
        write_fn(tmp)
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
