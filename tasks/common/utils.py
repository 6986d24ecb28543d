"""Seeding, system information, parameter and FLOP counts."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import random
import socket
from datetime import datetime, timezone

import numpy as np
import torch
import torch.nn as nn

from mhla.layers import AttentionBase


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> list[float] | None:
    """The 1 / 5 / 15-minute load averages (rounded), or None where the OS has none: how busy the machine was."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def system_info(device: str | None = None) -> dict:
    """The machine, for run logs and the headers of benchmark / results files (the one implementation).

    Keys: ``host, platform, python, torch, cpu, cpu_count, torch_threads, cuda`` (available), ``date`` (UTC),
    and with a GPU ``gpu`` (name) and ``gpu_count``. With ``device`` (what a benchmark ran on: ``"cpu"``,
    ``"cuda"``, ``"cuda:1"``) it is recorded as ``device``, and ``gpu`` names that device's GPU; a CPU device
    records no ``gpu``.
    """
    info = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if device is not None:
        info["device"] = str(device)
    on_gpu = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    if on_gpu:
        info["gpu"] = torch.cuda.get_device_name(torch.device(device) if device is not None else 0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# SDPA kernels whose FLOPs ``torch.utils.flop_counter`` (torch 2.x) has no formula for, so it counts them as 0:
# the CPU kernel (what ``F.scaled_dot_product_attention`` runs on CPU unless it falls back to its math path,
# e.g. for Dv != Dqk or training-mode dropout), MPS' math kernel and the out-of-tree ("overrideable") fused kernel. Forward ops take ``(query, key, value, ...)``,
# backward ops ``(grad_out, query, key, value, ...)``. torch's own formulas cover the CUDA kernels (flash,
# memory-efficient, cuDNN) and flex_attention; the math fallback decomposes into ``bmm`` and is counted as such.
SDPA_FORWARD_OPS = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_attention_math_for_mps",
    "_scaled_dot_product_fused_attention_overrideable",
)
SDPA_BACKWARD_OPS = (
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_fused_attention_overrideable_backward",
)


def _sdpa_dims(query, key, value) -> tuple[int, int, int, int, int]:
    """``(batch x query heads, Lq, Lk, Dqk, Dv)`` from SDPA's ``[..., L, E]`` shapes (GQA's fewer key / value
    heads are broadcast to the query heads, as the kernels do)."""
    return math.prod(query[:-2]), query[-2], key[-2], query[-1], value[-1]


def sdpa_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """Forward FLOPs of softmax attention from the shapes of q, k, v: the two matmuls ``Q K^T`` and ``P V``,
    ``2 * B * H * Lq * Lk * (Dqk + Dv)``, what ``softmax(q @ k.transpose(-2, -1)) @ v`` counts and what torch
    counts for the CUDA kernels. A causal or masked call counts the full ``Lq x Lk`` scores, as torch does."""
    bh, lq, lk, d, dv = _sdpa_dims(query, key, value)
    return 2 * bh * lq * lk * (d + dv)


def sdpa_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    """Backward FLOPs of a fused SDPA kernel, torch's convention for the CUDA kernels: the scores recomputed
    (``Q K^T``) and the four gradient matmuls (``dO V^T``, ``P^T dO``, ``dS K``, ``dS^T Q``),
    ``2 * B * H * Lq * Lk * (3 Dqk + 2 Dv)``; i.e. the explicit math's backward plus one ``Q K^T``."""
    bh, lq, lk, d, dv = _sdpa_dims(query, key, value)
    return 2 * bh * lq * lk * (3 * d + 2 * dv)


def sdpa_flop_formulas() -> dict:
    """``custom_mapping`` for ``FlopCounterMode``: :data:`SDPA_FORWARD_OPS` / :data:`SDPA_BACKWARD_OPS` (those
    this torch has, and has no formula for) -> :func:`sdpa_flops` / :func:`sdpa_backward_flops`. Keys are
    ``OpOverloadPacket`` s (``torch.ops.aten.<name>``), the counter's keys."""
    from torch.utils.flop_counter import flop_registry  # noqa: PLC0415  (~0.1 s to import)

    mapping = {}
    for names, formula in ((SDPA_FORWARD_OPS, sdpa_flops), (SDPA_BACKWARD_OPS, sdpa_backward_flops)):
        for name in names:
            op = getattr(torch.ops.aten, name, None)
            if op is not None and op not in flop_registry:
                mapping[op] = formula
    return mapping


def _is_mhla_attention(obj) -> bool:
    """An attention layer or diffusers processor of this package (they pick their op backend by ``backend``)."""
    return isinstance(obj, AttentionBase) or type(obj).__module__.split(".")[0] == "mhla"


@contextlib.contextmanager
def torch_attention_backend(model: nn.Module):
    """Run this package's attention layers (and diffusers processors) in ``model`` on the ``"torch"`` op backend
    instead of ``"auto"`` / ``"triton"``, restored on exit: Triton kernels run outside PyTorch's dispatcher, so
    a FLOP counter sees none of their work, while the torch path does the same matmuls as aten ops."""
    changed = []
    for module in model.modules():
        for obj in (module, getattr(module, "processor", None)):
            if obj is not None and getattr(obj, "backend", None) in ("auto", "triton") and _is_mhla_attention(obj):
                changed.append((obj, obj.backend))
                obj.backend = "torch"
    try:
        yield
    finally:
        for obj, backend in changed:
            obj.backend = backend


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost token-mixing modules of ``model`` (``(name, module)``): every module whose class name holds
    ``Attention`` (this package's layers and their LM / DiG / timm / diffusers / transformers counterparts: self- and
    cross-attention), none inside another one."""
    out: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if "Attention" in type(module).__name__ and not any(name.startswith(p + ".") for p, _ in out):
            out.append((name, module))
    return out


def count_flops_split(model: nn.Module, *inputs, **kwargs) -> dict:
    """Forward FLOPs of ``model(*inputs, **kwargs)`` as :func:`count_flops` counts them, split:
    ``{"total", "attention"}``, where ``attention`` is the attention matmuls, the FLOPs inside the
    :func:`attention_modules` that are not in one of their ``nn.Linear`` / ``nn.Conv*`` submodules: ``Q K^T`` and
    ``P V`` of softmax attention (SDPA included), the ``K^T V`` summaries, the mixing and the query products of
    linear attention and MHLA, a recurrence's matmuls. The input / output projections, gates and convolutions
    (CPE, LePE, short convs) stay outside it. Papers that quote "FLOPs" of linear-attention models often leave
    these matmuls out (the MHLA paper's GFLOPs do): ``total - attention`` is that convention."""
    from torch.utils.flop_counter import FlopCounterMode  # noqa: PLC0415  (~0.1 s to import)

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch_attention_backend(model), \
                FlopCounterMode(display=False, custom_mapping=sdpa_flop_formulas()) as counter:
            model(*inputs, **kwargs)
    finally:
        model.train(was_training)
    counts = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    root = type(model).__name__

    def flops(name: str) -> int:
        return counts.get(f"{root}.{name}" if name else root, 0)

    attention = 0
    for name, module in attention_modules(model):
        projections = sum(flops(f"{name}.{child}") for child, m in module.named_modules()
                          if child and isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)))
        attention += flops(name) - projections
    return {"total": int(counter.get_total_flops()), "attention": int(attention)}


def count_flops(model: nn.Module, *inputs, **kwargs) -> int:
    """Forward FLOPs of ``model(*inputs, **kwargs)`` (eval mode, no grad) with ``torch.utils.flop_counter``.

    Counted (2 FLOPs per multiply-add): matmuls (``mm``, ``bmm``, ``addmm``, ``baddbmm``, so ``nn.Linear``,
    ``@`` and ``einsum`` too), convolutions, and softmax attention through SDPA: torch's formulas on CUDA, and
    :func:`sdpa_flop_formulas` for the CPU kernel (``aten._scaled_dot_product_flash_attention_for_cpu``,
    which torch counts as 0), MPS and the overrideable kernel, all ``2 B H Lq Lk (Dqk + Dv)``, the count of the
    explicit ``softmax(q k^T) v``. Not counted: elementwise ops, reductions and normalizations (softmax, norms,
    feature maps, activations, RoPE, MHLA's normalizer division, ``k.sum``), pooling, and anything that runs
    outside PyTorch's dispatcher (Triton kernels, custom CUDA extensions).

    The attentions of :func:`mhla.registry.list_attentions` are all seen: softmax (SDPA, above); mhla (the
    torch backend's ``matmul`` s: block summaries, the M x M mixing, the query products); linear, focused,
    inline, mala and rala (``einsum`` s, plus their convs / linears). MHLA's Triton kernels would be invisible,
    so the count runs those layers on the torch backend (:func:`torch_attention_backend`; same matmuls).
    Causal attention is counted in full (no halving for the mask), as torch does.

    Papers usually quote MACs ("FLOPs" from fvcore) = this / 2. :func:`count_flops_split` also gives the part
    that is attention matmuls."""
    return count_flops_split(model, *inputs, **kwargs)["total"]
