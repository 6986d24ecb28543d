"""Rotary position embedding (RoPE): the one rotation and the one placement vocabulary of the repository.

Layout: ``x [batch, seq, heads, dim]`` (``[B, N, H, D]``) with tables ``cos``, ``sin`` that broadcast to it
(``[N, 1, D]``, ``[B, N, 1, D]``, ``[1, N, 1, D]``, ...), holding each pair's angle in the two channels of
the pair. Two channel layouts, both rotating pair ``p`` by angle ``a_p``:

* half-split (``interleaved=False``; Llama's ``rotate_half``): pair ``p`` is ``(x[p], x[p + D/2])``, tables
  ``cat([a, a])``. Used by the language model (:mod:`models.lm.modeling_mhla_lm`).
* interleaved (``interleaved=True``): pair ``p`` is ``(x[2p], x[2p+1])``, tables ``a.repeat_interleave(2)``.
  Used by the diffusers adapter (Wan's ``WanRotaryPosEmbed`` tables) and by MALA / RALA's 2-D RoPE
  (:func:`mhla.baselines.rope_2d_angles`).

The two layouts are the same rotation up to a fixed permutation of the channels (applied to q and k alike,
it leaves every dot product unchanged).

Placement (where the rotation sits relative to the feature map ``phi``), :data:`ROPE_PLACEMENTS`:

* ``"before_feature_map"``: ``phi(rope(q))``, ``phi(rope(k))`` (features stay nonnegative).
* ``"after_feature_map"``: ``rope(phi(q))``, ``rope(phi(k))`` (the authors' LM release).
* ``"none"``: no rotation (the model's rotary tables, if any, are ignored).

The diffusers adapter's old spellings ``"before"`` / ``"after"`` are aliases (:data:`ROPE_PLACEMENT_ALIASES`).
:func:`rope_and_feature_map` is the one implementation of the placement, used by both paths.

What ``normalize=True`` divides by with ``"after_feature_map"``: the numerator uses the rotated features, the
normaliser the un-rotated ``phi(q) . phi(k)`` (RoFormer's linear-attention form, as MALA / RALA: the denominator
stays positive); with the other placements both use the same features. One layer implements it for every model
(:class:`mhla.layers.KernelAttention`); causal layers refuse that one combination, which would need a second
decode state (the paper's LM has no normaliser). ``tests/layers/test_rope.py`` checks the causal and the bidirectional
layer against each other for every placement, and the normaliser against its definition.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ROPE_PLACEMENTS = ("before_feature_map", "after_feature_map", "none")
ROPE_PLACEMENT_ALIASES = {"before": "before_feature_map", "after": "after_feature_map"}


def rope_placement(placement: str) -> str:
    """The canonical name (:data:`ROPE_PLACEMENTS`) of ``placement``; accepts ``"before"`` / ``"after"``."""
    name = ROPE_PLACEMENT_ALIASES.get(placement, placement) if isinstance(placement, str) else placement
    if name not in ROPE_PLACEMENTS:
        raise ValueError(
            f"rope must be one of {ROPE_PLACEMENTS} (or the aliases {tuple(ROPE_PLACEMENT_ALIASES)}), "
            f"got {placement!r}"
        )
    return name


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False,
               upcast: bool = False) -> torch.Tensor:
    """Rotate the channel pairs of ``x`` by the angles whose cosines / sines are ``cos`` / ``sin``.

    Args:
        x: ``[B, N, H, D]`` (any leading dims; ``D`` even).
        cos, sin: tables broadcastable to ``x`` (e.g. ``[N, 1, D]`` or ``[1, N, 1, D]``), each angle stored
            in both channels of its pair: ``cat([a, a])`` (half-split) or ``a.repeat_interleave(2)``
            (interleaved). The interleaved form reads the even entries ``cos[..., 0::2]`` only.
        interleaved: pairs ``(x[2p], x[2p+1])`` when True, ``(x[p], x[p + D/2])`` (``rotate_half``)
            when False.
        upcast: compute in ``promote_types(x.dtype, float32)`` (tables cast to it) and return ``x.dtype``.
            False: torch's type promotion of ``x`` and the tables (bf16 x with bf16 tables stays bf16; bf16 x
            with fp32 tables gives fp32).

    Returns:
        The rotated ``x``, same shape: ``out_p = (x_a cos_p - x_b sin_p, x_a sin_p + x_b cos_p)`` for pair
        ``p = (a, b)``.
    """
    out_dtype = None
    if upcast:
        acc = torch.promote_types(x.dtype, torch.float32)
        out_dtype, x, cos, sin = x.dtype, x.to(acc), cos.to(acc), sin.to(acc)
    if interleaved:
        xr = x.unflatten(-1, (-1, 2))
        x1, x2 = xr[..., 0], xr[..., 1]
        c, s = cos[..., 0::2], sin[..., 0::2]
        out = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        out = x * cos + torch.cat([-x2, x1], dim=-1) * sin
    return out if out_dtype is None else out.to(out_dtype)


def rope_and_feature_map(
    q: torch.Tensor,
    k: torch.Tensor,
    feature_map: Callable[[torch.Tensor], torch.Tensor] | None,
    rotate: Callable[[torch.Tensor], torch.Tensor] | None,
    placement: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply the feature map and the rotation to ``q, k [B, N, H, D]`` in the order ``placement`` says.

    Args:
        feature_map: ``phi`` (``None``: identity, e.g. softmax attention, where both placements coincide).
        rotate: ``t -> rope(t)`` with the tables of this call (``None``: no rotation, e.g. a model without
            RoPE), typically ``lambda t: apply_rope(t, cos, sin, ...)``.
        placement: a name of :data:`ROPE_PLACEMENTS` or an alias.

    Returns:
        ``(q, k, q_plain, k_plain)``: ``q, k`` for the numerator; ``q_plain, k_plain`` are ``phi(q), phi(k)``
        before the rotation for ``"after_feature_map"`` (for a normaliser that must stay positive), and the
        same tensors as ``q, k`` for the other placements.
    """
    placement = rope_placement(placement)
    rot = rotate is not None and placement != "none"
    if rot and (placement == "before_feature_map" or feature_map is None):
        q, k = rotate(q), rotate(k)
        rot = False
    if feature_map is not None:
        q, k = feature_map(q), feature_map(k)
    if rot:  # after the feature map
        return rotate(q), rotate(k), q, k
    return q, k, q, k


@dataclass
class RotaryTables:
    """The rotary tables of one call, with their channel layout: what a model hands its attention layers.

    ``cos``, ``sin``: broadcastable to ``x [B, N, H, D]`` with the tokens on dim -3 (``[N, 1, D]``,
    ``[B, N, 1, D]`` or ``[1, N, 1, D]``). ``interleaved`` / ``upcast``: as :func:`apply_rope` (the language
    model: half-split, no upcast; Wan's tables: interleaved fp64, computed in fp32 or wider).
    """

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool = False
    upcast: bool = False

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, N, H, D]`` rotated by these tables."""
        return apply_rope(x, self.cos, self.sin, interleaved=self.interleaved, upcast=self.upcast)

    def permute_tokens(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "RotaryTables":
        """The tables with their tokens reordered by ``fn`` (which maps ``[B, N, ...] -> [B, N, ...]``, e.g.
        :meth:`mhla.layouts.BlockLayout.raster_to_block_major`): rotating then reordering equals reordering
        the tokens and their tables, then rotating."""

        def move(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 3:  # [N, 1, D]
                return fn(t.unsqueeze(0)).squeeze(0)
            return fn(t)

        return RotaryTables(move(self.cos), move(self.sin), self.interleaved, self.upcast)
