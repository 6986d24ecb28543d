"""The training loop every task uses.

A task supplies a :class:`Task` (model, datasets, loss, evaluation); :class:`Trainer` does the rest:
devices and ``torchrun`` (DDP, or FSDP with ``trainer.strategy=fsdp``), seeds, AdamW with a cosine
schedule and warmup, gradient clipping, mixed precision (bf16 autocast on GPU), EMA, MHLA mixing-matrix
projection after each optimizer step, progress bars, periodic evaluation, atomic checkpoints (``last.pt``
and ``best.pt``) with exact resume, and logging (stdout, ``metrics.jsonl``, W&B offline by default).

Exact resume: the checkpoint holds the model, optimizer, scheduler, EMA, RNG states and the step; the data
order is a function of ``(seed, epoch)`` (:class:`~tasks.common.data.ResumableSampler`), and a resumed run
skips the batches of the current epoch it already consumed. A resumed run therefore ends with the same
parameters as an uninterrupted one (tested).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from .checkpoint import CheckpointManager, load_checkpoint
from .data import ResumableSampler
from .distributed import DistInfo, all_reduce_mean, barrier, setup_distributed
from .ema import ModelEMA
from .logger import RunLogger
from .optim import build_optimizer, build_scheduler
from .utils import count_parameters, rng_state, seed_everything, set_rng_state, system_info


class Task:
    """What a task provides to the trainer. Subclasses override the methods below.

    ``monitor`` / ``monitor_mode``: the eval metric that selects ``best.pt``.
    """

    monitor: str = "loss"
    monitor_mode: str = "min"

    def __init__(self, cfg):
        self.cfg = cfg

    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def build_datasets(self):
        """Return ``(train_dataset, eval_dataset)``; samples are what :meth:`collate` batches."""
        raise NotImplementedError

    def collate(self, samples):
        return torch.utils.data.default_collate(samples)

    def on_batch(self, batch, device):
        """Move a batch to ``device`` and apply batch-level augmentation (mixup, ...)."""
        return [b.to(device, non_blocking=True) if torch.is_tensor(b) else b for b in batch]

    def training_loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader, device, dist_info: DistInfo) -> dict:
        raise NotImplementedError

    def example_input(self, device):
        """An input for the FLOP counter (or None to skip counting)."""
        return None

    def describe_model(self, model: nn.Module) -> str:
        return type(model).__name__

    def after_fit(self, trainer: "Trainer", metrics: dict) -> dict:
        """Hook for task-specific end-of-run work (sample grids, ...). Returns extra metrics."""
        return {}


def project_mixing_(model: nn.Module) -> None:
    """Keep every MHLA mixing matrix in its feasible set (the paper's clipping to [0, 1])."""
    for m in model.modules():
        if hasattr(m, "project_") and callable(m.project_) and m is not model:
            m.project_()


def _precision_context(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return torch.autocast(device_type=device.type, dtype=dtype)


class Trainer:
    """Runs :class:`Task` training under ``cfg.trainer``, ``cfg.optim``, ``cfg.sched``, ``cfg.logger``."""

    def __init__(self, cfg, task: Task, run_dir: str | os.PathLike):
        self.cfg = cfg
        self.task = task
        self.tcfg = cfg.trainer
        self.run_dir = Path(run_dir)
        self.dist = setup_distributed(self.tcfg.get("device", "auto"))
        self.device = self.dist.device
        precision = self.tcfg.get("precision", "auto")
        if precision == "auto":
            precision = "bf16" if self.device.type == "cuda" else "fp32"
        if precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"trainer.precision must be auto, fp32, bf16 or fp16, got {precision!r}")
        self.precision = precision
        if self.device.type == "cuda":  # TF32 matmuls/convs in fp32 (DiT's and DiG's scripts turn them on)
            tf32 = bool(self.tcfg.get("tf32", False))
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32

    # ------------------------------------------------------------------------------------ set-up
    def _print(self, *args) -> None:
        if self.dist.is_main:
            print(*args, flush=True)

    def _wrap(self, model: nn.Module) -> nn.Module:
        strategy = self.tcfg.get("strategy", "ddp")
        if not self.dist.enabled:
            return model
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

            ids = [self.device.index] if self.device.type == "cuda" else None
            return DDP(model, device_ids=ids)
        if strategy == "fsdp":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: PLC0415

            if self.device.type != "cuda":
                raise ValueError("trainer.strategy=fsdp needs CUDA GPUs; use trainer.strategy=ddp on CPU")
            if self.tcfg.get("ema", {}).get("enabled", False):
                raise ValueError("trainer.strategy=fsdp does not support EMA yet; set trainer.ema.enabled=false "
                                 "or use trainer.strategy=ddp")

            return FSDP(model, device_id=self.device if self.device.type == "cuda" else None,
                        use_orig_params=True)
        raise ValueError(f"trainer.strategy must be ddp or fsdp, got {strategy!r}")

    def _loader(self, dataset, sampler, batch_size: int) -> DataLoader:
        workers = int(self.tcfg.get("num_workers", 0))
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                          collate_fn=self.task.collate, pin_memory=self.device.type == "cuda",
                          persistent_workers=False, drop_last=False)

    # ------------------------------------------------------------------------------------- fit
    def fit(self) -> dict:
        cfg, tcfg = self.cfg, self.tcfg
        seed = int(cfg.get("seed", 0))
        seed_everything(seed)
        model = self.task.build_model().to(self.device)
        n_params = count_parameters(model)
        flops_msg = ""
        example = self.task.example_input(self.device)
        if example is not None and self.dist.is_main and tcfg.get("count_flops", True):
            from .utils import count_flops  # noqa: PLC0415

            flops = count_flops(model, *example) if isinstance(example, tuple) else count_flops(model, example)
            flops_msg = (f", {flops / 2e9:.3f} GMACs per sample "
                         f"(torch.utils.flop_counter, matmul/conv only)")
        self._print(f"model: {self.task.describe_model(model)}: {n_params / 1e6:.3f}M params{flops_msg}")

        train_ds, eval_ds = self.task.build_datasets()
        bs = int(cfg.data.batch_size)
        sampler = ResumableSampler(len(train_ds), bs, rank=self.dist.rank, world_size=self.dist.world_size,
                                   shuffle=True, seed=seed, repeats=int(cfg.data.get("repeated_aug", 1) or 1))
        steps_per_epoch = sampler.batches_per_epoch
        global_batch = bs * self.dist.world_size
        recipe_batch = cfg.task.get("global_batch")
        self._print(f"data: {len(train_ds)} train samples, global batch {global_batch} "
                    f"({bs} x {self.dist.world_size} processes), {steps_per_epoch} steps per epoch")
        if recipe_batch and int(recipe_batch) != global_batch:
            self._print(f"WARNING: the recipe's global batch is {recipe_batch} but this run uses {global_batch}; "
                        f"set data.batch_size={int(recipe_batch) // self.dist.world_size} or scale optim.lr "
                        f"(linear scaling: lr x {global_batch / int(recipe_batch):.3g})")
        max_steps = tcfg.get("max_steps")
        max_epochs = tcfg.get("max_epochs")
        if max_steps is None and max_epochs is None:
            raise ValueError("set trainer.max_steps or trainer.max_epochs")
        total = min(int(max_steps) if max_steps else math.inf,
                    int(math.ceil(float(max_epochs) * steps_per_epoch)) if max_epochs else math.inf)
        total = int(total)

        # Resume: read the checkpoint before wrapping, so full (unsharded) weights load into the plain model.
        state, step = None, 0
        resume = tcfg.get("resume")
        if resume:
            path = self.run_dir / "checkpoints" / "last.pt" if resume in (True, "auto", "last") else Path(resume)
            if resume == "auto" and not path.exists():
                self._print(f"resume=auto: no checkpoint at {path}, starting fresh")
            else:
                state = load_checkpoint(path, map_location=self.device)
                model.load_state_dict(state["model"])
                step = int(state["step"])
                self._print(f"resumed from {path} at step {step}")

        ema = None
        if tcfg.get("ema", {}).get("enabled", False):
            ema = ModelEMA(model, decay=tcfg.ema.decay, warmup=tcfg.ema.get("warmup", True))
        wrapped = self._wrap(model)
        self._wrapped = wrapped
        optimizer = build_optimizer(wrapped, cfg.optim)
        scheduler = build_scheduler(optimizer, cfg.sched, total, steps_per_epoch)
        scaler = torch.amp.GradScaler(enabled=self.precision == "fp16" and self.device.type == "cuda")
        ckpt = CheckpointManager(self.run_dir / "checkpoints", monitor=self.task.monitor,
                                 mode=self.task.monitor_mode)
        if state is not None:
            optim_state = state["optimizer"]
            if type(wrapped).__name__ == "FullyShardedDataParallel":
                from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: PLC0415

                optim_state = FSDP.optim_state_dict_to_load(wrapped, optimizer, optim_state)
            optimizer.load_state_dict(optim_state)
            scheduler.load_state_dict(state["scheduler"])
            if ema is not None and state.get("ema") is not None:
                ema.load_state_dict(state["ema"])
            if state.get("scaler"):
                scaler.load_state_dict(state["scaler"])
            set_rng_state(state["rng"][min(self.dist.rank, len(state["rng"]) - 1)]
                          if isinstance(state["rng"], list) else state["rng"])
            ckpt.best = state.get("best_metric")
            del state

        from omegaconf import OmegaConf  # noqa: PLC0415

        resolved = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
        logger = RunLogger(cfg.get("logger"), self.run_dir, resolved, system_info(), enabled=self.dist.is_main)
        if self.dist.is_main:
            logger.log({"params": n_params}, step)

        eval_loader = None
        if eval_ds is not None:
            eval_sampler = ResumableSampler(len(eval_ds), int(cfg.data.get("eval_batch_size", bs)),
                                            rank=self.dist.rank, world_size=self.dist.world_size,
                                            shuffle=False, drop_last=False)
            eval_loader = self._loader(eval_ds, eval_sampler, eval_sampler.batch_size)

        log_every = int(tcfg.get("log_every", 50))
        eval_every = tcfg.get("eval_every_steps")
        ckpt_every = tcfg.get("checkpoint_every_steps")
        stop_after = tcfg.get("stop_after_steps")  # simulate an interruption (tests, preemptible jobs)
        clip = tcfg.get("grad_clip")
        progress = None
        if self.dist.is_main and tcfg.get("progress_bar", True):
            from tqdm.auto import tqdm  # noqa: PLC0415

            progress = tqdm(total=total, initial=step, desc="train", dynamic_ncols=True)

        metrics: dict = {}
        t0 = time.time()
        wrapped.train()
        while step < total:
            epoch, in_epoch = divmod(step, steps_per_epoch)
            sampler.set_epoch(epoch, skip_batches=in_epoch)
            if hasattr(train_ds, "set_epoch"):
                train_ds.set_epoch(epoch)
            for batch in self._loader(train_ds, sampler, bs):
                batch = self.task.on_batch(batch, self.device)
                with _precision_context(self.precision, self.device):
                    loss, logs = self.task.training_loss(wrapped, batch)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"loss is {loss.item()} at step {step}; lower optim.lr or check data")
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                grad_norm = None
                if clip:
                    scaler.unscale_(optimizer)
                    grad_norm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), float(clip))
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                project_mixing_(model)
                if ema is not None:
                    ema.update(model)
                step += 1
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(loss=f"{loss.item():.4f}")
                if step % log_every == 0 or step == total:
                    rec = {"train/loss": all_reduce_mean(loss.detach(), self.dist).item(),
                           "train/lr": scheduler.get_last_lr()[0], "epoch": step / steps_per_epoch,
                           **{f"train/{k}": float(v) for k, v in logs.items()}}
                    if grad_norm is not None:
                        rec["train/grad_norm"] = float(grad_norm)
                    logger.log(rec, step)
                end_of_epoch = step % steps_per_epoch == 0
                do_eval = eval_loader is not None and (
                    (eval_every and step % int(eval_every) == 0)
                    or (not eval_every and end_of_epoch) or step == total)
                if do_eval:
                    metrics = self._evaluate(model, ema, eval_loader)
                    logger.log({f"eval/{k}": v for k, v in metrics.items()}, step)
                    self._print(f"step {step}: " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
                    wrapped.train()
                if (ckpt_every and step % int(ckpt_every) == 0) or end_of_epoch or step == total \
                        or (stop_after and step >= int(stop_after)):
                    self._save(ckpt, model, optimizer, scheduler, scaler, ema, step, metrics if do_eval else None)
                if step >= total or (stop_after and step >= int(stop_after)):
                    break
            if stop_after and step >= int(stop_after):
                break
        if progress is not None:
            progress.close()
        elapsed = time.time() - t0
        metrics = dict(metrics)
        self.model, self.ema = model, ema  # after_fit may sample from them
        metrics.update(self.task.after_fit(self, metrics) or {})
        if self.dist.is_main:
            logger.summary({**metrics, "train_time_s": elapsed, "steps": step})
        logger.finish()
        barrier(self.dist)
        self.step = step
        return metrics

    def _evaluate(self, model, ema, loader) -> dict:
        target = ema.module if (ema is not None and self.tcfg.ema.get("evaluate", True)) else model
        target.eval()
        with _precision_context(self.precision, self.device):
            return self.task.evaluate(target, loader, self.device, self.dist)

    def _save(self, ckpt, model, optimizer, scheduler, scaler, ema, step, metrics) -> None:
        rngs = rng_state()
        if self.dist.enabled:
            import torch.distributed as dist  # noqa: PLC0415

            gathered = [None] * self.dist.world_size
            dist.all_gather_object(gathered, rngs)
            rngs = gathered
        model_state, optim_state = self._full_state(model, optimizer)
        if not self.dist.is_main:
            return
        state = {
            "model": model_state,
            "optimizer": optim_state,
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "ema": ema.state_dict() if ema is not None else None,
            "step": step,
            "rng": rngs,
            "config": self.cfg_container(),
        }
        ckpt.save(state, metrics)

    def _full_state(self, model, optimizer):
        """Model and optimizer state dicts, gathered to full tensors on rank 0 under FSDP."""
        wrapped = getattr(self, "_wrapped", None)
        if wrapped is None or type(wrapped).__name__ != "FullyShardedDataParallel":
            return model.state_dict(), optimizer.state_dict()
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType  # noqa: PLC0415
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: PLC0415

        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, cfg):
            return wrapped.state_dict(), FSDP.optim_state_dict(wrapped, optimizer)

    def cfg_container(self):
        from omegaconf import OmegaConf  # noqa: PLC0415

        return OmegaConf.to_container(self.cfg, resolve=True) if OmegaConf.is_config(self.cfg) else self.cfg
