"""The Triton kernels for a test module: Triton's CPU interpreter without a GPU, or the module skipped.

Import it first in a kernel test module, before anything imports ``mhla.ops`` (which imports the kernels)::

    from helpers.triton_env import DEVICE, triton_backend

Without CUDA it sets ``TRITON_INTERPRET=1`` (triton reads it when ``@triton.jit`` decorates the kernels, at their
import; ``tests/conftest.py`` sets it for the whole session, this covers a module imported on its own), then
skips the importing module when triton is missing or the kernels cannot run here (e.g. they were imported
before the variable was set).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
triton_backend = pytest.importorskip("mhla.ops.mhla.triton.backend")
if not triton_backend.available():
    pytest.skip("Triton kernels cannot run here (no CUDA and not built for the interpreter)", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

__all__ = ["DEVICE", "triton_backend"]
