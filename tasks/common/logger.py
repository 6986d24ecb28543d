"""Run logging: stdout, ``train.log`` and a ``metrics.jsonl`` file in the run folder, and W&B (offline unless
asked).

``logger.name``: ``wandb`` or ``none``. ``logger.mode``: ``offline`` (default; sync later with
``wandb sync``), ``online`` (needs network and a login) or ``disabled``.

``train.log`` (:func:`open_run_log`) gets the lines the trainer prints at start, a progress line every
``trainer.log_every`` steps, the evaluations and the final line, through the Python logger ``mhla.run``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

RUN_LOG = "mhla.run"
_FORMAT = "[%(asctime)s][%(levelname)s] - %(message)s"


def run_log() -> logging.Logger:
    """The logger whose records go to the current run's ``train.log`` (and nowhere else)."""
    log = logging.getLogger(RUN_LOG)
    log.setLevel(logging.INFO)
    log.propagate = False  # the trainer prints its own lines; Hydra's console handler would print them twice
    return log


def open_run_log(run_dir: str | os.PathLike) -> logging.Logger:
    """Point :func:`run_log` at ``<run_dir>/train.log`` (appending). Under ``train.py`` Hydra already has a file
    handler on that file, which is reused, so one handle writes it; otherwise a handler is added. The handler of
    a previous run in this process is dropped."""
    close_run_log()
    log = run_log()
    path = Path(run_dir).resolve() / "train.log"
    handler = next((h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)
                    and Path(h.baseFilename).resolve() == path), None)
    if handler is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler.mhla_owned = True  # ours to close
    log.addHandler(handler)
    return log


def close_run_log() -> None:
    """Detach the ``train.log`` handler (closing it unless it is Hydra's)."""
    log = run_log()
    for handler in list(log.handlers):
        log.removeHandler(handler)
        if getattr(handler, "mhla_owned", False):
            handler.close()


class RunLogger:
    def __init__(self, cfg, run_dir: str | os.PathLike, config: dict, system: dict, enabled: bool = True):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.wandb_run = None
        self._metrics_file = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics_file = open(self.run_dir / "metrics.jsonl", "a")
        name = cfg.get("name", "none") if cfg is not None else "none"
        if name == "wandb":
            mode = cfg.get("mode", "offline")
            if mode not in ("offline", "online", "disabled"):
                raise ValueError(f"logger.mode must be offline, online or disabled, got {mode!r}")
            import wandb  # noqa: PLC0415

            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb_run = wandb.init(
                project=cfg.get("project", "mhla"),
                entity=cfg.get("entity"),
                name=cfg.get("run_name"),
                group=cfg.get("group"),
                tags=list(cfg.get("tags") or []),
                mode=mode,
                dir=str(self.run_dir),
                config={"config": config, "system": system},
                resume="allow",
                id=cfg.get("run_id"),
            )
        elif name != "none":
            raise ValueError(f"logger must be wandb or none, got {name!r}")

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: (float(v) if hasattr(v, "__float__") else v) for k, v in metrics.items()}}
        self._metrics_file.write(json.dumps(record) + "\n")
        self._metrics_file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)

    def summary(self, metrics: dict) -> None:
        if self.wandb_run is not None:
            for k, v in metrics.items():
                self.wandb_run.summary[k] = v

    def finish(self, exit_code: int | None = None) -> None:
        """Close ``metrics.jsonl`` and finish the W&B run (``exit_code`` != 0 marks it failed / interrupted).
        Safe to call twice."""
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None
        if self.wandb_run is not None:
            run, self.wandb_run = self.wandb_run, None
            run.finish(exit_code=exit_code)
