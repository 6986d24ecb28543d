"""What the MQAR cell's frozen-uniform control computes (issue 28): causal MHLA with its mixing matrix frozen at the
uniform init (``W[i, j] = 1/(i+1)`` for ``j <= i``) is plain causal linear attention scaled by ``1/(i+1)`` in query
block ``i``. The per-head output RMSNorm removes that scale up to its eps:
``RMSNorm(y / (i+1); eps) = RMSNorm(y; eps (i+1)^2)``. So the control is linear attention whose output norm has a
per-block eps, and with the eps taken to ~0 the two models (same seed: same parameters, the mixing matrix draws no
random numbers) give the same logits. These tests fail if the control stops being that."""

from __future__ import annotations

import os

import pytest
import torch
from hydra import compose, initialize_config_dir

from tasks.common.config import register_resolvers
from tasks.language.mqar import build_mqar_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["task=mqar", "data.seq_len=64", "data.num_kv_pairs=4", "attn.short_conv=4", "attn.gate=false"]
FROZEN_UNIFORM = ["attn=mhla", "attn.block_size=8", "attn.mixing_init=uniform", "attn.mixing_learnable=false"]


def _model(overrides):
    register_resolvers()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[*BASE, *overrides])
    torch.manual_seed(0)
    return build_mqar_model(cfg).double().eval()


def _set_norm_eps(model, eps):
    for m in model.modules():
        if isinstance(getattr(m, "eps", None), float):
            m.eps = eps


@pytest.fixture(scope="module")
def pair():
    return _model(["attn=linear"]), _model(FROZEN_UNIFORM)


def test_same_seed_same_parameters(pair):
    lin, fu = pair
    pl, pf = dict(lin.named_parameters()), dict(fu.named_parameters())
    assert pl.keys() == pf.keys()  # the frozen mixing is a buffer, not a parameter
    assert all(torch.equal(pl[k], pf[k]) for k in pl)
    assert not any(p.requires_grad for n, p in fu.named_buffers() if "mixing" in n)


def test_frozen_uniform_is_linear_attention_up_to_the_norm_eps(pair):
    lin, fu = pair
    x = torch.randint(0, 512, (3, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        gap_eps = (lin(x).logits - fu(x).logits).abs()
        _set_norm_eps(lin, 1e-300), _set_norm_eps(fu, 1e-300)
        gap_zero = (lin(x).logits - fu(x).logits).abs().max().item()
        _set_norm_eps(lin, 1e-6), _set_norm_eps(fu, 1e-6)
    assert gap_zero < 1e-10
    # With the models' eps the first block (scale 1) is identical and later blocks are not: the eps is what differs.
    assert gap_eps[:, :8].max().item() < 1e-10
    assert gap_eps[:, 8:].max().item() > 1e-6
