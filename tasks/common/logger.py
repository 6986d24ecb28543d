"""Run logging: stdout, ``train.log`` and a ``metrics.jsonl`` file in the run folder, and W&B (offline unless
asked).

``logger.name``: ``wandb`` or ``none``. ``logger.mode``: ``offline`` (default; sync later with
``wandb sync``), ``online`` (needs network and a login) or ``disabled``.

``train.log`` (:func:`open_run_log`) gets the lines the trainer prints at start, a progress line every
``trainer.log_every`` steps, the evaluations and the final line, through the Python logger ``mhla.run``.

One record, every sink: :meth:`RunLogger.log` converts a record once (:func:`scalar_record`) and writes that
same dict to ``metrics.jsonl`` and W&B, and the trainer prints it with :func:`format_metrics`, so the three carry
the same keys (the text lines drop the group prefix, ``eval/`` or ``train/``, that their heading names).

Media (W&B only): :meth:`RunLogger.log_media` takes ``{name: Media}`` (an image or video, a file or an array)
and does nothing without W&B. The trainer logs a heatmap of every MHLA mixing matrix at each evaluation, and
the :class:`Media` values that a task's ``evaluate`` or ``after_fit`` returns (sample grids, videos).

Resume: :attr:`RunLogger.run_id` (the W&B run id) is stored in the checkpoints; a resumed run passes it back
(``resume_id``) and continues the same W&B run.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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


#: file suffixes that :class:`Media` accepts, by kind
MEDIA_SUFFIXES = {"image": (".png", ".jpg", ".jpeg", ".gif", ".bmp"), "video": (".gif", ".mp4", ".webm", ".ogg")}


@dataclass(frozen=True)
class Media:
    """An image or a video for W&B (:meth:`RunLogger.log_media`), without importing W&B where it is made.

    ``data``: a file path (images: .png, .jpg, ...; videos: .gif, .mp4, .webm, .ogg) or, for an image, an array
    ``[H, W]`` / ``[H, W, 3 or 4]`` (uint8, or float in [0, 1]). ``kind``: ``"image"`` or ``"video"`` (a file:
    W&B encodes arrays as video only with moviepy, which this project does not install).
    """

    data: object
    kind: str = "image"
    caption: str | None = None

    def __post_init__(self):
        if self.kind not in MEDIA_SUFFIXES:
            raise ValueError(f"Media kind must be image or video, got {self.kind!r}")
        if isinstance(self.data, (str, os.PathLike)):
            suffix = Path(self.data).suffix.lower()
            if suffix not in MEDIA_SUFFIXES[self.kind]:
                raise ValueError(f"a {self.kind} file must end in {', '.join(MEDIA_SUFFIXES[self.kind])}: "
                                 f"{self.data}")
        elif self.kind == "video":
            raise ValueError("a video Media must be a file (.gif, .mp4, .webm, .ogg), not an array")

    def to_wandb(self):
        """The ``wandb.Image`` / ``wandb.Video`` of this object."""
        import wandb  # noqa: PLC0415

        data = str(self.data) if isinstance(self.data, (str, os.PathLike)) else self.data
        if self.kind == "video":
            return wandb.Video(data, caption=self.caption, format=Path(data).suffix[1:].lower())
        return wandb.Image(data, caption=self.caption)


def split_media(values: dict) -> tuple[dict, dict]:
    """``(scalars, media)``: the :class:`Media` values of ``values`` apart from the rest (a task's
    ``evaluate`` / ``after_fit`` may return both)."""
    media = {k: v for k, v in values.items() if isinstance(v, Media)}
    return {k: v for k, v in values.items() if k not in media}, media


def scalar_record(metrics: dict) -> dict:
    """The record that every sink gets: numbers (Python, numpy or 0-d tensors) as ``float``, the rest as is."""
    return {k: (float(v) if hasattr(v, "__float__") else v) for k, v in metrics.items()}


def _format_value(v) -> str:
    """Floats to 4 decimals (4 significant digits when tiny or huge, e.g. a learning rate), the rest as is."""
    if not isinstance(v, float):
        return f"{v}"
    return f"{v:.4f}" if v == 0 or 1e-3 <= abs(v) < 1e6 else f"{v:.4g}"


def format_metrics(record: dict, prefix: str = "") -> str:
    """``k=v`` for every key of ``record``, with ``prefix`` (a group such as ``eval/``, which the line's heading
    names) dropped from the keys: the text form of a logged record."""
    return " ".join(f"{k.removeprefix(prefix)}={_format_value(v)}" for k, v in record.items())


def heatmap_image(matrix, title: str = "") -> np.ndarray:
    """An RGB ``uint8`` image ``[height, width, 3]`` of ``matrix`` as a heatmap: ``[M, M]``, or ``[H, M, M]``
    with one panel per head; rows are query blocks, columns key blocks, one colour scale from 0 to the max.
    Rendered off-screen by matplotlib (no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    panels = np.asarray(matrix, dtype=np.float32)
    panels = panels[None] if panels.ndim == 2 else panels
    n = len(panels)
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(3.2 * cols + 0.8, 3.0 * rows + 0.4), dpi=80)
    canvas = FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    vmax = float(panels.max()) if panels.size and panels.max() > 0 else 1.0
    for i, ax in enumerate(axes.flat):
        if i >= n:
            ax.axis("off")
            continue
        im = ax.imshow(panels[i], cmap="viridis", vmin=0.0, vmax=vmax, interpolation="nearest")
        ax.set_title(f"head {i}" if n > 1 else f"M = {panels.shape[-1]}", fontsize=8)
        ax.set_xlabel("key block", fontsize=7)
        ax.set_ylabel("query block", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    fig.suptitle(title, fontsize=9)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def open_metrics(path: Path, from_step: int | None):
    """``path`` opened for appending, first keeping only its records with ``step <= from_step`` (all of them when
    ``from_step`` is None; none when it is 0: a fresh run)."""
    if from_step == 0:  # a fresh run: nothing of an earlier one is kept
        return open(path, "w")
    if from_step is not None and path.exists():
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= from_step]
        with open(path, "w") as f:
            f.writelines(kept)
    return open(path, "a")


class RunLogger:
    """The sinks of one run: ``metrics.jsonl`` (and W&B when ``cfg.name`` is ``wandb``) on the main process;
    ``enabled=False`` (other ranks) makes every method a no-op.

    ``resume_id``: the W&B run id of the run being resumed (from its checkpoint), continued with
    ``resume="allow"``; ``logger.run_id``, when set, takes precedence.

    ``metrics.jsonl`` holds one run's records: ``from_step`` is the step of the checkpoint the run resumes from
    (records an interrupted run logged past it are dropped; the resumed run logs those steps again), and a
    fresh run (``from_step=0``) starts the file anew, as it overwrites the earlier run's checkpoints. ``None``
    (the default) appends to whatever is there.
    """

    def __init__(self, cfg, run_dir: str | os.PathLike, config: dict, system: dict, enabled: bool = True,
                 resume_id: str | None = None, from_step: int | None = None):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.wandb_run = None
        self.mode = None
        self.media = False
        self._metrics_file = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics_file = open_metrics(self.run_dir / "metrics.jsonl", from_step)
        name = cfg.get("name", "none") if cfg is not None else "none"
        if name == "wandb":
            self._init_wandb(cfg, config, system, resume_id)
        elif name != "none":
            raise ValueError(f"logger must be wandb or none, got {name!r}")

    def _init_wandb(self, cfg, config: dict, system: dict, resume_id: str | None) -> None:
        self.mode = cfg.get("mode", "offline")
        if self.mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logger.mode must be offline, online or disabled, got {self.mode!r}")
        self.media = bool(cfg.get("media", True))
        import wandb  # noqa: PLC0415

        os.environ.setdefault("WANDB_SILENT", "true")
        self.wandb_run = wandb.init(
            project=cfg.get("project", "mhla"),
            entity=cfg.get("entity"),
            name=cfg.get("run_name"),
            group=cfg.get("group"),
            tags=list(cfg.get("tags") or []),
            mode=self.mode,
            dir=str(self.run_dir),
            config={"config": config, "system": system},
            resume="allow",
            id=cfg.get("run_id") or resume_id,
        )

    @property
    def run_id(self) -> str | None:
        """The W&B run id (None without W&B, or with ``logger.mode=disabled``)."""
        if self.wandb_run is None or self.mode == "disabled":
            return None
        return self.wandb_run.id

    @property
    def logs_media(self) -> bool:
        """Whether :meth:`log_media` writes anything (W&B on and ``logger.media`` true); callers skip rendering
        media otherwise."""
        return self.media and self.run_id is not None

    def log(self, metrics: dict, step: int) -> dict:
        """Write ``metrics`` at ``step`` to ``metrics.jsonl`` and W&B (the same :func:`scalar_record` to both);
        returns that record (for the text line)."""
        record = scalar_record(metrics)
        if not self.enabled:
            return record
        self._write_jsonl(record, step)
        if self.wandb_run is not None:
            self.wandb_run.log(record, step=step)
        return record

    def _write_jsonl(self, record: dict, step: int) -> None:
        self._metrics_file.write(json.dumps({"step": step, **record}) + "\n")
        self._metrics_file.flush()

    def log_media(self, media: dict, step: int) -> None:
        """Log ``{name: Media}`` to W&B at ``step``; nothing without W&B (``logger=none``, ``mode=disabled``) or
        with ``logger.media=false``."""
        if media and self.logs_media:
            self.wandb_run.log({k: m.to_wandb() for k, m in media.items()}, step=step)

    def summary(self, metrics: dict, step: int) -> None:
        """The run's final values as ``final/<key>``: one record in ``metrics.jsonl`` and the W&B summary."""
        if not self.enabled:
            return
        record = {f"final/{k}": v for k, v in scalar_record(metrics).items()}
        self._write_jsonl(record, step)
        if self.wandb_run is not None:
            self.wandb_run.summary.update(record)

    def finish(self, exit_code: int | None = None) -> None:
        """Close ``metrics.jsonl`` and finish the W&B run (``exit_code`` != 0 marks it failed / interrupted).
        Safe to call twice."""
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None
        if self.wandb_run is not None:
            run, self.wandb_run = self.wandb_run, None
            run.finish(exit_code=exit_code)
