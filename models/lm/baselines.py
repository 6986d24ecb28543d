"""Language-model baselines of Tables 6 / 8 in the same harness (sizes: docs/baselines.md#lm-baselines).

* Transformer++: transformers' ``LlamaForCausalLM`` (RoPE theta 1e4, SwiGLU, RMSNorm eps 1e-6, no biases).
  At 340M: hidden 1024, 24 layers, 16 heads of 64, SwiGLU 2816, vocab 32000, tied embeddings (341.1M).
* GLA, Mamba, Mamba2, Gated DeltaNet: flash-linear-attention (``fla``) models at the flame / fla-legacy
  340M configs. ``fla`` needs a GPU (Triton kernels) and is an optional extra: without it,
  :func:`build_fla_model` raises an ImportError that says how to install it.

``attn_type="softmax"`` in :class:`models.lm.MHLALMForCausalLM` is the same-code softmax control (MHLA's
block, key dim 0.5x); Transformer++ is the literature baseline.
"""

from __future__ import annotations

from .configuration_mhla_lm import swiglu_intermediate

# 340M-class configs (docs/baselines.md#lm-baselines; tie pinned explicitly, counts are what we get)
FLA_340M = {
    "gla": dict(hidden_size=1024, num_hidden_layers=24, num_heads=4, expand_k=0.5, expand_v=1.0, hidden_ratio=4,
                use_gk=True, use_gv=False, attn_mode="chunk", norm_eps=1e-6),
    "mamba": dict(hidden_size=1024, num_hidden_layers=48, state_size=16, expand=2, conv_kernel=4,
                  time_step_rank=128, norm_eps=1e-5),
    "mamba2": dict(hidden_size=1024, num_hidden_layers=48, state_size=128, head_dim=64, expand=2, n_groups=1,
                   conv_kernel=4, chunk_size=256, norm_eps=1e-5),
    "gated_deltanet": dict(hidden_size=1024, num_hidden_layers=21, num_heads=6, head_dim=256, expand_v=2,
                           use_short_conv=True, conv_size=4, use_gate=True),
}
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

    tie = {"gla": True}.get(name, False) if tie_word_embeddings is None else tie_word_embeddings
    cfg = getattr(fla_models, FLA_CLASSES[name])(vocab_size=vocab_size, tie_word_embeddings=tie,
                                                  **{**FLA_340M[name], **overrides})
    return AutoModelForCausalLM.from_config(cfg)
