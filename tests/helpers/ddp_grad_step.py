"""One gradient step of the classification task, single-process or under torchrun (gloo, CPU).

    python tests/helpers/ddp_grad_step.py OUT.pt GLOBAL_BATCH
    torchrun --nproc_per_node=2 tests/helpers/ddp_grad_step.py OUT.pt GLOBAL_BATCH

Each rank takes its shard of the first global batch from the trainer's sampler, runs the task's loss under
DDP and backward; rank 0 saves the (all-reduced) gradients, which must equal the single-process gradients
of the whole global batch.
"""

import os
import sys

import torch
from hydra import compose, initialize_config_dir

from tasks.classification.task import ClassificationTask
from tasks.common.data import ResumableSampler
from tasks.common.distributed import cleanup, setup_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(out: str, global_batch: int) -> None:
    torch.set_num_threads(1)
    info = setup_distributed("cpu")
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "data.limit=256", "model.embed_dim=16", "model.depth=2", "model.num_heads=2", "attn.cpe=true"])
    task = ClassificationTask(cfg)
    torch.manual_seed(0)
    model = task.build_model()
    train, _ = task.build_datasets()
    per_rank = global_batch // info.world_size
    sampler = ResumableSampler(len(train), per_rank, rank=info.rank, world_size=info.world_size, seed=0)
    idx = list(sampler)[:per_rank]
    x = torch.stack([train[i][0] for i in idx])
    y = torch.stack([train[i][1] for i in idx])
    wrapped = model
    if info.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
    loss, _ = task.training_loss(wrapped, (x, y))
    loss.backward()
    if info.rank == 0:
        torch.save({n: p.grad.clone() for n, p in model.named_parameters()}, out)
    cleanup(info)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
