"""Plain linear attention, the M = 1 special case of MHLA.

    :mod:`.naive`  the dense O(T^2) definition, :func:`linear_reference` (test oracle).
    :mod:`.api`    :func:`linear_attention`, the entry point and its one path (torch): non-causal; causal
                   chunkwise, with a state and variable-length batches.
"""

from .api import linear_attention
from .naive import linear_reference

__all__ = ["linear_attention", "linear_reference"]
