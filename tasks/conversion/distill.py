#!/usr/bin/env python
"""Convert a trained ``train.py`` run to another attention, distil its attention layers, save a checkpoint.

    python -m tasks.conversion.distill teacher=outputs/mnist/vit_mnist-softmax/<run> attn=mhla
    distill.steps=200
    python train.py attn=mhla trainer.init_from=<this run's folder> trainer.max_steps=300     # then fine-tune

Steps (docs/conversion.md):

1. the teacher: the checkpoint's model, built by its own task from the config stored in it;
2. the student config: the teacher's config with ``attn`` replaced by this command's (``attn=mhla
   attn.<opt>=...``, resolved against the model's attention contract as ``train.py`` resolves it) and
   ``seed``;
3. the student: :func:`mhla.convert` of a copy of the teacher with that resolved attention; its state dict
   must be the one ``train.py`` builds for the student config (else ``trainer.init_from`` could not load it:
   refused here);
4. ``distill.steps`` steps of :func:`mhla.distill.distill_attention` on the task's training batches (the
   models are called through the task's own ``training_loss``), then the task's evaluation of the models
   ``evaluate`` names;
5. ``<run_dir>/checkpoints/last.pt`` in ``train.py``'s format (``model``, ``step``, ``config`` = the student
   config) and ``<run_dir>/run.json`` (:mod:`tasks.common.records`: config, commit, machine, load, metrics),
   and one ``final: ...`` line.
"""

from __future__ import annotations

import copy
import os
import time

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from mhla.conversion import convert
from mhla.distill import attention_gap, distill_attention
from tasks.common.checkpoint import (
    atomic_save,
    find_checkpoint,
    load_run_checkpoint,
    model_weights,
    run_config,
)
from tasks.common.config import ConfigError, model_attention, register_resolvers
from tasks.common.distributed import DistInfo
from tasks.common.records import write_run_record
from tasks.common.task import task_class
from tasks.common.utils import load_average, seed_everything

register_resolvers()

EVALUATED = ("teacher", "converted", "distilled")


def student_config(teacher_cfg, attn_cfg, seed: int):
    """The teacher's run config with ``attn`` replaced and ``seed`` set (struct off: the stored config is
    plain)."""
    cfg = copy.deepcopy(teacher_cfg)
    OmegaConf.set_struct(cfg, False)
    cfg.attn = OmegaConf.create(OmegaConf.to_container(attn_cfg, resolve=True))
    cfg.seed = int(seed)
    return cfg


def check_same_state(student, reference, what: str) -> None:
    """``student`` and ``reference`` have the same state-dict keys and shapes, else a ConfigError naming
    them."""
    a = {k: tuple(v.shape) for k, v in student.state_dict().items()}
    b = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    if a != b:
        diff = sorted(set(a) ^ set(b)) or sorted(k for k in a if a[k] != b[k])
        raise ConfigError(f"the converted model's weights differ from what train.py builds for {what} "
                          f"({diff[:6]}); train.py could not fine-tune it with trainer.init_from")


def loaders(task, cfg, batch_size: int, seed: int, eval_limit):
    train_ds, eval_ds = task.build_datasets()
    gen = torch.Generator().manual_seed(seed)
    train = torch.utils.data.DataLoader(train_ds, batch_size=batch_size, shuffle=True, drop_last=True,
                                        collate_fn=task.collate, generator=gen)
    if eval_limit:
        eval_ds = torch.utils.data.Subset(eval_ds, range(min(int(eval_limit), len(eval_ds))))
    eval_bs = int(cfg.data.get("eval_batch_size") or batch_size)
    evaluate = torch.utils.data.DataLoader(eval_ds, batch_size=eval_bs, shuffle=False,
                                           collate_fn=task.collate)
    return train, evaluate


def run(cfg: DictConfig, run_dir: str) -> dict:
    started, load_before = time.time(), load_average()
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if cfg.device == "auto" else cfg.device))
    wanted = list(cfg.get("evaluate") or [])
    bad = [w for w in wanted if w not in EVALUATED]
    if bad:
        raise ConfigError(f"evaluate={bad}: choose among {list(EVALUATED)}")
    ckpt = find_checkpoint(cfg.teacher)
    state = load_run_checkpoint(ckpt)
    teacher_cfg = run_config(state)
    scfg = student_config(teacher_cfg, cfg.attn, cfg.seed)
    attn = model_attention(scfg)  # resolved as train.py resolves it: refuses what the model cannot take
    print("student attention: " + " ".join(f"{k}={v}" for k, v in attn.items()), flush=True)

    seed_everything(int(cfg.seed))
    task = task_class(teacher_cfg)(teacher_cfg)
    teacher = task.build_model()
    teacher.load_state_dict(model_weights(state, prefer=str(cfg.teacher_weights)))
    teacher.to(device).eval()
    student = convert(teacher, attn, copy=True)
    check_same_state(student, task_class(scfg)(scfg).build_model(), f"attn={attn['name']}")
    conv = student.mhla_conversion
    print(f"converted {len(conv['layers'])} layers of {type(student).__name__} ({conv['family']}); new "
          f"parameters: {len(conv['new_parameters'])} tensors", flush=True)

    bs = int(cfg.distill.batch_size or teacher_cfg.data.batch_size)
    train_loader, eval_loader = loaders(task, teacher_cfg, bs, int(cfg.seed), cfg.get("eval_limit"))

    def forward(model, batch):
        return task.training_loss(model, task.on_batch(batch, device))

    dist_info = DistInfo(device=device)
    metrics: dict = {}

    def evaluate(which: str, model) -> None:
        if which in wanted:
            model.eval()
            out = task.evaluate(model, eval_loader, device, dist_info)
            metrics.update({f"{which}_{k}": v for k, v in out.items() if isinstance(v, (int, float))})
            print(f"{which}: " + " ".join(f"{k}={v:.4f}" for k, v in out.items() if isinstance(v, float)),
                  flush=True)

    evaluate("teacher", teacher)
    evaluate("converted", student)
    gap_batches = [b for _, b in zip(range(2), eval_loader)]
    gap_before = attention_gap(teacher, student, gap_batches, num_batches=2, forward=forward)
    steps = int(cfg.distill.steps)
    history = {"steps": 0, "seconds": 0.0, "history": []}
    if steps > 0:
        d = cfg.distill
        history = distill_attention(teacher, student, train_loader, steps=steps, lr=float(d.lr),
                                    weight_decay=float(d.weight_decay), warmup=d.get("warmup"),
                                    train=str(d.train),
                                    inputs=str(d.inputs), forward=forward, grad_clip=d.get("grad_clip"),
                                    log_every=int(d.log_every))
        evaluate("distilled", student)
    gap_after = attention_gap(teacher, student, gap_batches, num_batches=2, forward=forward)
    mean = lambda g: sum(g.values()) / max(1, len(g))  # noqa: E731
    metrics.update(distill_steps=steps, distill_seconds=history["seconds"], rel_mse_before=mean(gap_before),
                   rel_mse_after=mean(gap_after))

    out = os.path.join(run_dir, "checkpoints")
    os.makedirs(out, exist_ok=True)
    student_container = OmegaConf.to_container(scfg, resolve=True)
    atomic_save({"model": student.state_dict(), "step": steps, "config": student_container,
                 "conversion": {**conv, "teacher": str(ckpt), "distill": OmegaConf.to_container(cfg.distill),
                                "history": history["history"], "rel_mse_before": gap_before,
                                "rel_mse_after": gap_after}},
                os.path.join(out, "last.pt"))
    record_cfg = OmegaConf.create({**OmegaConf.to_container(cfg, resolve=True),
                                   "student_config": student_container})
    write_run_record(run_dir, record_cfg, metrics, seconds=time.time() - started, load_before=load_before)
    line = " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
    print(f"saved {os.path.join(out, 'last.pt')}", flush=True)
    print(f"final: {line}", flush=True)
    return metrics


@hydra.main(version_base="1.3", config_path="../../configs", config_name="distill")
def main(cfg: DictConfig) -> None:
    run(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
