"""The short commands are the paper's models (issue 47).

``python train.py task=imagenet model=deit_t attn=mhla`` (the command the docs lead with) must compose the same recipe
as ``experiment=table2/deit_t_mhla`` in every field that matters for the number, and the same holds for every other
Table 2 / Table 3a row and its short command: ``task=<task> model=<model> attn=<attn>`` plus only the overrides that
name the row itself (its resolution, a baseline's own setting, the "no module" ablation rows), listed in
:data:`ROW_OVERRIDES` with the reason. The two configs are compared key by key, with each attention replaced by what
the model builds from it (:func:`mhla.registry.resolve_attention` under the model's contract, the class's own
defaults filled in by :func:`mhla.registry.effective_options`: a DeiT's kernel-3 CPE
for every attention, DiT's CPE + gate for MHLA come from the model's ``attn_defaults``). Left out: ``paper`` and
``assumptions`` (what the results file prints beside the number, not the recipe).
"""

from __future__ import annotations

import glob
import os

import pytest
from omegaconf import OmegaConf

from mhla.registry import effective_options, get_attention_class, list_attentions, resolve_attention
from models.attention import attention_contract, cross_attention_contract
from scripts.tables.config import compose

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOT_RECIPE = ("paper", "assumptions")

# cell -> the overrides its short command adds to task / model / attn, and why the row needs them
ROW_OVERRIDES = {
    # Table 2a: FLatten's per-token position encoding is sized for FLatten-DeiT-T's 196 tokens (224 px unpadded)
    "table2/deit_t_focused": ["model.pad_to=null"],
    # InLine-DeiT-T's own 6 heads of 32
    "table2/deit_t_inline": ["attn.head_width=32"],
    # Table 2b: the RAVLT recipe's colour jitter (the VLT attention wrapper is model=vlt_*'s default)
    "table2/vlt_t_mala": ["data.augment.color_jitter=0.4"],
    "table2/vlt_t_mhla": ["data.augment.color_jitter=0.4"],
    "table2/vlt_s_mala": ["data.augment.color_jitter=0.4"],
    "table2/vlt_s_mhla": ["data.augment.color_jitter=0.4"],
    "table2/vlt_t_rala": ["data.augment.color_jitter=0.4", "model.head_dim=1024"],  # RAVLT's head width
    # Table 3a: 512 px rows (64 x 64 latents)
    "table3/dit_s2_512_softmax": ["data.image_size=512", "model.input_size=64"],
    "table3/dit_s2_512_linear": ["data.image_size=512", "model.input_size=64"],
    "table3/dit_s2_512_mhla": ["data.image_size=512", "model.input_size=64"],
    "table3/dig_s2_512_gla": ["data.image_size=512", "model.input_size=64"],
    # Table 3a's module ablation rows of DiT-L/2 and XL/2 (model=dit_*'s MHLA default is the CPE + gate row)
    "table3/dit_l2_256_mhla": ["attn.cpe=false", "attn.gate=false"],
    "table3/dit_l2_256_mhla_cpe": ["attn.gate=false"],
    "table3/dit_xl2_256_mhla": ["attn.cpe=false", "attn.gate=false"],
    "table3/dit_xl2_256_mhla_cpe": ["attn.gate=false"],
}


def cells() -> list[str]:
    out = []
    for folder in ("table2", "table3"):
        for path in sorted(glob.glob(os.path.join(ROOT, "configs", "experiment", folder, "*.yaml"))):
            out.append(f"{folder}/{os.path.splitext(os.path.basename(path))[0]}")
    return out


def short_command(cell: str) -> list[str]:
    """``task=... model=... attn=...`` of the cell's defaults list, plus its row's own overrides."""
    with open(os.path.join(ROOT, "configs", "experiment", cell + ".yaml")) as f:
        defaults = OmegaConf.create(f.read()).get("defaults") or []
    groups = {}
    for entry in defaults:
        for key, value in (entry.items() if hasattr(entry, "items") else []):
            groups[str(key).replace("override /", "").strip()] = value
    return [f"{g}={groups[g]}" for g in ("task", "model", "attn") if g in groups] + ROW_OVERRIDES.get(cell, [])


def recipe(overrides: list[str]) -> dict:
    """The composed config as flat ``{dotted key: value}``, each attention as the model builds it."""
    cfg, _ = compose(overrides)
    plain = OmegaConf.to_container(cfg, resolve=False)
    for key in NOT_RECIPE:
        plain.pop(key, None)
    contract = attention_contract(cfg.model)
    plain["attn"] = built(resolve_attention(cfg.attn, contract), contract)
    if "attn_cross" in cfg:
        cross = cross_attention_contract(cfg.model)
        plain["attn_cross"] = built(resolve_attention(cfg.attn_cross, cross, "attn_cross"), cross)
    return dict(flatten(plain))


def built(options: dict, contract) -> dict:
    """Every option the layer runs with, less those that mean nothing because the option they depend on is off
    (``cpe_kernel`` without ``cpe``)."""
    out = effective_options(options, contract)
    cls = get_attention_class(out["name"]) if out["name"] in list_attentions() else None
    for child, parent in getattr(cls, "dependent_options", {}).items():
        if not out.get(parent):
            out.pop(child, None)
    return out


def flatten(value, prefix=""):
    if isinstance(value, dict):
        if not value and prefix:
            yield prefix, {}
        for k, v in value.items():
            yield from flatten(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, value


def differences(a: dict, b: dict) -> list[str]:
    return [f"{k}: {a.get(k, '<absent>')!r} vs {b.get(k, '<absent>')!r}" for k in sorted(set(a) | set(b))
            if a.get(k, "<absent>") != b.get(k, "<absent>")]


def test_headline_command_is_the_table2_deit_t_mhla_cell():
    short = recipe(["task=imagenet", "model=deit_t", "attn=mhla"])
    cell = recipe(["experiment=table2/deit_t_mhla"])
    assert differences(short, cell) == []
    assert short["attn.cpe"] is True and short["attn.num_blocks"] == 16  # the paper's kernel-3 CPE, M = 16


@pytest.mark.parametrize("cell", cells())
def test_short_command_composes_the_cell(cell):
    short, full = short_command(cell), [f"experiment={cell}"]
    assert differences(recipe(short), recipe(full)) == [], f"python train.py {' '.join(short)} is not {full[0]}"


@pytest.mark.parametrize("attn", ["softmax", "linear", "mhla", "focused", "inline", "mala", "rala"])
@pytest.mark.parametrize("model", ["deit_t", "deit_s"])
def test_every_deit_attention_gets_the_cpe_and_can_drop_it(model, attn):
    """Table 2 uses the kernel-3 CPE for every row; ``attn.cpe=false`` switches it off."""
    on, _ = compose(["task=imagenet", f"model={model}", f"attn={attn}"])
    assert resolve_attention(on.attn, attention_contract(on.model))["cpe"] is True
    off, _ = compose(["task=imagenet", f"model={model}", f"attn={attn}", "attn.cpe=false"])
    assert resolve_attention(off.attn, attention_contract(off.model))["cpe"] is False


def test_dit_modules_are_mhla_only():
    """DiT's CPE + gate default is MHLA's (Table 3a's headline rows); softmax / linear DiT stay vanilla."""
    for attn in ("softmax", "linear"):
        cfg, _ = compose(["task=imagenet_gen", "model=dit_s", f"attn={attn}"])
        options = resolve_attention(cfg.attn, attention_contract(cfg.model))
        assert not options.get("cpe") and not options.get("gate"), options
    cfg, _ = compose(["experiment=table3b/dit_xl2_256_mhla_finetune"])  # the fine-tune: the bare operator, stated
    options = resolve_attention(cfg.attn, attention_contract(cfg.model))
    assert options["cpe"] is False and options["gate"] is False and "modules" in cfg.assumptions


def test_cpu_proxy_of_the_headline_cell_keeps_the_cpe():
    """SCALE=mini swaps in vit_mini (no attn_defaults): the cell's own ``attn.cpe: true`` keeps the CPE there."""
    cfg, _ = compose(["experiment=table2/deit_t_mhla", "scale=mini/deit_t"])
    assert cfg.model.name == "vit_mini"
    assert resolve_attention(cfg.attn, attention_contract(cfg.model))["cpe"] is True
