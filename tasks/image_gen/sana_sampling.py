"""Sampling SANA latents from caption embeddings: settings, seeded noise, the Flow-DPM-Solver and Euler samplers.

    z = sample_latents(model, text, mask=mask, neg_text=neg, neg_mask=neg_mask, seeds=[sample_seed(0, i, 0) ...])

Rectified flow from ``t = 1`` (noise) to ``t = 0`` with classifier-free guidance ``v_u + g (v_c - v_u)`` on SANA's
shifted time grid. ``solver="dpm"`` is diffusers' ``SanaPipeline`` itself (:func:`sana_pipeline`: our transformer
and the Flow-DPM-Solver scheduler, no text encoder or VAE), driven with ``prompt_embeds`` / ``latents`` and
``output_type="latent"``; ``solver="euler"`` is :func:`tasks.common.flow_matching.euler_sample`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from omegaconf import OmegaConf

from tasks.common.flow_matching import euler_sample

# Used when the run's config has no task.sample block (SanaPipeline's defaults at 1024 px).
DEFAULTS = dict(steps=20, cfg_scale=4.5, shift=3.0, seed=0, solver="dpm", images_per_prompt=1, batch_size=8,
                max_sequence_length=300, use_chi=True, npz_size=512, precision="auto")
SOLVERS = ("dpm", "euler")
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def sample_settings(cfg=None, **overrides) -> dict:
    """:data:`DEFAULTS` < the run's ``task.sample`` block < ``overrides`` that are not ``None``."""
    s = dict(DEFAULTS)
    block = None
    if cfg is not None:
        task = cfg.get("task") if hasattr(cfg, "get") else None
        block = task.get("sample") if task is not None else None
    if block:
        block = OmegaConf.to_container(block, resolve=True) if OmegaConf.is_config(block) else dict(block)
        s.update(block)  # an explicit null counts (npz_size: null keeps the decoded size)
    s.update({k: v for k, v in overrides.items() if v is not None})
    if s["solver"] not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {s['solver']!r}")
    return s


def sample_seed(seed: int, prompt_index: int, k: int) -> int:
    """The noise seed of image ``k`` of prompt ``prompt_index``."""
    return int(seed) * 1_000_003 + int(prompt_index) * 1_000 + int(k)


def initial_noise(seeds, shape, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """``[len(seeds), *shape]`` standard normal noise, row ``b`` from a CPU generator seeded with ``seeds[b]``."""
    rows = [torch.randn(tuple(shape), generator=torch.Generator().manual_seed(int(s))) for s in seeds]
    return torch.stack(rows).to(device=device, dtype=dtype)


def _autocast(precision: str, device: torch.device):
    """CUDA autocast for ``precision`` bf16 / fp16 on a CUDA device; nothing otherwise (fp32)."""
    if precision in AUTOCAST and device.type == "cuda":
        return torch.autocast("cuda", dtype=AUTOCAST[precision])
    return torch.autocast("cpu", enabled=False)


def make_velocity(model, precision: str = "fp32") -> Callable:
    """``velocity(x [B, C, h, w], t [B] in [0, 1], cond=(text [B, L, D], mask [B, L] | None)) -> v`` (fp32).

    The transformer sees ``timestep = t * 1000`` (as in training and in ``SanaPipeline``); ``precision``
    ``bf16`` / ``fp16`` runs it under CUDA autocast.
    """

    def velocity(x, t, cond):
        text, mask = cond
        with _autocast(precision, x.device):
            out = model(x, encoder_hidden_states=text, timestep=t.float() * 1000.0, encoder_attention_mask=mask,
                        return_dict=False)[0]
        return out.float()

    return velocity


def dpm_scheduler(shift: float):
    """SANA's Flow-DPM-Solver: diffusers' ``DPMSolverMultistepScheduler`` on flow sigmas shifted by ``shift``
    (the scheduler a diffusers SANA pipeline folder ships, ``flow_shift`` 3.0 at 1024 px)."""
    from diffusers import DPMSolverMultistepScheduler  # noqa: PLC0415

    return DPMSolverMultistepScheduler(flow_shift=float(shift), use_flow_sigmas=True, prediction_type="flow_prediction")


@functools.cache
def _pipeline_class():
    from diffusers import SanaPipeline  # noqa: PLC0415

    class EmbeddingSanaPipeline(SanaPipeline):
        """``SanaPipeline`` that guides whenever ``g != 1`` (diffusers: only ``g > 1``), so that ``g < 1`` is the
        same ``v_u + g (v_c - v_u)`` as :func:`tasks.common.flow_matching.guided_velocity` (``g = 0``:
        unconditional). :func:`sample_latents` passes ``g = 1`` when there is no unconditional embedding."""

        @property
        def do_classifier_free_guidance(self):
            return self._guidance_scale != 1.0

    return EmbeddingSanaPipeline


def sana_pipeline(model, shift: float = 3.0, progress: bool = False):
    """diffusers' ``SanaPipeline`` around ``model`` and :func:`dpm_scheduler` with no tokenizer, text encoder or VAE
    (nothing is loaded): call it with ``prompt_embeds`` (+ masks), ``latents`` and ``output_type="latent"``."""
    pipe = _pipeline_class()(tokenizer=None, text_encoder=None, vae=None, transformer=model,
                             scheduler=dpm_scheduler(shift))
    pipe.set_progress_bar_config(disable=not progress, desc="sampling", leave=False)
    return pipe


def _pad(text: torch.Tensor, mask: torch.Tensor | None, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``text [B, L, D]`` zero-padded to ``length`` tokens and its mask (all ones when ``None``) padded with 0:
    the pipeline stacks the two branches into one batch, which needs one length and explicit masks."""
    b, n, _ = text.shape
    mask = torch.ones(b, n, dtype=torch.long, device=text.device) if mask is None else mask.long()
    return (torch.nn.functional.pad(text, (0, 0, 0, length - n)),
            torch.nn.functional.pad(mask, (0, length - n)))


@torch.no_grad()
def dpm_sample(model, noise: torch.Tensor, *, num_steps: int = 20, shift: float = 3.0, cond=None, uncond=None,
               guidance_scale: float = 1.0, precision: str = "fp32", progress: bool = False) -> torch.Tensor:
    """Flow-DPM-Solver (2nd-order multistep) from ``noise [B, C, h, w]`` at ``t = 1`` to ``t = 0``: diffusers'
    ``SanaPipeline`` (:func:`sana_pipeline`) on ``cond = (text [B, L, D], mask [B, L] | None)`` and, for guidance,
    ``uncond`` (the pipeline's ``negative_prompt_embeds``; both padded to one length, the padding masked out).
    Returns ``x_0`` (fp32)."""
    guided = uncond is not None and guidance_scale != 1.0
    length = max(cond[0].shape[1], uncond[0].shape[1]) if guided else cond[0].shape[1]
    text, mask = _pad(*cond, length)
    negative = {}
    if guided:
        nt, nm = _pad(*uncond, length)
        negative = dict(negative_prompt_embeds=nt, negative_prompt_attention_mask=nm)
    size = 32 * int(model.config.sample_size)  # checked (divisible by 32) but unused: the latents are given
    with _autocast(precision, noise.device):
        return sana_pipeline(model, shift, progress)(
            prompt_embeds=text, prompt_attention_mask=mask, negative_prompt=None, **negative, latents=noise.float(),
            num_inference_steps=int(num_steps), guidance_scale=float(guidance_scale) if guided else 1.0,
            height=size, width=size, use_resolution_binning=False, output_type="latent", return_dict=False)[0]


@torch.no_grad()
def sample_latents(model, text: torch.Tensor, *, mask: torch.Tensor | None = None,
                   neg_text: torch.Tensor | None = None, neg_mask: torch.Tensor | None = None,
                   noise: torch.Tensor | None = None, seeds=None, steps: int = 20, shift: float = 3.0,
                   guidance_scale: float = 4.5, solver: str = "dpm", precision: str = "fp32",
                   progress: bool = False) -> torch.Tensor:
    """Sample SANA latents ``[B, C, h, w]`` (fp32; ``C, h = w`` from the transformer's config) for captions
    ``text [B, L, D]`` (``mask [B, L]``: 1 for tokens, 0 for padding, or ``None``).

    ``neg_text [B, L', D]`` (``neg_mask``) is the unconditional branch of classifier-free guidance (SANA: the
    Gemma embedding of ""); without it, or with ``guidance_scale == 1``, the conditional velocity alone is
    integrated. Noise: ``noise [B, C, h, w]``, or :func:`initial_noise` of ``seeds`` (one seed per row).
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    device = next(model.parameters()).device
    c = model.config
    shape = (c.in_channels, c.sample_size, c.sample_size)
    if noise is None:
        if seeds is None:
            raise ValueError("pass noise [B, C, h, w] or one seed per caption")
        noise = initial_noise(seeds, shape, device)
    if noise.shape[0] != text.shape[0]:
        raise ValueError(f"noise batch {noise.shape[0]} != captions {text.shape[0]}")
    dev = lambda m: None if m is None else m.to(device)  # noqa: E731
    cond = (text.to(device=device, dtype=torch.float32), dev(mask))
    uncond = None if neg_text is None else (neg_text.to(device=device, dtype=torch.float32), dev(neg_mask))
    kwargs = dict(num_steps=int(steps), shift=float(shift), cond=cond, uncond=uncond,
                  guidance_scale=float(guidance_scale), progress=progress)
    if solver == "euler":
        return euler_sample(make_velocity(model, precision), noise.to(device).float(), **kwargs)
    return dpm_sample(model, noise.to(device), precision=precision, **kwargs)
