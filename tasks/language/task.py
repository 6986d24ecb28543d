"""The language-modelling task for the shared trainer: packed token windows, next-token loss, validation
perplexity beside the unigram baseline, and a few greedy generations written to the run directory."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from models.lm import MHLALMConfig, MHLALMForCausalLM
from models.lm.baselines import build_transformer_pp
from tasks.common.config import ConfigError
from tasks.common.task import Task

from .data import build_lm_datasets, packed_forward_kwargs

def build_lm(model_cfg, attn: dict, vocab_size: int, eos_id: int | None = None,
             trained_context: int | None = None) -> nn.Module:
    """The model of ``model.arch`` with the resolved attention ``attn`` (:func:`tasks.common.config.model_attention`):
    ``mhla_lm`` (ours, any causal registered attention) or ``llama`` (Transformer++, its own softmax attention);
    the other ``model.*`` fields map to the transformers config fields of the same name. ``trained_context``: the
    longest context a training row reads (:class:`models.lm.MHLALMConfig`; None: ``max_position_embeddings``)."""
    arch = model_cfg.get("arch", "mhla_lm")
    common = dict(vocab_size=vocab_size, hidden_size=int(model_cfg.hidden_size),
                  num_hidden_layers=int(model_cfg.num_hidden_layers),
                  max_position_embeddings=int(model_cfg.max_position_embeddings),
                  tie_word_embeddings=bool(model_cfg.get("tie_word_embeddings", True)),
                  bos_token_id=eos_id, eos_token_id=eos_id)
    if arch == "llama":
        return build_transformer_pp(num_attention_heads=int(model_cfg.num_heads),
                                    intermediate_size=model_cfg.get("intermediate_size"), **common)
    fields = ("num_heads", "key_dim_ratio", "value_dim_ratio", "intermediate_size", "rope_theta")
    extra = {k: model_cfg[k] for k in fields if k in model_cfg and model_cfg[k] is not None}
    return MHLALMForCausalLM(MHLALMConfig(attn=dict(attn), trained_context=trained_context, **common, **extra))


class LanguageModelingTask(Task):
    monitor = "val_loss"
    monitor_mode = "min"

    def __init__(self, cfg, attention=None):
        super().__init__(cfg, attention)
        self._data = None

    @property
    def seq_len(self) -> int:
        return int(self.cfg.data.seq_len)

    def data(self):
        """(train, val, tokenizer, info), built once (the tokenizer fixes the vocabulary size)."""
        if self._data is None:
            self._data = build_lm_datasets(self.cfg.data, self.seq_len, seed=int(self.cfg.get("seed", 0)))
            info = self._data[3]
            print(f"data: {info['train_tokens']:,} train / {info['val_tokens']:,} val tokens, "
                  f"vocab {len(self._data[2])}, unigram baseline val ppl {info['unigram_ppl']:.1f}", flush=True)
        return self._data

    def build_model(self) -> nn.Module:
        _, _, tok, _ = self.data()
        arch = self.cfg.model.get("arch", "mhla_lm")
        if self.cfg.data.get("reset_at_doc_boundary", False) and arch != "mhla_lm":
            raise ConfigError(f"data.reset_at_doc_boundary=true needs our LM (model.arch=mhla_lm, which takes "
                              f"cu_seqlens); model.arch={arch} does not: set data.reset_at_doc_boundary=false")
        return build_lm(self.cfg.model, self.attention.options, len(tok), tok.eos_token_id, self.trained_context())

    def trained_context(self) -> int | None:
        """The longest context a training row reads, when longer than ``data.seq_len`` (None here: the windows)."""
        return None

    def _packed(self, batch) -> dict:
        """``cu_seqlens`` of the documents in a packed batch when ``data.reset_at_doc_boundary`` (else ``{}``)."""
        return packed_forward_kwargs(self.cfg.data, batch, self.data()[2].eos_token_id)

    def describe_model(self, model: nn.Module) -> str:
        return f"{self.cfg.model.name} ({self.cfg.model.get('arch', 'mhla_lm')}) with {self.cfg.attn.name} attention"

    def build_datasets(self):
        train, val, _, _ = self.data()
        return train, val

    def on_batch(self, batch, device):
        return batch.to(device, non_blocking=True)

    def example_input(self, device):
        return None  # FLOPs of an LM: 6 x params x tokens; the counter cannot pass input_ids cleanly

    def training_loss(self, model, batch, cache=None):
        """Next-token loss of ``batch`` (``cache``: the state of the text before it, a state-passed document's
        earlier windows)."""
        return model(input_ids=batch, labels=batch, past_key_values=cache, use_cache=cache is not None,
                     **self._packed(batch)).loss, {}

    @torch.no_grad()
    def evaluate(self, model, loader, device, dist_info) -> dict:
        nll = torch.zeros((), device=device, dtype=torch.float64)
        count = torch.zeros((), device=device, dtype=torch.float64)
        for x in loader:
            x = x.to(device)
            logits = model(input_ids=x, use_cache=False, **self._packed(x)).logits.float()
            nll += F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="sum").double()
            count += x[:, 1:].numel()
        if dist_info.enabled:
            dist.all_reduce(nll)
            dist.all_reduce(count)
        loss = (nll / count).item()
        return {"val_ppl": math.exp(loss), "unigram_ppl": self.data()[3]["unigram_ppl"], "val_loss": loss}

    def after_fit(self, trainer, metrics: dict) -> dict:
        """Greedy continuations of a few validation prompts -> ``<run_dir>/samples.txt`` (main process)."""
        n = int(self.cfg.task.get("num_samples", 4))
        if not n or not trainer.dist.is_main:
            return {}
        _, val, tok, _ = self.data()
        model = trainer.ema.module if trainer.ema is not None else (getattr(trainer, "model", None))
        model = model if model is not None else trainer._wrapped
        model = getattr(model, "module", model)
        model.eval()
        prompt_len, new = int(self.cfg.task.get("prompt_len", 32)), int(self.cfg.task.get("sample_tokens", 64))
        lines = []
        for i in range(min(n, len(val))):
            prompt = val[(i * len(val)) // n][:prompt_len].unsqueeze(0).to(trainer.device)
            with torch.no_grad():
                # synced_gpus=False: only this rank generates (under FSDP the trainer has gathered the
                # weights; transformers would otherwise wait for the other ranks at every token)
                out = model.generate(prompt, max_new_tokens=new, do_sample=False, use_cache=True,
                                     attention_mask=torch.ones_like(prompt), pad_token_id=tok.eos_token_id,
                                     synced_gpus=False)
            lines.append(f"### prompt {i}\n{tok.decode(prompt[0])}\n### greedy continuation\n"
                         f"{tok.decode(out[0, prompt_len:])}\n")
        path = Path(trainer.run_dir) / "samples.txt"
        path.write_text("\n".join(lines), encoding="utf-8")
        print(f"samples: {path}", flush=True)
        print(lines[0], flush=True)
        return {}
