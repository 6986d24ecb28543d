"""Run logging: stdout, a ``metrics.jsonl`` file in the run folder, and W&B (offline unless asked).

``logger.name``: ``wandb`` or ``none``. ``logger.mode``: ``offline`` (default; sync later with
``wandb sync``), ``online`` (needs network and a login) or ``disabled``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


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

    def finish(self) -> None:
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
