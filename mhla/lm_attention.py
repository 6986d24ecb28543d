"""The paper's language-model attention setting, shared by every causal model that builds one: the defaults
(:data:`LM_ATTENTION_DEFAULTS`), their completion for a context length (:func:`complete_lm_attention`) and the
block's layer (:func:`build_lm_attention`). The LM (``models.lm``) and the conversion of transformers decoders
(:mod:`mhla.conversion`) both use them, so they live here, below both.
"""

from __future__ import annotations

import torch.nn as nn

from .layouts import auto_block_size
from .mixing import AUTO_CAP, resolve_far_cap
from .registry import accepted_options, build_attention, get_attention_class
from .rope import rope_placement

# The paper's language-model setting: "*" for every causal attention that takes the option, then each name's own.
# ``out_norm`` is left out: it follows ``normalize`` (:func:`complete_lm_attention`).
LM_ATTENTION_DEFAULTS: dict[str, dict] = {
    "*": {"gate": True, "rope": "after_feature_map", "qk_norm": False, "cpe": False, "short_conv": 0,
          "feature_map": "relu", "normalize": False},
    "mhla": {"block_size": 64, "mixing_init": "uniform", "mixing_param": "clamp", "mixing_learnable": True,
             "mixing_per_head": False, "mixing_extension": "uniform_far", "backend": "auto"},
}


def complete_lm_attention(attn: dict, max_position_embeddings: int, trained_context: int | None = None) -> dict:
    """``attn`` with every option of the paper's LM setting filled in: the defaults of its name, ``out_norm =
    not normalize`` unless given, ``block_size="auto"`` resolved, MHLA's ``max_learned_blocks`` (context /
    block size) and ``mixing_extension="uniform_far:auto"`` resolved (:func:`mhla.mixing.resolve_far_cap`: capped at
    the far blocks of the longest row the model trained on, ``trained_context`` tokens, default the context: with
    the state passed over longer documents, their length). Raises ValueError for an attention without a causal
    form or an option it does not take."""
    attn = {k: v for k, v in dict(attn).items() if v is not None}
    name = attn.get("name", "mhla")
    cls = get_attention_class(name)
    if not cls.supports.causal:
        raise ValueError(f"attn={name} has no causal form; the language model takes a causal attention")
    accepted = accepted_options(cls)
    out = {"name": name}
    out.update({k: v for k, v in LM_ATTENTION_DEFAULTS["*"].items() if accepted is None or k in accepted})
    out.update(LM_ATTENTION_DEFAULTS.get(name, {}))
    out.update(attn)
    if "normalize" in out and "out_norm" not in attn and out.get("gate") in (False, None, "none", "linear"):
        out["out_norm"] = not out["normalize"]  # (the swish gate has its own RMSNorm)
    out["rope"] = rope_placement(out.get("rope", "none"))
    if out.get("block_size") == "auto":
        out["block_size"] = auto_block_size(max_position_embeddings)
    if accepted is not None and "max_learned_blocks" in accepted and out.get("max_learned_blocks") is None:  # MHLA
        out["max_learned_blocks"] = max(1, max_position_embeddings // int(out["block_size"]))
    if out.get("mixing_extension") == AUTO_CAP:
        far = int(trained_context or max_position_embeddings) // int(out["block_size"]) - int(out["max_learned_blocks"])
        out["mixing_extension"] = resolve_far_cap(AUTO_CAP, far)
    unknown = sorted(k for k in out if k != "name" and accepted is not None and k not in accepted)
    if unknown:
        raise ValueError(f"attn={name} does not take {unknown}; its options: {', '.join(sorted(accepted))}")
    return out


def build_lm_attention(config) -> nn.Module:
    """The attention layer of one block: the registered attention ``config.attn`` (name + options), causal, with
    the model's head dims (``config``: ``attn``, ``hidden_size``, ``num_heads``, ``head_dim``, ``head_value_dim``,
    as ``models.lm.MHLALMConfig`` has them) and no projection biases."""
    return build_attention(config.attn, config.hidden_size, config.num_heads, causal=True, head_dim=config.head_dim,
                           value_dim=config.head_value_dim, qkv_bias=False, proj_bias=False)
