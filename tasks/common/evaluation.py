"""Evaluate a checkpoint written by ``train.py``: the functions behind ``eval.py`` (its command line), used by
the scripts that read trained runs (``scripts/analyze_attention.py``, ``scripts/length_extrapolation.py``).

    cfg, task, model, info = load_run("outputs/.../checkpoints/best.pt")          # model in eval mode
    metrics = evaluate_checkpoint("outputs/.../checkpoints/best.pt", ["data.eval_batch_size=64"])

The run's resolved config is stored in the checkpoint; ``overrides`` are applied on top with Hydra's rule (a
misspelled key is an error, ``+key=value`` adds a key). The task is the class the stored config names in
``task.target``, picked as ``train.py`` picks it (:func:`tasks.common.task.task_class`).
"""

from __future__ import annotations

from torch.utils.data import DataLoader

from .checkpoint import load_run_checkpoint, model_weights, run_config
from .config import apply_overrides, check_eval_batch_size
from .data import ResumableSampler
from .distributed import setup_distributed
from .progress import ProgressLoader
from .task import task_class
from .trainer import _precision_context, cap_num_workers


def load_run(ckpt_path: str, overrides: list[str] | None = None, use_ema: bool = True):
    """``(cfg, task, model, dist_info)`` of a ``train.py`` checkpoint: the run's stored config with
    ``overrides`` on top, its task (the class ``task.target`` names, as in ``train.py``:
    :func:`tasks.common.task.task_class`), and the model with the EMA (``use_ema``) or raw weights, in eval
    mode."""
    state = load_run_checkpoint(ckpt_path)
    cfg = run_config(state)
    apply_overrides(cfg, overrides or [])  # a misspelled key is an error, as in train.py
    check_eval_batch_size(cfg)
    task = task_class(cfg)(cfg)
    info = setup_distributed(cfg.trainer.get("device", "auto"))
    model = task.build_model()
    model.load_state_dict(model_weights(state, "ema" if use_ema else "model"))
    model.to(info.device).eval()
    return cfg, task, model, info


def eval_loader(cfg, task, info, split: str = "eval") -> DataLoader:
    """The loader over ``task``'s eval split that :func:`evaluate_checkpoint` uses: in order (no shuffle, no
    dropped tail), ``data.eval_batch_size`` (else ``data.batch_size``) per batch, this process's shard.
    ``split="train"``: the same over the training split (to measure how well a model fits what it saw)."""
    if split not in ("eval", "train"):
        raise ValueError(f"split must be 'eval' or 'train', got {split!r}")
    train_ds, eval_ds = task.build_datasets()
    ds = train_ds if split == "train" else eval_ds
    bs = int(cfg.data.get("eval_batch_size") or cfg.data.batch_size)
    sampler = ResumableSampler(len(ds), bs, rank=info.rank, world_size=info.world_size, shuffle=False,
                               drop_last=False)
    return DataLoader(ds, batch_size=bs, sampler=sampler, collate_fn=task.collate,
                      num_workers=cap_num_workers(int(cfg.trainer.get("num_workers", 0)))[0])


def eval_precision(cfg, info):
    """The autocast context of the run's ``trainer.precision`` on ``info.device`` ("auto": bf16 on a GPU, fp32
    on a CPU)."""
    precision = cfg.trainer.get("precision", "auto")
    precision = ("bf16" if info.device.type == "cuda" else "fp32") if precision == "auto" else precision
    return _precision_context(precision, info.device)


def evaluate_checkpoint(ckpt_path: str, overrides: list[str] | None = None, use_ema: bool = True) -> dict:
    """The task's evaluation of a ``train.py`` checkpoint (:func:`load_run`) on its eval split, with the run's
    precision: the metrics ``eval.py`` prints."""
    cfg, task, model, info = load_run(ckpt_path, overrides, use_ema)
    loader = eval_loader(cfg, task, info)
    with eval_precision(cfg, info):
        return task.evaluate(model, ProgressLoader(loader, "eval", enabled=info.is_main), info.device, info)
