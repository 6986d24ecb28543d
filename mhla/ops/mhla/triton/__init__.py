"""Fused Triton kernels for MHLA (``backend="triton"``).

Importing the modules of this package needs triton (this ``__init__`` imports nothing).
:func:`mhla.ops.mhla_attention` imports :mod:`.backend` lazily and falls back to torch when it cannot (no
triton, or no CUDA and no ``TRITON_INTERPRET=1``). The package imports only downwards: the state and the
torch paths of MHLA (:mod:`mhla.ops.mhla.state`, :mod:`mhla.ops.mhla.chunk`) and the shared helpers
(:mod:`mhla.ops.utils`), never the entry point that dispatches to it.

Modules: :mod:`.chunk` (the kernels, shared by both forms), :mod:`.noncausal` and :mod:`.causal`
(autograd Functions), :mod:`.backend` (the entry point :func:`~.backend.mhla_triton`), :mod:`.utils`
(tiles, configs, dtypes), :mod:`.compile_check` (compile every variant for a CUDA arch without a GPU:
``python -m mhla.ops.mhla.triton.compile_check``).
"""
