"""Bars: is the one bar in a generated image horizontal or vertical? The worked example of docs/adding_a_task.md.

A task is one :class:`~tasks.common.task.Task` subclass (this file) and one config
(``examples/configs/task/bars.yaml``, whose ``task.target`` names the class). The images are made from a seed,
no download: ``[1, S, S]`` with one bar two pixels wide at a random row (horizontal, label 0) or column
(vertical, label 1), plus Gaussian noise. The model is the config's ViT built with the run's attention, so every
attention that runs in a ViT runs here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from models.vit import build_vit
from tasks.common.task import Task


class BarImages(torch.utils.data.Dataset):
    """``n`` images ``[1, size, size]`` and labels (0: horizontal bar, 1: vertical), the same for the same
    ``seed``."""

    def __init__(self, n: int, size: int, noise: float, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        where = torch.randint(0, size - 1, (n,), generator=g)
        self.images = noise * torch.randn(n, 1, size, size, generator=g)
        for i, (label, at) in enumerate(zip(self.labels.tolist(), where.tolist())):
            if label == 0:
                self.images[i, 0, at:at + 2, :] += 1.0
            else:
                self.images[i, 0, :, at:at + 2] += 1.0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


class BarsTask(Task):
    monitor = "accuracy"  # the eval metric that picks best.pt
    monitor_mode = "max"

    def build_model(self) -> nn.Module:
        return build_vit(self.cfg.model, self.attention.options)

    def build_datasets(self):
        data, size, seed = self.cfg.data, int(self.cfg.model.img_size), int(self.cfg.get("seed", 0))
        return (BarImages(int(data.num_train), size, float(data.noise), seed),
                BarImages(int(data.num_eval), size, float(data.noise), seed + 10_000))

    def training_loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, dict]:
        images, labels = batch
        return F.cross_entropy(model(images).float(), labels), {}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader, device, dist_info) -> dict:
        correct = torch.zeros((), device=device)
        loss = torch.zeros((), device=device)
        count = torch.zeros((), device=device)
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            logits = model(images).float()
            loss += F.cross_entropy(logits, labels, reduction="sum")
            correct += (logits.argmax(-1) == labels).sum()
            count += labels.numel()
        if dist_info.enabled:  # every rank saw its own share of the eval set
            for t in (correct, loss, count):
                dist.all_reduce(t)
        return {"accuracy": (correct / count).item(), "loss": (loss / count).item()}

    def example_input(self, device) -> torch.Tensor:
        size = int(self.cfg.model.img_size)
        return torch.zeros(1, 1, size, size, device=device)

    def describe_model(self, model: nn.Module) -> str:
        return f"{self.cfg.model.name} with {self.attention.name} attention"
