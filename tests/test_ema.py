"""Our ModelEMA against timm's: the DeiT recipe (constant decay, no warmup) must give timm's numbers."""

import pytest
import torch
import torch.nn as nn
from timm.utils.model_ema import ModelEmaV3

from tasks.common.ema import ModelEMA


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.GELU(), nn.Linear(8, 3))


def _perturb(model, step):
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model.train()
    model(torch.randn(4, 6, generator=g))  # moves the BatchNorm running statistics (buffers)


@pytest.mark.parametrize("decay", [0.9, 0.99996])
def test_constant_decay_ema_equals_timm_model_ema(decay):
    model = _model()
    ours = ModelEMA(model, decay=decay, warmup=False)
    timm_ema = ModelEmaV3(model, decay=decay, use_warmup=False)
    for step in range(20):
        _perturb(model, step)
        ours.update(model)
        timm_ema.update(model)  # step=None: timm's constant decay, as DeiT's ModelEma
    theirs = timm_ema.module.state_dict()
    for name, t in ours.module.state_dict().items():
        torch.testing.assert_close(t, theirs[name], rtol=1e-6, atol=1e-7, msg=name)


def test_deit_recipe_uses_the_constant_decay():
    from hydra import compose, initialize_config_dir  # noqa: PLC0415

    import os  # noqa: PLC0415

    configs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    with initialize_config_dir(config_dir=configs, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["task=imagenet", "model=deit_t"])
    assert cfg.trainer.ema.enabled and cfg.trainer.ema.decay == 0.99996 and cfg.trainer.ema.warmup is False
