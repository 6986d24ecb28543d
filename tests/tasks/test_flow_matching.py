"""Flow matching against closed forms: shift, interpolation, the exact velocity of point / Gaussian data."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.common import flow_matching as fm


def test_shift_closed_form_and_inverse():
    t = torch.linspace(0, 1, 11, dtype=torch.float64)
    s = fm.shift_time(t, 3.0)
    assert s[0] == 0 and s[-1] == 1
    assert math.isclose(float(fm.shift_time(torch.tensor(0.5), 3.0)), 0.75)  # 1.5 / 2
    assert torch.all(s[1:-1] > t[1:-1])  # shift > 1 moves toward noise
    torch.testing.assert_close(fm.unshift_time(s, 3.0), t)
    torch.testing.assert_close(fm.shift_time(t, 1.0), t)
    with pytest.raises(ValueError):
        fm.shift_time(t, 0.0)


def test_logit_normal_moments():
    g = torch.Generator().manual_seed(0)
    t = fm.sample_timesteps(200_000, mean=0.5, std=0.8, generator=g)
    n = torch.logit(t.double())
    assert abs(n.mean().item() - 0.5) < 0.01 and abs(n.std().item() - 0.8) < 0.01
    ts = fm.sample_timesteps(200_000, shift=3.0, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fm.unshift_time(ts.double(), 3.0), torch.sigmoid(torch.randn(
        200_000, generator=torch.Generator().manual_seed(0))).double(), rtol=1e-5, atol=1e-6)
    u = fm.sample_timesteps(1000, distribution="uniform", generator=g)
    assert u.min() >= 0 and u.max() < 1


def test_interpolation_and_target():
    x0, eps = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    t = torch.tensor([0.0, 0.25, 1.0])
    xt = fm.interpolate(x0, eps, t)
    torch.testing.assert_close(xt[0], x0[0])
    torch.testing.assert_close(xt[2], eps[2])
    torch.testing.assert_close(xt[1], 0.75 * x0[1] + 0.25 * eps[1])
    # v is the time derivative of x_t (finite difference)
    h = 1e-3
    dv = (fm.interpolate(x0, eps, t[1] + h) - fm.interpolate(x0, eps, t[1] - h)) / (2 * h)
    torch.testing.assert_close(dv, fm.velocity_target(x0, eps), rtol=1e-3, atol=1e-3)


def test_loss_zero_for_exact_velocity_of_point_data():
    """Data = one point c: the exact field is v(x, t) = (x - c) / t; its loss is 0, a wrong field's is not."""
    c = torch.randn(1, 6, dtype=torch.float64)
    x0 = c.expand(64, 6)
    exact = lambda x, t: (x - c) / t[:, None]  # noqa: E731
    assert fm.flow_matching_loss(exact, x0, shift=3.0).item() < 1e-20
    assert fm.flow_matching_loss(lambda x, t: torch.zeros_like(x), x0).item() > 0.5
    per = fm.flow_matching_loss(exact, x0, reduction="none")
    assert per.shape == (64,)


def test_euler_transports_gaussian_exactly():
    """Data N(mu, s^2): the ODE map is eps -> mu + s * eps; Euler with the exact field converges to it."""
    mu, s = 2.0, 0.5

    def velocity(x, t, cond):
        t = t.double()[:, None]
        var = (1 - t) ** 2 * s**2 + t**2
        resid = x - (1 - t) * mu
        e_eps = t / var * resid
        e_x0 = mu + (1 - t) * s**2 / var * resid
        return e_eps - e_x0

    eps = torch.randn(512, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    err = {n: (fm.euler_sample(velocity, eps, num_steps=n, shift=3.0) - (mu + s * eps)).abs().max().item()
           for n in (100, 400)}
    assert err[400] < 0.02
    assert 3.5 < err[100] / err[400] < 4.5  # Euler is first order: 4x the steps, 1/4 the error


def test_euler_point_mass_exact_in_one_step_and_cfg():
    c = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    vel = lambda x, t, cond: (x - cond) / t.double()[:, None]  # noqa: E731
    eps = torch.randn(4, 2, dtype=torch.float64)
    torch.testing.assert_close(fm.euler_sample(vel, eps, num_steps=1, cond=c), c.expand(4, 2))
    # CFG with targets c (cond) and 0 (uncond), scale g: the straight-line field lands on g c
    out = fm.euler_sample(vel, eps, num_steps=7, shift=3.0, cond=c, uncond=torch.zeros_like(c), guidance_scale=5.0)
    torch.testing.assert_close(out, 5.0 * c.expand(4, 2))
    times = fm.sampling_times(50, 3.0)
    assert times.shape == (51,) and times[0] == 1 and times[-1] == 0 and torch.all(times[1:] < times[:-1])
    assert fm.model_timestep(torch.tensor([0.5])).item() == 500.0
