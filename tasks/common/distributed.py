"""Process-group set-up for ``torchrun`` (DDP / FSDP) with a single-process fallback."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def setup_distributed(device: str = "auto") -> DistInfo:
    """Initialise from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) if present.

    ``device``: ``"cpu"``, ``"cuda"`` or ``"auto"`` (CUDA when available). The backend is NCCL on CUDA and
    gloo on CPU.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"trainer.device must be cpu, cuda or auto, got {device!r}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
    return DistInfo(rank=rank, local_rank=local, world_size=world, device=dev)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def all_reduce_mean(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= info.world_size
    return t


def cleanup(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
