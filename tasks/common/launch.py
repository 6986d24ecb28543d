"""Run ``train.py`` as a subprocess and read its result: the one launcher behind the experiment scripts.

``scripts/reproduce_table.py`` (paper tables and their CPU proxies) and ``scripts/run_mqar.py`` (the MQAR grid)
both start training runs, several at a time with a fixed number of threads each, and parse the run's last
``final: key=value ...`` line. They do it through :func:`run_training` and :func:`run_parallel`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

from tqdm import tqdm

from .records import RUN_RECORD_KEYS, read_run_record
from .stats import mean_std  # noqa: F401  (the drivers import it from here)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_METRIC = re.compile(r"([\w/]+)=([-\d.eE+naninf]+)")


def parse_final(stdout: str) -> dict[str, float] | None:
    """The metrics of the last ``final: k=v ...`` line that ``train.py`` prints, or None if there is none."""
    finals = [line for line in stdout.splitlines() if line.startswith("final:")]
    return {k: float(v) for k, v in _METRIC.findall(finals[-1])} if finals else None


def run_training(overrides: list[str], threads: int | None = None, launcher: list[str] | None = None) -> dict:
    """Run ``train.py <overrides>`` to the end and return its record.

    Args:
        overrides: Hydra overrides.
        threads: torch/OpenMP threads for the run (``OMP_NUM_THREADS``); None keeps the environment's.
        launcher: the command that runs ``train.py`` (default: this Python; e.g. ``["torchrun", "--nproc_per_node=8"]``).

    Returns:
        ``{"command", "seconds", "metrics", "params_M", "run"}`` for a run that printed its ``final:`` line
        (``run``: the run's own record, :mod:`tasks.common.records`, when ``overrides`` name its folder with
        ``hydra.run.dir=``: resolved config, commit, machine, load), else ``{"command", "seconds", "error"}``
        with the last lines of its output.
    """
    cmd = [*(launcher or [sys.executable]), os.path.join(ROOT, "train.py"), *overrides]
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    rec = {"command": "python train.py " + " ".join(overrides), "seconds": round(time.time() - t0, 1)}
    metrics = parse_final(proc.stdout)
    if proc.returncode != 0 or metrics is None:
        tail = [line for line in (proc.stderr or proc.stdout).strip().splitlines()[-15:]
                if not line.startswith("Set the environment variable HYDRA_FULL_ERROR")]
        rec["error"] = tail[-1] if tail else f"failed (exit {proc.returncode})"
        rec["error_tail"] = "\n".join(tail)
        return rec
    params = re.search(r"([\d.]+)M params", proc.stdout)
    rec.update(metrics=metrics, params_M=float(params.group(1)) if params else None)
    run_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")), None)
    record = read_run_record(run_dir) if run_dir else None
    if record is not None:  # the resolved config, code version, machine and load of the run (tasks.common.records)
        rec["run"] = {k: record.get(k) for k in RUN_RECORD_KEYS}
    return rec


def run_parallel(fn: Callable, items: Iterable, jobs: int, desc: str, on_done: Callable[[object, dict], str]) -> None:
    """Call ``fn(item)`` for every item, ``jobs`` at a time, with a progress bar.

    ``on_done(item, record)`` runs in submission order as records arrive (save them there) and returns the line
    to print for that run.
    """
    items = list(items)
    bar = tqdm(total=len(items), desc=desc, unit="run") if items else None
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [(item, pool.submit(fn, item)) for item in items]
        for item, fut in futures:
            msg = on_done(item, fut.result())
            if bar is not None:
                bar.write(msg)
                bar.update()
            else:
                print(msg, flush=True)
    if bar is not None:
        bar.close()


def metric_curve(run_dir: str, key: str = "train/loss") -> list[tuple[int, float]]:
    """``(step, value)`` pairs of metric ``key`` (``train/loss``, ``eval/acc``, ...) from a run's ``metrics.jsonl``."""
    curve = []
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if key in rec:
                    curve.append((rec["step"], rec[key]))
    return curve


def train_loss_curve(run_dir: str) -> list[tuple[int, float]]:
    """``(step, train loss)`` pairs from a run's ``metrics.jsonl``."""
    return metric_curve(run_dir, "train/loss")


def read_notes(notes: str) -> str:
    """A ``--notes`` argument: the text itself, or the contents of the file named after a leading ``@``; a leading
    ``## Reading`` heading is dropped (the scripts write that heading above the notes themselves)."""
    if notes.startswith("@"):
        with open(notes[1:]) as f:
            notes = f.read()
    head, _, rest = notes.lstrip().partition("\n")
    return rest.lstrip("\n") if head.strip() == "## Reading" else notes
