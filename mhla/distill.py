"""Attention distillation: train a converted model's new attention layers to match the softmax teacher's,
layer by layer.

    import copy, mhla
    from mhla.distill import distill_attention
    teacher = model.eval()
    student = mhla.convert(model, attn="mhla", copy=True)
    history = distill_attention(teacher, student, batches, steps=200, lr=1e-3)
    # then ordinary fine-tuning of the student (train.py: trainer.init_from=<the student's checkpoint>)

What one step does, for the attention layers the conversion changed (:func:`mhla.conversion.converted_pairs`):

1. the teacher runs on a batch (no gradients); a forward hook on each of its attention modules records the
   module's inputs (positional and keyword: hidden states, rotary tables, masks, ...) and its output;
2. ``inputs="teacher"`` (default): each student attention module is called on the *teacher's* inputs of its
   layer, so every layer learns to reproduce its teacher layer from the same input, independently of the
   others (LoLCATs' "attention transfer"); ``inputs="student"``: the student model runs on the batch itself
   and each layer's output (given the student's own hidden states) is compared;
3. the loss is the sum over layers of ``MSE(student output, teacher output)`` plus the student modules'
   ``regularization_loss`` hooks (a write gate's budget, :mod:`mhla.hooks`); AdamW steps the trainable
   parameters, then the modules' ``after_optimizer_step`` hooks run (MHLA's mixing matrix is clipped to [0,
   1]).

Trainable: ``train="attention"`` (default) every parameter of the converted attention modules (the projections
``qkv`` / ``proj`` or ``q_proj`` ... ``o_proj`` / ``to_q`` ... ``to_out``, the norms, MHLA's mixing matrix);
``train="new"`` only the parameters the teacher has no weight for (the mixing matrix, a new gate). Everything
else is frozen during the stage and unfrozen after it. The learning rate: linear warmup over the first
``warmup`` steps, then cosine to ``0.1 x lr``. Weight decay applies to matrices, not to biases, norms or the
mixing matrix.

The models are called through ``forward(model, batch)`` (default: ``model(batch)`` for a tensor,
``model(**batch)`` for a mapping, ``model(*batch)`` for a tuple / list), so any task's batches work
(``tasks/conversion/distill.py`` passes the task's own training step).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from .conversion import converted_pairs, new_parameter_names
from .hooks import after_optimizer_step, regularization_loss


def default_forward(model: nn.Module, batch):
    """``model(batch)`` for a tensor, ``model(**batch)`` for a mapping, ``model(*batch)`` for a tuple /
    list."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _main_output(out) -> torch.Tensor:
    """The attention output of a module's return value (Llama's attention returns ``(output, weights)``)."""
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not torch.is_tensor(out):
        raise TypeError(f"an attention module returned {type(out).__name__}, not a tensor")
    return out


def _batches(source: Iterable) -> Iterable:
    """Cycle through ``source`` (re-iterating it when it runs out: a DataLoader reshuffles)."""
    while True:
        empty = True
        for batch in source:
            empty = False
            yield batch
        if empty:
            raise ValueError("distill_attention: the batch source is empty")


def _grid_hook(teacher: nn.Module, student: nn.Module):
    """A pre-hook on the teacher's forward that records the patch grid into the student's grid context
    (diffusers)."""
    ctx = getattr(student, "_mhla_grid_context", None)
    if ctx is None:
        return None
    from .adapters.diffusers import _patch_grid  # noqa: PLC0415

    def hook(module, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        grid = _patch_grid(student, x)
        if grid is not None:
            ctx.grid = grid

    return teacher.register_forward_pre_hook(hook, with_kwargs=True)


def trainable_parameters(teacher: nn.Module, student: nn.Module, pairs, train: str
                         ) -> dict[str, nn.Parameter]:
    """``{student parameter name: parameter}`` that the stage trains (module docstring)."""
    if train not in ("attention", "new"):
        raise ValueError(f"train must be 'attention' or 'new', got {train!r}")
    out = {}
    for name, t_mod, s_mod in pairs:
        keep = set(new_parameter_names(t_mod, s_mod)) if train == "new" else None
        for pname, p in s_mod.named_parameters():
            if keep is None or pname in keep:
                out[f"{name}.{pname}"] = p
    if not out:
        raise ValueError(f"train={train!r}: the converted layers have no such parameter")
    return out


def _optimizer(params: dict[str, nn.Parameter], lr: float, weight_decay: float, student: nn.Module):
    grouped = {id(p) for m in student.modules() if getattr(m, "optim_group", None)
               for p in m.parameters(False)}
    decay = [p for n, p in params.items() if p.ndim >= 2 and id(p) not in grouped]
    rest = [p for n, p in params.items() if not (p.ndim >= 2 and id(p) not in grouped)]
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                          {"params": rest, "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999))


def distill_attention(teacher: nn.Module, student: nn.Module, batches: Iterable, *, steps: int,
                      lr: float = 1e-3, weight_decay: float = 0.0, warmup: int | None = None,
                      train: str = "attention", inputs: str = "teacher", layers: Iterable[str] | None = None,
                      forward: Callable = default_forward, grad_clip: float | None = None,
                      log_every: int = 10, log: Callable[[str], None] | None = print,
                      on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Train ``student``'s converted attention layers to reproduce ``teacher``'s, layer by layer (module
    docstring).

    Args:
        teacher: the original model (left unchanged; run in eval mode without gradients).
        student: the converted model (:func:`mhla.convert` with ``copy=True``), on the teacher's device.
        batches: an iterable of model inputs (cycled), what ``forward(model, batch)`` takes.
        steps: optimizer steps. lr, weight_decay, warmup (default ``min(50, steps // 10)``), grad_clip:
        AdamW's. train: ``"attention"`` or ``"new"``. inputs: ``"teacher"`` or ``"student"``.
        layers: the attention modules to match, by name (default: those the conversion changed).
        log_every, log: a line every ``log_every`` steps (``log=None``: silent). on_step(step, record): a
        callback.

    Returns:
        ``{"steps", "seconds", "loss": [per step], "rel_mse": {layer: final MSE / mean square of the teacher's
        output}, "trainable_parameters": count, "history": [records every log_every steps]}``.
    """
    if inputs not in ("teacher", "student"):
        raise ValueError(f"inputs must be 'teacher' or 'student', got {inputs!r}")
    pairs = converted_pairs(teacher, student, layers)
    params = trainable_parameters(teacher, student, pairs, train)
    flags = {n: p.requires_grad for n, p in student.named_parameters()}
    chosen = {id(p) for p in params.values()}
    for p in student.parameters():
        p.requires_grad_(id(p) in chosen)
    teacher_flags = [p.requires_grad for p in teacher.parameters()]
    for p in teacher.parameters():
        p.requires_grad_(False)
    warmup = min(50, steps // 10) if warmup is None else int(warmup)
    optimizer = _optimizer(params, lr, weight_decay, student)
    def factor(s: int) -> float:  # linear warmup, then cosine from 1 to 0.1
        if s < warmup:
            return (s + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    captured: dict[str, tuple] = {}
    s_outputs: dict[str, torch.Tensor] = {}

    def t_hook(name):
        def hook(module, args, kwargs, out):
            captured[name] = (args, kwargs, _main_output(out).detach())
        return hook

    def s_hook(name):
        def hook(module, args, kwargs, out):
            s_outputs[name] = _main_output(out)
        return hook

    handles = [t.register_forward_hook(t_hook(n), with_kwargs=True) for n, t, _ in pairs]
    if inputs == "student":
        handles += [s.register_forward_hook(s_hook(n), with_kwargs=True) for n, _, s in pairs]
    grid = _grid_hook(teacher, student)
    if grid is not None:
        handles.append(grid)
    was_training = teacher.training, student.training
    teacher.eval()
    student.train()
    losses, history, rel = [], [], {}
    t0 = time.time()
    source = _batches(batches)
    try:
        for step in range(1, steps + 1):
            batch = next(source)
            captured.clear()
            s_outputs.clear()
            with torch.no_grad():
                forward(teacher, batch)
            if inputs == "teacher":
                outs = {n: _main_output(s(*captured[n][0], **captured[n][1])) for n, _, s in pairs}
            else:
                forward(student, batch)
                outs = dict(s_outputs)
            terms = {n: F.mse_loss(outs[n].float(), captured[n][2].float()) for n, _, _ in pairs}
            loss = sum(terms.values())
            reg = regularization_loss(student)  # e.g. a write gate's budget; read every step, else kept
            if reg is not None:
                loss = loss + reg
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip:
                torch.nn.utils.clip_grad_norm_(list(params.values()), float(grad_clip))
            optimizer.step()
            schedule.step()
            after_optimizer_step(student)
            losses.append(loss.item())
            with torch.no_grad():
                rel = {n: float(terms[n] / captured[n][2].float().pow(2).mean().clamp_min(1e-12))
                       for n in terms}
            if step % max(1, log_every) == 0 or step == steps:
                rec = {"step": step, "loss": losses[-1], "rel_mse_mean": sum(rel.values()) / len(rel),
                       "lr": schedule.get_last_lr()[0], "seconds": round(time.time() - t0, 1)}
                history.append(rec)
                if log is not None:
                    log(f"distill step {step}/{steps}: loss={rec['loss']:.5g} "
                        f"rel_mse={rec['rel_mse_mean']:.4f} lr={rec['lr']:.3g}")
                if on_step is not None:
                    on_step(step, rec)
    finally:
        for h in handles:
            h.remove()
        for n, p in student.named_parameters():
            p.requires_grad_(flags.get(n, True))
        for p, f in zip(teacher.parameters(), teacher_flags):
            p.requires_grad_(f)
        teacher.train(was_training[0])
        student.train(was_training[1])
    return {"steps": steps, "seconds": round(time.time() - t0, 1), "loss": losses, "rel_mse": rel,
            "trainable_parameters": sum(p.numel() for p in params.values()), "history": history}


@torch.no_grad()
def attention_gap(teacher: nn.Module, student: nn.Module, batches: Iterable, *, num_batches: int = 1,
                  inputs: str = "teacher", layers: Iterable[str] | None = None,
                  forward: Callable = default_forward) -> dict[str, float]:
    """``{layer: MSE / mean square of the teacher's output}`` of the converted layers over ``num_batches``
    batches (the quantity :func:`distill_attention` minimises, relative), with the teacher's inputs or the
    student's own."""
    pairs = converted_pairs(teacher, student, layers)
    captured, s_out, sums = {}, {}, {}
    hooks = [t.register_forward_hook(lambda m, a, k, o, n=n: captured.__setitem__(n, (a, k, _main_output(o))),
                                     with_kwargs=True) for n, t, _ in pairs]
    if inputs == "student":
        hooks += [s.register_forward_hook(lambda m, a, k, o, n=n: s_out.__setitem__(n, _main_output(o)),
                                          with_kwargs=True) for n, _, s in pairs]
    grid = _grid_hook(teacher, student)
    hooks += [grid] if grid is not None else []
    modes = teacher.training, student.training
    teacher.eval()
    student.eval()
    try:
        for i, batch in enumerate(batches):
            if i >= num_batches:
                break
            forward(teacher, batch)
            if inputs == "student":
                forward(student, batch)
            for n, _, s in pairs:
                out = s_out[n] if inputs == "student" else _main_output(s(*captured[n][0], **captured[n][1]))
                t = captured[n][2].float()
                err, ref = (out.float() - t).pow(2).mean(), t.pow(2).mean()
                a, b = sums.get(n, (0.0, 0.0))
                sums[n] = (a + float(err), b + float(ref))
    finally:
        for h in hooks:
            h.remove()
        teacher.train(modes[0])
        student.train(modes[1])
    return {n: a / max(b, 1e-12) for n, (a, b) in sums.items()}
