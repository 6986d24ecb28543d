"""SANA fine-tuning with MHLA (Table 4) on the shared Trainer: flow matching on pre-extracted latents.

    python train.py task=sana_finetune attn=mhla model.pretrained=/data/Sana_600M_1024px_diffusers/transformer \
        task.data_root=/data/sana_latents     # .pt files {"latent": [32, 32, 32], "text": [L, 2304], "mask": [L]}
    python train.py task=sana_mini attn=mhla   # tiny SANA on generated data (CPU, seconds)
    python -m tasks.image_gen.sana_sample --ckpt <run_dir> ...   # sampling, FID / CLIP / GenEval (task.sample)

Loss: rectified-flow velocity regression (:func:`tasks.common.flow_matching.flow_matching_loss`, logit-normal
times, SANA's ``flow_shift``), the model called with ``timestep = t * 1000``. Latents (DC-AE f32c32) and Gemma-2
caption embeddings are extracted beforehand (not part of this repository); without ``task.data_root`` the task uses
generated data: smooth random latents whose mean is set by a random "caption" vector (so the text conditioning
carries information), for CPU smoke runs only.

Captions: ``text [L, D]`` with an optional ``mask [L]`` (1 = token, 0 = padding; all ones when absent), passed to the
transformer as ``encoder_attention_mask [B, L]`` as the sampler does; a batch pads shorter captions with masked-out
zeros. Caption dropout (``task.caption_dropout``, SANA's 0.1): during training each sample's caption is replaced,
with that probability, by the unconditional embedding that classifier-free guidance uses at sampling time
(:mod:`tasks.image_gen.sana_prompts`): ``<data_root>/negative.pt`` (``{"text": [L', D], "mask": [L']}``, the
caption encoder's embedding of ``""``, as ``sana_sample --encode-to`` writes it), or, with generated data or when
the data root has no ``negative.pt`` (a one-line warning), a single all-zero token ``[1, D]`` with mask ``[1]``
(the sampler's ``--negative zeros`` / ``--random-prompts`` branch). The draws use torch's global RNG (the trainer
seeds it, as for the loss's noise and times); ``caption_dropout`` 0 or 1 draws nothing. Evaluation never drops.
"""

from __future__ import annotations

import glob
import os

import torch
import torch.nn as nn
from omegaconf import OmegaConf, open_dict

from models.sana import build_sana, sana_config
from tasks.common.flow_matching import flow_matching_loss
from tasks.common.task import Task
from tasks.common.trainer import Trainer
from tasks.image_gen.sana_prompts import NEGATIVE_FILE, load_negative, stack_captions


class LatentFolder(torch.utils.data.Dataset):
    """``.pt`` files holding ``{"latent": [C, H, W], "text": [L, D], optional "mask": [L]}`` (pre-extracted latents
    and captions; ``negative.pt`` files are skipped). Items: ``(latent [C, H, W], text [L, D], mask [L] long)``."""

    def __init__(self, root: str):
        if not os.path.isdir(root):
            raise FileNotFoundError(f"task.data_root={root!r} does not exist: extract DC-AE latents and Gemma-2 caption "
                                    f"embeddings to .pt files {{'latent', 'text'}} there (or omit task.data_root for "
                                    f"generated data)")
        self.files = sorted(f for f in glob.glob(os.path.join(root, "**", "*.pt"), recursive=True)
                            if os.path.basename(f) != NEGATIVE_FILE)
        if not self.files:
            raise FileNotFoundError(f"no .pt latent files under {root}")

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = torch.load(self.files[i], map_location="cpu")
        text = d["text"].float()
        mask = d.get("mask")
        if mask is None:
            mask = torch.ones(text.shape[0], dtype=torch.long)
        elif mask.shape != text.shape[:1]:
            raise ValueError(f"{self.files[i]}: mask {tuple(mask.shape)} does not match text {tuple(text.shape)}")
        return d["latent"].float(), text, mask.long()


class GeneratedLatents(torch.utils.data.Dataset):
    """Deterministic generated pairs: text ``[L, D]`` ~ N(0, 1); latent = smooth noise + a text-dependent offset.

    Items: ``(latent [C, H, W], text [L, D], mask [L])`` with an all-ones mask."""

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
        return self.latent[i], self.text[i], torch.ones(self.text.shape[1], dtype=torch.long)


def pad_captions(text: torch.Tensor, mask: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad ``text [..., L, D]`` and ``mask [..., L]`` at the end to ``length >= L`` tokens (padding masked out)."""
    n = length - text.shape[-2]
    if n <= 0:
        return text, mask
    return (nn.functional.pad(text, (0, 0, 0, n)), nn.functional.pad(mask, (0, n)))


class SanaFinetuneTask(Task):
    monitor = "loss"
    monitor_mode = "min"

    def build_model(self) -> nn.Module:
        model = build_sana(self.cfg.model, self.attention.options, self.attention.cross.options)
        if OmegaConf.is_config(self.cfg):
            # Record the transformer's own config with the run (checkpoints save the run config), so the sampler
            # (tasks.image_gen.sana_checkpoint) rebuilds the same architecture without the pretrained folder.
            arch = {k: (list(v) if isinstance(v, tuple) else v) for k, v in model.config.items()
                    if not k.startswith("_")}
            with open_dict(self.cfg):
                self.cfg.model.transformer_config = arch
        return model

    def describe_model(self, model) -> str:
        cross = self.attention.cross
        return (f"SANA ({self.cfg.model.name}) with {self.cfg.attn.name} self-attention, "
                f"{'softmax (native)' if cross.is_native else cross.name} cross-attention")

    @property
    def caption_dropout(self) -> float:
        p = float(self.cfg.task.get("caption_dropout", 0.0) or 0.0)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"task.caption_dropout must be in [0, 1], got {p}")
        return p

    def negative_caption(self, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The unconditional caption ``(text [L', D], mask [L'] long)`` that caption dropout substitutes:
        ``<data_root>/negative.pt`` (:func:`tasks.image_gen.sana_prompts.load_negative`), else one zero token
        ``[1, D]`` with mask ``[1]`` (generated data, or a data root without ``negative.pt``: a warning)."""
        if getattr(self, "_negative", None) is not None and self._negative[0].shape[-1] == dim:
            return self._negative
        root = self.cfg.task.get("data_root")
        path = os.path.join(root, NEGATIVE_FILE) if root else None
        if path and os.path.isfile(path):
            text, mask = load_negative(path)
        else:
            if path and self.caption_dropout > 0:
                print(f"warning: {path} not found: caption dropout uses a zero caption embedding [1, {dim}] "
                      f"(sample with --negative zeros, or write negative.pt, the encoder's embedding of \"\")",
                      flush=True)
            text, mask = load_negative("zeros", dim)
        if text.shape[-1] != dim:
            raise ValueError(f"{path}: negative embedding dimension {text.shape[-1]} != caption dimension {dim}")
        mask = torch.ones(text.shape[0], dtype=torch.long) if mask is None else mask.long()
        self._negative = (text, mask)
        return self._negative

    def drop_captions(self, text: torch.Tensor, mask: torch.Tensor, p: float | None = None):
        """Caption dropout: each row of ``text [B, L, D]`` / ``mask [B, L]`` becomes, with probability ``p``
        (default ``task.caption_dropout``), the unconditional caption of :meth:`negative_caption`; both are
        padded to ``max(L, L')`` tokens. Returns ``(text [B, L*, D], mask [B, L*], dropped [B] bool)``.

        Draws ``torch.rand(B)`` from the global RNG on ``text``'s device, except when ``p`` is 0 or 1.
        """
        p = self.caption_dropout if p is None else float(p)
        b = text.shape[0]
        if p <= 0.0:
            return text, mask, torch.zeros(b, dtype=torch.bool, device=text.device)
        dropped = (torch.ones(b, dtype=torch.bool, device=text.device) if p >= 1.0
                   else torch.rand(b, device=text.device) < p)
        nt, nm = self.negative_caption(text.shape[-1])
        nt, nm = nt.to(device=text.device, dtype=text.dtype), nm.to(device=mask.device, dtype=mask.dtype)
        length = max(text.shape[1], nt.shape[0])
        text, mask = pad_captions(text, mask, length)
        nt, nm = pad_captions(nt, nm, length)
        text = torch.where(dropped[:, None, None], nt[None], text)
        mask = torch.where(dropped[:, None], nm[None], mask)
        return text, mask, dropped

    def collate(self, samples):
        """``[(latent [C, H, W], text [L_i, D], mask [L_i])]`` -> ``[latent [B, C, H, W], text [B, L, D],
        mask [B, L]]`` with ``L = max L_i`` (shorter captions zero-padded, the padding masked out)."""
        latents, texts, masks = zip(*samples)
        text, mask = stack_captions(list(texts), list(masks))
        return [torch.stack(latents), text, mask]

    def build_datasets(self):
        d = self.cfg.task  # data settings live in the task config (the data group is the trainer's batch size)
        if d.get("data_root"):
            full = LatentFolder(d.data_root)
            if self.caption_dropout > 0:  # load negative.pt (or warn) now, not at the first training step
                self.negative_caption(int(full[0][1].shape[-1]))
            n_eval = max(1, min(int(d.get("eval_size", 64)), len(full) // 10))
            return (torch.utils.data.Subset(full, range(n_eval, len(full))),
                    torch.utils.data.Subset(full, range(n_eval)))

        mc = sana_config(self.cfg.model.get("config", "sana_tiny"))
        args = (mc["in_channels"], mc["sample_size"], int(d.get("text_len", 8)), mc["caption_channels"])
        return (GeneratedLatents(int(d.get("train_size", 256)), *args, seed=0),
                GeneratedLatents(int(d.get("eval_size", 32)), *args, seed=1))

    def _loss(self, model, batch, generator=None):
        """Flow-matching loss of ``batch = [latent [B, C, H, W], text [B, L, D], mask [B, L]]`` (no dropout)."""
        x0, text, mask = batch
        t = self.cfg.task

        def predict(xt, tt):
            return model(xt, encoder_hidden_states=text, timestep=tt * 1000.0, encoder_attention_mask=mask,
                         return_dict=False)[0]

        return flow_matching_loss(predict, x0, shift=float(t.get("shift", 4.0)),
                                  distribution=str(t.get("timesteps", "logit_normal")), generator=generator)

    def training_loss(self, model, batch):
        x0, text, mask = batch
        text, mask, dropped = self.drop_captions(text, mask)
        loss = self._loss(model, [x0, text, mask])
        return loss, {"loss": loss.detach(), "caption_dropped": dropped.float().mean()}

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
    return Trainer(cfg, SanaFinetuneTask(cfg), run_dir).fit()
