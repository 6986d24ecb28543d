"""Gaussian diffusion vs closed forms: schedule, q_sample, posterior, KL, decoder likelihood, respacing,
learned-variance interpolation, and samplers that recover the data point under an oracle model."""

import math

import pytest
import torch

from tasks.image_gen.diffusion import (GaussianDiffusion, create_diffusion, discretized_gaussian_log_likelihood,
                                       linear_betas, normal_kl, space_timesteps)


def test_linear_schedule_endpoints():
    b = linear_betas(1000)
    assert b.dtype == torch.float64 and len(b) == 1000
    assert b[0].item() == pytest.approx(1e-4) and b[-1].item() == pytest.approx(0.02)
    d = GaussianDiffusion(b)
    assert d.alphas_cumprod[-1].item() == pytest.approx(math.prod(1 - x for x in b.tolist()), rel=1e-9)
    assert d.alphas_cumprod[-1].item() < 1e-4  # x_T is (almost) pure noise


def test_q_sample_closed_form_and_statistics():
    d = create_diffusion()
    x0 = torch.full((20000, 1, 1, 1), 0.7, dtype=torch.float64)
    t = torch.full((20000,), 300)
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    xt = d.q_sample(x0, t, noise)
    abar = d.alphas_cumprod[300].item()
    torch.testing.assert_close(xt, math.sqrt(abar) * x0 + math.sqrt(1 - abar) * noise)
    assert xt.mean().item() == pytest.approx(math.sqrt(abar) * 0.7, abs=0.02)
    assert xt.var().item() == pytest.approx(1 - abar, rel=0.05)


@pytest.mark.parametrize("t", [1, 10, 500, 999])
def test_posterior_is_the_product_of_gaussians(t):
    """q(x_{t-1} | x_t, x_0) ∝ N(x_{t-1}; sqrt(abar_{t-1}) x0, 1 - abar_{t-1}) N(x_t; sqrt(alpha_t) x_{t-1}, beta_t)."""
    d = create_diffusion()
    x0 = torch.randn(4, 2, 3, 3, dtype=torch.float64)
    xt = torch.randn(4, 2, 3, 3, dtype=torch.float64)
    tt = torch.full((4,), t)
    mean, var, logvar = d.q_posterior(x0, xt, tt)
    beta, alpha, abar_prev = d.betas[t], 1 - d.betas[t], d.alphas_cumprod[t - 1]
    prec = 1 / (1 - abar_prev) + alpha / beta
    ref_mean = (abar_prev.sqrt() * x0 / (1 - abar_prev) + alpha.sqrt() * xt / beta) / prec
    torch.testing.assert_close(mean, ref_mean)
    torch.testing.assert_close(var.flatten(), (1 / prec).expand(4))
    torch.testing.assert_close(logvar.flatten(), torch.log(1 / prec).expand(4))


def test_normal_kl_matches_torch_and_is_zero_for_equal_gaussians():
    m1, m2 = torch.randn(10, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    l1, l2 = torch.randn(10, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    assert normal_kl(m1, l1, m1, l1).abs().max() < 1e-12
    ref = torch.distributions.kl_divergence(torch.distributions.Normal(m1, (0.5 * l1).exp()),
                                            torch.distributions.Normal(m2, (0.5 * l2).exp()))
    torch.testing.assert_close(normal_kl(m1, l1, m2, l2), ref)


def test_discretized_likelihood_sums_to_one_over_the_256_bins():
    x = torch.linspace(-1, 1, 256, dtype=torch.float64)
    for mean, log_scale in [(0.0, -2.0), (0.9, -4.0), (-0.3, 0.5)]:
        lp = discretized_gaussian_log_likelihood(x, torch.full_like(x, mean), torch.full_like(x, log_scale))
        assert lp.exp().sum().item() == pytest.approx(1.0, abs=1e-6)


def test_space_timesteps():
    s = space_timesteps(1000, "250")
    assert len(s) == 250 and s[0] == 0 and s[-1] == 999 and s == sorted(set(s))
    assert space_timesteps(1000, "ddim50") == list(range(0, 1000, 20))
    assert space_timesteps(1000, "") == list(range(1000))
    with pytest.raises(ValueError):
        space_timesteps(1000, "ddim300")


@pytest.mark.parametrize("spacing", ["250", "ddim50", "100"])
def test_respacing_keeps_alphas_cumprod_on_kept_steps(spacing):
    base = create_diffusion()
    sub = base.respace(spacing)
    keep = space_timesteps(1000, spacing)
    torch.testing.assert_close(sub.alphas_cumprod, base.alphas_cumprod[keep])
    assert sub.timestep_map.tolist() == keep
    # respacing a respaced diffusion maps back to the original step indices
    assert set(sub.respace("10").timestep_map.tolist()) <= set(keep)


def test_learned_variance_interpolates_between_posterior_and_beta():
    d = create_diffusion()
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    t = torch.tensor([1, 400, 999])
    eps = torch.randn_like(x)
    lo = d.p_mean_variance(torch.cat([eps, -torch.ones_like(x)], 1), x, t)["log_variance"]
    hi = d.p_mean_variance(torch.cat([eps, torch.ones_like(x)], 1), x, t)["log_variance"]
    mid = d.p_mean_variance(torch.cat([eps, torch.zeros_like(x)], 1), x, t)["log_variance"]
    torch.testing.assert_close(lo[:, 0, 0, 0], d.posterior_log_variance_clipped[t])
    torch.testing.assert_close(hi[:, 0, 0, 0], torch.log(d.betas[t]))
    torch.testing.assert_close(mid, (lo + hi) / 2)


def _oracle(d, x0):
    """The model that knows x0: eps = (x_t - sqrt(abar) x0) / sqrt(1 - abar) (or v = sqrt(abar) eps -
    sqrt(1 - abar) x0 when ``d.prediction == "v"``); variance channel -1 (beta~)."""

    def fn(x, t_model):
        # t_model are original steps; map back to this diffusion's indices
        idx = torch.stack([(d.timestep_map == s).nonzero()[0, 0] for s in t_model])
        abar = d.alphas_cumprod[idx].view(-1, 1, 1, 1).to(x.dtype)
        eps = (x - abar.sqrt() * x0) / (1 - abar).sqrt()
        pred = eps if d.prediction == "eps" else abar.sqrt() * eps - (1 - abar).sqrt() * x0
        return torch.cat([pred, -torch.ones_like(x)], 1)

    return fn


def test_v_prediction_converts_to_the_same_x0_and_eps():
    """A v-model and an eps-model describing the same (x0, eps) give the same posterior mean and x0."""
    de, dv = create_diffusion(), create_diffusion(prediction="v")
    x0, eps = torch.randn(3, 2, 4, 4, dtype=torch.float64), torch.randn(3, 2, 4, 4, dtype=torch.float64)
    t = torch.tensor([0, 400, 999])
    xt = de.q_sample(x0, t, eps)
    v = dv.v_target(x0, t, eps)
    abar = de.alphas_cumprod[t].view(-1, 1, 1, 1)
    torch.testing.assert_close(v, abar.sqrt() * eps - (1 - abar).sqrt() * x0)
    s = torch.rand_like(x0) * 2 - 1
    oe = de.p_mean_variance(torch.cat([eps, s], 1), xt, t)
    ov = dv.p_mean_variance(torch.cat([v, s], 1), xt, t)
    for k in ("mean", "log_variance", "pred_xstart", "eps"):
        torch.testing.assert_close(ov[k], oe[k])
    torch.testing.assert_close(ov["pred_xstart"], x0)
    assert dv.respace("10").prediction == "v"
    with pytest.raises(ValueError, match="prediction"):
        create_diffusion(prediction="x0")


@pytest.mark.parametrize("prediction", ["eps", "v"])
def test_oracle_model_has_zero_loss_terms_for_t_at_least_1(prediction):
    d = create_diffusion(prediction=prediction)
    x0 = torch.rand(4, 1, 4, 4, dtype=torch.float64) * 2 - 1
    t = torch.tensor([1, 5, 300, 999])
    terms = d.training_losses(_oracle(d, x0), x0, t, torch.randn_like(x0))
    assert terms["mse"].abs().max() < 1e-10 and terms["vb"].abs().max() < 1e-6  # vb is computed in fp32
    terms0 = d.training_losses(_oracle(d, x0), x0, torch.zeros(4, dtype=torch.long), torch.randn_like(x0))
    assert (terms0["vb"] > 0).all()  # t = 0: decoder NLL of quantised data, in bits


@pytest.mark.parametrize("prediction", ["eps", "v"])
@pytest.mark.parametrize("method", ["ddpm", "ddim"])
def test_samplers_recover_the_data_point_under_the_oracle(method, prediction):
    x0 = torch.rand(2, 1, 4, 4, dtype=torch.float64) * 2 - 1
    d = create_diffusion("ddim25" if method == "ddim" else "25", prediction=prediction)
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    if method == "ddpm":
        out = d.p_sample_loop(_oracle(d, x0), x0.shape, noise=noise, generator=g)
    else:
        out = d.ddim_sample_loop(_oracle(d, x0), x0.shape, noise=noise)
    torch.testing.assert_close(out, x0, atol=1e-6, rtol=0)


def test_sampling_is_deterministic_under_a_generator():
    d = create_diffusion("10")
    fn = lambda x, t: torch.cat([0.1 * x, torch.zeros_like(x)], 1)  # noqa: E731
    a = d.p_sample_loop(fn, (2, 1, 4, 4), generator=torch.Generator().manual_seed(3))
    b = d.p_sample_loop(fn, (2, 1, 4, 4), generator=torch.Generator().manual_seed(3))
    c = d.p_sample_loop(fn, (2, 1, 4, 4), generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
