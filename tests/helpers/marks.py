"""Skip marks shared by the test modules (TRITON_INTERPRET itself is set in tests/conftest.py,
before any test module imports Triton)."""

from __future__ import annotations

import pytest
import torch

from recaccel.ops.backend import triton_interpret_enabled

needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret_enabled()),
    reason="triton kernels need CUDA or TRITON_INTERPRET=1",
)
