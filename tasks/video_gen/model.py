"""The denoiser the trainer optimises: a Wan transformer plus (mini task) a learned word-embedding table."""

from __future__ import annotations

import torch
import torch.nn as nn

from tasks.common.flow_matching import model_timestep


class VideoDenoiser(nn.Module):
    """``(x_t [B, C, F, H, W], t [B] in [0, 1], text) -> velocity [B, C, F, H, W]``.

    ``text``: LongTensor ``[B, L]`` word ids (mini task, looked up in ``text_table``) or float embeddings
    ``[B, L, text_dim]`` (UMT5 for Wan). The transformer receives ``timestep = 1000 t`` (diffusers' Wan).

    ``coord_channels`` (``model.coord_channels``, off by default, not in Wan): append three channels holding each
    pixel's (frame, row, column) coordinate in [-1, 1] to ``x_t`` (the transformer is built with
    ``in_channels + 3``). Wan knows positions only through RoPE, which is relative: at high noise a token cannot
    tell where in the frame it is, so it cannot place an object where the prompt's motion puts it.

    ``text_pool`` (``model.text_pool``, off by default, not in Wan): also add a linear map of the mean text
    embedding to Wan's time embedding, so the prompt modulates every block (the adaLN path of class-conditional
    DiT) besides reaching the tokens through cross-attention. The map starts at zero (the model starts as Wan).
    It goes in through a forward hook on ``transformer.condition_embedder.time_embedder``; diffusers' code is
    not changed.
    """

    def __init__(self, transformer: nn.Module, text_vocab: int | None = None, text_dim: int | None = None,
                 text_pool: bool = False, coord_channels: bool = False):
        super().__init__()
        self.transformer = transformer
        self.coord_channels = coord_channels
        self.text_table = nn.Embedding(text_vocab, text_dim) if text_vocab else None
        self.text_to_time = None
        if text_pool:
            embedder = transformer.condition_embedder
            self.text_to_time = nn.Linear(embedder.text_embedder.linear_1.in_features,
                                          embedder.time_embedder.linear_2.out_features)
            nn.init.zeros_(self.text_to_time.weight)
            nn.init.zeros_(self.text_to_time.bias)
            self._pooled: torch.Tensor | None = None
            embedder.time_embedder.register_forward_hook(self._add_pooled_text)

    def _add_pooled_text(self, module, inputs, temb):
        return temb + self._pooled.to(temb.dtype)

    def embed_text(self, text: torch.Tensor) -> torch.Tensor:
        if text.dtype in (torch.int64, torch.int32):
            if self.text_table is None:
                raise ValueError("got word ids but the model has no text table (model.text_vocab)")
            return self.text_table(text)
        return text

    @staticmethod
    def coordinates(x: torch.Tensor) -> torch.Tensor:
        """``[B, C, F, H, W]`` -> ``[B, 3, F, H, W]``: (frame, row, column) of every pixel, each in [-1, 1]."""
        axes = [torch.linspace(-1, 1, n, device=x.device, dtype=x.dtype) for n in x.shape[2:]]
        grid = torch.stack(torch.meshgrid(*axes, indexing="ij"))
        return grid.unsqueeze(0).expand(x.shape[0], -1, -1, -1, -1)

    def forward(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        enc = self.embed_text(text).to(x.dtype)
        if self.coord_channels:
            x = torch.cat([x, self.coordinates(x)], dim=1)
        if self.text_to_time is not None:
            self._pooled = self.text_to_time(enc.mean(dim=1))
        return self.transformer(x, model_timestep(t).to(x.dtype), enc, return_dict=False)[0]
