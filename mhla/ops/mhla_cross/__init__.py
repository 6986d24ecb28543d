"""MHLA cross-attention: ``Mq`` query blocks read a learned nonnegative mix of the summaries of ``Mk`` key
blocks (docs/cross_attention.md). Modules, each importing only those listed before it (and
:mod:`mhla.ops.utils`):

    :mod:`.blocks`   the blocking rule of an axis of any length (contiguous, balanced blocks)
    :mod:`.naive`    the dense definition, :func:`mhla_cross_reference` (test oracle, fp64-capable)
    :mod:`.chunk`    the torch path: key block summaries, mixing, query side (:func:`mhla_cross_torch`)
    :mod:`.triton`   the query side as a fused Triton kernel (optional; imported lazily by :mod:`.api`)
    :mod:`.api`      :func:`mhla_cross_attention`, the entry point: checks and backend dispatch

Plain linear cross-attention is the ``Mq = Mk = 1`` case (mixing ``[[1]]``).
"""

from .api import CROSS_BACKENDS, mhla_cross_attention, resolve_cross_backend
from .blocks import block_ids, block_starts
from .chunk import mhla_cross_torch
from .naive import mhla_cross_reference, mhla_cross_weights

__all__ = [
    "CROSS_BACKENDS",
    "block_ids",
    "block_starts",
    "mhla_cross_attention",
    "mhla_cross_reference",
    "mhla_cross_torch",
    "mhla_cross_weights",
    "resolve_cross_backend",
]
