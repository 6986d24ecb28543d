"""``attn.*`` is the one attention schema: for every task x attention pair and every option of the attention's
YAML, a set value either reaches the module that the task builds (read back with ``settings()``) or is refused at
start, with a message naming it. The configs are composed as ``train.py`` composes them."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from mhla.adapters.diffusers import swapped_attentions
from mhla.layers import AttentionBase
from mhla.registry import choices
from models.attention import attention_contract
from tasks.common.config import ConfigError, model_attention, register_resolvers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ATTN_DIR = os.path.join(ROOT, "configs", "attn")
register_resolvers()

# Each CPU task, with a small model (the options are what is checked, not the size).
TASKS = {
    "mnist": ["task=mnist", "model.depth=1", "model.embed_dim=16", "model.num_heads=2"],
    "mnist_cls_token": ["task=mnist", "model.depth=1", "model.embed_dim=16", "model.num_heads=2",
                        "model.class_token=true"],
    "vlt": ["task=mnist", "model=vlt_t", "scale=mini/vlt_t"],
    "mnist_gen": ["task=mnist_gen", "model.depth=1", "model.hidden_size=16", "model.num_heads=2"],
    "dig": ["task=mnist_gen", "model=dig_mnist", "model.depth=2", "model.hidden_size=16", "model.num_heads=2"],
    "lm_mini": ["task=lm_mini", "model.num_hidden_layers=1", "model.hidden_size=32", "model.num_heads=2"],
    "mqar": ["task=mqar", "model.num_hidden_layers=1"],
    "video_mini": ["task=video_mini", "model.num_layers=3", "data.num_frames=4", "data.height=8", "data.width=8"],
    "sana_mini": ["task=sana_mini"],
}

# A value other than the default for each option a YAML lists (lists: one per grid rank where it matters).
CANDIDATES = {
    "feature_map": "elu", "normalize": "flip", "out_norm": "flip", "mixing_init": "identity",
    "mixing_learnable": False, "mixing_per_head": True, "mixing_param": "softplus", "mixing_max": 2.0,
    "mixing_extension": "window",
    "max_learned_blocks": 2, "cpe": True, "cpe_kernel": 5, "gate": "linear", "rope": "before_feature_map",
    "short_conv": 2, "qk_norm": True, "eps": 1e-5, "backend": "torch", "num_blocks": 1, "block_size": 4,
    "blocks": "ones", "block": "whole", "temperature": 2.0, "focusing_factor": 2.0, "dwc_kernel": 3,
    "rope_2d": False, "lepe_kernel": 3, "chunk": 8, "expand_k": 1.0, "expand_v": 0.5, "gate_rank": 8,
    "gate_norm": 8.0, "layers": "hybrid", "softmax_every": 2, "softmax_offset": 1, "head_width": 8,
    "in_norm": True, "gate_bias": True, "feature_map_eps": 0.0, "q_scale": 0.5, "write_gate": "relu",
    "write_gate_penalty": 0.01, "write_gate_input": "short_conv",
}
HOST = ("layers", "softmax_every", "softmax_offset")


def _compose(overrides):
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        return compose("train", overrides=overrides)


def _options(name: str) -> list[str]:
    path = os.path.join(ATTN_DIR, f"{name}.yaml")
    if not os.path.exists(path):
        return []
    return [k for k in OmegaConf.load(path) if k not in ("name", "module")]


def _value(key, cfg, resolved):
    v = CANDIDATES[key]
    if v == "flip":
        return not resolved.get(key, key == "normalize")
    if v == "ones":  # one block per axis of the model's grid (valid on every grid)
        rank = 3 if cfg.model.kind == "wan" else 2
        return [1] * rank
    if v == "whole":  # blocks of 1 token per axis (valid on every grid)
        rank = 3 if cfg.model.kind == "wan" else 2
        return [1] * rank
    return v


def _build(task_name, cfg):
    """The model the task builds (the language models through their builders: no tokenizer needed here)."""
    kind = cfg.model.kind
    if kind == "lm":
        from tasks.language.mqar import build_mqar_model
        from tasks.language.task import build_lm

        if task_name == "mqar":
            return build_mqar_model(cfg)
        return build_lm(cfg.model, model_attention(cfg), 64)
    from tasks.common.task import task_class

    return task_class(cfg)(cfg).build_model()


def _layers(model, cfg):
    """The attention layers the config builds (VLT: its two linear stages; diffusers: the swapped ones)."""
    if cfg.model.kind in ("wan", "sana"):
        return list(swapped_attentions(model).values())
    root = model.stages[:2] if cfg.model.kind == "vlt" else model
    return [m for m in root.modules() if hasattr(m, "settings") and (isinstance(m, AttentionBase)
                                                                    or type(m).__name__ == "GatedLinearAttention")]


def _same(key, got, want) -> bool:
    if key == "gate" and want is True:
        want = "swish"
    if isinstance(want, list):
        want = tuple(want)
    if key == "block" and got is not None:
        return tuple(got) == tuple(want)
    return got == want or (isinstance(got, float) and isinstance(want, float) and math.isclose(got, want))


CASES = []
for _task, _ov in TASKS.items():
    _cfg = _compose(_ov)
    for _name in choices(attention_contract(_cfg.model)):
        CASES.append((_task, _name))


@pytest.mark.slow
@pytest.mark.parametrize("task,name", CASES)
def test_every_attn_option_takes_effect_or_is_refused(task, name):
    torch.manual_seed(0)
    base = _compose([*TASKS[task], f"attn={name}"])
    resolved = model_attention(base)
    for key in _options(name):
        cfg = base.copy()
        value = _value(key, cfg, resolved)
        with open_dict(cfg):
            cfg.attn[key] = value
        try:
            opts = model_attention(cfg)
            model = _build(task, cfg)
        except (ConfigError, ValueError, NotImplementedError) as e:
            assert key in str(e) or str(value) in str(e), f"attn.{key}={value} refused without naming it: {e}"
            continue
        assert opts.get(key) == value, (key, opts)
        if key in HOST:  # Wan's which-layers options: the swapped layer count changes from all layers
            assert len(swapped_attentions(model)) < len(model.transformer.blocks), key
            continue
        layers = _layers(model, cfg)
        assert layers, f"{task} with attn={name} built no attention layer"
        got = [layer.settings().get(key, "<not reported>") for layer in layers]
        assert all(_same(key, g, value) for g in got), f"{task} attn={name}: attn.{key}={value} built {got}"


def test_native_attentions_take_no_options():
    cfg = _compose([*TASKS["sana_mini"], "attn=native", "+attn.num_blocks=4"])
    with pytest.raises(ConfigError, match="attn.num_blocks"):
        model_attention(cfg)
    cfg = _compose([*TASKS["lm_mini"], "model=lm_mini_llama", "attn=softmax", "attn.gate=true"])
    with pytest.raises(ConfigError, match="attn.gate"):
        model_attention(cfg)


def test_an_attention_that_does_not_fit_is_refused_with_those_that_do():
    with pytest.raises(ConfigError, match="Attentions that fit: .*mhla"):
        model_attention(_compose([*TASKS["lm_mini"], "attn=focused"]))
    with pytest.raises(ConfigError, match="prefix tokens"):
        model_attention(_compose([*TASKS["mnist_cls_token"], "attn=rala"]))
    with pytest.raises(ConfigError, match="do not tile|cannot tile"):
        model_attention(_compose([*TASKS["mnist"], "attn.num_blocks=3"]))


@pytest.mark.parametrize("task", ["mnist", "mqar", "lm_mini"])
@pytest.mark.parametrize("name", ["mhla", "linear"])
def test_the_record_names_every_option_the_layer_runs_with(task, name):
    """A run's record (``run.json["attention"]``): the resolved options (the model's defaults for the config's
    None fields), plus the class's own defaults for the options nobody set; the model's fixed options stay out."""
    from mhla.registry import class_defaults, get_attention_class
    from tasks.common.records import effective_attention

    cfg = _compose([*TASKS[task], f"attn={name}"])
    resolved, record = model_attention(cfg), effective_attention(cfg)
    assert {k: record[k] for k in resolved} == resolved  # everything the model passes, unchanged
    defaults = class_defaults(get_attention_class(name))
    for k in set(record) - set(resolved) - {"name"}:
        assert record[k] == defaults[k], k
    assert not set(record) & set(attention_contract(cfg.model).fixed)
    assert {"feature_map", "normalize"} <= set(record)
    if name == "mhla":
        assert {"mixing_init", "mixing_learnable", "mixing_param"} <= set(record)
        assert cfg.attn.mixing_init is None  # the config leaves it to the model ...
        assert record["mixing_init"] == ("uniform" if task in ("mqar", "lm_mini") else "locality")  # ... the record says
