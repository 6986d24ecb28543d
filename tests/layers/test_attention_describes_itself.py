"""An attention describes itself (mhla/registry.py): its run-tag words, plot label and group, whether it keeps a
decoding cache, whether the benchmarks time it and with which options. The run tag, the plots, the benchmarks and
the length-extrapolation study take their lists from the registry, so the worked example of
docs/adding_an_attention.md (examples/cosine_attention.py, registered only through configs/attn/cosine.yaml's
``module:``) shows up in all of them with no other edit. A model's default token blocks are its contract's
(``model.token_blocks``), not an MHLA key. A combination of an attention's own properties with a model's
defaults that cannot run is refused at start by name: a feature map that changes the head dimension with RoPE
after the feature map (the language model's default)."""

import os

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import mhla  # noqa: F401
from mhla import registry
from mhla.layers import LinearAttention
from mhla.registry import Supports, register_attention

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compose(overrides):
    from tasks.common.config import register_resolvers

    register_resolvers()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


# ------------------------------------------------------------------------------------ the worked example
def test_the_cosine_example_has_a_run_tag():
    from tasks.common.config import run_settings, settings_tag

    settings = run_settings(_compose(["task=mnist", "attn=cosine", "attn.cpe=true", "attn.temperature=8"]))
    assert settings["attention"] == "cosine+cpe" and settings["M"] is None
    # in the language model it takes the LM's setting (no normaliser, a swish gate) and says so
    lm = run_settings(_compose(["task=lm_mini", "attn=cosine"]))
    assert lm["attention"] == "cosine+gate-nonorm"
    assert settings_tag(settings).startswith("vit_mnist-32px-cosine+cpe-seed0")


def test_the_cosine_example_is_in_the_plots():
    from scripts.tables import figures

    assert "cosine" in figures.ATTENTION_WORDS
    assert figures.split_row("deit_t_cosine", "") == ("deit_t", "cosine")
    # its bar sits with linear attention's (the group it inherits), after softmax and before MHLA
    assert figures.bar_order("Softmax") < figures.bar_order("Cosine") == figures.bar_order("Linear") \
        < figures.bar_order("MHLA")
    assert registry.plot_label("cosine") == "Cosine" and registry.plot_label("linear") == "Linear"


def test_the_cosine_example_is_benchmarked():
    from scripts import bench_generation, bench_models, length_extrapolation

    assert "cosine" in bench_models.ATTNS and "cosine" in bench_generation.ATTNS
    assert "cosine" in length_extrapolation.TRAIN_ATTNS
    assert bench_models.attn_config("cosine", 256, cpe_gate=False) == {"name": "cosine"}
    assert bench_models.attn_config("mhla", 256, cpe_gate=True) == {"name": "mhla", "num_blocks": 16, "cpe": True,
                                                                     "gate": True}
    assert bench_models.attn_config("mhla", 64, cpe_gate=False)["num_blocks"] == 4  # M^2 <= N
    # the Table 2 baselines do not declare benchmark = True; softmax's cost and cache grow with the context
    assert "focused" not in bench_models.ATTNS
    assert registry.grows_with_context("softmax") and not registry.grows_with_context("cosine")
    assert registry.has_decoding_cache("cosine") and not registry.has_decoding_cache("focused")


def test_a_new_attention_is_listed_once_registered(tmp_path, monkeypatch):
    """The lists are the registry's: an attention defined in a module that only an attention config names is in
    them once that config's module is imported (:func:`tasks.common.config.import_config_attentions`)."""
    from tasks.common.config import import_config_attentions

    (tmp_path / "describe_probe_attention.py").write_text(
        "from mhla.layers import LinearAttention\n"
        "from mhla.registry import register_attention\n\n\n"
        "@register_attention('describe_probe')\n"
        "class DescribeProbe(LinearAttention):\n"
        "    plot_label, plot_group = 'Probe', 2\n")
    (tmp_path / "describe_probe.yaml").write_text("name: describe_probe\nmodule: describe_probe_attention\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert import_config_attentions(tmp_path) == ["describe_probe_attention"]
        assert "describe_probe" in registry.benchmarked(registry.Needs(causal=True, decoding=True))  # inherited
        assert registry.plot_words()["probe"] == "describe_probe" and registry.plot_group("describe_probe") == 2
        assert registry.attention_tag({"name": "describe_probe", "cpe": True, "normalize": False}) \
            == "describe_probe+cpe-nonorm"
    finally:
        registry._REGISTRY.pop("describe_probe", None)


# ------------------------------------------------------------------------------------ a model's token blocks
def test_the_default_token_blocks_are_the_models_contract():
    from models.attention import attention_contract
    from tasks.common.config import model_attention, upgrade_config

    cfg = _compose(["task=mnist", "attn=mhla"])
    contract = attention_contract(cfg.model)
    assert contract.blocks == 4 and "mhla" not in contract.defaults  # no MHLA key in the model
    assert model_attention(cfg)["num_blocks"] == 4
    assert "num_blocks" not in model_attention(_compose(["task=mnist", "attn=linear"]))
    # MHLA's own layout options drop the model's default
    assert "num_blocks" not in model_attention(_compose(["task=mnist", "attn=mhla", "attn.blocks=[2,2]"]))
    # a run stored with the old key resolves as it did
    stored = OmegaConf.to_container(cfg)
    stored["model"]["mhla_num_blocks"] = stored["model"].pop("token_blocks")
    stored["model"]["mhla_num_blocks"] = 16
    old = upgrade_config(OmegaConf.create(stored))
    assert "mhla_num_blocks" not in old.model and model_attention(old)["num_blocks"] == 16


# ------------------------------------------------------------------- properties x a model's defaults
class TaylorLinearAttention(LinearAttention):
    """Linear attention with a second-order Taylor feature map: ``phi(x) = [1, x, x (x) x / sqrt(2)]`` on
    ``x / D^{1/4}``: ``D -> 1 + D + D^2`` features (the head dimension changes)."""

    supports = Supports(bidirectional=True, grid_ranks=(1, 2, 3), causal=True, prefix_tokens=True, decoding=True,
                        varlen=True, rope=True, host_projections=True)
    excluded_options = ("feature_map",)

    def __init__(self, dim: int, num_heads: int = 8, **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        self.feature_map = self.taylor

    @staticmethod
    def taylor(x: torch.Tensor) -> torch.Tensor:
        x = x * x.shape[-1] ** -0.25
        second = (x[..., :, None] * x[..., None, :]).flatten(-2) / 2 ** 0.5
        return torch.cat([torch.ones_like(x[..., :1]), x, second], dim=-1)


@pytest.fixture
def taylor():
    """``taylor_test`` registered for one test (the registry is the process's: other tests list its attentions)."""
    register_attention("taylor_test")(TaylorLinearAttention)
    yield "taylor_test"
    registry._REGISTRY.pop("taylor_test", None)


def test_a_feature_map_that_changes_the_head_dim_is_refused_at_start_under_rope_after_it(taylor):
    from models.attention import attention_contract
    from tasks.language.task import build_lm

    lm = _compose(["task=lm_mini"])
    contract = attention_contract(lm.model)
    with pytest.raises(ValueError, match=r"model=lm_mini: attn=taylor_test: its feature map changes the head "
                                         r"dimension .*set attn.rope=before_feature_map"):
        registry.resolve({"name": "taylor_test"}, contract)
    # with the rotation before the feature map it trains: a forward and backward of the LM
    options = registry.resolve({"name": "taylor_test", "rope": "before_feature_map"}, contract).options
    model = build_lm(lm.model, options, 64)
    loss = model(torch.randint(0, 64, (2, 16)), labels=torch.randint(0, 64, (2, 16))).loss
    loss.backward()
    assert torch.isfinite(loss)
    # a model without rotary tables (the ViT) runs it as it is
    vit = _compose(["task=mnist"])
    assert registry.resolve({"name": "taylor_test"}, attention_contract(vit.model)).name == "taylor_test"


def test_an_attention_without_timms_arguments_is_refused_at_start_in_a_vit():
    """GLA builds its own projections and takes none of the arguments timm's blocks build their attention with:
    the ViT refuses it at start, by name (it runs in DiG, which builds it from its config)."""
    from tasks.common.config import ConfigError, model_attention

    from models.attention import attention_contract

    with pytest.raises(ConfigError, match=r"model=vit_mnist builds its attention with qkv_bias, qk_norm, .*; "
                                          r"attn=gla does not take them. Attentions that fit: .*mhla"):
        model_attention(_compose(["task=mnist", "attn=gla"]))
    fits = registry.choices(attention_contract(_compose(["task=mnist"]).model))
    assert "gla" not in fits and {"mhla", "linear", "softmax"} <= set(fits)
    assert model_attention(_compose(["task=mnist_gen", "model=dig_mnist", "attn=gla"]))["name"] == "gla"
