"""The fused Triton kernel of MHLA cross-attention (``backend="triton"``): the query side
(:mod:`.query`). Importing :mod:`.query` needs triton; :func:`mhla.ops.mhla_cross_attention` imports it
lazily. It reuses MHLA's Triton helpers (interpreter detection, tile sizes, autotune configs:
:mod:`mhla.ops.mhla.triton.utils`)."""
