"""Gated linear attention (GLA; Yang et al., ICML 2024): ``S_t = diag(a_t) S_{t-1} + k_t^T v_t``,
``o_t = (scale * q_t) S_t``, layout ``[B, T, H, D]``.

    :mod:`.naive`  :func:`gla_reference`, token by token (test oracle).
    :mod:`.chunk`  :func:`gla_chunked`, the torch chunked form.
    :mod:`.api`    :func:`gla`, the entry point: fla's Triton ``chunk_gla`` (:func:`gla_fla`) on CUDA when
                   flash-linear-attention imports, else torch (:data:`GLA_BACKENDS`, :func:`resolve_gla_backend`).
"""

from .api import GLA_BACKENDS, gla, gla_fla, resolve_gla_backend
from .chunk import gla_chunked
from .naive import gla_reference

__all__ = ["GLA_BACKENDS", "gla", "gla_chunked", "gla_fla", "gla_reference", "resolve_gla_backend"]
