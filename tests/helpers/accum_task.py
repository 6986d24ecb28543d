"""Classification tasks for the gradient-accumulation tests (``tests/tasks/test_grad_accumulation.py``), named by
``task.target=helpers.accum_task.<class>`` (``tests/`` on the path: pytest's, or ``PYTHONPATH`` under torchrun).

* :class:`StoppingClassificationTask`: the classification task that sends SIGTERM to its own process at its
  ``task.signal_at_batch``-th micro-batch (rank 0 only), so a run stops in the middle of an accumulation cycle.
* :class:`SampleSeededClassificationTask`: the classification task with its randomness (drop-path, mixup /
  cutmix) drawn from seeds that the samples determine instead of from the global RNG stream, so that one batch of
  ``k x b`` samples and ``k`` micro-batches of ``b`` draw the same random numbers and must give the same
  gradients. The stock task draws them from the stream in batch order: there a run with accumulation equals the
  one-batch run in distribution only (as a DDP run does: each rank draws its own).

  - drop-path: each timm ``DropPath`` becomes a :class:`SeededDropPath`, whose keep / drop of sample ``i`` comes
    from a generator seeded by the sample's content (a CRC of its pixels) and the layer;
  - mixup / cutmix (timm's ``Mixup``, ``mode=batch``: one draw per group, partners paired by flipping the group)
    per group of samples, seeded by the group's samples. A group is what one process holds of a global
    micro-batch: every block of ``task.chunk_block`` consecutive samples of a batch is cut into the
    ``task.chunk_stride`` interleaved pieces ``block[r::chunk_stride]`` (the sampler gives rank ``r`` of ``W`` the
    samples ``r, r + W, ...`` of each global micro-batch). One process's batch of 32 and one process's
    micro-batches of 8 with ``chunk_block=8, chunk_stride=2`` have the groups that the micro-batches of 4 of two
    processes have with ``chunk_block=4, chunk_stride=1``.
"""

from __future__ import annotations

import os
import signal
import zlib

import numpy as np
import torch
import torch.nn as nn

from tasks.classification.task import ClassificationTask
from tasks.common.task import Task


class SignalAtBatch:
    """Mixin for a :class:`~tasks.common.task.Task`: SIGTERM to this process at its ``task.signal_at_batch``-th
    micro-batch (rank 0; the trainer's ranks agree to stop at the end of that optimizer step)."""

    def count_batch(self) -> None:
        self._batches_seen = getattr(self, "_batches_seen", 0) + 1
        at = self.cfg.task.get("signal_at_batch")
        if at and self._batches_seen == int(at) and int(os.environ.get("RANK", "0")) == 0:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_batch(self, batch, device):
        self.count_batch()
        return super().on_batch(batch, device)


class StoppingClassificationTask(SignalAtBatch, ClassificationTask):
    """The classification task, stopped by SIGTERM at micro-batch ``task.signal_at_batch``."""


class SeededDropPath(nn.Module):
    """Drop-path (stochastic depth) whose draw for each sample comes from ``seeds`` (one per sample of the
    batch, set before each forward) and the layer's index, not from the global RNG."""

    def __init__(self, drop_prob: float, layer: int):
        super().__init__()
        self.drop_prob, self.layer = float(drop_prob), layer
        self.seeds: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_prob == 0.0:
            return x
        assert len(self.seeds) == x.shape[0], "set the batch's seeds before the forward"
        draws = torch.stack([torch.rand((), generator=torch.Generator().manual_seed(s * 131 + self.layer))
                             for s in self.seeds])
        keep = 1.0 - self.drop_prob
        mask = (draws < keep).to(x.dtype).view(-1, *([1] * (x.dim() - 1)))
        return x * mask / keep


def sample_seeds(x: torch.Tensor) -> list[int]:
    """A seed per sample of ``x``: the CRC-32 of its bytes, the same wherever the sample lands."""
    return [zlib.crc32(row.contiguous().numpy().tobytes()) for row in x.detach().cpu()]


class SampleSeededClassificationTask(SignalAtBatch, ClassificationTask):
    """The classification task with drop-path and mixup seeded by the samples (module docstring)."""

    def build_model(self) -> nn.Module:
        model = super().build_model()
        layer = 0
        for name, module in list(model.named_modules()):
            if type(module).__name__ == "DropPath":
                parent_name, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent_name) if parent_name else model, attr,
                        SeededDropPath(module.drop_prob, layer))
                layer += 1
        return model

    def groups(self, n: int) -> list[list[int]]:
        """The sample indices of each mixup group of a batch of ``n`` (module docstring)."""
        block, stride = int(self.cfg.task.chunk_block), int(self.cfg.task.chunk_stride)
        out = []
        for start in range(0, n, block):
            indices = list(range(start, min(start + block, n)))
            out.extend(indices[r::stride] for r in range(stride))
        return out

    def on_batch(self, batch, device):
        self.count_batch()
        x, y = Task.on_batch(self, batch, device)  # to the device; the mixup comes below
        seeds = sample_seeds(x)
        mixup = self._mixup()
        if mixup is None:
            return x, y, seeds
        x, soft = x.clone(), torch.zeros(len(y), int(self.cfg.model.num_classes), device=x.device)
        for group in self.groups(len(y)):
            index = torch.tensor(group, device=x.device)
            state = np.random.get_state()  # timm's Mixup draws from NumPy's global RNG
            np.random.seed(sum(seeds[i] for i in group) % 2**32)
            x[index], soft[index] = mixup(x[index], y[index])
            np.random.set_state(state)
        return x, soft, seeds

    def training_loss(self, model, batch):
        x, y, seeds = batch
        for module in model.modules():
            if isinstance(module, SeededDropPath):
                module.seeds = seeds
        return super().training_loss(model, (x, y))
