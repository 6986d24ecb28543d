"""Several ``train.py`` runs one after another in one launch (one process, or each rank under ``torchrun``),
so that the start-up (imports, process group) is paid once:

    PYTHONPATH=. torchrun --nproc_per_node=2 tests/helpers/trainer_runs.py SPEC.json    # from the repository root

``SPEC.json``: ``[{"dir": run folder, "overrides": [Hydra overrides of configs/train.yaml]}, ...]``, each run
by ``train.run`` (what ``python train.py`` runs) in its folder, in order; the process group stays up between
them. ``"interrupted": true``: the run is expected to stop on a signal (``TrainingInterrupted``), and the next
one goes on. ``"dir": null``: the folder ``python train.py`` would make (``hydra.run.dir`` resolved, relative to the
current folder; under torchrun the one that the ranks of all nodes agree on).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(spec_path: str) -> None:
    torch.set_num_threads(1)
    import train  # noqa: PLC0415

    with open(spec_path) as f:
        spec = json.load(f)
    for item in spec:
        with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
            cfg = compose(config_name="train", overrides=list(item["overrides"]), return_hydra_config=True)
        run_dir = item["dir"] or OmegaConf.select(cfg, "hydra.run.dir")  # the resolvers train.py registered
        with open_dict(cfg):
            del cfg["hydra"]  # as @hydra.main passes it
        os.makedirs(run_dir, exist_ok=True)
        try:
            train.run(cfg, run_dir)
        except train.TrainingInterrupted:
            if not item.get("interrupted"):
                raise
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
