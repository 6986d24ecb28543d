"""The record of one ``train.py`` run (``<run_dir>/run.json``): what a results table needs to reproduce it.

Written by the trainer at the end of every run (main process): the command line, the code version (commit and
whether the tree had uncommitted changes), the machine (:func:`tasks.common.utils.system_info`), the load average
before and after, the wall time, the final metrics, and the *resolved* config (every field, not the overrides), so
that a recorded condition can be rerun exactly under later defaults (``python train.py --config-dir
<folder holding config.yaml> --config-name config``, or by comparing the fields). :func:`read_run_record` is how the
table drivers (:mod:`tasks.common.launch`) pick it up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from .fileio import atomic_write
from .utils import load_average, system_info

ROOT = Path(__file__).resolve().parents[2]
RECORD = "run.json"


def code_version(root: str | os.PathLike = ROOT) -> dict:
    """``{"commit": sha or None, "dirty": bool or None}`` of the checkout at ``root`` (None outside git)."""
    def git(*args):
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None

    try:
        commit = git("rev-parse", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    except (OSError, subprocess.SubprocessError):
        commit, status = None, None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def write_run_record(run_dir: str | os.PathLike, cfg, metrics: dict, *, seconds: float, load_before) -> Path:
    """Write ``<run_dir>/run.json`` (module docstring) and return its path."""
    record = {
        "command": "python " + " ".join(sys.argv),
        **code_version(),
        "machine": system_info(),
        "load_before": load_before,
        "load_after": load_average(),
        "seconds": round(seconds, 1),
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool))},
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    text = json.dumps(record, indent=1, default=str)
    return atomic_write(Path(run_dir) / RECORD, lambda tmp: Path(tmp).write_text(text))


def read_run_record(run_dir: str | os.PathLike) -> dict | None:
    """The ``run.json`` of ``run_dir``, or None when the run wrote none (it stopped early, or predates it)."""
    path = Path(run_dir) / RECORD
    if not path.is_file():
        return None
    with open(path) as f:
        return json.load(f)
