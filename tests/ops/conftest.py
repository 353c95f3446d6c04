"""Shared setup of the ops tests.

Without CUDA, Triton kernels run under Triton's interpreter: TRITON_INTERPRET=1 must be
set before a kernel module is first imported (``triton.jit`` reads it then). pytest
loads this file before it imports any test module of this folder.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests.helpers.ops_inputs import random_sparse_batch


@pytest.fixture(scope="session")
def sparse_batch():
    """Factory of random :class:`SparseFeatures` (see :func:`random_sparse_batch`)."""
    return random_sparse_batch
