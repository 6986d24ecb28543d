"""Language models: causal MHLA as a transformers model, and the baselines (``baselines.py``).

Importing this package registers ``model_type="mhla_lm"`` with ``AutoConfig``, ``AutoModel`` and
``AutoModelForCausalLM``, so ``AutoModelForCausalLM.from_pretrained(path)`` loads a saved model::

    from models.lm import MHLALMConfig, MHLALMForCausalLM
    model = MHLALMForCausalLM(MHLALMConfig(attn={"name": "mhla", "block_size": 32}, hidden_size=256,
                                           num_hidden_layers=4, num_heads=4, vocab_size=8000,
                                           max_position_embeddings=256))
    out = model(input_ids, labels=input_ids)            # out.loss, out.logits [B, T, V]
    model.generate(input_ids, max_new_tokens=64, do_sample=False)   # decodes with MHLALMCache
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_mhla_lm import LM_ATTENTION_DEFAULTS, ROPE_PLACEMENTS, MHLALMConfig, swiglu_intermediate
from .modeling_mhla_lm import MHLALMCache, MHLALMForCausalLM, MHLALMModel, MHLALMPreTrainedModel

AutoConfig.register(MHLALMConfig.model_type, MHLALMConfig, exist_ok=True)
AutoModel.register(MHLALMConfig, MHLALMModel, exist_ok=True)
AutoModelForCausalLM.register(MHLALMConfig, MHLALMForCausalLM, exist_ok=True)

__all__ = [
    "LM_ATTENTION_DEFAULTS", "ROPE_PLACEMENTS", "MHLALMCache", "MHLALMConfig", "MHLALMForCausalLM", "MHLALMModel",
    "MHLALMPreTrainedModel", "swiglu_intermediate",
]
