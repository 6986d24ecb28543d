"""LM task: data (split, packing, tokenizer cache, unigram baseline), train.py task=lm_mini end to end on a
tiny config for each model kind, the paper-recipe config, baselines (Transformer++; fla skipped without it)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")


def _cfg(*overrides):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def _write_corpus(tmp_path, n_docs=40):
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat while dogs ran past quick brown foxes under green trees near old houses".split()
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(n_docs):
        text = " ".join(rng.choice(words, size=120)) + "."
        (folder / f"doc{i:03d}.txt").write_text(text)
    return folder


def test_split_is_deterministic_and_by_document():
    from tasks.language.data import is_validation

    a = [is_validation(i, 0.1, 0) for i in range(2000)]
    assert a == [is_validation(i, 0.1, 0) for i in range(2000)]
    assert 120 < sum(a) < 280  # ~10%
    assert a != [is_validation(i, 0.1, 1) for i in range(2000)]


def test_packing_and_unigram(tmp_path):
    from tasks.language.data import PackedTokens, unigram_perplexity

    path = tmp_path / "t.bin"
    np.arange(103, dtype=np.uint16).tofile(path)
    ds = PackedTokens(path, 10)
    assert len(ds) == 10 and ds[3].tolist() == list(range(30, 40)) and ds[0].dtype == torch.int64
    train = np.array([0, 0, 1, 1])  # add-one: p(0) = p(1) = 3/8, p(2) = p(3) = 1/8
    assert unigram_perplexity(train, np.array([0, 1]), 4) == pytest.approx(8 / 3)
    assert unigram_perplexity(train, np.array([2]), 4) == pytest.approx(8.0)


def test_gensim_corpus_is_english_prose():
    from tasks.language.data import gensim_documents

    docs = gensim_documents()
    text = " ".join(docs)
    assert len(docs) > 1000 and len(text) > 3_000_000
    assert " the " in text and "'''" not in text and "__label__" not in text


def test_missing_paths_give_clear_errors(tmp_path):
    from tasks.language.data import iter_documents, load_tokenizer

    with pytest.raises(FileNotFoundError, match="FineWeb-Edu"):
        next(iter_documents(OmegaConf.create({"source": "parquet", "path": None})))
    with pytest.raises(FileNotFoundError, match="Llama 32k tokenizer"):
        load_tokenizer(OmegaConf.create({"tokenizer": str(tmp_path / "nope")}), tmp_path)


@pytest.mark.parametrize("model,attn", [("lm_mini", "mhla"), ("lm_mini", "linear"), ("lm_mini", "softmax"),
                                        ("lm_mini_llama", "softmax")])
def test_train_two_steps_and_generate(tmp_path, model, attn):
    """train.py task=lm_mini on a local text folder with a tiny model: two steps, eval, greedy samples."""
    import train

    corpus = _write_corpus(tmp_path)
    cfg = _cfg("task=lm_mini", f"model={model}", f"attn={attn}", "logger=none", "data=text_local",
               f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=300",
               "data.val_fraction=0.2", "data.seq_len=32", "data.batch_size=4", "data.eval_batch_size=8",
               "model.hidden_size=32", "model.num_hidden_layers=2", "model.num_heads=2",
               "trainer.max_steps=2", "trainer.eval_every_steps=2", "trainer.progress_bar=false",
               "task.num_samples=1", "task.prompt_len=8", "task.sample_tokens=12")
    if model == "lm_mini" and attn == "mhla":
        with open_dict(cfg):
            cfg.attn.block_size = 8
    metrics = train.run(cfg, str(tmp_path / "run"))
    assert set(metrics) >= {"val_ppl", "unigram_ppl", "val_loss"}
    assert np.isfinite(metrics["val_ppl"]) and metrics["unigram_ppl"] > 1
    assert (tmp_path / "run" / "samples.txt").read_text().count("greedy continuation") == 1
    assert (tmp_path / "run" / "checkpoints" / "last.pt").exists()


def test_llama_takes_only_its_own_attention():
    from tasks.common.config import ConfigError, model_attention

    assert model_attention(_cfg("task=lm_mini", "model=lm_mini_llama", "attn=softmax")) == {"name": "softmax"}
    with pytest.raises(ConfigError, match="it takes softmax"):
        model_attention(_cfg("task=lm_mini", "model=lm_mini_llama", "attn=mhla"))


def test_paper_recipe_config():
    cfg = _cfg("task=lm_fineweb")
    tokens_per_step = cfg.task.global_batch * cfg.data.seq_len
    assert tokens_per_step == 262_144 and cfg.data.batch_size * 8 == cfg.task.global_batch
    assert cfg.trainer.max_steps * tokens_per_step == pytest.approx(10e9, rel=1e-3)
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.trainer.grad_clip) == (3e-4, 0.01, 1.0)
    assert (cfg.model.hidden_size, cfg.model.num_hidden_layers) == (1024, 24)
    from tasks.common.config import model_attention

    assert model_attention(cfg)["block_size"] == 64 and model_attention(cfg)["mixing_init"] == "uniform"


def test_transformer_pp_size():
    from models.lm.baselines import build_transformer_pp

    def count(layers):
        return sum(p.numel() for p in build_transformer_pp(num_hidden_layers=layers).parameters())

    one, two = count(1), count(2)
    assert one + 23 * (two - one) == pytest.approx(341.1e6, rel=2e-3)  # docs/baselines.md#lm-baselines (tied)


def test_fla_baselines_optional():
    from models.lm.baselines import build_fla_model, fla_available

    if not fla_available():
        with pytest.raises(ImportError, match="flash-linear-attention"):
            build_fla_model("gla")
        pytest.skip("flash-linear-attention is not installed")
    assert sum(p.numel() for p in build_fla_model("gla").parameters()) == pytest.approx(341.7e6, rel=5e-3)


# fla 0.6.0 (flash-linear-attention + fla-core), every baseline built from FLA_340M on the meta device
FLA_META_COUNTS = {("gla", True): 341_707_776, ("gla", False): 374_475_776, ("mamba", False): 385_565_696,
                   ("mamba", True): 352_797_696, ("mamba2", True): 349_619_712, ("mamba2", False): 382_387_712,
                   ("gated_deltanet", True): 366_763_200, ("gated_deltanet", False): 399_531_200}


def test_fla_baseline_sizes_match_the_papers_labels():
    """The analytic count (no fla needed) equals fla's; every baseline within 3% of its Table 6 label (GLA 340M,
    Mamba 390M, Mamba2 340M, GDN 360M); flame's own GDN config (21 layers, 6 x 256, expand_v 2) is 512M."""
    from models.lm.baselines import FLA_340M, FLA_TIED, fla_available, fla_param_count

    for (name, tie), n in FLA_META_COUNTS.items():
        assert fla_param_count(name, tie_word_embeddings=tie)["params"] == n, (name, tie)
    labels = {"gla": 340, "mamba": 390, "mamba2": 340, "gated_deltanet": 360}
    for name, label in labels.items():
        assert abs(fla_param_count(name)["params"] / 1e6 / label - 1) < 0.03, name
    assert fla_param_count("gated_deltanet", num_hidden_layers=21, num_heads=6, head_dim=256, expand_v=2,
                           tie_word_embeddings=False)["params"] == 512_272_124
    assert "dt_rank" in FLA_340M["mamba"] and "time_step_rank" not in FLA_340M["mamba"]  # fla's key
    if fla_available():  # the live check where fla imports
        import torch
        from fla import models as fla_models
        from transformers import AutoModelForCausalLM

        from models.lm.baselines import FLA_CLASSES

        for name in FLA_340M:
            cfg = getattr(fla_models, FLA_CLASSES[name])(vocab_size=32000, tie_word_embeddings=FLA_TIED[name],
                                                         **FLA_340M[name])
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg)
            assert sum(p.numel() for p in model.parameters()) == fla_param_count(name)["params"], name


@pytest.mark.parametrize("source", ["hf_disk", "parquet", "jsonl"])
def test_local_dataset_sources(tmp_path, source):
    import datasets

    from tasks.language.data import iter_documents

    ds = datasets.Dataset.from_dict({"text": [f"document number {i}" for i in range(5)], "id": list(range(5))})
    path = tmp_path / "ds"
    if source == "hf_disk":
        ds.save_to_disk(str(path))
    elif source == "parquet":
        path.mkdir()
        ds.to_parquet(str(path / "part-0.parquet"))
    else:
        path.mkdir()
        ds.to_json(str(path / "part-0.jsonl"))
    cfg = OmegaConf.create({"source": source, "path": str(path), "text_field": "text", "max_documents": 4})
    assert list(iter_documents(cfg)) == [f"document number {i}" for i in range(4)]
    with pytest.raises(KeyError, match="content"):
        next(iter_documents(OmegaConf.create({"source": source, "path": str(path), "text_field": "content"})))


@pytest.mark.parametrize("task", ["lm_mini", "mqar"])
def test_attn_keys_reach_the_language_model_or_are_refused(task):
    """The LMs take their attention from attn.* like every model: a set option reaches the built layer, one that
    cannot take effect is refused at start, naming it."""
    from tasks.common.config import ConfigError, model_attention
    from tasks.language.mqar import build_mqar_model

    assert model_attention(_cfg(f"task={task}", "attn=mhla"))["mixing_init"] == "uniform"
    assert model_attention(_cfg(f"task={task}", "attn=mhla", "attn.mixing_init=locality"))["mixing_init"] == "locality"
    assert model_attention(_cfg(f"task={task}", "attn=linear", "attn.feature_map=elu"))["feature_map"] == "elu"
    with pytest.raises(ConfigError, match="no normaliser"):  # the paper's LM setting: rope after phi, no normaliser
        model_attention(_cfg(f"task={task}", "attn=linear", "attn.normalize=true"))
    for override, words in [("attn.num_blocks=4", "does not take num_blocks"), ("+attn.foo=1", "attn.foo"),
                            ("attn.mixing_extension=nope", "unknown extension rule")]:
        with pytest.raises((ConfigError, ValueError), match=words):
            model_attention(_cfg(f"task={task}", "attn=mhla", override))
    with pytest.raises(ConfigError, match="attn.mixing_init"):
        model_attention(_cfg(f"task={task}", "attn=softmax", "+attn.mixing_init=uniform"))
    if task == "mqar":  # the model the task builds carries the option
        model = build_mqar_model(_cfg("task=mqar", "attn=mhla", "attn.mixing_param=softplus"))
        assert {layer.attn.mixing.parameterization for layer in model.model.layers} == {"softplus"}


def test_reset_at_doc_boundary_reaches_the_model(tmp_path):
    """data.reset_at_doc_boundary=true: the loss is computed with the documents' cu_seqlens (and differs from the
    packed loss); the Llama baseline, which cannot take them, is refused."""
    from tasks.language.task import LanguageModelingTask as LMTask

    corpus = _write_corpus(tmp_path)
    base = ["task=lm_mini", "logger=none", "data=text_local", f"data.path={corpus}",
            f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=300", "data.val_fraction=0.2",
            "data.seq_len=256", "model.hidden_size=32", "model.num_hidden_layers=2", "model.num_heads=2"]
    losses = {}
    for reset in (False, True):
        task = LMTask(_cfg(*base, f"data.reset_at_doc_boundary={str(reset).lower()}"))
        torch.manual_seed(0)
        model = task.build_model().double()
        train, _ = task.build_datasets()
        batch = torch.stack([train[i] for i in range(2)])
        eos = task.data()[2].eos_token_id
        assert (batch == eos).any()  # 120-word documents: a 256-token window crosses a boundary
        losses[reset] = task.training_loss(model, batch)[0].item()
        assert ("cu_seqlens" in task._packed(batch)) is reset
    assert losses[True] != losses[False]
    with pytest.raises(ValueError, match="reset_at_doc_boundary"):
        LMTask(_cfg(*base, "model=lm_mini_llama", "attn=softmax", "data.reset_at_doc_boundary=true")).build_model()
