"""Rectified flow / flow matching: noising, timestep sampling and shift, velocity loss, Euler sampler with CFG.

Convention (the one diffusers' ``FlowMatchEulerDiscreteScheduler``, SD3, SANA and Wan use):

    x_t = (1 - t) * x0 + t * eps,        t in [0, 1],  t = 0: data,  t = 1: noise  (eps ~ N(0, I))
    v   = d x_t / d t = eps - x0         (the model predicts v: "flow_prediction")

Models take the time as ``t * time_scale`` (diffusers' transformers expect ``timestep = sigma * 1000``;
:func:`model_timestep`).

Timestep shift (resolution shift of SD3 / Wan; ``shift = 3.0`` in the MHLA Wan fine-tune, Wan's diffusers
scheduler ``flow_shift=3.0``): ``t' = s t / (1 + (s - 1) t)``. It keeps 0 and 1 fixed and, for ``s > 1``,
moves every interior time toward the noise end (``t' > t``). Training samples ``t = sigmoid(n)``,
``n ~ N(mean, std)`` (logit-normal, SD3) and then shifts it; sampling uses ``t_i = shift(1 - i / N)``.

Everything is plain functions on tensors; shapes are ``x0, eps, x_t, v: [B, ...]`` and ``t: [B]``.

    t = sample_timesteps(B, shift=3.0, device=x0.device)
    loss = flow_matching_loss(lambda xt, t: model(xt, model_timestep(t), cond), x0)
    x0_hat = euler_sample(lambda x, t, c: model(x, model_timestep(t), c), torch.randn(shape),
                          num_steps=50, shift=3.0, cond=c, uncond=u, guidance_scale=5.0)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


def _bcast(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``t: [B]`` (or scalar) -> ``[B, 1, ..., 1]`` matching ``x``'s rank, in ``x``'s dtype."""
    t = torch.as_tensor(t, device=x.device, dtype=x.dtype)
    if t.dim() == 0:
        return t
    return t.reshape(t.shape[0], *([1] * (x.dim() - 1)))


def shift_time(t: torch.Tensor, shift: float) -> torch.Tensor:
    """``s t / (1 + (s - 1) t)``: SD3 / Wan timestep shift (identity for ``s = 1``; 0 and 1 are fixed)."""
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    return shift * t / (1 + (shift - 1) * t)


def unshift_time(t: torch.Tensor, shift: float) -> torch.Tensor:
    """Inverse of :func:`shift_time`: ``t / (s - (s - 1) t)``."""
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    return t / (shift - (shift - 1) * t)


def sample_timesteps(batch_size: int, *, distribution: str = "logit_normal", mean: float = 0.0, std: float = 1.0,
                     shift: float = 1.0, device=None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Training times ``t: [B]`` in (0, 1) (fp32).

    ``distribution``: ``"logit_normal"`` (``sigmoid(N(mean, std))``, SD3's default) or ``"uniform"``;
    then :func:`shift_time` with ``shift``.
    """
    if distribution == "logit_normal":
        n = torch.randn(batch_size, generator=generator, device=device) * std + mean
        t = torch.sigmoid(n)
    elif distribution == "uniform":
        t = torch.rand(batch_size, generator=generator, device=device)
    else:
        raise ValueError(f"distribution must be logit_normal or uniform, got {distribution!r}")
    return shift_time(t, shift)


def interpolate(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``x_t = (1 - t) x0 + t noise`` (``t: [B]`` or scalar)."""
    tb = _bcast(t, x0)
    return (1 - tb) * x0 + tb * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``v = noise - x0``: the time derivative of :func:`interpolate`."""
    return noise - x0


def model_timestep(t: torch.Tensor, time_scale: float = 1000.0) -> torch.Tensor:
    """The ``timestep`` a diffusers transformer expects: ``t * 1000`` (fp32)."""
    return t.float() * time_scale


def flow_matching_loss(predict: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x0: torch.Tensor, *,
                       t: torch.Tensor | None = None, noise: torch.Tensor | None = None, shift: float = 1.0,
                       distribution: str = "logit_normal", mean: float = 0.0, std: float = 1.0,
                       generator: torch.Generator | None = None, reduction: str = "mean"):
    """Velocity regression ``|| predict(x_t, t) - (noise - x0) ||^2`` (mean over elements).

    Args:
        predict: ``(x_t [B, ...], t [B]) -> v [B, ...]`` (times in [0, 1]; see :func:`model_timestep`).
        x0: clean data ``[B, ...]``. t, noise: given, or sampled (:func:`sample_timesteps`, ``randn``).
        reduction: ``"mean"`` (scalar) or ``"none"`` (per sample ``[B]``).
    Returns:
        the loss (fp32).
    """
    if noise is None:
        noise = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
    if t is None:
        t = sample_timesteps(x0.shape[0], distribution=distribution, mean=mean, std=std, shift=shift,
                             device=x0.device, generator=generator)
    xt = interpolate(x0, noise, t)
    pred = predict(xt, t)
    err = F.mse_loss(pred.float(), velocity_target(x0, noise).float(), reduction="none")
    per_sample = err.flatten(1).mean(1)
    if reduction == "none":
        return per_sample
    if reduction != "mean":
        raise ValueError(f"reduction must be mean or none, got {reduction!r}")
    return per_sample.mean()


def sampling_times(num_steps: int, shift: float = 1.0, device=None) -> torch.Tensor:
    """``[num_steps + 1]`` times from 1 (noise) down to 0 (data): ``shift_time(1 - i / N)`` (fp64)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64, device=device)
    return shift_time(t, shift)


def guided_velocity(velocity: Callable, x: torch.Tensor, t: torch.Tensor, cond, uncond=None,
                    guidance_scale: float = 1.0) -> torch.Tensor:
    """Classifier-free guidance: ``v_u + g (v_c - v_u)`` (just ``v_c`` when ``g == 1`` or no ``uncond``).

    ``velocity(x [B, ...], t [B], cond) -> v [B, ...]``; two calls (memory-friendly for video).
    """
    v_c = velocity(x, t, cond)
    if uncond is None or guidance_scale == 1.0:
        return v_c
    v_u = velocity(x, t, uncond)
    return v_u + guidance_scale * (v_c - v_u)


@torch.no_grad()
def euler_sample(velocity: Callable, noise: torch.Tensor, *, num_steps: int = 50, shift: float = 1.0,
                 cond=None, uncond=None, guidance_scale: float = 1.0, progress: bool = False) -> torch.Tensor:
    """Integrate ``dx/dt = v(x, t)`` from ``t = 1`` (``x = noise``) to ``t = 0`` with Euler steps.

    ``x_{i+1} = x_i + (t_{i+1} - t_i) v(x_i, t_i)`` on :func:`sampling_times` (``num_steps`` model
    evaluations, times twice with guidance). ``velocity(x, t [B] fp32, cond)``; returns ``x_0`` in the
    dtype of ``noise``.
    """
    times = sampling_times(num_steps, shift, device=noise.device)
    x = noise.clone()
    steps = range(num_steps)
    if progress:
        steps = tqdm(steps, desc="sampling", leave=False)
    for i in steps:
        t = times[i].float().expand(x.shape[0])
        v = guided_velocity(velocity, x, t, cond, uncond, guidance_scale)
        x = x + (times[i + 1] - times[i]).to(x.dtype) * v.to(x.dtype)
    return x
