"""Our ModelEMA against timm's: the DeiT recipe (constant decay, no warmup) must give timm's numbers."""

import os

import pytest
import torch
import torch.nn as nn
from timm.utils.model_ema import ModelEmaV3

from tasks.common.ema import ModelEMA

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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

    configs = os.path.join(ROOT, "configs")
    with initialize_config_dir(config_dir=configs, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["task=imagenet", "model=deit_t"])
    assert cfg.trainer.ema.enabled and cfg.trainer.ema.decay == 0.99996 and cfg.trainer.ema.warmup is False


@pytest.mark.parametrize("which", ["both", True, False])
def test_evaluate_both_reports_the_model_and_its_ema(tmp_path, which):
    """``trainer.ema.evaluate: both`` (the ImageNet recipe, Table 2): the model's metrics under their names (the
    headline, as DeiT reports) and the EMA's as ``ema_<name>``; ``true`` / ``false``: one of them, unprefixed."""
    from hydra import compose, initialize_config_dir  # noqa: PLC0415

    from train import run  # noqa: PLC0415

    configs = os.path.join(ROOT, "configs")
    tiny = ["logger=none", "trainer.progress_bar=false", "trainer.count_flops=false", "data.limit=256",
            "data.eval_limit=128", "data.batch_size=64", "model.embed_dim=16", "model.depth=1", "model.num_heads=2",
            "trainer.max_steps=3", "trainer.ema.enabled=true", "trainer.ema.decay=0.5",
            f"trainer.ema.evaluate={str(which).lower()}"]
    with initialize_config_dir(config_dir=configs, version_base="1.3"):
        cfg = compose(config_name="train", overrides=tiny)
        imagenet = compose(config_name="train", overrides=["task=imagenet"])
    assert imagenet.trainer.ema.evaluate == "both"
    metrics = run(cfg, str(tmp_path))
    assert "top1" in metrics and ("ema_top1" in metrics) == (which == "both")
    if which == "both":
        assert metrics["ema_loss"] != metrics["loss"]  # two different sets of weights were evaluated
