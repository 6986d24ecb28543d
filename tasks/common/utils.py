"""Seeding, system information, parameter and FLOP counts."""

from __future__ import annotations

import os
import platform
import random
import socket
from datetime import datetime, timezone

import numpy as np
import torch
import torch.nn as nn


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


def count_flops(model: nn.Module, *inputs, **kwargs) -> int:
    """Forward FLOPs with ``torch.utils.flop_counter.FlopCounterMode`` (counts matmuls/convs as 2 x MACs;
    elementwise ops are not counted). Papers usually quote MACs ("FLOPs" from fvcore) = this / 2."""
    from torch.utils.flop_counter import FlopCounterMode  # noqa: PLC0415

    was_training = model.training
    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(*inputs, **kwargs)
    model.train(was_training)
    return int(counter.get_total_flops())
