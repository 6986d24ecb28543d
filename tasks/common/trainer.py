"""The training loop every task uses.

A task supplies a :class:`Task` (model, datasets, loss, evaluation); :class:`Trainer` does the rest:
devices and ``torchrun`` on one node or several (DDP, or FSDP2 with ``trainer.strategy=fsdp``:
:mod:`tasks.common.fsdp`), seeds, AdamW with a cosine schedule and warmup, gradient clipping, mixed precision
(bf16 autocast on GPU), EMA, the modules' training hooks (:mod:`mhla.hooks`: optimizer groups, a call
after each optimizer step, matrices to log), progress bars, periodic evaluation, atomic checkpoints
(``last.pt`` and ``best.pt``; under FSDP the DCP folders ``last.dcp`` and ``best.dcp``, which every reader
of a checkpoint reads as the same dict) with exact resume, and logging (stdout, ``train.log``,
``metrics.jsonl``, W&B offline by default).

Gradient accumulation (``trainer.accumulate``; :func:`tasks.common.config.resolve_accumulation`): an optimizer
step runs ``accumulate`` micro-batches of ``data.batch_size`` per process, each loss scaled by ``1 / accumulate``,
so the summed gradients are those of one batch of all of them (every task's loss is a mean over a fixed number of
terms per sample); gradients cross processes on the last micro-batch only (DDP ``no_sync``, FSDP2 without
reduce-scatter before it), then one clipping, GradScaler step, optimizer step, schedule step and EMA update. The
default, ``auto``, forms the recipe's global batch (``task.global_batch``) on any number of processes. Steps,
logs, schedules and checkpoints count optimizer steps; a stop signal finishes the step's micro-batches first.

Exact resume: the checkpoint holds the model, optimizer, scheduler, EMA, RNG states and the step; the data
order is a function of ``(seed, epoch)`` (:class:`~tasks.common.data.ResumableSampler`), each ``DataLoader`` has
its own generator seeded from ``(seed, epoch)`` (so making an iterator does not consume the global RNG that
drop-path uses), and a resumed run skips the batches of the current epoch it already consumed. A resumed run
therefore ends with the same parameters, and logs the same losses, as an uninterrupted one (tested, with
drop-path). ``trainer.resume``: ``auto`` (this run folder's ``last.pt`` / ``last.dcp`` if there is one),
``last`` (it must be there), or a run folder / checkpoint path.

Logging: each record goes with the same keys to ``metrics.jsonl``, W&B and the text lines
(:mod:`tasks.common.logger`); with W&B, a heatmap of every matrix the modules log at each evaluation (MHLA's
mixing matrices: ``mixing/<layer>``) and the :class:`~tasks.common.logger.Media` that a task's ``evaluate`` (``eval/<name>``)
or ``after_fit`` (``final/<name>``) returns. Checkpoints hold the W&B run id, so a resumed run continues the
same W&B run.

Data-loader workers: ``trainer.num_workers`` is capped to the CPUs this process may use
(:func:`cap_num_workers`), with one line saying so.

Interrupts: SIGINT (Ctrl-C) and SIGTERM (preemption) stop the run at the end of the current step (or
evaluation): ``last.pt`` is saved, the logger is finished, and :class:`TrainingInterrupted` is raised, which
``train.py`` turns into exit code 130 / 143. A second signal stops at once without saving.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import OmegaConf, open_dict
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from mhla.hooks import after_optimizer_step, logged_matrices, regularization_loss

from .checkpoint import (
    TRAINER_STATE,
    CheckpointManager,
    find_checkpoint,
    is_sharded_checkpoint,
    latest_checkpoint,
    load_run_checkpoint,
)
from .config import ConfigError, check_trainer, recipe_global_batch, resolve_accumulation
from .data import ResumableSampler, WorkerEpoch, loader_generator, loader_seed
from .distributed import all_reduce_mean, barrier, setup_distributed
from .ema import ModelEMA
from .logger import Media, RunLogger, format_metrics, heatmap_image, open_run_log, run_log, split_media
from .optim import build_optimizer, build_scheduler
from .progress import ProgressLoader
from .records import code_version, write_run_record
from .task import Task
from .utils import (
    count_flops,
    count_parameters,
    load_average,
    rng_state,
    seed_everything,
    set_rng_state,
    system_info,
)


def _fsdp_module():
    """:mod:`tasks.common.fsdp`, imported when a run uses FSDP (torch's FSDP and DCP take ~1 s to import)."""
    from . import fsdp  # noqa: PLC0415

    return fsdp


def matrix_heatmaps(model: nn.Module, step: int) -> dict[str, Media]:
    """``{"<kind>/<layer>": Media}``: a heatmap image of each matrix the model's modules log
    (:func:`mhla.hooks.logged_matrices`; MHLA: ``mixing/<layer>``)."""
    return {key: Media(heatmap_image(w.numpy(), f"{key.partition('/')[2]} {key.partition('/')[0]} matrix, step {step}"),
                       caption=f"step {step}")
            for key, w in logged_matrices(model).items()}


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one, else the CPU count): the
    number that PyTorch's DataLoader compares ``num_workers`` with."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def cap_num_workers(requested: int) -> tuple[int, str | None]:
    """``(workers, note)``: ``requested`` data-loader workers, at most :func:`available_cpus` (more only make
    PyTorch warn and the workers compete for the cores), and a line saying so when capped (else None)."""
    cpus = available_cpus()
    if requested <= cpus:
        return requested, None
    return cpus, (f"data loader: trainer.num_workers={requested} capped to {cpus}, the CPUs available to this "
                  f"process")


def _precision_context(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return torch.autocast(device_type=device.type, dtype=dtype)


class TrainingInterrupted(Exception):
    """Training stopped by SIGINT / SIGTERM; ``last.pt`` holds the step reached. ``exit_code`` is the shell's
    convention for a process ended by that signal (128 + its number: 130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + signum
        saved = f"saved {checkpoint}" if checkpoint is not None else "nothing trained, nothing saved"
        super().__init__(f"{signal.Signals(signum).name} at step {step}: {saved}")


class StopSignals:
    """Within ``with StopSignals() as stop:``, SIGINT and SIGTERM set ``stop.signum`` instead of ending the
    process, so the training loop can save and finish at the end of its step; a second signal raises
    ``KeyboardInterrupt`` at once. Installed only from the main thread (elsewhere Python cannot)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without saving")
        self.signum = signum  # no printing here: the handler may interrupt a print


def _ignore_stop_signals(worker_id: int) -> None:
    """``DataLoader`` worker start-up: ignore Ctrl-C (sent to the whole process group) and SIGTERM, so that a
    worker does not die under the batch the main process is waiting for while the run stops and saves."""
    for sig in StopSignals.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def stop_workers(loader: DataLoader | None) -> None:
    """End ``loader``'s persistent worker processes now. They ignore SIGTERM (:func:`_ignore_stop_signals`),
    so left alive until interpreter exit, ``multiprocessing``'s exit hook would terminate them in vain and then
    wait for them forever; a loader still referenced after :meth:`Trainer.fit` (a caller, a traceback) would
    otherwise hang the process at exit. The loader stays usable: its next iteration starts new workers."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
        loader._iterator = None


def plan_schedule(max_steps, max_epochs, steps_per_epoch: int) -> tuple[int, str | None]:
    """The run's total optimizer steps, the smaller of ``max_steps`` and ``ceil(max_epochs x steps_per_epoch)``
    (null: no limit), and a note when ``max_epochs`` cuts ``max_steps`` short (else None)."""
    by_steps = int(max_steps) if max_steps is not None else None
    by_epochs = int(math.ceil(float(max_epochs) * steps_per_epoch)) if max_epochs is not None else None
    if by_steps is None and by_epochs is None:
        raise ConfigError("set trainer.max_steps or trainer.max_epochs")
    if by_steps is None or (by_epochs is not None and by_epochs < by_steps):
        note = None if by_steps is None else (
            f"NOTE: trainer.max_steps={by_steps} is capped by trainer.max_epochs={max_epochs} ({max_epochs} x "
            f"{steps_per_epoch} steps per epoch = {by_epochs} steps); set trainer.max_epochs=null to train "
            f"{by_steps} steps")
        return by_epochs, note
    return by_steps, None


#: the settings a resumed run should share with its checkpoint, with the names the warnings use
_RESUME_FACTS = {"global_batch": "global batch", "total_steps": "step total", "lr": "optim.lr", "seed": "seed"}
_LEGACY_FACTS = {"batch_size": "data.batch_size", "lr": "optim.lr", "seed": "seed"}  # checkpoints without "run"


def resume_mismatches(state: dict, facts: dict) -> list[str]:
    """A warning for each of global batch, step total, lr and seed on which this run (``facts``) differs from
    the checkpoint (``state["run"]``; for older checkpoints: batch size, lr and seed of their stored config)."""
    saved, labels = state.get("run"), _RESUME_FACTS
    if not saved:
        config = state.get("config") or {}
        saved = {"batch_size": (config.get("data") or {}).get("batch_size"),
                 "lr": (config.get("optim") or {}).get("lr"), "seed": config.get("seed")}
        labels = _LEGACY_FACTS
    return [f"this run's {label} is {facts[key]} but the checkpoint's is {saved[key]}: the resumed run will not "
            f"match an uninterrupted run"
            for key, label in labels.items() if saved.get(key) is not None and saved[key] != facts[key]]


@dataclass
class _Run:
    """What the training loop of one :meth:`Trainer.fit` works on."""

    model: nn.Module
    wrapped: nn.Module
    ema: ModelEMA | None
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: torch.amp.GradScaler
    ckpt: CheckpointManager
    sampler: ResumableSampler
    train_data: object  # the train dataset as the loader sees it (WorkerEpoch-wrapped with workers)
    train_loader: DataLoader
    eval_loader: DataLoader | None
    seed: int
    total: int
    steps_per_epoch: int  # optimizer steps
    facts: dict  # global_batch, batch_size, total_steps, lr, seed
    accumulate: int = 1  # micro-batches per optimizer step
    step: int = 0
    saved_step: int = -1  # the step of the last checkpoint saved (or loaded)
    logger: RunLogger | None = None
    segments: list = field(default_factory=list)  # the processes that trained it before this one (a resume)
    segment: dict = field(default_factory=dict)  # this process: started, from_step, commit, load_before
    t0: float = 0.0  # this process's start (time.time()), for its segment's seconds

    def history(self) -> list[dict]:
        """:attr:`segments` and this process's segment up to :attr:`step` (``tasks.common.records``)."""
        if not self.segment:
            return list(self.segments)
        now = {**self.segment, "to_step": self.step, "seconds": round(time.time() - self.t0, 1)}
        return self.segments + [now]


def weights_seed(cfg) -> int:
    """The seed the model's initial weights are drawn from: ``trainer.init_seed`` when set (a control that crosses
    one seed's weights with another's data order), else the run's ``seed``."""
    init_seed = cfg.trainer.get("init_seed")
    return int(cfg.get("seed", 0) if init_seed is None else init_seed)


class Trainer:
    """Runs :class:`Task` training under ``cfg.trainer``, ``cfg.optim``, ``cfg.sched``, ``cfg.logger``."""

    def __init__(self, cfg, task: Task, run_dir: str | os.PathLike):
        self.cfg = cfg
        self.task = task
        self.tcfg = cfg.trainer
        self._auto_accumulate = False  # trainer.accumulate=auto (set by _resolve_accumulation)
        self.run_dir = Path(run_dir)
        self.dist = setup_distributed(self.tcfg.get("device", "auto"))
        self.device = self.dist.device
        precision = self.tcfg.get("precision", "auto")
        if precision == "auto":
            precision = "bf16" if self.device.type == "cuda" else "fp32"
        if precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"trainer.precision must be auto, fp32, bf16 or fp16, got {precision!r}")
        self.precision = precision
        requested = self.tcfg.get("num_workers", 0)  # not an int >= 0: check_trainer says so when fit() starts
        requested = requested if isinstance(requested, int) and requested > 0 else 0
        self.num_workers, self._workers_note = cap_num_workers(requested)
        if self.device.type == "cuda":  # TF32 matmuls/convs in fp32 (DiT's and DiG's scripts turn them on)
            tf32 = bool(self.tcfg.get("tf32", False))
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32

    # ------------------------------------------------------------------------------------ set-up
    @property
    def _fsdp(self) -> bool:
        """FSDP2 shards this run: ``trainer.strategy=fsdp`` with more than one process."""
        return self.dist.enabled and self.tcfg.get("strategy", "ddp") == "fsdp"

    def _gathered(self, *modules: nn.Module | None):
        """Under FSDP, the whole weights of ``modules`` for the block (:func:`tasks.common.fsdp.gathered`);
        else nothing."""
        return _fsdp_module().gathered(*modules) if self._fsdp else contextlib.nullcontext()

    def _print(self, *args) -> None:
        """Print on the main process, and write the line to ``train.log``."""
        if self.dist.is_main:
            msg = " ".join(str(a) for a in args)
            print(msg, flush=True)
            run_log().info(msg)

    def _wrap(self, model: nn.Module, ema: ModelEMA | None) -> nn.Module:
        """The model the training step runs: ``model`` itself with one process; under ``torchrun``, DDP around
        it (``trainer.strategy=ddp``) or ``model`` sharded in place with FSDP2 (``fsdp``; the EMA's copy is
        sharded the same way, so each rank averages its own shard: :mod:`tasks.common.fsdp`)."""
        if not self.dist.enabled:
            return model
        d = self.dist
        nodes = d.world_size // max(d.local_world_size, 1)
        self._print(f"torchrun: {d.world_size} processes on {nodes} node{'s' * (nodes != 1)} "
                    f"({d.local_world_size} per node), trainer.strategy={self.tcfg.get('strategy', 'ddp')}")
        if self.tcfg.get("strategy", "ddp") == "ddp":
            ids = [self.device.index] if self.device.type == "cuda" else None
            return DDP(model, device_ids=ids)
        fsdp = _fsdp_module()
        mesh = fsdp.device_mesh(self.device, self.dist.world_size)
        sharded = fsdp.shard_model(model, mesh, self.precision)
        if ema is not None:
            fsdp.shard_model(ema.module, mesh, self.precision)
        self._print(f"FSDP2 over {self.dist.world_size} processes: sharded {sharded}"
                    + ("" if self.precision == "fp32"
                       else f"; {self.precision} parameters, fp32 gradient reduction"))
        return model

    def _loader(self, dataset, sampler, batch_size: int, generator: torch.Generator) -> DataLoader:
        """A loader with its own ``generator``; its workers stay alive across epochs and evaluations and leave
        SIGINT / SIGTERM to the main process (which stops the run and then shuts them down)."""
        workers = self.num_workers
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                          collate_fn=self.task.collate, pin_memory=self.device.type == "cuda",
                          persistent_workers=workers > 0, drop_last=False, generator=generator,
                          worker_init_fn=_ignore_stop_signals if workers > 0 else None)

    def _describe_model(self, model: nn.Module) -> int:
        """Print the model line (parameters, and GMACs unless ``trainer.count_flops=false``); returns the
        parameter count. A task with the optional hook ``paper_flops(model, device) -> (FLOPs, words, words for
        the example's count) | None`` (:meth:`~tasks.classification.task.ClassificationTask.paper_flops`: DeiT
        zero-pads 224 px to 256 px) also gets the count at the paper's resolution."""
        n_params = count_parameters(model)
        flops_msg = ""
        example = self.task.example_input(self.device)
        if example is not None and self.dist.is_main and self.tcfg.get("count_flops", True):
            flops = count_flops(model, *example) if isinstance(example, tuple) else count_flops(model, example)
            counter = "torch.utils.flop_counter: matmuls, convs and attention; elementwise ops not counted"
            paper_hook = getattr(self.task, "paper_flops", None)
            paper = paper_hook(model, self.device) if paper_hook is not None else None
            if paper is None:
                flops_msg = f", {flops / 2e9:.3f} GMACs per sample ({counter})"
            else:
                paper_flops, paper_words, run_words = paper
                flops_msg = (f", GMACs per sample ({counter}): {flops / 2e9:.3f} {run_words}, "
                             f"{paper_flops / 2e9:.3f} {paper_words}")
        self._print(f"model: {self.task.describe_model(model)}: {n_params / 1e6:.3f}M params{flops_msg}")
        return n_params

    def _plan(self, n_train: int, sampler: ResumableSampler) -> int:
        """Print the data and schedule lines (the global batch as ``1024 = 128 x 2 processes x 4 accumulation
        steps``, the recipe-batch warning when ``trainer.accumulate`` forces another global batch, the max_epochs
        cap note); returns the total number of optimizer steps."""
        cfg, bs, world, k = self.cfg, sampler.batch_size, self.dist.world_size, sampler.accumulate
        steps_per_epoch = sampler.steps_per_epoch
        global_batch = bs * world * k
        recipe = recipe_global_batch(cfg)
        source = f" (trainer.accumulate=auto: {recipe[1]})" if recipe and self._auto_accumulate else ""
        self._print(f"data: {n_train} train samples, global batch {global_batch} = {bs} x {world} "
                    f"process{'es' * (world != 1)} x {k} accumulation step{'s' * (k != 1)}{source}, "
                    f"{steps_per_epoch} steps per epoch")
        if recipe and recipe[0] != global_batch:
            self._print(f"WARNING: the recipe's global batch is {recipe[0]} ({recipe[1]}) but this run uses "
                        f"{global_batch} (trainer.accumulate={k}); trainer.accumulate=auto forms the recipe's, "
                        f"else scale optim.lr (linear scaling: lr x {global_batch / recipe[0]:.3g})")
        total, note = plan_schedule(self.tcfg.get("max_steps"), self.tcfg.get("max_epochs"), steps_per_epoch)
        self._print(f"schedule: {total} steps ({total / steps_per_epoch:.3g} epochs)")
        if note:
            self._print(note)
        return total

    # ------------------------------------------------------------------------------------ resume
    def _resume_path(self) -> Path | None:
        """The checkpoint that ``trainer.resume`` names, or None to start fresh."""
        resume = self.tcfg.get("resume")
        if resume is None or resume is False or resume == "":
            return None
        own = latest_checkpoint(self.run_dir / "checkpoints")  # last.pt, or last.dcp (FSDP)
        if resume == "auto":
            if own is not None:
                return own
            self._print(f"resume=auto: no checkpoint in {self.run_dir / 'checkpoints'}, starting fresh (to "
                        f"continue a run in another folder, pass trainer.resume=<its run folder>)")
            return None
        if resume is True or resume == "last":
            if own is None:
                raise FileNotFoundError(
                    f"trainer.resume={resume}: no checkpoint (last.pt / last.dcp) in "
                    f"{self.run_dir / 'checkpoints'}. Pass trainer.resume=<run folder or checkpoint> to "
                    f"continue another run, or trainer.resume=auto to start fresh when there is none")
            return own
        return find_checkpoint(resume)

    def _load_resume(self, model: nn.Module, ckpt: CheckpointManager, facts: dict) -> dict | None:
        """Load the weights of the checkpoint to resume into ``model`` (before wrapping, so full weights load
        into the plain model) and return its state; warn about settings that changed; None to start fresh. An
        FSDP run resuming from a DCP folder reads only its ``trainer.pt`` here (the state's ``sharded_from``):
        the tensors load after sharding (:meth:`_restore`)."""
        path = self._resume_path()
        if path is None:
            if (left := latest_checkpoint(ckpt.dir)) is not None:
                self._print(f"WARNING: {left} is left from an earlier run in this folder; this fresh run "
                            f"overwrites it and its metrics.jsonl (trainer.resume=auto would continue it)")
            return None
        if self._fsdp and is_sharded_checkpoint(path):
            state = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)
            state["sharded_from"] = path
        elif self._fsdp:  # every rank maps the file; the weights go to the model before it is sharded
            state = load_run_checkpoint(path, map_location="cpu", require=("optimizer", "scheduler", "rng"),
                                        mmap=True)
        else:
            state = load_run_checkpoint(path, map_location=self.device,
                                        require=("optimizer", "scheduler", "rng"))
        if "sharded_from" not in state:
            model.load_state_dict(state["model"])
        step, total = int(state["step"]), facts["total_steps"]
        self._print(f"resumed from {path} at step {step}")
        for warning in resume_mismatches(state, facts):
            self._print(f"WARNING: {warning}")
        if step > total:
            raise ConfigError(
                f"the checkpoint {path} is at step {step}, past the end of this run's schedule ({total} steps at "
                f"global batch {facts['global_batch']}): nothing to train. Resume with the settings of the "
                f"interrupted run (data.batch_size, trainer.max_steps / max_epochs) or raise trainer.max_steps")
        if step == total:
            self._print(f"the checkpoint is at step {step}, the end of this run's schedule: nothing left to "
                        f"train")
        return state

    def _restore(self, state: dict, run: _Run) -> None:
        """Optimizer, scheduler, EMA, scaler, RNG and best metric from a checkpoint's ``state``."""
        if "sharded_from" in state:  # FSDP from a DCP folder: each rank loads its shards
            _fsdp_module().load_sharded(state["sharded_from"], run.model, run.optimizer,
                              run.ema.module if run.ema is not None else None)
            if run.ema is not None and state.get("ema_num_updates") is not None:
                run.ema.num_updates.copy_(state["ema_num_updates"])
        elif self._fsdp:  # FSDP from a .pt: the weights were loaded before sharding
            _fsdp_module().load_optimizer_state(run.model, run.optimizer, state["optimizer"], self.dist.rank)
        else:
            run.optimizer.load_state_dict(state["optimizer"])
        run.scheduler.load_state_dict(state["scheduler"])  # (a .pt's EMA was loaded before sharding: _setup)
        if state.get("scaler"):
            run.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"][min(self.dist.rank, len(state["rng"]) - 1)]
                      if isinstance(state["rng"], list) else state["rng"])
        run.ckpt.best = state.get("best_metric")
        run.step = run.saved_step = int(state["step"])
        # a checkpoint from before the history was kept: what trained up to its step is unknown
        run.segments = list(state.get("segments") or [{"from_step": None, "to_step": run.step}])

    # ------------------------------------------------------------------------------------- fit
    def fit(self) -> dict:
        """Train for the configured schedule (resuming if ``trainer.resume`` says so), evaluating and saving
        checkpoints on the way. Returns the last evaluation's metrics plus the task's :meth:`Task.after_fit` ones.

        Raises:
            TrainingInterrupted: after SIGINT / SIGTERM, once ``last.pt`` is saved and the logger finished.
        """
        check_trainer(self.cfg)
        started, load_before = time.time(), load_average()
        if self.dist.is_main:
            open_run_log(self.run_dir)
        with StopSignals() as stop:
            run = self._setup()
            # this process's segment of the run (one per process that trained it; the record lists them)
            run.t0 = started
            run.segment = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                           "from_step": run.step, **code_version(), "load_before": load_before}
            exit_code = 1
            try:
                metrics = self._fit(run, stop)
                exit_code = 0
            except TrainingInterrupted as e:
                exit_code = e.exit_code
                raise
            finally:
                run.logger.finish(exit_code=exit_code)
                for loader in (run.train_loader, run.eval_loader):
                    stop_workers(loader)
        if self.dist.is_main:  # the run's record: resolved config, code version, machine and its load
            write_run_record(self.run_dir, self.cfg, metrics, seconds=time.time() - started,
                             load_before=load_before, segments=run.history(), attention=self.task.attention)
        barrier(self.dist)
        return metrics

    def _setup(self) -> _Run:
        """Model, data, schedule, optimizer, checkpoint manager, logger; the resumed state when resuming."""
        cfg, tcfg = self.cfg, self.tcfg
        accumulate = self._resolve_accumulation()
        seed = int(cfg.get("seed", 0))
        init_seed = weights_seed(cfg)
        seed_everything(init_seed)
        model = self.task.build_model().to(self.device)
        if init_seed != seed:
            seed_everything(seed)  # everything after the weights (data order, loaders) follows the run's seed
        if tcfg.get("init_from"):  # another run's weights (docs/conversion.md); trainer.resume still wins
            from .init_from import init_model_from  # noqa: PLC0415

            for line in init_model_from(model, tcfg.init_from, self.task.attention.options,
                                        map_location=self.device):
                self._print(line)
        n_params = self._describe_model(model)

        train_ds, eval_ds = self.task.build_datasets()
        bs = int(cfg.data.batch_size)
        sampler = ResumableSampler(len(train_ds), bs, rank=self.dist.rank, world_size=self.dist.world_size,
                                   shuffle=True, seed=seed, repeats=int(cfg.data.get("repeated_aug", 1) or 1),
                                   accumulate=accumulate)
        total = self._plan(len(train_ds), sampler)
        facts = {"global_batch": bs * self.dist.world_size * accumulate, "batch_size": bs, "total_steps": total,
                 "lr": float(cfg.optim.lr), "seed": seed}

        ckpt = CheckpointManager(self.run_dir / "checkpoints", monitor=self.task.monitor,
                                 mode=self.task.monitor_mode, sharded=self._fsdp)
        if self.dist.is_main and (stale := ckpt.remove_stale_temp_files()):
            self._print(f"removed {len(stale)} temp file(s) left by an interrupted checkpoint save in {ckpt.dir}")
        state = self._load_resume(model, ckpt, facts)

        ema = None
        if tcfg.get("ema", {}).get("enabled", False):
            ema = ModelEMA(model, decay=tcfg.ema.decay, warmup=tcfg.ema.get("warmup", True))
            if state is not None and state.get("ema") is not None:  # whole weights, before FSDP shards them
                ema.load_state_dict(state["ema"])
        wrapped = self._wrap(model, ema)
        self._wrapped = wrapped
        optimizer = build_optimizer(wrapped, cfg.optim)
        scheduler = build_scheduler(optimizer, cfg.sched, total, sampler.steps_per_epoch)
        fp16_cuda = self.precision == "fp16" and self.device.type == "cuda"
        if self._fsdp:  # found-inf agreed by all ranks (each sees its shard of the gradients)
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # noqa: PLC0415

            scaler = ShardedGradScaler(enabled=fp16_cuda)
        else:
            scaler = torch.amp.GradScaler(enabled=fp16_cuda)

        if self._workers_note:
            self._print(self._workers_note)
        workers = self.num_workers
        train_data = WorkerEpoch(train_ds) if workers > 0 and hasattr(train_ds, "set_epoch") else train_ds
        eval_loader = None
        if eval_ds is not None:
            eval_bs = int(cfg.data.get("eval_batch_size") or bs)
            eval_sampler = ResumableSampler(len(eval_ds), eval_bs, rank=self.dist.rank,
                                            world_size=self.dist.world_size, shuffle=False, drop_last=False)
            eval_loader = self._loader(eval_ds, eval_sampler, eval_bs, loader_generator(seed))

        run = _Run(model=model, wrapped=wrapped, ema=ema, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                   ckpt=ckpt, sampler=sampler, train_data=train_data,
                   train_loader=self._loader(train_data, sampler, bs, loader_generator(seed)),
                   eval_loader=eval_loader, seed=seed, total=total, steps_per_epoch=sampler.steps_per_epoch,
                   facts=facts, accumulate=accumulate)
        resumed, wandb_id = state is not None, None
        if resumed:
            self._restore(state, run)
            wandb_id = state.get("wandb_run_id")
            del state
        run.logger = self._start_logger(wandb_id, run.step)
        if self.dist.is_main and not resumed:  # a resumed run logged it when it started
            run.logger.log({"params": n_params}, run.step)
        return run

    def _start_logger(self, resume_id: str | None, from_step: int) -> RunLogger:
        """The run's logger, whose ``metrics.jsonl`` keeps the records up to ``from_step`` (the step resumed at;
        0: a fresh run, none kept); with W&B it continues the run ``resume_id`` (from the checkpoint resumed) and prints one
        line naming the W&B run."""
        cfg = self.cfg
        resolved = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
        logger = RunLogger(cfg.get("logger"), self.run_dir, resolved, system_info(), enabled=self.dist.is_main,
                           resume_id=resume_id, from_step=from_step)
        if logger.run_id is not None:
            again = " (continued: the id stored in the checkpoint)" if logger.run_id == resume_id else ""
            self._print(f"W&B run {logger.run_id}{again}, mode {logger.mode}, files in {self.run_dir / 'wandb'}")
        return logger

    def _fit(self, run: _Run, stop: StopSignals) -> dict:
        """The training loop, then the final evaluation (when nothing was left to train) and ``after_fit``."""
        start_step, t0 = run.step, time.time()
        metrics = self._train(run, stop)
        self.step = run.step
        self.model, self.ema = run.model, run.ema  # after_fit may sample from them
        signum = self._stop_agreed(stop)
        if signum:
            self._stop(run, signum)
        if run.step == start_step and run.eval_loader is not None:  # resumed at the end of the schedule
            metrics = self._evaluate(run)
        elapsed = time.time() - t0
        with self._gathered(run.model, run.ema.module if run.ema is not None else None):  # FSDP: whole weights
            extra, media = split_media(self.task.after_fit(self, dict(metrics)) or {})
        metrics = {**metrics, **extra}
        if self.dist.is_main:
            run.logger.log_media({f"final/{k}": m for k, m in media.items()}, run.step)
            run.logger.summary({**metrics, "train_time_s": elapsed, "steps": run.step}, run.step)
        return metrics

    def _train(self, run: _Run, stop: StopSignals) -> dict:
        """Steps until the end of the schedule, ``trainer.stop_after_steps`` or a stop signal; returns the last
        evaluation's metrics."""
        stop_after = self.tcfg.get("stop_after_steps")
        progress = None
        if self.dist.is_main and self.tcfg.get("progress_bar", True):
            progress = tqdm(total=run.total, initial=run.step, desc="train", dynamic_ncols=True)
        metrics: dict = {}
        start = (run.step, time.time())
        run.wrapped.train()
        try:
            while run.step < run.total and not self._stop_agreed(stop):
                self._start_epoch(run)
                batches = iter(run.train_loader)
                for _ in range(len(run.train_loader) // run.accumulate):  # the epoch's optimizer steps left
                    loss, logs, grad_norm = self._train_step(run, batches)
                    run.step += 1
                    if progress is not None:
                        progress.update(1)
                        progress.set_postfix(loss=f"{loss.item():.4f}")
                    metrics = self._after_step(run, loss, logs, grad_norm, start, metrics)
                    if run.step >= run.total or (stop_after and run.step >= int(stop_after)) \
                            or self._stop_agreed(stop):
                        break
                if stop_after and run.step >= int(stop_after):
                    break
        finally:
            if progress is not None:
                progress.close()
        return metrics

    def _start_epoch(self, run: _Run) -> None:
        """Point the sampler, the dataset and the loader's generator at the epoch of ``run.step`` (from the first
        micro-batch of its next optimizer step)."""
        epoch, in_epoch = divmod(run.step, run.steps_per_epoch)
        run.sampler.set_epoch(epoch, skip_batches=in_epoch * run.accumulate)
        if hasattr(run.train_data, "set_epoch"):
            run.train_data.set_epoch(epoch)
        run.train_loader.generator.manual_seed(loader_seed(run.seed, epoch))

    def _train_step(self, run: _Run, batches) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
        """One optimizer step on the next ``run.accumulate`` micro-batches of the iterator ``batches``: their
        gradients summed (:meth:`_backward`), synchronised across processes on the last one only
        (:meth:`_gradient_sync`), then one clipping, GradScaler step, optimizer step, schedule step,
        ``after_optimizer_step`` and EMA update. Returns the loss of the whole batch (the mean of the micro-batches'
        losses), the task's logs (means alike) and the gradient norm (if clipped)."""
        k = run.accumulate
        run.optimizer.zero_grad(set_to_none=True)
        losses, logs = [], []
        for micro in range(k):
            with self._gradient_sync(run, micro == k - 1):
                loss, micro_logs = self._backward(run, next(batches), micro)
            losses.append(loss.detach() if k > 1 else loss)
            logs.append(micro_logs)
        loss = losses[0] if k == 1 else torch.stack(losses).mean()
        logs = logs[0] if k == 1 else {name: sum(one[name] for one in logs) / k for name in logs[0]}
        grad_norm = None
        clip = self.tcfg.get("grad_clip")
        if clip:
            run.scaler.unscale_(run.optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(run.wrapped.parameters(), float(clip))
            if self._fsdp:  # a DTensor (the gradients are sharded): its value, all shards' norm
                grad_norm = _fsdp_module().full_tensor(grad_norm)
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.scheduler.step()
        after_optimizer_step(run.model)
        if run.ema is not None:
            run.ema.update(run.model)
        return loss, logs, grad_norm

    def _backward(self, run: _Run, batch, micro: int) -> tuple[torch.Tensor, dict]:
        """Forward and backward of micro-batch ``micro`` of the step; its loss is scaled by ``1 / accumulate``
        before the backward, so the gradients the step sums equal those of one batch of all its micro-batches
        (a mean over ``accumulate`` equal-sized means), the modules' regularization terms added
        (:func:`mhla.hooks.regularization_loss`; logged as ``reg_loss``). Returns the unscaled loss and the
        task's logs."""
        batch = self.task.on_batch(batch, self.device)
        with _precision_context(self.precision, self.device):
            loss, logs = self.task.training_loss(run.wrapped, batch)
            reg = regularization_loss(run.model)  # the modules' own terms (a write gate's budget)
            if reg is not None:
                logs = {**logs, "reg_loss": reg.item()}
                loss = loss + reg
        if not torch.isfinite(loss):
            where = f", micro-batch {micro + 1}/{run.accumulate}" if run.accumulate > 1 else ""
            raise FloatingPointError(f"loss is {loss.item()} at step {run.step}{where}; lower optim.lr or check "
                                     f"data")
        run.scaler.scale(loss if run.accumulate == 1 else loss / run.accumulate).backward()
        return loss, logs

    def _gradient_sync(self, run: _Run, sync: bool):
        """The context of a micro-batch's forward and backward: gradients are reduced across processes only when
        ``sync`` (the step's last micro-batch); before it each process sums its own (DDP: ``no_sync``; FSDP2:
        :func:`tasks.common.fsdp.no_gradient_sync`, no reduce-scatter)."""
        if sync or not self.dist.enabled:
            return contextlib.nullcontext()
        if self._fsdp:
            return _fsdp_module().no_gradient_sync(run.model)
        return run.wrapped.no_sync()

    def _resolve_accumulation(self) -> int:
        """``trainer.accumulate`` resolved for this run's processes (:func:`resolve_accumulation`), written back
        into the config as the integer, so the checkpoints and ``run.json`` store the count the run used."""
        self._auto_accumulate = self.tcfg.get("accumulate", "auto") == "auto"
        accumulate = resolve_accumulation(self.cfg, self.dist.world_size)
        if OmegaConf.is_config(self.cfg):
            with open_dict(self.cfg):
                self.cfg.trainer.accumulate = accumulate
        return accumulate

    def _after_step(self, run: _Run, loss, logs: dict, grad_norm, start: tuple[int, float], metrics: dict) -> dict:
        """Log, evaluate and save as the step's number says; returns the latest evaluation's metrics."""
        tcfg, step = self.tcfg, run.step
        if step % int(tcfg.get("log_every", 50)) == 0 or step == run.total:
            rec = {"train/loss": all_reduce_mean(loss.detach(), self.dist).item(),
                   "train/lr": run.scheduler.get_last_lr()[0], "epoch": step / run.steps_per_epoch,
                   **{f"train/{k}": float(v) for k, v in logs.items()}}
            if grad_norm is not None:
                rec["train/grad_norm"] = float(grad_norm)
            rec = run.logger.log(rec, step)
            if self.dist.is_main:
                rate = (step - start[0]) / max(time.time() - start[1], 1e-9)
                train = {k: v for k, v in rec.items() if k != "epoch"}
                run_log().info(f"step {step}/{run.total} (epoch {rec['epoch']:.2f}): "
                               f"{format_metrics(train, 'train/')}, {rate:.2f} steps/s")
        end_of_epoch = step % run.steps_per_epoch == 0
        eval_every = tcfg.get("eval_every_steps")
        do_eval = run.eval_loader is not None and (
            (eval_every and step % int(eval_every) == 0) or (not eval_every and end_of_epoch) or step == run.total)
        if do_eval:
            metrics = self._evaluate(run)
            rec = run.logger.log({f"eval/{k}": v for k, v in metrics.items()}, step)
            self._print(f"step {step}: {format_metrics(rec, 'eval/')}")
            run.wrapped.train()
        ckpt_every, stop_after = tcfg.get("checkpoint_every_steps"), tcfg.get("stop_after_steps")
        if (ckpt_every and step % int(ckpt_every) == 0) or end_of_epoch or step == run.total \
                or (stop_after and step >= int(stop_after)):
            self._save(run, metrics if do_eval else None)
        return metrics

    # ------------------------------------------------------------------------------- interrupts
    def _stop_agreed(self, stop: StopSignals) -> int | None:
        """The stop signal if any process received one (all processes agree, so they stop at the same step and
        save together); None to go on."""
        signum = stop.signum or 0
        if self.dist.enabled:
            flag = torch.tensor([signum], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            signum = int(flag.item())
        return signum or None

    def _stop(self, run: _Run, signum: int) -> None:
        """Save ``last.pt`` at the step reached (unless already saved there) and raise TrainingInterrupted."""
        trained = run.step > 0
        if trained and run.saved_step != run.step:
            self._save(run, None)
        name = signal.Signals(signum).name
        where = run.ckpt.last_path if trained else None
        self._print(f"{name} received: stopped at step {run.step}/{run.total}"
                    + (f", saved {where}. Resume with the same command and trainer.resume={self.run_dir}"
                       if where else ", nothing trained"))
        raise TrainingInterrupted(signum, run.step, where)

    # ------------------------------------------------------------------------------- evaluation, saving
    def _evaluate(self, run: _Run) -> dict:
        """Evaluate the EMA weights (``trainer.ema.evaluate: true``), the model (``false``) or both (``both``:
        the model's metrics under their names, the EMA's prefixed ``ema_``, e.g. ``top1`` and ``ema_top1``; the
        model's drive ``best.pt``) on the eval loader; returns the scalar metrics, after logging the media (the
        task's, as ``eval/<name>``, and the mixing heatmaps) of the weights whose metrics are unprefixed."""
        ema, which = run.ema, self.tcfg.ema.get("evaluate", True)
        if ema is not None and which == "both":
            ema_metrics = self._evaluate_weights(run, ema.module, log_media=False)
            return {**self._evaluate_weights(run, run.model), **{f"ema_{k}": v for k, v in ema_metrics.items()}}
        return self._evaluate_weights(run, ema.module if (ema is not None and which) else run.model)

    def _evaluate_weights(self, run: _Run, target: nn.Module, log_media: bool = True) -> dict:
        target.eval()
        run.eval_loader.generator.manual_seed(loader_seed(run.seed, 0))  # the same for every evaluation
        # FSDP: whole weights for the evaluation (ranks may get different numbers of batches) and the heatmaps
        with self._gathered(target):
            with _precision_context(self.precision, self.device):
                loader = ProgressLoader(run.eval_loader, f"eval @ step {run.step}",
                                        enabled=self.dist.is_main and self.tcfg.get("progress_bar", True))
                metrics, media = split_media(self.task.evaluate(target, loader, self.device, self.dist))
            if log_media and run.logger is not None and run.logger.logs_media:
                media = {**{f"eval/{k}": m for k, m in media.items()}, **matrix_heatmaps(target, run.step)}
                run.logger.log_media(media, run.step)
        return metrics

    def _save(self, run: _Run, metrics: dict | None) -> None:
        """Write ``last.pt`` (and ``best.pt`` when ``metrics`` improved) from the main process; under FSDP
        ``last.dcp`` (``best.dcp``) from every rank, each writing its shards."""
        rngs = rng_state()
        if self.dist.enabled:
            gathered = [None] * self.dist.world_size
            dist.all_gather_object(gathered, rngs)
            rngs = gathered
        run.saved_step = run.step
        if self._fsdp:
            ema = run.ema.module if run.ema is not None else None
            tensors = _fsdp_module().sharded_state(run.model, run.optimizer, ema)
            ema_updates = run.ema.num_updates.detach().cpu().clone() if run.ema is not None else None
            state = {**self._trainer_state(run, rngs), "ema_num_updates": ema_updates}
            run.ckpt.save_sharded(tensors, state, metrics, run.step, self.dist.is_main)
            return
        if not self.dist.is_main:
            return
        state = {
            "model": run.model.state_dict(),
            "optimizer": run.optimizer.state_dict(),
            "ema": run.ema.state_dict() if run.ema is not None else None,
            **self._trainer_state(run, rngs),
        }
        run.ckpt.save(state, metrics)

    def _trainer_state(self, run: _Run, rngs) -> dict:
        """What a checkpoint holds besides the model, optimizer and EMA weights."""
        return {
            "scheduler": run.scheduler.state_dict(),
            "scaler": run.scaler.state_dict(),
            "step": run.step,
            "rng": rngs,
            "config": self.cfg_container(),
            "run": {k: run.facts[k] for k in _RESUME_FACTS},
            "wandb_run_id": run.logger.run_id if run.logger is not None else None,
            "segments": run.history(),
        }

    def cfg_container(self):
        return OmegaConf.to_container(self.cfg, resolve=True) if OmegaConf.is_config(self.cfg) else self.cfg
