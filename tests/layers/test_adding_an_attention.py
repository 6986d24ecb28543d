"""docs/adding_an_attention.md, followed: its two files are the repository's, and the attention they add trains in
the classification task and in the language model, with its option reaching the layer and the inherited option it
sets itself refused."""

from __future__ import annotations

import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "adding_an_attention.md")
FILES = {"python": os.path.join(ROOT, "examples", "cosine_attention.py"),
         "yaml": os.path.join(ROOT, "configs", "attn", "cosine.yaml")}


def _blocks(lang: str) -> list[str]:
    text = open(DOC).read()
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_the_page_shows_the_two_files_as_they_are():
    for lang, path in FILES.items():
        assert open(path).read() in _blocks(lang), f"docs/adding_an_attention.md shows another {path}"


def _train(tmp_path, overrides):
    from hydra import compose, initialize_config_dir

    from tasks.common.config import register_resolvers
    from train import run

    register_resolvers()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, "logger=none", "trainer.device=cpu", "trainer.max_steps=3",
                                          "trainer.max_epochs=null", "trainer.progress_bar=false",
                                          "trainer.count_flops=false"])
    return cfg, run(cfg, str(tmp_path))


def test_cosine_attention_trains_in_classification(tmp_path):
    cfg, metrics = _train(tmp_path, ["task=mnist", "attn=cosine", "attn.temperature=8", "data.limit=128",
                                     "data.eval_limit=64", "model.depth=1"])
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    from tasks.common.config import model_attention
    from tasks.classification.task import ClassificationTask

    model = ClassificationTask(cfg).build_model()
    layers = [m for m in model.modules() if type(m).__name__ == "CosineLinearAttention"]
    assert layers and all(m.settings()["temperature"] == 8.0 for m in layers)
    assert model_attention(cfg)["temperature"] == 8


def test_cosine_attention_trains_in_the_language_model(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = "the cat sat on the mat and the dog ran after it while the bird sang in the tree".split()
    rng = torch.Generator().manual_seed(0)
    for i in range(20):
        idx = torch.randint(0, len(words), (200,), generator=rng).tolist()
        (corpus / f"doc{i}.txt").write_text(" ".join(words[j] for j in idx))
    _, metrics = _train(tmp_path / "run", [
        "task=lm_mini", "attn=cosine", "data=text_local", f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
        "data.vocab_size=300", "data.val_fraction=0.2", "data.seq_len=32", "data.batch_size=4",
        "data.eval_batch_size=8", "model.hidden_size=32", "model.num_hidden_layers=1", "model.num_heads=2",
        "trainer.eval_every_steps=3", "task.num_samples=1", "task.prompt_len=8", "task.sample_tokens=6"])
    assert metrics["val_ppl"] > 1 and (tmp_path / "run" / "samples.txt").exists()  # generate() decoded with it


def test_an_inherited_option_the_class_sets_itself_is_refused():
    from hydra import compose, initialize_config_dir

    from tasks.common.config import ConfigError, model_attention

    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        cfg = compose("train", overrides=["task=mnist", "attn=cosine", "+attn.feature_map=elu"])
    with pytest.raises(ConfigError, match="attn.feature_map"):
        model_attention(cfg)
