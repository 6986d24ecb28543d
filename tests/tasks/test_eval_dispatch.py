"""eval.py picks a checkpoint's Task class as train.py does: from ``task.target`` of the run's config
(:func:`tasks.common.task.task_class`). Every ``configs/task/*.yaml`` names its class; a tiny run of
every task that needs no downloads (MNIST, MNIST generation, SANA mini, video mini, LM mini, MQAR) is trained
for two steps, and eval.py must rebuild the same Task and give back the run's final metrics. Checkpoints from
before ``task.target`` (``task.module`` only) still load. The tasks that need data or weights (ImageNet,
FineWeb, the SANA / Wan fine-tuning) are checked by their config's class only."""

import glob
import math
import os

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CLASSIFICATION = "tasks.classification.task.ClassificationTask"
IMAGE_GEN = "tasks.image_gen.task.ImageGenTask"
SANA = "tasks.image_gen.sana_task.SanaFinetuneTask"
LANGUAGE = "tasks.language.task.LanguageModelingTask"
MQAR = "tasks.language.mqar.MQARTask"
VIDEO = "tasks.video_gen.task.VideoGenTask"
# written out by hand (not read from the configs), so a config that names another class fails
EXPECTED = {"mnist": CLASSIFICATION, "imagenet": CLASSIFICATION, "mnist_gen": IMAGE_GEN,
            "imagenet_gen": IMAGE_GEN, "sana_mini": SANA, "sana_finetune": SANA, "lm_mini": LANGUAGE,
            "lm_fineweb": LANGUAGE, "mqar": MQAR, "video_mini": VIDEO, "wan_finetune": VIDEO}
COMMON = ["logger=none", "trainer.device=cpu", "trainer.progress_bar=false", "trainer.count_flops=false",
          "trainer.max_steps=2"]


def make_cfg(overrides):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def qualname(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def test_every_task_config_is_listed_here():
    names = {os.path.basename(p)[:-5] for p in glob.glob(os.path.join(CONFIGS, "task", "*.yaml"))}
    assert names == set(EXPECTED), "a task config was added or removed: list its Task class in EXPECTED"


@pytest.mark.parametrize("task", sorted(EXPECTED))
def test_task_config_names_its_class(task):
    from tasks.common.task import task_class  # noqa: PLC0415

    cfg = make_cfg([f"task={task}"])
    assert cfg.task.target == EXPECTED[task] and "module" not in cfg.task
    assert qualname(task_class(cfg)) == EXPECTED[task]


def test_task_class_refuses_configs_without_a_task_class():
    from tasks.common.config import ConfigError  # noqa: PLC0415
    from tasks.common.task import task_class  # noqa: PLC0415

    with pytest.raises(ConfigError, match=r"\+task\.target="):
        task_class(OmegaConf.create({"task": {"module": "tasks.language.mqar"}}))
    for bad in ("tasks.classification.task.NoSuchTask", "tasks.nowhere.task.Task", "torch.nn.Linear", "Task"):
        with pytest.raises(ConfigError, match="is not a Task subclass"):
            task_class(OmegaConf.create({"task": {"target": bad}}))


# ---------------------------------------------------------------------------------- tiny runs of every task
def write_corpus(folder, n_docs=30):
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat while dogs ran past quick brown foxes under green trees".split()
    folder.mkdir()
    for i in range(n_docs):
        (folder / f"doc{i:03d}.txt").write_text(" ".join(rng.choice(words, size=100)) + ".")
    return folder


def tiny_overrides(task, tmp):
    """Overrides that make ``task`` a run of seconds on the CPU (as in the task's own tests)."""
    return {
        "mnist": ["data.limit=128", "data.eval_limit=64", "data.batch_size=32", "model.embed_dim=16",
                  "model.depth=1", "model.num_heads=2", "trainer.ema.enabled=true"],
        "mnist_gen": ["data.limit=32", "data.eval_limit=16", "data.batch_size=8", "model.depth=1",
                      "model.hidden_size=32", "model.num_heads=2", "task.sample.grid=false"],
        "sana_mini": ["attn=mhla", "task.train_size=16", "task.eval_size=8", "trainer.eval_every_steps=null",
                      "trainer.checkpoint_every_steps=null"],
        "video_mini": ["data.train_size=8", "data.eval_size=4", "data.batch_size=4", "data.num_frames=4",
                       "data.height=8", "data.width=8", "model.num_layers=1", "sample.prompts=[]"],
        "lm_mini": ["data=text_local", f"data.path={write_corpus(tmp / 'corpus')}",
                    f"data.cache_dir={tmp / 'cache'}", "data.vocab_size=300", "data.val_fraction=0.2",
                    "data.seq_len=32", "data.batch_size=4", "data.eval_batch_size=8", "model.hidden_size=32",
                    "model.num_hidden_layers=1", "model.num_heads=2", "attn.block_size=8",
                    "task.num_samples=0"],
        "mqar": ["data.num_train=64", "data.num_test=32", "data.batch_size=16", "data.seq_len=32",
                 "data.num_kv_pairs=4"],
    }[task]


@pytest.mark.parametrize("task", ["mnist", "mnist_gen", "sana_mini", "video_mini", "lm_mini", "mqar"])
def test_eval_rebuilds_the_task_of_a_checkpoint_and_its_metrics(task, tmp_path):
    from tasks.common.evaluation import evaluate_checkpoint, load_run  # noqa: PLC0415
    from train import run  # noqa: PLC0415

    metrics = run(make_cfg([f"task={task}", *COMMON, *tiny_overrides(task, tmp_path)]), str(tmp_path / "run"))
    ckpt = str(tmp_path / "run" / "checkpoints" / "last.pt")
    cfg, task_obj, _, _ = load_run(ckpt)
    assert qualname(type(task_obj)) == EXPECTED[task] == cfg.task.target
    again = evaluate_checkpoint(ckpt)  # the run's final evaluation, again (every task's evaluation is seeded)
    assert cfg.task.monitor in again and math.isfinite(again[cfg.task.monitor])
    assert again == pytest.approx({k: metrics[k] for k in again}, rel=1e-5, abs=1e-6)


def test_a_checkpoint_from_before_the_attention_schema_evaluates(tmp_path, capsys):
    """A real checkpoint written before attn.* was every model's schema (tests/data/mqar_legacy_run.pt: an MQAR
    run with model.mixing_init=locality, model.cpe=true, model.output_gate=true) loads through the one config
    mapping (tasks.common.config.upgrade_config) and gives the logits it gave then (to float32 rounding: they
    were stored on another CPU, whose kernels round differently); without a task class a config is refused with
    the fix (``+task.target=...``), which then works."""
    from eval import main  # noqa: PLC0415
    from tasks.common.evaluation import load_run  # noqa: PLC0415

    src = os.path.join(ROOT, "tests", "data", "mqar_legacy_run.pt")
    cfg, _, model, _ = load_run(src)
    assert (cfg.attn.mixing_init, cfg.attn.cpe, cfg.attn.gate) == ("locality", True, True)
    assert "mixing_init" not in cfg.model
    layer = model.model.layers[0].attn
    assert layer.mixing.init == "locality" and layer.cpe is not None and layer.gate is not None
    state = torch.load(src, weights_only=False)
    expected = state["expected"]
    with torch.no_grad():
        logits = model(expected["input_ids"], use_cache=False).logits
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-5, atol=1e-5)
    old = OmegaConf.create(state["config"])
    with open_dict(old):
        del old.task["target"]
    state["config"] = OmegaConf.to_container(old)
    ckpt = tmp_path / "no_target.pt"
    torch.save(state, ckpt)
    overrides = ["data.num_test=32"]
    assert main([f"ckpt={ckpt}", *overrides]) == 2
    assert "+task.target=" in capsys.readouterr().err
    assert main([f"ckpt={ckpt}", f"+task.target={MQAR}", *overrides]) == 0


