"""Process-group set-up for ``torchrun`` (DDP / FSDP) with a single-process fallback.

Nothing here assumes one node: the global rank and world size (``RANK``, ``WORLD_SIZE``) name the process
among all nodes' (data sharding, rank 0 writes the run's files), the local rank and local world size
(``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) its place on its node, and the GPU is ``cuda:<LOCAL_RANK>``; the
process group meets at ``MASTER_ADDR:MASTER_PORT``, which torchrun sets on every node (docs/training.md,
"Several GPUs and nodes").
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0  # among all processes of all nodes
    local_rank: int = 0  # among this node's processes: the GPU index
    world_size: int = 1  # processes of all nodes
    local_world_size: int = 1  # processes on this node
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def setup_distributed(device: str = "auto") -> DistInfo:
    """Initialise from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``)
    if present.

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
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if device == "cuda":
        if local >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local} but this node sees {torch.cuda.device_count()} GPU(s): start "
                             f"at most that many processes per node (torchrun --nproc_per_node)")
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
    return DistInfo(rank=rank, local_rank=local, world_size=world, local_world_size=local_world, device=dev)


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
