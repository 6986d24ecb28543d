"""Gaussian diffusion as DiT uses it, written from the equations of DDPM (Ho et al. 2020) and improved DDPM
(Nichol & Dhariwal 2021).

* Forward process: ``q(x_t | x_0) = N(sqrt(abar_t) x_0, (1 - abar_t) I)``, linear betas 1e-4 .. 0.02 over
  ``T = 1000`` steps (:func:`linear_betas`).
* Posterior: ``q(x_{t-1} | x_t, x_0) = N(c1_t x_0 + c2_t x_t, beta~_t)`` with
  ``c1 = beta_t sqrt(abar_{t-1}) / (1 - abar_t)``, ``c2 = (1 - abar_{t-1}) sqrt(alpha_t) / (1 - abar_t)``,
  ``beta~_t = beta_t (1 - abar_{t-1}) / (1 - abar_t)``.
* Model: predicts ``eps`` (DiT; ``prediction="eps"``) or the velocity ``v = sqrt(abar) eps - sqrt(1 - abar) x_0``
  (Salimans & Ho 2022; ``prediction="v"``, well conditioned at high noise, so small models trained briefly give
  clean samples; the MNIST default uses it) and, with a learned sigma, ``s in [-1, 1]`` (raw output, mapped by
  ``(s + 1) / 2``) interpolating the log-variance between ``log beta~_t`` and ``log beta_t`` (improved DDPM,
  eq. 15). The MSE term is on the predicted quantity; samplers convert it to ``x_0`` and ``eps``.
* Loss ("hybrid"): ``MSE(eps) + L_vlb`` where ``L_vlb`` is the KL between posterior and model transition
  (in bits, per dimension) with the model mean frozen (stop-gradient), so the VLB only trains the variance;
  at ``t = 0`` it is the discretized Gaussian decoder NLL. DiT adds the two unweighted (no ``T / 1000``
  rescale; it equals 1 at T = 1000 anyway).
* Respacing (:func:`space_timesteps`, :meth:`GaussianDiffusion.respace`): keep a subset of steps S and
  recompute ``beta_i = 1 - abar_{s_i} / abar_{s_{i-1}}``, so ``abar`` is unchanged on the kept steps; the
  model still sees the original step indices.
* Samplers: ancestral DDPM (:meth:`p_sample_loop`) and DDIM (:meth:`ddim_sample_loop`, eta = 0 by default).
  All randomness goes through an explicit ``torch.Generator``, so sampling is deterministic under a seed.

Tensors: images / latents ``x: [B, C, H, W]``; timesteps ``t: [B]`` long (indices into this process's
steps); the model function is ``model_fn(x, t_model) -> [B, 2C or C, H, W]``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from tqdm.auto import tqdm

ModelFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def linear_betas(num_steps: int = 1000, start: float = 1e-4, end: float = 0.02) -> torch.Tensor:
    """DDPM's linear schedule, scaled as improved DDPM does so any T spans the same noise levels
    (``start * 1000 / T`` .. ``end * 1000 / T``; exactly 1e-4 .. 0.02 at T = 1000). float64 ``[T]``."""
    scale = 1000.0 / num_steps
    return torch.linspace(start * scale, end * scale, num_steps, dtype=torch.float64)


def space_timesteps(num_steps: int, spacing: str | int) -> list[int]:
    """Steps to keep out of ``range(num_steps)``.

    ``spacing``: an int / digit string ``"250"`` (that many steps, evenly strided with rounding, first and last
    kept, as improved DDPM's ``space_timesteps``), ``"ddim50"`` (stride ``num_steps // 50`` from 0, as DDIM), or
    ``""`` / ``num_steps`` (all steps).
    """
    spacing = str(spacing)
    if spacing in ("", str(num_steps)):
        return list(range(num_steps))
    if spacing.startswith("ddim"):
        n = int(spacing[4:])
        stride = num_steps // n
        if stride < 1 or len(range(0, num_steps, stride)) != n:
            raise ValueError(f"cannot take exactly {n} DDIM steps with an integer stride from {num_steps}")
        return list(range(0, num_steps, stride))
    n = int(spacing)
    if not 1 <= n <= num_steps:
        raise ValueError(f"cannot keep {n} of {num_steps} diffusion steps")
    if n == 1:
        return [num_steps - 1]
    stride = (num_steps - 1) / (n - 1)
    steps = sorted({round(i * stride) for i in range(n)})
    if len(steps) != n:
        raise ValueError(f"{n} steps out of {num_steps} collide after rounding")
    return steps


def normal_kl(mean1, logvar1, mean2, logvar2) -> torch.Tensor:
    """Elementwise ``KL(N(mean1, e^logvar1) || N(mean2, e^logvar2))`` in nats."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2)
                  + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def discretized_gaussian_log_likelihood(x: torch.Tensor, mean: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    """Log-probability of data ``x`` in [-1, 1] quantised to 256 bins of width 2/255 under
    ``N(mean, exp(log_scale)^2)`` (edge bins extend to +-infinity). Elementwise, in nats."""
    inv_std = torch.exp(-log_scale)
    upper = inv_std * (x - mean + 1.0 / 255)
    lower = inv_std * (x - mean - 1.0 / 255)
    log_cdf_upper = torch.special.log_ndtr(upper)  # log P(X <= upper)
    log_sf_lower = torch.special.log_ndtr(-lower)  # log P(X > lower)
    delta = (torch.special.ndtr(upper) - torch.special.ndtr(lower)).clamp(min=1e-12)
    return torch.where(x < -0.999, log_cdf_upper, torch.where(x > 0.999, log_sf_lower, torch.log(delta)))


def _mean_flat(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=list(range(1, x.ndim)))


class GaussianDiffusion:
    """Schedule tables (float64) and the losses / samplers over them.

    Args:
        betas: ``[T]`` noise schedule. learn_sigma: model outputs ``2C`` channels (eps, variance interp).
        timestep_map: the original step of each of these steps (identity unless respaced).
        prediction: what the first ``C`` output channels are: ``eps`` (noise, DiT) or ``v`` (velocity).
    """

    def __init__(self, betas: torch.Tensor, learn_sigma: bool = True, timestep_map: list[int] | None = None,
                 prediction: str = "eps"):
        if prediction not in ("eps", "v"):
            raise ValueError(f"prediction must be eps or v, got {prediction!r}")
        self.prediction = prediction
        betas = torch.as_tensor(betas, dtype=torch.float64)
        if betas.ndim != 1 or (betas <= 0).any() or (betas > 1).any():
            raise ValueError("betas must be a 1-D tensor in (0, 1]")
        self.betas = betas
        self.num_timesteps = len(betas)
        self.learn_sigma = learn_sigma
        self.timestep_map = torch.tensor(timestep_map if timestep_map is not None else range(len(betas)),
                                         dtype=torch.long)
        alphas = 1.0 - betas
        self.alphas_cumprod = torch.cumprod(alphas, 0)
        self.alphas_cumprod_prev = torch.cat([torch.ones(1, dtype=torch.float64), self.alphas_cumprod[:-1]])
        self.sqrt_alphas_cumprod = self.alphas_cumprod.sqrt()
        self.sqrt_one_minus_alphas_cumprod = (1.0 - self.alphas_cumprod).sqrt()
        self.sqrt_recip_alphas_cumprod = (1.0 / self.alphas_cumprod).sqrt()
        self.sqrt_recipm1_alphas_cumprod = (1.0 / self.alphas_cumprod - 1).sqrt()
        self.posterior_variance = betas * (1.0 - self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        # beta~_0 = 0: clip the log at t = 0 to beta~_1 (as improved DDPM)
        post = self.posterior_variance
        self.posterior_log_variance_clipped = torch.log(torch.cat([post[1:2], post[1:]])) if len(post) > 1 \
            else torch.log(betas)
        self.posterior_mean_coef1 = betas * self.alphas_cumprod_prev.sqrt() / (1.0 - self.alphas_cumprod)
        self.posterior_mean_coef2 = (1.0 - self.alphas_cumprod_prev) * alphas.sqrt() / (1.0 - self.alphas_cumprod)

    @classmethod
    def linear(cls, num_steps: int = 1000, learn_sigma: bool = True, prediction: str = "eps") -> GaussianDiffusion:
        return cls(linear_betas(num_steps), learn_sigma, prediction=prediction)

    def respace(self, spacing: str | int) -> GaussianDiffusion:
        """A diffusion over a subset of steps (``space_timesteps``) with the same ``abar`` on those steps."""
        keep = space_timesteps(self.num_timesteps, spacing)
        last, betas = 1.0, []
        for s in keep:
            abar = float(self.alphas_cumprod[s])
            betas.append(1.0 - abar / last)
            last = abar
        return GaussianDiffusion(torch.tensor(betas, dtype=torch.float64), self.learn_sigma,
                                 [int(self.timestep_map[s]) for s in keep], prediction=self.prediction)

    # ----------------------------------------------------------------------------------- helpers
    @staticmethod
    def _at(table: torch.Tensor, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``table[t]`` broadcast to ``x``'s shape, in ``x``'s dtype and device."""
        out = table.to(x.device)[t].to(x.dtype)
        return out.view(-1, *([1] * (x.ndim - 1)))

    def model_timesteps(self, t: torch.Tensor) -> torch.Tensor:
        return self.timestep_map.to(t.device)[t]

    # ----------------------------------------------------------------------------------- forward
    def q_sample(self, x_start: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """``x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps``."""
        return self._at(self.sqrt_alphas_cumprod, t, x_start) * x_start + \
            self._at(self.sqrt_one_minus_alphas_cumprod, t, x_start) * noise

    def q_posterior(self, x_start, x_t, t):
        """Mean, variance, clipped log-variance of ``q(x_{t-1} | x_t, x_0)``."""
        mean = self._at(self.posterior_mean_coef1, t, x_t) * x_start + self._at(self.posterior_mean_coef2, t, x_t) * x_t
        return mean, self._at(self.posterior_variance, t, x_t), self._at(self.posterior_log_variance_clipped, t, x_t)

    def predict_xstart_from_eps(self, x_t, t, eps):
        return self._at(self.sqrt_recip_alphas_cumprod, t, x_t) * x_t - self._at(self.sqrt_recipm1_alphas_cumprod, t, x_t) * eps

    def predict_eps_from_xstart(self, x_t, t, x_start):
        return (self._at(self.sqrt_recip_alphas_cumprod, t, x_t) * x_t - x_start) / \
            self._at(self.sqrt_recipm1_alphas_cumprod, t, x_t)

    def v_target(self, x_start, t, noise):
        """``v = sqrt(abar_t) eps - sqrt(1 - abar_t) x_0``."""
        return self._at(self.sqrt_alphas_cumprod, t, x_start) * noise - \
            self._at(self.sqrt_one_minus_alphas_cumprod, t, x_start) * x_start

    def xstart_and_eps(self, x_t, t, pred):
        """The model's prediction (``eps`` or ``v``, per ``self.prediction``) -> ``(x_0, eps)``."""
        if self.prediction == "eps":
            return self.predict_xstart_from_eps(x_t, t, pred), pred
        a, s = self._at(self.sqrt_alphas_cumprod, t, x_t), self._at(self.sqrt_one_minus_alphas_cumprod, t, x_t)
        return a * x_t - s * pred, s * x_t + a * pred

    # ------------------------------------------------------------------------------------ model
    def p_mean_variance(self, model_out: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor,
                        clip_denoised: bool = False) -> dict:
        """From the model output at ``(x_t, t)``: mean and log-variance of ``p(x_{t-1} | x_t)``, predicted
        ``x_0`` and ``eps``. Without a learned sigma the variance is ``beta~_t`` (fixed small)."""
        C = x_t.shape[1]
        if self.learn_sigma:
            if model_out.shape[1] != 2 * C:
                raise ValueError(f"learn_sigma expects {2 * C} output channels, got {model_out.shape[1]}")
            pred, s = model_out[:, :C], model_out[:, C:]
            min_log = self._at(self.posterior_log_variance_clipped, t, x_t)
            max_log = self._at(torch.log(self.betas), t, x_t)
            frac = (s + 1) / 2
            log_var = frac * max_log + (1 - frac) * min_log
        else:
            pred = model_out
            log_var = self._at(self.posterior_log_variance_clipped, t, x_t).expand_as(x_t)
        x0, eps = self.xstart_and_eps(x_t, t, pred)
        if clip_denoised:
            x0 = x0.clamp(-1, 1)
        mean, _, _ = self.q_posterior(x0, x_t, t)
        return {"mean": mean, "log_variance": log_var, "pred_xstart": x0, "eps": eps}

    def vb_terms_bpd(self, model_out, x_start, x_t, t) -> torch.Tensor:
        """``L_t`` of the VLB per sample, bits per dimension: KL(q posterior || p) for t > 0, the decoder NLL at
        t = 0. ``[B]``."""
        true_mean, _, true_log_var = self.q_posterior(x_start, x_t, t)
        out = self.p_mean_variance(model_out, x_t, t)
        kl = _mean_flat(normal_kl(true_mean, true_log_var, out["mean"], out["log_variance"])) / math.log(2.0)
        nll = -_mean_flat(discretized_gaussian_log_likelihood(x_start, out["mean"], 0.5 * out["log_variance"]))
        return torch.where(t == 0, nll / math.log(2.0), kl)

    def training_losses(self, model_fn: ModelFn, x_start: torch.Tensor, t: torch.Tensor,
                        noise: torch.Tensor | None = None) -> dict:
        """Hybrid loss per sample: ``{"loss", "mse", "vb"}`` each ``[B]`` (``vb`` only with a learned sigma)."""
        noise = torch.randn_like(x_start) if noise is None else noise
        x_t = self.q_sample(x_start, t, noise)
        out = model_fn(x_t, self.model_timesteps(t))
        C = x_start.shape[1]
        target = noise if self.prediction == "eps" else self.v_target(x_start, t, noise)
        terms = {"mse": _mean_flat((target - out[:, :C].float()) ** 2)}
        if self.learn_sigma:
            frozen = torch.cat([out[:, :C].detach(), out[:, C:]], dim=1).float()  # VLB trains only the variance
            terms["vb"] = self.vb_terms_bpd(frozen, x_start.float(), x_t.float(), t)
            terms["loss"] = terms["mse"] + terms["vb"]
        else:
            terms["loss"] = terms["mse"]
        return terms

    # ---------------------------------------------------------------------------------- sampling
    def p_sample(self, model_fn: ModelFn, x: torch.Tensor, t: torch.Tensor, generator=None,
                 clip_denoised: bool = False) -> dict:
        """One ancestral step ``x_t -> x_{t-1}`` (no noise at t = 0)."""
        out = self.p_mean_variance(model_fn(x, self.model_timesteps(t)).float(), x, t, clip_denoised)
        noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
        nonzero = (t != 0).to(x.dtype).view(-1, *([1] * (x.ndim - 1)))
        return {"sample": out["mean"] + nonzero * torch.exp(0.5 * out["log_variance"]) * noise,
                "pred_xstart": out["pred_xstart"]}

    def _initial(self, shape, noise, generator, device):
        if noise is not None:
            return noise.to(device)
        return torch.randn(shape, generator=generator, device=device)

    @torch.no_grad()
    def p_sample_loop(self, model_fn: ModelFn, shape, *, noise=None, generator=None, device="cpu",
                      clip_denoised: bool = False, progress: bool = False) -> torch.Tensor:
        """DDPM sampling from ``x_T ~ N(0, I)`` (or ``noise``) over this diffusion's steps."""
        x = self._initial(shape, noise, generator, device)
        for i in self._steps(progress, "DDPM"):
            t = torch.full((x.shape[0],), i, device=x.device, dtype=torch.long)
            x = self.p_sample(model_fn, x, t, generator, clip_denoised)["sample"]
        return x

    def ddim_sample(self, model_fn: ModelFn, x, t, generator=None, clip_denoised=False, eta: float = 0.0):
        """One DDIM step: ``x_{t-1} = sqrt(abar') x0 + sqrt(1 - abar' - s^2) eps + s z`` with
        ``s = eta sqrt((1 - abar') / (1 - abar)) sqrt(1 - abar / abar')``."""
        out = self.p_mean_variance(model_fn(x, self.model_timesteps(t)).float(), x, t, clip_denoised)
        eps = self.predict_eps_from_xstart(x, t, out["pred_xstart"])
        abar = self._at(self.alphas_cumprod, t, x)
        abar_prev = self._at(self.alphas_cumprod_prev, t, x)
        sigma = eta * torch.sqrt((1 - abar_prev) / (1 - abar)) * torch.sqrt(1 - abar / abar_prev)
        mean = out["pred_xstart"] * abar_prev.sqrt() + torch.sqrt(1 - abar_prev - sigma**2) * eps
        if eta > 0:
            noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
            nonzero = (t != 0).to(x.dtype).view(-1, *([1] * (x.ndim - 1)))
            mean = mean + nonzero * sigma * noise
        return {"sample": mean, "pred_xstart": out["pred_xstart"]}

    @torch.no_grad()
    def ddim_sample_loop(self, model_fn: ModelFn, shape, *, noise=None, generator=None, device="cpu",
                         clip_denoised: bool = False, eta: float = 0.0, progress: bool = False) -> torch.Tensor:
        x = self._initial(shape, noise, generator, device)
        for i in self._steps(progress, "DDIM"):
            t = torch.full((x.shape[0],), i, device=x.device, dtype=torch.long)
            x = self.ddim_sample(model_fn, x, t, generator, clip_denoised, eta)["sample"]
        return x

    def _steps(self, progress: bool, desc: str):
        steps = range(self.num_timesteps - 1, -1, -1)
        if progress:
            return tqdm(steps, desc=f"{desc} sampling", leave=False)
        return steps


def create_diffusion(spacing: str | int = "", num_steps: int = 1000, learn_sigma: bool = True,
                     prediction: str = "eps") -> GaussianDiffusion:
    """DiT's setting: ``create_diffusion("")`` for training (1000 steps), ``create_diffusion(250)`` for DDPM
    sampling, ``create_diffusion("ddim50")`` for DDIM. ``prediction``: ``eps`` (DiT) or ``v``."""
    base = GaussianDiffusion.linear(num_steps, learn_sigma, prediction)
    return base if str(spacing) in ("", str(num_steps)) else base.respace(spacing)


def sample(diffusion: GaussianDiffusion, model_fn: ModelFn, shape, *, method: str = "ddpm", generator=None,
           device="cpu", clip_denoised: bool = False, eta: float = 0.0, progress: bool = False) -> torch.Tensor:
    """``method``: ``ddpm`` (ancestral) or ``ddim``."""
    if method == "ddpm":
        return diffusion.p_sample_loop(model_fn, shape, generator=generator, device=device,
                                       clip_denoised=clip_denoised, progress=progress)
    if method == "ddim":
        return diffusion.ddim_sample_loop(model_fn, shape, generator=generator, device=device,
                                          clip_denoised=clip_denoised, eta=eta, progress=progress)
    raise ValueError(f"sampling method must be ddpm or ddim, got {method!r}")


__all__ = ["GaussianDiffusion", "create_diffusion", "space_timesteps", "linear_betas", "normal_kl",
           "discretized_gaussian_log_likelihood", "sample"]
