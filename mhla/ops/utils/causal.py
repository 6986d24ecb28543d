"""Causal sums that stay causal whatever the values, shared by every op.

A causal sum written as a dense product (a masked matmul, or ``cumsum`` followed by a subtraction) also
multiplies the masked weights by the later positions, and ``0 * nan`` is ``nan``: a NaN or inf in position
``s`` would reach the outputs before ``s``. :func:`causal_product` and :func:`exclusive_cumsum` keep a
non-finite entry in the outputs at and after its position only.
"""

from __future__ import annotations

import torch


def causal_product(product, x: torch.Tensor, dim: int, *, strict: bool = False, lazy: bool = True):
    """``product(x)`` for a causal sum over the positions ``dim`` of ``x``, whatever ``x`` holds.

    ``product`` is a dense matmul such as ``y_i = sum_j w_ij x_j`` with ``w_ij = 0`` for ``j > i`` (``j >= i``
    when ``strict``), and its output positions are the last ``n`` positions of ``x``. The matmul also
    multiplies the zero weights by the later ``x_j``, and ``0 * nan = nan``: a NaN or inf would reach every
    earlier output. So the product runs on ``x`` with its non-finite entries set to 0, and the outputs that
    read one (elementwise in the other dims) are set to NaN.

    ``lazy``: first test whether ``x`` is finite through its sum (one reduction and a host sync; an
    overflowing sum only takes the exact path) and then skip the masking.
    """
    if lazy and not torch.compiler.is_compiling() and torch.isfinite(x.detach().sum()):
        return product(x)
    finite = torch.isfinite(x)
    count = (~finite).cumsum(dim, dtype=torch.int32)  # non-finite entries at positions <= i
    if strict:
        count = count - (~finite).int()
    out = product(torch.where(finite, x, 0.0))
    n = out.shape[dim]
    return torch.where(count.narrow(dim, x.shape[dim] - n, n) > 0, float("nan"), out)


def exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``y_i = sum_{j < i} x_j`` along ``dim``, without the ``cumsum - x`` subtraction that lets a non-finite
    ``x_i`` reach ``y_i``."""
    shifted = torch.cat([torch.zeros_like(x.narrow(dim, 0, 1)), x.narrow(dim, 0, x.shape[dim] - 1)], dim)
    return shifted.cumsum(dim)
