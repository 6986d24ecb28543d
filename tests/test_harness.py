"""The shared training harness: config composition, a few training steps, exact resume, bad configs."""

import os
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
TINY = [
    "logger=none", "trainer.progress_bar=false", "trainer.count_flops=false", "data.limit=512",
    "data.eval_limit=256", "data.batch_size=64", "model.embed_dim=16", "model.depth=1", "model.num_heads=2",
]


def make_cfg(overrides):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def run(cfg, run_dir):
    sys.path.insert(0, ROOT)
    from train import run as train_run  # noqa: PLC0415

    return train_run(cfg, str(run_dir))


def test_default_config_composes_and_resolves():
    cfg = make_cfg([])
    assert cfg.task.name == "mnist" and cfg.attn.name == "mhla" and cfg.model.name == "vit_mnist"
    OmegaConf.to_container(cfg, resolve=True)


@pytest.mark.parametrize("attn", ["mhla", "linear", "softmax"])
def test_train_two_steps(tmp_path, attn, capsys):
    cfg = make_cfg(TINY + [f"attn={attn}", "trainer.max_steps=2"])
    metrics = run(cfg, tmp_path)
    assert 0.0 <= metrics["top1"] <= 1.0
    assert "final: top1=" in capsys.readouterr().out
    assert (tmp_path / "checkpoints" / "last.pt").exists()
    assert (tmp_path / "checkpoints" / "best.pt").exists()
    assert (tmp_path / "metrics.jsonl").exists()


def test_resume_equals_uninterrupted_run(tmp_path):
    common = TINY + ["trainer.max_steps=6", "trainer.eval_every_steps=100", "model.drop_path_rate=0.1"]
    run(make_cfg(common), tmp_path / "straight")
    run(make_cfg(common + ["trainer.stop_after_steps=3"]), tmp_path / "split")
    interrupted = torch.load(tmp_path / "split" / "checkpoints" / "last.pt", weights_only=False)
    assert interrupted["step"] == 3
    run(make_cfg(common + ["trainer.resume=last"]), tmp_path / "split")
    a = torch.load(tmp_path / "straight" / "checkpoints" / "last.pt", weights_only=False)
    b = torch.load(tmp_path / "split" / "checkpoints" / "last.pt", weights_only=False)
    assert a["step"] == b["step"] == 6
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=0, atol=0, msg=k)
    # and the run really changed the weights
    assert any((a["model"][k] != interrupted["model"][k]).any() for k in a["model"])


def test_bad_configs_fail_at_start_with_a_fix(tmp_path):
    from tasks.common.config import ConfigError

    with pytest.raises(ConfigError, match="does not fit the 8x8 token grid"):
        run(make_cfg(TINY + ["attn.num_blocks=9"]), tmp_path)
    with pytest.raises(Exception, match="not in struct|Could not override"):
        make_cfg(["attn.bogus=1"])
    with pytest.raises(Exception, match="Could not find|Could not load"):
        make_cfg(["attn=nonexistent"])


def test_cli_unknown_key_message():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "trainer.nonsense=3"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode != 0
    assert "nonsense" in proc.stderr
