"""The denoiser the trainer optimises: a Wan transformer plus (mini task) a learned word-embedding table."""

from __future__ import annotations

import torch
import torch.nn as nn

from tasks.common.flow_matching import model_timestep


class VideoDenoiser(nn.Module):
    """``(x_t [B, C, F, H, W], t [B] in [0, 1], text) -> velocity [B, C, F, H, W]``.

    ``text``: LongTensor ``[B, L]`` word ids (mini task, looked up in ``text_table``) or float embeddings
    ``[B, L, text_dim]`` (UMT5 for Wan). The transformer receives ``timestep = 1000 t`` (diffusers' Wan).
    """

    def __init__(self, transformer: nn.Module, text_vocab: int | None = None, text_dim: int | None = None):
        super().__init__()
        self.transformer = transformer
        self.text_table = nn.Embedding(text_vocab, text_dim) if text_vocab else None

    def embed_text(self, text: torch.Tensor) -> torch.Tensor:
        if text.dtype in (torch.int64, torch.int32):
            if self.text_table is None:
                raise ValueError("got word ids but the model has no text table (model.text_vocab)")
            return self.text_table(text)
        return text

    def forward(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        enc = self.embed_text(text).to(x.dtype)
        return self.transformer(x, model_timestep(t).to(x.dtype), enc, return_dict=False)[0]
