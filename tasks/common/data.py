"""Deterministic data order and per-sample seeded augmentation, so a resumed run sees exactly the same data.

* :class:`ResumableSampler` shuffles with a generator seeded by ``(seed, epoch)``, shards across ranks,
  groups micro-batches into optimizer steps (gradient accumulation), and can skip the batches already consumed
  in the current epoch.
* :class:`SeededDataset` seeds Python, NumPy and torch RNGs from ``(seed, epoch, index)`` around each
  sample's transform, so random augmentation does not depend on worker count or on where a run resumed.
* :func:`loader_generator` gives each ``DataLoader`` its own generator seeded from ``(seed, epoch)``: without
  one, every new loader iterator draws its workers' base seed from the global torch RNG, which then differs
  between a resumed and an uninterrupted run (drop-path and dropout draw from it).
* :class:`WorkerEpoch` carries ``set_epoch`` into persistent ``DataLoader`` workers.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from mhla.layouts import ceil_div


class ResumableSampler(Sampler[int]):
    """Epoch-seeded shuffling, sharded by rank, with ``drop_last`` on the global batch.

    Args:
        n: dataset length. batch_size: per-rank (micro-)batch. rank, world_size: sharding.
        accumulate: micro-batches per optimizer step (gradient accumulation): the global batch is
            ``batch_size x world_size x accumulate`` samples, ``steps_per_epoch`` counts them (whole ones: the
            epoch's tail is dropped), and the loader yields ``batches_per_epoch = steps_per_epoch x accumulate``
            micro-batches. Micro-batch ``j`` of every rank is part of global micro-batch ``j``, so the
            ``accumulate`` consecutive micro-batches of an optimizer step hold exactly the samples of one batch of
            ``batch_size x world_size x accumulate`` (the same order-chunk, whatever the split).
        shuffle: permute each epoch (else identity order). seed: base seed.
        repeats: repeated augmentation (DeiT): each sampled image appears ``repeats`` times in a row, as
            *virtual indices* ``r * n + i`` (``SeededDataset`` maps them back to ``i`` with a different
            augmentation seed per repeat); an epoch still has ``n`` samples. Within a global batch, rank
            ``r`` takes every ``world_size``-th sample, so the repeats of an image land on different ranks.
    """

    def __init__(self, n: int, batch_size: int, *, rank: int = 0, world_size: int = 1, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = True, repeats: int = 1, accumulate: int = 1):
        if repeats < 1:
            raise ValueError(f"repeated augmentation count must be >= 1, got {repeats}")
        if accumulate < 1 or (accumulate > 1 and not drop_last):
            raise ValueError(f"accumulate must be >= 1 (and 1 without drop_last), got {accumulate}")
        self.n, self.batch_size, self.accumulate = n, batch_size, accumulate
        self.repeats = repeats
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.skip_batches = 0
        global_batch = batch_size * world_size
        if drop_last:
            self.steps_per_epoch = n // (global_batch * accumulate)
            if self.steps_per_epoch == 0:
                steps = f" x {accumulate} accumulation steps" if accumulate > 1 else ""
                raise ValueError(
                    f"the dataset has {n} samples, fewer than one global batch ({global_batch * accumulate} = "
                    f"{batch_size} per device x {world_size}{steps}); "
                    + ("train a smaller global batch: trainer.accumulate=<k> (or a lower data.batch_size)"
                       if accumulate > 1 else "lower data.batch_size")
                )
            self.batches_per_epoch = self.steps_per_epoch * accumulate  # micro-batches
        else:
            self.batches_per_epoch = self.steps_per_epoch = ceil_div(n, global_batch)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Iterate epoch ``epoch`` from its micro-batch ``skip_batches`` on (a resumed run's place)."""
        self.epoch = epoch
        self.skip_batches = skip_batches

    def order(self) -> list[int]:
        """This rank's sample indices for the current epoch, from its micro-batch ``skip_batches`` on (what
        iterating the sampler yields; a dataset that builds its batches from their place in the epoch, such as
        a length curriculum, reads it too)."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.n, generator=g)
        else:
            order = torch.arange(self.n)
        if self.repeats > 1:
            r = torch.arange(self.repeats).repeat(self.n)
            order = (order.repeat_interleave(self.repeats) + r * self.n)[: self.n]
        order = order.tolist()
        global_batch = self.batch_size * self.world_size
        order = order[: self.batches_per_epoch * global_batch] if self.drop_last else order
        # Rank r takes every world_size-th sample of each global batch: batch b of every rank is part of
        # global batch b, whatever the number of ranks.
        mine = []
        for b in range(self.skip_batches, self.batches_per_epoch):
            chunk = order[b * global_batch : (b + 1) * global_batch]
            mine.extend(chunk[self.rank :: self.world_size])
        return mine

    def __iter__(self):
        return iter(self.order())

    def __len__(self) -> int:
        return (self.batches_per_epoch - self.skip_batches) * self.batch_size


class SeededDataset(Dataset):
    """Wraps ``dataset`` (returning raw samples) and applies ``transform`` under a per-sample seed."""

    def __init__(self, dataset, transform=None, seed: int = 0):
        self.dataset, self.transform, self.seed = dataset, transform, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        # virtual indices r * n + i come from repeated augmentation: same image, another seed
        sample = self.dataset[index % len(self.dataset)]
        if self.transform is None:
            return sample
        s = (self.seed * 1_000_003 + self.epoch) * 10_000_019 + index
        py_state, np_state = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            random.seed(s)
            np.random.seed(s % (2**32))
            torch.manual_seed(s)
            out = self.transform(sample)
        random.setstate(py_state)
        np.random.set_state(np_state)
        return out


def loader_seed(seed: int, epoch: int) -> int:
    """The seed of the ``DataLoader`` generator for ``epoch`` (distinct from the sampler's permutation seed)."""
    return ((seed * 1_000_003 + epoch) * 7_919 + 17) % (2**63)


def loader_generator(seed: int, epoch: int = 0) -> torch.Generator:
    """A generator for ``DataLoader(generator=...)``, so that creating an iterator does not consume the global
    torch RNG (it draws the workers' base seed from this one instead)."""
    return torch.Generator().manual_seed(loader_seed(seed, epoch))


class WorkerEpoch(Dataset):
    """Wraps a dataset that has ``set_epoch`` so that the epoch reaches persistent ``DataLoader`` workers.

    A worker holds its own copy of the dataset, made when it started; ``set_epoch`` in the main process does not
    reach that copy. This wrapper keeps the epoch in a shared-memory tensor, and each worker calls
    ``set_epoch`` on its copy when the value changed. Call ``set_epoch`` before iterating the loader for the
    epoch (workers fetch nothing between epochs).
    """

    def __init__(self, dataset):
        self.dataset = dataset
        self._shared_epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self._applied = getattr(dataset, "epoch", None)

    def set_epoch(self, epoch: int) -> None:
        self._shared_epoch.fill_(epoch)
        self.dataset.set_epoch(epoch)
        self._applied = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        epoch = int(self._shared_epoch)
        if epoch != self._applied:  # in a worker: the main process moved to another epoch
            self.dataset.set_epoch(epoch)
            self._applied = epoch
        return self.dataset[index]
