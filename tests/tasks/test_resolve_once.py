"""A training run resolves its attention once: ``train.run`` resolves ``attn`` and ``attn_cross`` at the start
(:func:`tasks.common.config.resolve_run_attention`) and hands the result to the task, the model builder, the run's
record and the FLOP count, none of which resolves it again."""

import json
import os
from collections import Counter

import pytest
from hydra import compose, initialize_config_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY = ["logger=none", "trainer.progress_bar=false", "trainer.device=cpu", "trainer.max_steps=2",
        "trainer.max_epochs=null", "data.batch_size=4", "data.eval_batch_size=8", "data.limit=16",
        "data.eval_limit=8"]


def _compose(overrides):
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


@pytest.fixture
def resolutions(monkeypatch):
    """Counts, by config key, the resolutions (:func:`mhla.registry.resolve` as tasks.common.config calls it)
    and the contracts built for them."""
    from tasks.common import config

    counts = Counter()

    def counted(name, real):
        def wrapper(*args, **kwargs):
            counts[name(*args, **kwargs)] += 1
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(config, "resolve", counted(lambda cfg, contract, key="attn": key, config.resolve))
    monkeypatch.setattr(config, "attention_contract", counted(lambda m: "contract", config.attention_contract))
    monkeypatch.setattr(config, "cross_attention_contract",
                        counted(lambda m: "cross_contract", config.cross_attention_contract))
    return counts


@pytest.mark.parametrize("overrides", [
    ["task=mnist", "attn=mhla", "trainer.count_flops=true"],
    # a model that pads its input: the FLOP count builds the unpadded model too (tasks/classification/task.py)
    ["task=mnist", "attn=mhla", "model.pad_to=48", "trainer.count_flops=true"],
], ids=["vit", "vit_padded_flops"])
def test_a_training_run_resolves_its_attention_once(overrides, resolutions, tmp_path, capsys):
    import train

    train.run(_compose([*TINY, *overrides]), str(tmp_path))
    assert resolutions == {"attn": 1, "attn_cross": 1, "contract": 1, "cross_contract": 1}
    out = capsys.readouterr().out
    assert "attention: name=mhla num_blocks=4" in out and "GMACs" in out
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["attention"]["name"] == "mhla" and record["attention"]["num_blocks"] == 4
    assert record["attention"]["mixing_init"] == "locality"  # the class's defaults filled in


def test_a_task_built_without_a_resolved_attention_resolves_it_once(resolutions):
    """Checkpoint readers build a task from a stored config alone: it resolves on first use, once."""
    from tasks.common.task import task_class

    cfg = _compose([*TINY, "task=mnist", "attn=linear"])
    task = task_class(cfg)(cfg)
    task.build_model()
    task.describe_model(None)
    assert task.attention.name == "linear" and task.attention.cross.is_native
    assert resolutions == {"attn": 1, "attn_cross": 1, "contract": 1, "cross_contract": 1}


def test_the_resolved_attention_is_frozen():
    from dataclasses import FrozenInstanceError

    from tasks.common.config import resolve_run_attention

    attention = resolve_run_attention(_compose([*TINY, "task=mnist", "attn=mhla"]))
    options = attention.options
    options["num_blocks"] = 16  # a builder's copy: the run's attention does not change
    assert attention.options["num_blocks"] == 4
    with pytest.raises(FrozenInstanceError):
        attention.key = "attn_cross"
    with pytest.raises(TypeError):
        attention.resolved["num_blocks"] = 16
