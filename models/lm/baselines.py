"""Language-model baselines of Tables 6 / 8 in the same harness (sizes: docs/baselines.md#lm-baselines).

* Transformer++: transformers' ``LlamaForCausalLM`` (RoPE theta 1e4, SwiGLU, RMSNorm eps 1e-6, no biases).
  At 340M: hidden 1024, 24 layers, 16 heads of 64, SwiGLU 2816, vocab 32000, tied embeddings (341.1M).
* GLA, Mamba, Mamba2, Gated DeltaNet: flash-linear-attention (``fla``) models at the flame / fla-legacy
  340M configs, sized to the paper's Table 6 labels where those configs are not (:data:`FLA_340M`). ``fla`` needs
  a GPU (Triton kernels) and is an optional extra: without it, :func:`build_fla_model` raises an ImportError
  that says how to install it, and :func:`fla_param_count` counts them analytically.

``attn_type="softmax"`` in :class:`models.lm.MHLALMForCausalLM` is the same-code softmax control (MHLA's
block, key dim 0.5x); Transformer++ is the literature baseline.
"""

from __future__ import annotations

from .configuration_mhla_lm import swiglu_intermediate

# 340M-class configs (docs/baselines.md#lm-baselines; flame / fla-legacy; tie pinned explicitly, counts are what we get, fla 0.6.0 on the meta
# device = fla_param_count). The paper's labels (Table 6): GLA 340M, Mamba 390M, Mamba2 340M, GDN 360M.
#   gla     flame / fla-legacy, tied: 341.7M
#   mamba   flame's, untied: 385.6M. dt_rank 64 = ceil(1024 / 16), what fla builds: its MambaConfig key is dt_rank
#           (the time_step_rank=128 this dict passed before was HF's name, silently ignored by fla)
#   mamba2  flame's layers, TIED: 349.6M (untied, flame's: 382.4M); the paper's 340M fits the tied model
#   gated_deltanet  flame's "340M" (21 layers, 6 heads x 256, expand_v 2) counts 512.3M untied. Here shaped like
#           the paper's other 340M models (hidden 1024, 24 layers, 4 heads, value width = hidden, tied) with GDN's
#           head dim 256 (expand_v 1): 366.8M, the paper's 360M (its config is not published)
FLA_340M = {
    "gla": dict(hidden_size=1024, num_hidden_layers=24, num_heads=4, expand_k=0.5, expand_v=1.0, hidden_ratio=4,
                use_gk=True, use_gv=False, attn_mode="chunk", norm_eps=1e-6),
    "mamba": dict(hidden_size=1024, num_hidden_layers=48, state_size=16, expand=2, conv_kernel=4,
                  dt_rank=64, norm_eps=1e-5),
    "mamba2": dict(hidden_size=1024, num_hidden_layers=48, state_size=128, head_dim=64, expand=2, n_groups=1,
                   conv_kernel=4, chunk_size=256, norm_eps=1e-5),
    "gated_deltanet": dict(hidden_size=1024, num_hidden_layers=24, num_heads=4, head_dim=256, expand_v=1,
                           use_short_conv=True, conv_size=4, use_gate=True),
}
FLA_TIED = {"gla": True, "mamba": False, "mamba2": True, "gated_deltanet": True}  # tie_word_embeddings
FLA_CLASSES = {"gla": "GLAConfig", "mamba": "MambaConfig", "mamba2": "Mamba2Config",
               "gated_deltanet": "GatedDeltaNetConfig"}


def build_transformer_pp(vocab_size: int = 32000, hidden_size: int = 1024, num_hidden_layers: int = 24,
                         num_attention_heads: int = 16, intermediate_size: int | None = None,
                         max_position_embeddings: int = 2048, tie_word_embeddings: bool = True,
                         bos_token_id: int | None = 1, eos_token_id: int | None = 2, **kwargs):
    """Transformer++ (Llama-style) as ``LlamaForCausalLM``; defaults are the 340M model."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_attention_heads,
        intermediate_size=intermediate_size or swiglu_intermediate(hidden_size), hidden_act="silu",
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6, attention_bias=False, mlp_bias=False,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **kwargs)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def fla_available() -> bool:
    try:
        import fla  # noqa: F401, PLC0415
    except Exception:  # noqa: BLE001 - fla raises more than ImportError without a GPU / Triton
        return False
    return True


def build_fla_model(name: str, vocab_size: int = 32000, tie_word_embeddings: bool | None = None, **overrides):
    """A flash-linear-attention causal LM (``gla`` | ``mamba`` | ``mamba2`` | ``gated_deltanet``) at 340M."""
    if name not in FLA_340M:
        raise ValueError(f"unknown fla baseline {name!r}; choose one of {sorted(FLA_340M)}")
    try:
        import fla  # noqa: F401, PLC0415
        from fla import models as fla_models  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001
        raise ImportError(
            f"the {name} baseline needs flash-linear-attention (GPU + Triton): pip install "
            f"flash-linear-attention (it registers GLA/Mamba/Mamba2/GatedDeltaNet with transformers). "
            f"Import failed with: {e!r}") from e
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    tie = FLA_TIED[name] if tie_word_embeddings is None else tie_word_embeddings
    cfg = getattr(fla_models, FLA_CLASSES[name])(vocab_size=vocab_size, tie_word_embeddings=tie,
                                                  **{**FLA_340M[name], **overrides})
    return AutoModelForCausalLM.from_config(cfg)


def _gla_layer(c: dict, d: int, mlp: int) -> tuple[int, int, int, int]:
    kd, vd, r = int(d * c["expand_k"]), int(d * c["expand_v"]), 16  # gate low rank 16
    proj = 2 * d * kd + 2 * d * vd + vd * d + d * r + r * kd  # q, k, v, g, o; the low-rank forget gate
    return proj, 0, proj + kd + vd // int(c["num_heads"]) + mlp + 2 * d, mlp  # + its bias, g_norm, two norms


def _mamba_layer(c: dict, d: int, mlp: int) -> tuple[int, int, int, int]:
    e, s, r, k = int(c["expand"]) * d, int(c["state_size"]), int(c["dt_rank"]), int(c["conv_kernel"])
    proj = d * 2 * e + e * (r + 2 * s) + r * e + e * d  # in, x, dt, out projections
    conv = e * k
    return proj, conv, proj + conv + e + e + e * s + e + d, 0  # conv bias, dt bias, A_log, D, norm (no MLP)


def _mamba2_layer(c: dict, d: int, mlp: int) -> tuple[int, int, int, int]:
    e, s, k = int(c["expand"]) * d, int(c["state_size"]), int(c["conv_kernel"])
    h, g = e // int(c["head_dim"]), int(c["n_groups"])
    proj = d * (2 * e + 2 * g * s + h) + e * d  # in (x, z, B, C, dt), out
    conv = (e + 2 * g * s) * k
    return proj, conv, proj + conv + (e + 2 * g * s) + 3 * h + e + d, 0  # conv bias, dt_bias / A_log / D, norms


def _gated_deltanet_layer(c: dict, d: int, mlp: int) -> tuple[int, int, int, int]:
    h, hd = int(c["num_heads"]), int(c["head_dim"])
    kd, vd, k = h * hd, int(h * hd * c["expand_v"]), int(c["conv_size"])
    proj = 2 * d * kd + 2 * d * vd + vd * d + 2 * d * h  # q, k, v, g, o; a, b
    conv = (2 * kd + vd) * k if c.get("use_short_conv", True) else 0
    return proj, conv, proj + conv + 2 * h + vd // h + mlp + 2 * d, mlp  # A_log, dt_bias, o_norm, two norms


#: per fla baseline: ``(config, width, SwiGLU MLP parameters) -> (projection parameters, conv parameters, parameters
#: of one layer, MLP parameters of one layer)``, from fla 0.6.0's layer definitions (:func:`fla_param_count`)
FLA_LAYER_COUNTS = {"gla": _gla_layer, "mamba": _mamba_layer, "mamba2": _mamba2_layer,
                    "gated_deltanet": _gated_deltanet_layer}


def fla_param_count(name: str, vocab_size: int = 32000, tie_word_embeddings: bool | None = None,
                    **overrides) -> dict:
    """What :func:`build_fla_model` builds, counted analytically from fla 0.6.0's layer definitions (no ``fla``
    needed; ``tests/tasks/test_lm_task.py`` checks it against fla on the meta device): ``{"params": parameters,
    "macs_per_token": multiply-adds of one token through the projections, the MLPs, the short / causal convs
    and the output head}``. The recurrence itself (the state update and read-out, the "attention matmuls") is
    not in ``macs_per_token``."""
    if name not in FLA_340M:
        raise ValueError(f"unknown fla baseline {name!r}; choose one of {sorted(FLA_340M)}")
    c = {"hidden_ratio": 4, "conv_size": 4, "conv_kernel": 4, **FLA_340M[name], **overrides}
    d, n_layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
    tie = FLA_TIED[name] if tie_word_embeddings is None else tie_word_embeddings
    mlp = 3 * d * swiglu_intermediate(d, c["hidden_ratio"])  # gate, up, down (fla's GatedMLP)
    proj, conv, layer, mlp = FLA_LAYER_COUNTS[name](c, d, mlp)
    embeddings = vocab_size * d * (1 if tie else 2)
    params = n_layers * layer + embeddings + d  # + the final norm
    return {"params": params, "macs_per_token": n_layers * (proj + conv + mlp) + vocab_size * d}
