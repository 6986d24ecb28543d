"""Fused Triton kernels for MHLA (``backend="triton"``).

Importing this package needs triton. :mod:`mhla.ops.api` imports :mod:`.triton_backend` lazily and falls
back to torch when it cannot (no triton, or no CUDA and no ``TRITON_INTERPRET=1``).

Modules: :mod:`.chunk` (the kernels, shared by both forms), :mod:`.noncausal` and :mod:`.causal`
(autograd Functions), :mod:`.triton_backend` (the entry point), :mod:`.utils` (tiles, configs, dtypes).
"""
