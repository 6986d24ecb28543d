"""Text conditioning: the mini task's word table, UMT5 encoding for Wan, and the per-prompt embedding cache."""

from __future__ import annotations

import hashlib
import os

import torch

from models.wan import load_text_encoder

UMT5_MAX_LEN = 512  # Wan's text context length


def prompt_key(prompt: str) -> str:
    """File stem of a prompt's cached embedding: sha1 of the UTF-8 prompt."""
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()


@torch.no_grad()
def encode_umt5(tokenizer, encoder, prompts: list[str], max_len: int = UMT5_MAX_LEN, device=None) -> torch.Tensor:
    """UMT5 embeddings ``[B, max_len, 4096]`` as Wan uses them: the prompt's tokens, zeros after its end."""
    tok = tokenizer(prompts, padding="max_length", max_length=max_len, truncation=True,
                    add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    device = device or next(encoder.parameters()).device
    ids, mask = tok.input_ids.to(device), tok.attention_mask.to(device)
    hidden = encoder(ids, mask).last_hidden_state
    return hidden * mask.unsqueeze(-1).to(hidden.dtype)


class PromptEncoder:
    """Prompt -> ``[L, D]`` embedding, from ``cache_dir/<sha1>.pt`` when present, else UMT5 (then cached).

    The UMT5 encoder loads lazily from ``pretrained`` (``<pretrained>/text_encoder``, ``/tokenizer``), so a
    run whose prompts are all cached never needs it.
    """

    def __init__(self, pretrained: str | None, cache_dir: str | None, device="cpu", dtype=torch.bfloat16):
        self.pretrained, self.cache_dir, self.device, self.dtype = pretrained, cache_dir, device, dtype
        self._tok = self._enc = None

    def _encoder(self):
        if self._enc is None:
            self._tok, enc = load_text_encoder(self.pretrained)
            self._enc = enc.to(self.device, self.dtype)
        return self._tok, self._enc

    def __call__(self, prompts: list[str]) -> torch.Tensor:
        out: list[torch.Tensor | None] = [None] * len(prompts)
        missing = []
        for i, p in enumerate(prompts):
            path = os.path.join(self.cache_dir, prompt_key(p) + ".pt") if self.cache_dir else None
            if path and os.path.isfile(path):
                out[i] = torch.load(path, map_location="cpu", weights_only=True)
            else:
                missing.append(i)
        if missing:
            tok, enc = self._encoder()
            emb = encode_umt5(tok, enc, [prompts[i] for i in missing], device=self.device).cpu()
            for j, i in enumerate(missing):
                out[i] = emb[j]
                if self.cache_dir:
                    os.makedirs(self.cache_dir, exist_ok=True)
                    torch.save(emb[j].clone(), os.path.join(self.cache_dir, prompt_key(prompts[i]) + ".pt"))
        return torch.stack(out)
