"""SANA fine-tuning with MHLA (Table 4) on the shared Trainer: flow matching on pre-extracted latents.

    python train.py task=sana_finetune attn=mhla model.pretrained=/data/Sana_600M_1024px_diffusers/transformer \
        task.data_root=/data/sana_latents     # a folder of .pt files {"latent": [32, 32, 32], "text": [L, 2304]}
    python train.py task=sana_mini attn=mhla   # tiny SANA on generated data (CPU, seconds)
    python -m tasks.image_gen.sana_sample --ckpt <run_dir> ...   # sampling, FID / CLIP / GenEval (task.sample)

Loss: rectified-flow velocity regression (:func:`tasks.common.flow_matching.flow_matching_loss`, logit-normal
times, SANA's ``flow_shift``), the model called with ``timestep = t * 1000``. Latents (DC-AE f32c32) and Gemma-2
caption embeddings are extracted beforehand (not part of this repository); without ``task.data_root`` the task uses
generated data: smooth random latents whose mean is set by a random "caption" vector (so the text conditioning
carries information), for CPU smoke runs only.
"""

from __future__ import annotations

import glob
import os

import torch
import torch.nn as nn

from tasks.common.trainer import Task


class LatentFolder(torch.utils.data.Dataset):
    """``.pt`` files holding ``{"latent": [C, H, W], "text": [L, D]}`` (pre-extracted latents and captions)."""

    def __init__(self, root: str):
        if not os.path.isdir(root):
            raise FileNotFoundError(f"task.data_root={root!r} does not exist: extract DC-AE latents and Gemma-2 caption "
                                    f"embeddings to .pt files {{'latent', 'text'}} there (or omit task.data_root for "
                                    f"generated data)")
        self.files = sorted(glob.glob(os.path.join(root, "**", "*.pt"), recursive=True))
        if not self.files:
            raise FileNotFoundError(f"no .pt latent files under {root}")

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = torch.load(self.files[i], map_location="cpu")
        return d["latent"].float(), d["text"].float()


class GeneratedLatents(torch.utils.data.Dataset):
    """Deterministic generated pairs: text ``[L, D]`` ~ N(0, 1); latent = smooth noise + a text-dependent offset."""

    def __init__(self, n: int, channels: int, size: int, text_len: int, text_dim: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.text = torch.randn(n, text_len, text_dim, generator=g)
        low = torch.randn(n, channels, max(size // 4, 1), max(size // 4, 1), generator=g)
        smooth = nn.functional.interpolate(low, size=size, mode="bilinear", align_corners=False)
        offset = self.text.mean(1)[:, :channels, None, None] * 2
        self.latent = smooth + offset

    def __len__(self):
        return self.latent.shape[0]

    def __getitem__(self, i):
        return self.latent[i], self.text[i]


class SanaFinetuneTask(Task):
    monitor = "loss"
    monitor_mode = "min"

    def build_model(self) -> nn.Module:
        from omegaconf import OmegaConf, open_dict  # noqa: PLC0415

        from models.sana import build_sana  # noqa: PLC0415

        model = build_sana(self.cfg.model, self.cfg.attn)
        if OmegaConf.is_config(self.cfg):
            # Record the transformer's own config with the run (checkpoints save the run config), so the sampler
            # (tasks.image_gen.sana_sample) rebuilds the same architecture without the pretrained folder.
            arch = {k: (list(v) if isinstance(v, tuple) else v) for k, v in model.config.items()
                    if not k.startswith("_")}
            with open_dict(self.cfg):
                self.cfg.model.transformer_config = arch
        return model

    def describe_model(self, model) -> str:
        return f"SANA ({self.cfg.model.name}) with {self.cfg.attn.name} self-attention, softmax cross-attention"

    def build_datasets(self):
        d = self.cfg.task  # data settings live in the task config (the data group is the trainer's batch size)
        if d.get("data_root"):
            full = LatentFolder(d.data_root)
            n_eval = max(1, min(int(d.get("eval_size", 64)), len(full) // 10))
            return (torch.utils.data.Subset(full, range(n_eval, len(full))),
                    torch.utils.data.Subset(full, range(n_eval)))
        from models.sana import sana_config  # noqa: PLC0415

        mc = sana_config(self.cfg.model.get("config", "sana_tiny"))
        args = (mc["in_channels"], mc["sample_size"], int(d.get("text_len", 8)), mc["caption_channels"])
        return (GeneratedLatents(int(d.get("train_size", 256)), *args, seed=0),
                GeneratedLatents(int(d.get("eval_size", 32)), *args, seed=1))

    def _loss(self, model, batch, generator=None):
        from tasks.common.flow_matching import flow_matching_loss  # noqa: PLC0415

        x0, text = batch
        t = self.cfg.task
        return flow_matching_loss(lambda xt, tt: model(xt, text, tt * 1000.0, return_dict=False)[0], x0,
                                  shift=float(t.get("shift", 4.0)), distribution=str(t.get("timesteps", "logit_normal")),
                                  generator=generator)

    def training_loss(self, model, batch):
        loss = self._loss(model, batch)
        return loss, {"loss": loss.detach()}

    @torch.no_grad()
    def evaluate(self, model, loader, device, dist_info) -> dict:
        g = torch.Generator(device=device).manual_seed(0)  # fixed noise and times: comparable across runs
        total, n = 0.0, 0
        for batch in loader:
            batch = self.on_batch(batch, device)
            total += float(self._loss(model, batch, generator=g)) * batch[0].shape[0]
            n += batch[0].shape[0]
        return {"loss": total / max(n, 1)}


def run(cfg, run_dir) -> dict:
    from tasks.common.trainer import Trainer  # noqa: PLC0415

    return Trainer(cfg, SanaFinetuneTask(cfg), run_dir).fit()
