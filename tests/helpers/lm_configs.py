"""``lm_config(name, **kw)``: an ``MHLALMConfig`` from one flat list of keywords, for tests that build the same
model with several attentions: keywords that are ``MHLALMConfig`` arguments go to the model, the others into
``attn`` when the attention takes them (``block_size`` goes to MHLA and is left out for softmax, as a test that
loops over attentions wants)."""

from __future__ import annotations

import inspect

from mhla.registry import accepted_options, get_attention_class
from models.lm import MHLALMConfig

MODEL_FIELDS = set(inspect.signature(MHLALMConfig.__init__).parameters) - {"self", "attn", "kwargs"}


def lm_config(name: str = "mhla", **kw) -> MHLALMConfig:
    accepted = accepted_options(get_attention_class(name))
    attn = {"name": name, **{k: v for k, v in kw.items()
                             if k not in MODEL_FIELDS and (accepted is None or k in accepted)}}
    return MHLALMConfig(attn=attn, **{k: v for k, v in kw.items() if k in MODEL_FIELDS})
