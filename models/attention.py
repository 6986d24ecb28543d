"""Which attention a model takes: one dispatcher from a model config to its family's attention contract.

Every model family says what it asks of its attention in its own module, next to the code that builds it, as
``attention_contract(model_cfg) -> mhla.registry.AttentionContract`` (needs, per-attention defaults, the options it
sets itself, its own built-in attentions). :func:`attention_contract` picks the family by ``model.kind`` and adds the
model config's own ``attn_defaults`` (``{attention name: {option: value}}``, ``"*"`` for every attention that takes
the option), so a config file can change a default for one model without touching the attention's file.

    contract = attention_contract(cfg.model)
    options = mhla.registry.resolve_attention(cfg.attn, contract)   # {"name": "mhla", ...every option...}

The cross-attention of the models that have one (Wan, SANA) has its own contract,
:func:`cross_attention_contract` (config ``attn_cross``, defaults ``model.attn_cross_defaults``;
docs/cross_attention.md).

The family modules are imported on use (the language model imports transformers, SANA and Wan diffusers).
"""

from __future__ import annotations

import importlib

from mhla.registry import AttentionContract, Needs, get_attention_class, list_attentions, with_defaults

GRID_MODEL_FIXED = ("grid", "qkv_bias", "causal", "num_prefix_tokens", "projections", "head_dim", "value_dim")

FAMILIES = {
    "vit": "models.vit",
    "vlt": "models.vlt",
    "dit": "models.dit",
    "dig": "models.dig",
    "lm": "models.lm.configuration_mhla_lm",
    "wan": "models.wan",
    "sana": "models.sana",
}


def _plain(value):
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or (hasattr(value, "__iter__") and not isinstance(value, (str, bytes))):
        return [_plain(v) for v in value]
    return value


def token_blocks(model_cfg) -> int | str | None:
    """The model's default token blocks, ``model.token_blocks``: an int M, ``auto`` (chosen from the model's token
    grid, docs/choosing_m.md) or None (unset); a contract's ``blocks`` (the default of an attention that splits
    its tokens into blocks, e.g. MHLA's ``num_blocks``)."""
    value = model_cfg.get("token_blocks")
    if value is None:
        return None
    return "auto" if str(value) == "auto" else int(value)


def grid_model_contract(model_cfg, *, patch_grid: tuple[int, int], width: dict) -> AttentionContract:
    """The contract of a model whose blocks attend over its 2-D patch grid (DiT, DiG): any bidirectional attention
    on a 2-D grid; its default token blocks are ``model.token_blocks`` (MHLA's M); ``width``: ``{"dim",
    "num_heads"}`` of its layers for the start-of-run probe (empty: the probe's own)."""
    return AttentionContract(model=f"model={model_cfg.get('name', model_cfg.get('kind'))}", needs=Needs(grid_rank=2),
                             blocks=token_blocks(model_cfg), fixed=GRID_MODEL_FIXED,
                             probes=(({"grid": tuple(patch_grid), **width}, {}),))


def attention_contract(model_cfg) -> AttentionContract:
    """The attention contract of ``model_cfg`` (its family's, plus the config's ``attn_defaults``)."""
    kind = model_cfg.get("kind")
    if kind not in FAMILIES:
        raise ValueError(f"model.kind={kind!r} has no attention contract; known kinds: {', '.join(FAMILIES)}")
    contract = importlib.import_module(FAMILIES[kind]).attention_contract(model_cfg)
    own = _plain(model_cfg.get("attn_defaults") or {})
    star = own.pop("*", {})
    for name, options in contract.defaults.items():  # the config's "*" beats the family's per-name defaults
        options.update({k: v for k, v in star.items() if name == "*" or k in options})
    if star:
        contract.defaults.setdefault("*", {}).update(star)
    for name, options in own.items():  # (MHLA's blocks here drop the family's num_blocks default, and so on)
        cls = get_attention_class(name) if name in list_attentions() else None
        contract.defaults[name] = with_defaults(options, contract.defaults.get(name, {}), cls)
    return contract


NO_CROSS = {"native": "the model's own cross-attention, or none (nothing to swap)"}


def cross_attention_contract(model_cfg) -> AttentionContract:
    """The contract of the model's cross-attention (``attn_cross``): its family's ``cross_attention_contract``
    (Wan, SANA: queries over the latent grid, keys from the text), plus the config's ``attn_cross_defaults``.
    A family without one has only ``native`` (its own cross-attention, or none): any other ``attn_cross`` is
    refused."""
    kind = model_cfg.get("kind")
    if kind not in FAMILIES:
        raise ValueError(f"model.kind={kind!r} has no attention contract; known kinds: {', '.join(FAMILIES)}")
    family = importlib.import_module(FAMILIES[kind])
    name = f"model={model_cfg.get('name', kind)}"
    if not hasattr(family, "cross_attention_contract"):
        return AttentionContract(model=name, needs=Needs(cross=True), native=dict(NO_CROSS), native_only=True)
    contract = family.cross_attention_contract(model_cfg)
    for attn_name, options in _plain(model_cfg.get("attn_cross_defaults") or {}).items():
        cls = get_attention_class(attn_name) if attn_name in list_attentions() else None
        contract.defaults[attn_name] = with_defaults(options, contract.defaults.get(attn_name, {}), cls)
    return contract
