"""Generating images from a trained DiT: guidance, samplers, latent decoding, uint8 conversion, grids.

    imgs = generate(model, labels, steps=250, method="ddpm", cfg_scale=1.5, generator=g)  # [B, H, W, C] uint8
"""

from __future__ import annotations

import torch

from .diffusion import create_diffusion, sample
from .vae import decode


def model_fn_for(model, labels: torch.Tensor, cfg_scale: float = 1.0, guidance_channels: int | None = None):
    """``(x_t, t) -> output`` for the samplers: conditional, or classifier-free guided when ``cfg_scale != 1``."""
    if cfg_scale == 1.0:
        return lambda x, t: model(x, t, labels)
    return lambda x, t: model.forward_with_cfg(x, t, labels, cfg_scale, guidance_channels)


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W]`` in [-1, 1] -> ``[B, H, W, C]`` uint8 (ADM's conversion: ``(x + 1) * 127.5``, rounded)."""
    return ((x.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


@torch.no_grad()
def generate(model, labels: torch.Tensor, *, steps: int | str = 250, method: str = "ddpm", cfg_scale: float = 1.0,
             guidance_channels: int | None = None, generator: torch.Generator | None = None, vae=None,
             latent_scale: float = 0.18215, clip_denoised: bool | None = None, num_train_steps: int = 1000,
             prediction: str = "eps", progress: bool = False) -> torch.Tensor:
    """Sample one image per label. Returns ``[B, H, W, C]`` uint8 (decoded by ``vae`` for latent models).

    ``steps``: sampling steps (respaced from ``num_train_steps``); DDIM uses ``"ddim<steps>"`` spacing.
    ``clip_denoised``: clip predicted x0 to [-1, 1]; default: on in pixel space, off for latents (as DiT).
    ``generator``: all noise comes from it (on the model's device), so equal seeds give equal images.
    ``prediction``: what the model was trained to predict (``eps`` or ``v``; ``task.prediction``).
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    spacing = f"ddim{steps}" if method == "ddim" else str(steps)
    diffusion = create_diffusion(spacing, num_train_steps, learn_sigma=model.learn_sigma, prediction=prediction)
    shape = (labels.shape[0], model.in_channels, model.input_size, model.input_size)
    clip = (vae is None) if clip_denoised is None else clip_denoised
    x = sample(diffusion, model_fn_for(model, labels.to(device), cfg_scale, guidance_channels), shape,
               method=method, generator=generator, device=device, clip_denoised=clip, progress=progress)
    if vae is not None:
        x = decode(vae, x, latent_scale)
    model.train(was_training)
    return to_uint8(x)


def save_grid(images_uint8: torch.Tensor, path: str, nrow: int, upscale: int = 1) -> str:
    """Save ``[B, H, W, C]`` uint8 images as a PNG grid with ``nrow`` images per row, each enlarged
    ``upscale`` times by pixel repetition (for viewing small images; the pixels are not interpolated)."""
    from torchvision.utils import save_image  # noqa: PLC0415

    x = images_uint8.permute(0, 3, 1, 2).float() / 255
    if upscale > 1:
        x = x.repeat_interleave(upscale, dim=2).repeat_interleave(upscale, dim=3)
    save_image(x, path, nrow=nrow, padding=2, pad_value=1.0)
    return path
