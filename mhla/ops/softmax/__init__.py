"""Softmax attention, the baseline MHLA is compared with. Layout ``[batch, seq, heads, dim]``.

    :mod:`.naive`  the definition written out, :func:`softmax_reference` (test oracle).
    :mod:`.api`    :func:`softmax_attention`, the entry point: PyTorch's ``scaled_dot_product_attention``
                   (FlashAttention / memory-efficient kernels on CUDA) and variable-length batches.
"""

from .api import softmax_attention
from .naive import softmax_reference

__all__ = ["softmax_attention", "softmax_reference"]
