"""Decoding SANA latents to images in [-1, 1]: DC-AE f32c32 from a LOCAL folder, or a preview for tiny runs.

    decode = dcae_decoder(load_dcae("/models/dc-ae-f32c32-sana-1.0-diffusers"))   # or preview_decoder
    images = decode(latents)                                                     # [B, 3, H, W] in [-1, 1]
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.weights import require_local_weights

DC_AE_REPO = "mit-han-lab/dc-ae-f32c32-sana-1.0-diffusers"


def load_dcae(path: str | None, device="cpu", dtype=torch.float32):
    """diffusers' ``AutoencoderDC`` (DC-AE f32c32 for SANA-0.6B) from a LOCAL folder, frozen, in eval mode."""
    require_local_weights(path, what="DC-AE weights (SANA-0.6B decodes with DC-AE f32c32)", repo=DC_AE_REPO,
                          option="--vae {dir} (or --pipeline <Sana_600M_1024px_diffusers>, whose vae/ is used)",
                          example_dir="/models/dc-ae-f32c32-sana-1.0-diffusers",
                          contents="config.json + diffusion_pytorch_model.safetensors")
    from diffusers import AutoencoderDC  # noqa: PLC0415

    vae = AutoencoderDC.from_pretrained(path, local_files_only=True, dtype=dtype).to(device).eval()
    for p in vae.parameters():
        p.requires_grad_(False)
    return vae


def dcae_decoder(vae) -> Callable:
    """``decode(latents [B, C, h, w]) -> images [B, 3, h * f, w * f]`` in [-1, 1] (fp32, clamped), dividing by
    the VAE config's ``scaling_factor`` first (0.41407 for DC-AE f32c32 SANA)."""
    scale = float(vae.config.scaling_factor)
    dtype = next(vae.parameters()).dtype

    @torch.no_grad()
    def decode(z):
        return vae.decode((z / scale).to(dtype), return_dict=False)[0].float().clamp(-1, 1)

    return decode


@torch.no_grad()
def preview_decoder(z: torch.Tensor, factor: int = 4) -> torch.Tensor:
    """Stand-in decoder (no VAE): latent channels 0-2 squashed by ``tanh`` and upsampled ``factor`` x (nearest).

    ``z [B, C, h, w]`` -> ``[B, 3, h * factor, w * factor]`` in [-1, 1]; only for tiny runs and tests.
    """
    rgb = z[:, :3] if z.shape[1] >= 3 else z[:, :1].expand(-1, 3, -1, -1)
    return torch.nn.functional.interpolate(torch.tanh(rgb.float()), scale_factor=factor, mode="nearest")

