"""The record of one ``train.py`` run (``<run_dir>/run.json``): what a results table needs to reproduce it.

Written by the trainer at the end of every run (main process): the command line, the code version (commit and
whether the tree had uncommitted changes), the machine (:func:`tasks.common.utils.system_info`), the load average
before and after, the wall time, the segments of a run resumed from a checkpoint (each process that trained
it: its steps, seconds, commit and load; ``resumed_from_step``), the final metrics, the *resolved* config
(every field, not the overrides) and the attention the run built with every option set (``attention``; the
config's None options mean "the model's default"), so that a recorded condition can be rerun exactly under
later defaults (``python train.py --config-dir <folder holding config.yaml> --config-name config``, or by
comparing the fields).
:func:`read_run_record` is how the table drivers (:mod:`tasks.common.launch`) pick it up.

A benchmark (a measurement of time, not a training run) records the same things around its timing with
:class:`Measurement`: the commit, the 1-minute load average before and after, and whether the machine was busy
(:func:`is_busy`, the rule in :data:`BUSY_RULE`); the results writer (``tasks/common/results.py``) refuses to
write a busy measurement unless told to, and then marks it BUSY.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from .fileio import atomic_write
from .utils import load_average, system_info

ROOT = Path(__file__).resolve().parents[2]
RECORD = "run.json"
#: What a table keeps of each run's record: the code version, machine, load, resolved config and effective attention.
RUN_RECORD_KEYS = ("commit", "dirty", "machine", "load_before", "load_after", "config", "attention")


def code_version(root: str | os.PathLike = ROOT) -> dict:
    """``{"commit": sha or None, "dirty": bool or None}`` of the checkout at ``root``.

    ``dirty`` is whether tracked files other than the records under ``results/`` differ from the commit: a seed
    grid rewrites its table under ``results/`` after each run, which changes no code the next run executes.

    Outside git (a copy of the tree without ``.git``, e.g. on a rented GPU machine) the commit is read from the
    environment variable ``MHLA_COMMIT`` when set (``dirty`` is then None: unknown), else None.
    """
    def git(*args):
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None

    try:
        commit = git("rev-parse", "HEAD")
        code = ("--", ".", ":(exclude)results")  # every tracked path but the records
        status = git("status", "--porcelain", "--untracked-files=no", *code) if commit else None
    except (OSError, subprocess.SubprocessError):
        commit, status = None, None
    if commit is None and os.environ.get("MHLA_COMMIT"):
        return {"commit": os.environ["MHLA_COMMIT"], "dirty": None}
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def effective_attention(cfg) -> dict | None:
    """The attention the run built with every option it runs with: ``cfg.attn`` (whose None fields mean "the
    model's default"; a stored config is brought to today's schema first, :func:`tasks.common.config.upgrade_config`)
    resolved against the model's contract (:func:`tasks.common.config.resolve_model_attention`), the class's own
    defaults filled in (:attr:`mhla.registry.ResolvedAttention.effective`); None for a config without a model
    attention (e.g. a distillation record)."""
    from .config import resolve_model_attention, upgrade_config  # noqa: PLC0415  (records stays light to import)

    try:
        if cfg.get("attn") is None or cfg.get("model") is None:
            return None
        stored = upgrade_config(OmegaConf.create(OmegaConf.to_container(cfg) if OmegaConf.is_config(cfg) else cfg))
        return resolve_model_attention(stored).effective
    except (ValueError, KeyError, AttributeError, ImportError):
        return None


def write_run_record(run_dir: str | os.PathLike, cfg, metrics: dict, *, seconds: float, load_before,
                     segments: list[dict] | None = None, attention=None) -> Path:
    """Write ``<run_dir>/run.json`` (module docstring) and return its path.

    ``seconds`` and ``load_before`` are this process's. ``segments`` (the trainer's): one dict per process
    that trained the run, in order, ``{"from_step", "to_step", "seconds", "started", "commit", "dirty",
    "load_before"}``; more than one when the run was resumed from a checkpoint (``trainer.resume``). A segment
    from a checkpoint that predates them is ``{"from_step": None, "to_step": step}``: what trained up to that
    step is unknown. ``seconds_total`` is their sum (``seconds`` without segments), None when one is
    unknown. ``attention``: the run's resolved attention (a :class:`mhla.registry.ResolvedAttention`, the
    trainer's); without it the record resolves ``cfg`` (:func:`effective_attention`)."""
    known = [seg.get("seconds") for seg in segments] if segments is not None else [seconds]
    segments = list(segments or [])
    record = {
        "command": "python " + " ".join(sys.argv),
        **code_version(),
        "machine": system_info(),
        "load_before": load_before,
        "load_after": load_average(),
        "seconds": round(seconds, 1),
        "segments": segments,
        "resumed_from_step": segments[-1]["from_step"] if segments else 0,
        "seconds_total": round(sum(known), 1) if known and None not in known else None,
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool))},
        "config": OmegaConf.to_container(cfg, resolve=True),
        "attention": attention.effective if attention is not None else effective_attention(cfg),
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


# ------------------------------------------------------------------------------------------ measurements
BUSY_FRACTION = 0.5
MIN_WATCH_S = 1.0  # other processes' CPU share is read only over at least this long (/proc/stat counts ticks)
BUSY_RULE = ("busy: the 1-minute load average before the measurement is above half the CPU cores (other work was "
             "running), or after it is above the measurement's own threads plus half the cores (other work started "
             "during it), or (where watched) other processes used more than half the CPUs' time during it; "
             "the "
             "load average lags by about a minute, so start a benchmark a minute after the last job")


def busy_cpu_s() -> float | None:
    """System-wide busy CPU seconds since boot from ``/proc/stat`` (Linux), or None where not available."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and of its finished children (a benchmark that times in subprocesses)."""
    import resource  # noqa: PLC0415  (POSIX)

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def is_busy(load_before, load_after, cpu_count: int | None, threads: int = 1,
            other_cpu_frac: float | None = None) -> bool | None:
    """Whether a measurement ran on a busy machine (:data:`BUSY_RULE`), from the 1-minute load averages before and
    after it (``[1 min, 5 min, 15 min]`` lists or numbers), the machine's ``cpu_count``, the measurement's own
    ``threads`` (what it adds to the load itself) and, where watched, the share of all CPUs' time other
    processes used during it (``other_cpu_frac``). None when the OS reports no load average."""
    if load_before is None or load_after is None or not cpu_count:
        return None
    first = (lambda x: float(x[0]) if isinstance(x, (list, tuple)) else float(x))
    slack = BUSY_FRACTION * cpu_count
    return (first(load_before) > slack or first(load_after) > min(threads, cpu_count) + slack
            or (other_cpu_frac is not None and other_cpu_frac > BUSY_FRACTION))


def wait_until_settled(max_wait_s: float = 180.0, poll_s: float = 5.0) -> float:
    """Wait until the 1-minute load average is under the busy line (:data:`BUSY_FRACTION` of the cores), at
    most ``max_wait_s``; returns the seconds waited. For a measurement that follows its own driver's jobs
    (training runs, then their timing): the load average lags by about a minute, so without this the
    measurement would start "busy" on the load of jobs that have already ended."""
    cores, waited = os.cpu_count() or 1, 0.0
    while waited < max_wait_s:
        load = load_average()
        if not load or float(load[0]) <= BUSY_FRACTION * cores:
            break
        if waited == 0.0:
            print(f"waiting for the load average to settle ({float(load[0]):.2f} on {cores} cores)",
                  flush=True)
        time.sleep(poll_s)
        waited += poll_s
    return waited


class Measurement:
    """The record of a benchmark's conditions, taken around the timing::

        with Measurement(threads=torch.get_num_threads()) as m:
            rows = run_the_benchmark()
        write_result(stem, md, {..., "rows": rows}, plot, measurement=m.record, allow_busy=args.allow_busy)

    ``m.record``: ``commit``, ``dirty`` (:func:`code_version`), ``load_before``, ``load_after`` (1 / 5 / 15-minute
    load averages), ``cpu_count``, ``threads`` (the measurement's own: ``threads`` for a CPU benchmark, 1 for a
    GPU one), ``seconds``, ``other_cpu_frac`` (the share of all CPUs' time that other processes used during
    it, from ``/proc/stat`` less this process and its children; None where not available or under
    :data:`MIN_WATCH_S`), ``busy`` (:func:`is_busy`;
    ``other_cpu_frac`` counts when ``watch_other_cpu``, the default: a CPU benchmark) and ``busy_rule``
    (:data:`BUSY_RULE`)."""

    def __init__(self, threads: int = 1, watch_other_cpu: bool = True):
        self.threads = max(1, int(threads or 1))
        self.watch_other_cpu = watch_other_cpu
        self.record: dict = {}

    def __enter__(self) -> Measurement:
        self.record = {**code_version(), "load_before": load_average(), "load_after": None,
                       "cpu_count": os.cpu_count(), "threads": self.threads}
        self._t0, self._cpu0 = time.time(), (busy_cpu_s(), own_cpu_s())
        return self

    def busy_at_start(self) -> bool:
        """The load before the measurement alone says busy (a benchmark may refuse to start)."""
        r = self.record
        return bool(r["load_before"] and r["cpu_count"]
                    and float(r["load_before"][0]) > BUSY_FRACTION * r["cpu_count"])

    def refuses_to_start(self, allow_busy: bool = False) -> bool:
        """Whether a CPU benchmark (``watch_other_cpu``) should stop before timing anything, because the load
        before it already says busy (:meth:`busy_at_start`): prints why and returns True unless ``allow_busy``.
        A benchmark that only learned this at its end would spend its whole run to write nothing."""
        if not self.watch_other_cpu or allow_busy or not self.busy_at_start():
            return False
        from .results import load_summary  # noqa: PLC0415  (results imports nothing of ours but fileio)

        print(f"refusing to measure: the machine is busy ({load_summary(self.record)}); the load average lags by "
              "about a minute, so start a minute after the last job, or pass --allow-busy", file=sys.stderr)
        return True

    def __exit__(self, *exc) -> bool:
        r = self.record
        r["load_after"] = load_average()
        wall = time.time() - self._t0
        r["seconds"] = round(wall, 1)
        (busy0, own0), busy1, own1 = self._cpu0, busy_cpu_s(), own_cpu_s()
        watched = None not in (busy0, busy1) and wall >= MIN_WATCH_S and r["cpu_count"]
        r["other_cpu_frac"] = (round(max(0.0, (busy1 - busy0) - (own1 - own0)) / (wall * r["cpu_count"]), 3)
                               if watched else None)
        r["busy"] = is_busy(r["load_before"], r["load_after"], r["cpu_count"], self.threads,
                            r["other_cpu_frac"] if self.watch_other_cpu else None)
        r["busy_rule"] = BUSY_RULE
        return False
