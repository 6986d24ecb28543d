"""Video generation task for the shared trainer: flow-matching fine-tuning of a Wan transformer.

Two settings, one code path:
    ``task=video_mini``    CPU default: a tiny random-init Wan-shaped model in pixel space (``model.vae: null``)
                           on generated moving-shape clips, word-table text; samples ``<run_dir>/samples.gif``
    ``task=wan_finetune``  Wan2.1-T2V-1.3B from ``model.pretrained`` (local diffusers folder), VAE latents,
                           UMT5 text (or cached embeddings), the paper's recipe (AdamW 2e-5, shift 3, bf16)

Loss: velocity MSE (:mod:`tasks.common.flow_matching`), times ``shift(sigmoid(N(0, 1)))``; captions are
dropped (replaced by the null prompt) with probability ``task.caption_dropout`` so CFG works at sampling.
Evaluation: the same loss at fixed times and fixed noise (``eval/loss``, comparable across runs).
``task.finetune: false`` marks an evaluation-only row (Table 5's FlashAttention: the pretrained Wan2.1, not
fine-tuned): :meth:`VideoGenTask.build_datasets` refuses to train it and ``scripts.tables.table5`` only samples it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import OmegaConf

from models.wan import build_wan, load_vae, token_grid
from tasks.common import flow_matching as fm
from tasks.common.config import ConfigError
from tasks.common.logger import Media
from tasks.common.task import Task

from .data import VOCAB, MovingShapes, VideoFolder, caption_ids
from .follow import follow_report, summary_line
from .media import save_frames_png, save_gif, save_mp4, tile_videos
from .model import VideoDenoiser
from .text import PromptEncoder


def _plain(cfg):
    return OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg or {})


class VideoGenTask(Task):
    monitor = "loss"
    monitor_mode = "min"

    def __init__(self, cfg, attention=None):
        super().__init__(cfg, attention)
        m, d = cfg.model, cfg.data
        self.pixel_space = not m.get("vae")
        stride = (1, 1, 1) if self.pixel_space else tuple(m.get("vae_stride", (4, 8, 8)))
        self.grid = token_grid(int(d.num_frames), int(d.height), int(d.width), tuple(m.patch_size), stride)
        self.word_text = m.get("text", "umt5") == "table"
        self._vae = self._prompts = None

    # ------------------------------------------------------------------------------------- model
    def build_model(self) -> nn.Module:
        m = self.cfg.model
        coords = bool(m.get("coord_channels", False))
        if coords:
            if m.get("pretrained"):
                raise ConfigError("model.coord_channels adds input channels: only for a random-init model "
                                  "(model.pretrained=null)")
            m = OmegaConf.merge(m, {"in_channels": int(m.in_channels) + 3})  # x_t + (frame, row, column)
        transformer = build_wan(m, self.attention.options, grid=self.grid, cross_cfg=self.attention.cross.options)
        kw = dict(text_pool=bool(m.get("text_pool", False)), coord_channels=coords)
        if self.word_text:
            return VideoDenoiser(transformer, len(VOCAB), int(m.text_dim), **kw)
        return VideoDenoiser(transformer, **kw)

    def describe_model(self, model) -> str:
        attention = self.attention
        a, cross = attention.options, attention.cross
        layers = "-" if attention.is_native else a.get("layers", "all")
        blocks = f", blocks {list(a['blocks'])}" if a.get("blocks") else ""  # (MHLA's blocks per axis)
        return (f"{self.cfg.model.name} (Wan-shaped) with {a['name']} self-attention (layers: {layers}{blocks}), "
                f"{'softmax (native)' if cross.is_native else cross.name} cross-attention, "
                f"token grid {self.grid} = {math.prod(self.grid)} tokens")

    # -------------------------------------------------------------------------------------- data
    @property
    def finetune(self) -> bool:
        """``task.finetune`` (default true); false: an evaluation-only row (Table 5's FlashAttention, the
        pretrained Wan2.1 without fine-tuning), sampled by ``python -m scripts.tables.table5``, never trained."""
        return bool(self.cfg.task.get("finetune", True))

    def build_datasets(self):
        if not self.finetune:  # the trainer asks for data only to train: refuse before any step
            raise ConfigError(
                "task.finetune=false: this row is evaluation-only (the pretrained model, not fine-tuned); sample it "
                "with `python -m scripts.tables.table5 --sample-pretrained <row> --wan <Wan2.1 folder>` instead of "
                "train.py, or set task.finetune=true to fine-tune it")
        d = self.cfg.data
        if d.name == "moving_shapes":
            if int(d.height) != int(d.width):
                raise ValueError("moving_shapes clips are square: set data.height == data.width")
            seed = int(self.cfg.get("seed", 0))
            kw = dict(num_frames=int(d.num_frames), size=int(d.height), start=d.get("start", "random"))
            return (MovingShapes(int(d.train_size), seed=seed, **kw), MovingShapes(int(d.eval_size), seed=seed + 7919, **kw))
        if d.name == "video_folder":
            kw = dict(num_frames=int(d.num_frames), height=int(d.height), width=int(d.width),
                      frame_stride=int(d.get("frame_stride", 1)))
            train = VideoFolder(d.root, limit=d.get("limit"), **kw)
            n_eval = int(d.get("eval_size", 0) or 0)
            return train, (torch.utils.data.Subset(train, range(min(n_eval, len(train)))) if n_eval else None)
        raise ValueError(f"data.name={d.name!r} is not a video dataset (moving_shapes | video_folder)")

    def collate(self, samples):
        videos = torch.stack([s[0] for s in samples])
        texts = [s[1] for s in samples]
        return videos, (torch.stack(texts) if torch.is_tensor(texts[0]) else texts)

    def vae(self, device):
        if self._vae is None:
            self._vae = load_vae(self.cfg.model.pretrained).to(device).eval().requires_grad_(False)
        return self._vae

    def prompts(self, device):
        if self._prompts is None:
            self._prompts = PromptEncoder(self.cfg.model.get("pretrained"), self.cfg.data.get("text_emb_dir"),
                                          device=device)
        return self._prompts

    @torch.no_grad()
    def encode_video(self, video: torch.Tensor) -> torch.Tensor:
        """Pixels ``[B, 3, F, H, W]`` in [-1, 1] -> normalised latents (pixel space: unchanged)."""
        if self.pixel_space:
            return video
        vae = self.vae(video.device)
        z = vae.encode(video.to(vae.dtype)).latent_dist.sample()
        mean = torch.tensor(vae.config.latents_mean, device=z.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=z.device).view(1, -1, 1, 1, 1)
        return ((z - mean) / std).float()

    @torch.no_grad()
    def decode_video(self, latents: torch.Tensor) -> torch.Tensor:
        if self.pixel_space:
            return latents.clamp(-1, 1)
        vae = self.vae(latents.device)
        mean = torch.tensor(vae.config.latents_mean, device=latents.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=latents.device).view(1, -1, 1, 1, 1)
        return vae.decode((latents * std + mean).to(vae.dtype), return_dict=False)[0].float().clamp(-1, 1)

    def encode_text(self, texts, device) -> torch.Tensor:
        """Word ids (mini) or a list of prompts -> the model's ``text`` input."""
        if torch.is_tensor(texts):
            return texts.to(device)
        if self.word_text:
            return torch.stack([caption_ids(t) if t else torch.zeros(3, dtype=torch.long) for t in texts]).to(device)
        return self.prompts(device)(list(texts)).to(device)

    def null_text(self, batch: int, device) -> torch.Tensor:
        """The unconditional input: word id 0 (mini) or the embedding of the empty prompt."""
        if self.word_text:
            return torch.zeros(batch, 3, dtype=torch.long, device=device)
        return self.prompts(device)([""] * batch).to(device)

    def on_batch(self, batch, device):
        video, texts = batch
        return self.encode_video(video.to(device)), self.encode_text(texts, device)

    # ------------------------------------------------------------------------------------- loss
    def _fm_kwargs(self):
        t = self.cfg.task
        return dict(shift=float(t.shift), distribution=t.get("timestep_sampling", "logit_normal"),
                    mean=float(t.get("logit_mean", 0.0)), std=float(t.get("logit_std", 1.0)))

    def training_loss(self, model, batch):
        x0, text = batch
        p = float(self.cfg.task.get("caption_dropout", 0.0))
        if p > 0:
            drop = torch.rand(x0.shape[0], device=x0.device) < p
            if drop.any():
                null = self.null_text(x0.shape[0], x0.device)
                text = torch.where(drop.view(-1, *([1] * (text.dim() - 1))), null.to(text.dtype), text)
        loss = fm.flow_matching_loss(lambda xt, t: model(xt, t, text), x0, **self._fm_kwargs())
        return loss, {}

    @torch.no_grad()
    def evaluate(self, model, loader, device, dist_info) -> dict:
        """Velocity loss at times 0.1, 0.3, 0.5, 0.7, 0.9 with noise seeded per batch (deterministic)."""
        total, count = torch.zeros((), device=device), torch.zeros((), device=device)
        for i, batch in enumerate(loader):
            x0, text = self.on_batch(batch, device)
            g = torch.Generator(device="cpu").manual_seed(1000 + i + 100_000 * dist_info.rank)
            for tv in (0.1, 0.3, 0.5, 0.7, 0.9):
                noise = torch.randn(x0.shape, generator=g).to(device, x0.dtype)
                t = torch.full((x0.shape[0],), tv, device=device)
                per = fm.flow_matching_loss(lambda xt, tt: model(xt, tt, text), x0, t=t, noise=noise,
                                            reduction="none")
                total += per.sum()
                count += per.numel()
        if dist_info.enabled:
            dist.all_reduce(total)
            dist.all_reduce(count)
        return {"loss": (total / count).item()}

    def example_input(self, device):
        return None  # the FLOP counter does not take the (x, t, text) signature

    # --------------------------------------------------------------------------------- sampling
    def latent_shape(self, batch: int) -> tuple[int, ...]:
        m = self.cfg.model
        patch = tuple(m.patch_size)
        lat = tuple(g * p for g, p in zip(self.grid, patch))
        return (batch, int(m.in_channels), *lat)

    @torch.no_grad()
    def generate(self, model, prompts: list[str], device, *, num_steps: int, guidance_scale: float, shift: float,
                 seed: int = 0, batch_size: int = 4, progress: bool = True) -> list[torch.Tensor]:
        """Videos ``[3, F, H, W]`` in [-1, 1] for ``prompts`` (Euler + CFG, noise seeded per prompt)."""
        model.eval()
        out = []
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            noise = torch.stack([torch.randn(self.latent_shape(1)[1:], generator=torch.Generator().manual_seed(seed + start + j))
                                 for j in range(len(chunk))]).to(device)
            cond = self.encode_text(chunk, device)
            uncond = self.null_text(len(chunk), device)
            x0 = fm.euler_sample(lambda x, t, c: model(x, t, c).float(), noise, num_steps=num_steps, shift=shift,
                                 cond=cond, uncond=uncond, guidance_scale=guidance_scale, progress=progress)
            out.extend(self.decode_video(x0).cpu())
        return out

    def after_fit(self, trainer, metrics) -> dict:
        s = self.cfg.get("sample")
        if not s or not s.get("prompts") or not trainer.dist.is_main:
            return {}

        model = trainer.ema.module if trainer.ema is not None else trainer.model  # EMA weights when kept
        prompts = list(s.prompts)
        videos = self.generate(model, prompts, trainer.device, num_steps=int(s.num_steps),
                               guidance_scale=float(s.guidance_scale), shift=float(s.shift), seed=int(s.get("seed", 0)))
        run = Path(trainer.run_dir)
        grid = tile_videos(videos)
        scale = int(s.get("gif_scale", 1))
        gif = save_gif(grid, run / "samples.gif", fps=int(s.get("fps", 8)), scale=scale)
        mp4 = save_mp4(grid, run / "samples.mp4", fps=int(s.get("fps", 8)))
        save_frames_png(videos, run / "samples_frames.png", scale=scale)
        (run / "samples.txt").write_text("\n".join(prompts) + "\n")
        print(f"samples: {gif}" + (f", {mp4}" if mp4 else "") + f" ({len(prompts)} prompts, left to right: "
              f"{'; '.join(prompts)})", flush=True)
        out = {"samples": Media(gif, "video", caption=f"left to right: {'; '.join(prompts)}")}
        if self.cfg.data.name == "moving_shapes":  # the captions are checkable: colour, motion, axis, shape
            report = follow_report(videos, prompts)
            (run / "samples_follow.json").write_text(json.dumps(report, indent=1) + "\n")
            print(summary_line(report) + f" -> {run / 'samples_follow.json'}", flush=True)
            out.update(follow=report["followed"], follow_shape=report["shape_ok"])
        return out
