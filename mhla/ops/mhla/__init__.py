"""Multi-Head Linear Attention (token-level heads): the op, its implementations and its state.

Modules, each importing only those listed before it (and :mod:`mhla.ops.utils`):
    :mod:`.state`      :class:`MHLAState` (the recurrent state of the causal form), :func:`init_state`,
                       :class:`MixingRows` (the compact rows of a causal mixing matrix that a bounded state
                       reads), and the checks of a causal call that continues a state.
    :mod:`.naive`      the dense O(T^2) definition: :func:`mhla_reference`, :func:`mhla_attention_matrix`,
                       :func:`mhla_effective_weights` (test oracle, attention maps).
    :mod:`.chunk`      chunked PyTorch: :func:`mhla_noncausal_torch`, :func:`mhla_causal_torch` (with state).
    :mod:`.decode`     :func:`mhla_decode_step`, one token per call on the state.
    :mod:`.triton`     the fused Triton kernels, entry :func:`mhla.ops.mhla.triton.backend.mhla_triton`
                       (optional: imported lazily, only by :mod:`.api`).
    :mod:`.api`        :func:`mhla_attention`, the public entry point: validation, backend dispatch
                       (:data:`BACKENDS`, :func:`resolve_backend`) and variable-length batches.
"""

from .api import BACKENDS, mhla_attention, resolve_backend
from .chunk import mhla_causal_torch, mhla_noncausal_torch
from .decode import mhla_decode_step
from .naive import mhla_attention_matrix, mhla_effective_weights, mhla_reference
from .state import MHLAState, MixingRows, init_state

__all__ = [
    "BACKENDS",
    "MHLAState",
    "MixingRows",
    "init_state",
    "mhla_attention",
    "mhla_attention_matrix",
    "mhla_causal_torch",
    "mhla_decode_step",
    "mhla_effective_weights",
    "mhla_noncausal_torch",
    "mhla_reference",
    "resolve_backend",
]
