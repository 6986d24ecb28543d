"""Class-conditional image generation with DiT for the shared trainer (Table 3 / 12 / 7b, MNIST default).

Training: DiT's recipe (``configs/task/imagenet_gen.yaml``): hybrid loss (eps MSE + VLB for the learned
variance; ``task.prediction=v`` regresses the velocity instead, as the MNIST default does) on uniformly drawn
steps of the 1000-step linear schedule, in SD-VAE latent space (encoded on the fly, or pre-extracted once with
``data.latents=precompute``). Evaluation: the same loss on held-out data with
fixed noise and steps (a deterministic number to compare runs; FID comes from sampling, ``sample.py``).
After training, rank 0 writes ``<run_dir>/samples.png``: one row per class, sampled from the EMA weights.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from models.dig import build_dig
from models.dit import build_dit
from tasks.common.distributed import barrier, setup_distributed
from tasks.common.logger import Media
from tasks.common.task import Task

from .data import LatentDataset, MNISTImages, build_image_folder, check_image_folder_split
from .diffusion import create_diffusion
from .sampling import generate, save_grid
from .vae import downsample_factor, encode, load_vae, precompute_latents


class ImageGenTask(Task):
    monitor = "loss"
    monitor_mode = "min"

    def __init__(self, cfg, attention=None):
        super().__init__(cfg, attention)
        self.diffusion = create_diffusion("", int(cfg.task.get("diffusion_steps", 1000)),
                                          learn_sigma=bool(cfg.model.get("learn_sigma", True)),
                                          prediction=str(cfg.task.get("prediction", "eps")))
        self._vae = None

    # ----------------------------------------------------------------------------------- model
    def build_model(self) -> nn.Module:
        self._check_data_root()  # before the model: a wrong data.root should not wait for the build
        kind = self.cfg.model.get("kind", "dit")
        if kind == "dig":  # DiG (models/dig.py): a DiT subclass whose blocks scan with GLA (attn=gla) or run MHLA
            return build_dig(self.cfg.model, self.attention.options)
        if kind != "dit":
            raise ValueError(f"model.kind={kind!r} is not a generation model (dit | dig)")

        return build_dit(self.cfg.model, self.attention.options)

    def describe_model(self, model) -> str:
        a = self.attention.options
        extras = "".join(f"+{k}" for k in ("cpe", "gate") if a.get(k))
        return f"{self.cfg.model.name} with {a['name']}{extras} attention"

    def example_input(self, device):
        m = self.cfg.model
        s = int(m.input_size)
        x = torch.zeros(1, int(m.get("in_channels", 4)), s, s, device=device)
        return x, torch.zeros(1, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, device=device)

    # ------------------------------------------------------------------------------------ data
    @property
    def latent(self) -> bool:
        return self.cfg.data.get("latents", "none") in ("online", "precompute")

    def vae(self, device):
        if self._vae is None:
            self._vae = load_vae(self.cfg.data.get("vae_path"), device)
        return self._vae.to(device)  # loaded on the CPU for the size check, moved once to the training device

    def build_datasets(self):
        data, seed = self.cfg.data, int(self.cfg.get("seed", 0))
        if data.name == "mnist":
            if self.latent:
                raise ValueError("data=mnist_gen is pixel space; set data.latents=none")
            pad = int(data.get("pad_to", 32))
            size = int(data.get("image_size") or pad)
            self._check_size(size, 1)
            return (MNISTImages("train", pad, data.get("limit"), size),
                    MNISTImages("test", pad, data.get("eval_limit"), size))
        if data.name in ("imagenet", "imagefolder"):
            return self._image_folder(data, seed)
        raise ValueError(f"data.name={data.name!r} is not supported by the image generation task (mnist | imagenet)")

    def _check_size(self, pixels: int, factor: int) -> None:
        want = pixels // factor
        if int(self.cfg.model.input_size) != want:
            raise ValueError(f"model.input_size={self.cfg.model.input_size} but the data gives {want}x{want} inputs "
                             f"({pixels} px / {factor}); set model.input_size={want}")

    def _check_data_root(self) -> None:
        """Refuse a missing or empty ``data.root/train`` at start, unless a precomputed latent cache replaces it."""
        data = self.cfg.data
        if data.name not in ("imagenet", "imagefolder"):
            return
        if data.get("latents", "online") == "precompute":
            if os.path.isfile(os.path.join(self._latent_cache(data), "meta.json")):
                return

        check_image_folder_split(data.root, "train")

    @staticmethod
    def _latent_cache(data) -> str:
        """Where ``data.latents=precompute`` keeps the latents (``data.latent_cache``, default ``<root>/latents_<size>``)."""
        return data.get("latent_cache") or os.path.join(str(data.root), f"latents_{int(data.image_size)}")

    def _images(self, data, seed, flip: bool = True):
        return build_image_folder(data.root, int(data.image_size), flip=flip, seed=seed,
                                  skip_bad_images=bool(data.get("skip_bad_images", False)))

    def _image_folder(self, data, seed):
        size = int(data.image_size)
        mode = data.get("latents", "online")
        if mode == "none":
            self._check_size(size, 1)
            return self._images(data, seed), None
        if mode == "online":
            self._check_size(size, downsample_factor(self.vae("cpu")))
            return self._images(data, seed), None
        if mode != "precompute":
            raise ValueError(f"data.latents must be none, online or precompute, got {mode!r}")
        cache = self._latent_cache(data)
        if not os.path.isfile(os.path.join(cache, "meta.json")):
            self._precompute(data, cache, seed)
        ds = LatentDataset(cache, seed=seed)
        self._check_size(size, size // ds.meta["latent_shape"][-1])
        return ds, None

    def _precompute(self, data, cache, seed):
        info = setup_distributed(self.cfg.trainer.get("device", "auto"))
        images = self._images(data, seed, flip=False)
        precompute_latents(images, self.vae(info.device), cache, batch_size=int(data.get("encode_batch_size", 64)),
                           rank=info.rank, world_size=info.world_size, device=info.device, progress=info.is_main)
        barrier(info)

    def on_batch(self, batch, device):
        x, y = (b.to(device, non_blocking=True) for b in batch)
        if self.cfg.data.get("latents", "none") == "online":
            x = encode(self.vae(device), x)
        return x, y

    # ------------------------------------------------------------------------------------ loss
    def training_loss(self, model, batch):
        x, y = batch
        t = torch.randint(0, self.diffusion.num_timesteps, (x.shape[0],), device=x.device)
        terms = self.diffusion.training_losses(lambda xt, tt: model(xt, tt, y), x, t)
        logs = {"mse": terms["mse"].mean().detach()}
        if "vb" in terms:
            logs["vb"] = terms["vb"].mean().detach()
        return terms["loss"].mean(), logs

    @torch.no_grad()
    def evaluate(self, model, loader, device, dist_info) -> dict:
        """Hybrid loss on held-out images with steps and noise fixed by ``(seed, batch)``."""
        sums = torch.zeros(3, device=device, dtype=torch.float64)
        for b, batch in enumerate(loader):
            x, y = self.on_batch(batch, device)
            g = torch.Generator().manual_seed(1000 + b * 7919 + dist_info.rank)
            t = torch.randint(0, self.diffusion.num_timesteps, (x.shape[0],), generator=g).to(device)
            noise = torch.randn(x.shape, generator=g).to(device)
            terms = self.diffusion.training_losses(lambda xt, tt: model(xt, tt, y), x.float(), t, noise)
            sums += torch.stack([terms["loss"].sum(), terms["mse"].sum(),
                                 torch.tensor(float(x.shape[0]), device=device)]).double()
        if dist_info.enabled:
            dist.all_reduce(sums)
        return {"loss": (sums[0] / sums[2]).item(), "mse": (sums[1] / sums[2]).item()}

    # ------------------------------------------------------------------------------ after fit
    def after_fit(self, trainer, metrics: dict) -> dict:
        s = self.cfg.task.get("sample") or {}
        if not s.get("grid", True) or not trainer.dist.is_main:
            return {}

        model = trainer.ema.module if getattr(trainer, "ema", None) is not None else trainer.model
        n_cls = min(int(s.get("classes", 10)), int(self.cfg.model.num_classes))
        per = int(s.get("per_class", 10))
        labels = torch.arange(n_cls).repeat_interleave(per)
        g = torch.Generator(device=trainer.device).manual_seed(int(s.get("seed", 0)))
        vae = self.vae(trainer.device) if self.latent else None
        t0 = time.time()
        imgs = generate(model, labels.to(trainer.device), steps=s.get("steps", 250), method=s.get("method", "ddpm"),
                        cfg_scale=float(s.get("cfg_scale", 1.0)), guidance_channels=s.get("guidance_channels"),
                        generator=g, vae=vae, num_train_steps=self.diffusion.num_timesteps,
                        prediction=self.diffusion.prediction, progress=True)
        path = save_grid(imgs.cpu(), os.path.join(str(trainer.run_dir), "samples.png"), nrow=per,
                         upscale=int(s.get("upscale", 1)))
        what = (f"{n_cls} classes x {per}, {s.get('method', 'ddpm')} {s.get('steps', 250)} steps, "
                f"cfg {s.get('cfg_scale', 1.0)}")
        print(f"sample grid ({what}): {path}", flush=True)
        grid = Media(path, "image", caption=f"one row per class: {what}")
        return {"sample_s": time.time() - t0, "samples": grid}
